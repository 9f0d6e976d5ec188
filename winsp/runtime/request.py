"""A request: one forward's window-parallel state and the per-layer steps that move and attend local rows.

Made by :meth:`winsp.WindowRuntime.request` (the planning phase, where every tensor the steps read is prepared or
found in the runtime's store). The steps are tensor ops on those prepared tensors and Python constants, so they trace
without graph breaks: ``scatter`` (canonical rows -> this rank's rows), ``to_layer`` (a redistribution only where the
layout really changes), ``to_grid`` (a stage's sharded merge or split), ``attention`` (on local rows, plus the
replicated-text reduction) and ``gather`` (the canonical output on every rank). Each step's backward is its forward's
exact adjoint, which is what :func:`winsp.sync_gradients`' convention rests on.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch import Tensor

from winsp.attention.backends import Runner, bind_backend, explain_backend
from winsp.attention.halo.layer import neighborhood_layer
from winsp.attention.input_dtypes import dtype_codes, dtype_problem
from winsp.attention.score_mods import check_score_mods
from winsp.attention.split import join_local_rows, refuse_score_mods, split_attention, split_local_rows
from winsp.attention.windows import _scale, attend
from winsp.comm.redistribute import gather_rows, redistribute_rows
from winsp.comm.text import finish_text_reduction, reduce_window_text, sum_window_text
from winsp.geometry.layout import Grids, check_grids
from winsp.geometry.neighborhood import is_neighborhood
from winsp.geometry.windows import WindowGeometry
from winsp.planning.grid_step import GridStep, StageRows
from winsp.planning.plan import Plan
from winsp.runtime.local import LayoutTensors, LocalWindows
from winsp.utils.checks import count_tuple

if TYPE_CHECKING:
    from winsp.runtime.runtime import WindowRuntime

__all__ = ["CheckedRequest", "WindowRequest", "PreparedRequest"]


@dataclass(frozen=True)
class CheckedRequest:
    """A request's inputs, checked once where they enter (:meth:`CheckedRequest.check`, which
    :meth:`winsp.WindowRuntime.request` calls): the code further in takes this and checks nothing again.

    ``grids``: the stage-0 model grids, one per sample (:class:`~winsp.geometry.layout.Grids`); ``text_lengths``:
    one per sample (zeros for a model without text); ``device``: where the prepared tensors live; ``dtype``: the
    attention inputs' dtype (None: the backend is chosen at the first attention call); ``score_mods``: whether
    attention calls pass a ``score_mod`` / ``mask_mod`` (None: as the runtime's earlier requests did);
    ``text_layers``: per layer, whether its attention takes the text (None: every layer does).
    """

    grids: Grids
    text_lengths: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype | None = None
    score_mods: bool | None = None
    text_layers: tuple[bool, ...] | None = None

    @classmethod
    def check(cls, grids: Sequence[Sequence[int]], text_lengths: Sequence[int] | None = None, *,
              device: torch.device | str | None = None, dtype: torch.dtype | None = None,
              score_mods: bool | None = None, text_layers: Sequence[bool] | None = None) -> "CheckedRequest":
        """The checked inputs; a ValueError naming the first one that is wrong."""
        checked = check_grids(grids)
        if text_lengths is None:
            lengths = (0,) * len(checked)
        else:
            lengths = count_tuple("text_lengths", text_lengths)
            if len(lengths) != len(checked):
                raise ValueError(f"text_lengths has {len(lengths)} entries but there are {len(checked)} samples")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        if score_mods is not None and not isinstance(score_mods, bool):
            raise ValueError(f"score_mods must be True, False or None, got {score_mods!r}")
        if text_layers is not None:
            if isinstance(text_layers, (str, bytes)) or not all(isinstance(t, bool) for t in text_layers):
                raise ValueError(f"text_layers must be one True / False per layer, got {text_layers!r}")
            text_layers = None if all(text_layers) else tuple(text_layers)
        return cls(checked, lengths, torch.device(device) if device is not None else torch.device("cpu"), dtype,
                   score_mods, text_layers)


@dataclass(eq=False)
class PreparedRequest:
    """A store entry: the plans of one request shape and, for this rank and device, every prepared tensor.

    ``slot_of_layer[i]`` is the index in ``layouts`` of layer i's plan (layers with equal geometry share a slot);
    ``stage_rows[slot]`` tells that layout's padding rows; ``steps[(a, b)]`` moves rows from slot a's layout to slot
    b's; ``runners[(slot, dtype, modded, bare)]`` is the attention backend chosen for that layout (``bare``: the one
    planned without text), dtype and whether the call modifies scores, as ``(name, runner, why)``;
    ``hook_data[(slot, name)]`` is what layout hook ``name`` built.
    """

    plans: tuple[Plan, ...]
    slot_of_layer: tuple[int, ...]
    layouts: tuple[LayoutTensors, ...]
    stage_rows: tuple[StageRows, ...]
    stage_model_grids: tuple[Grids, ...]
    stage_laid_grids: tuple[Grids, ...]
    steps: dict
    runners: dict
    hook_data: dict
    splits: dict = field(default_factory=dict)  # (slot, heads) -> SplitAttentionTensors, for layouts that split
    bare: tuple = ()  # per slot, its layout planned without text: for layers the text does not join (text_layers)


class WindowRequest:
    """One forward's window-parallel state: which layout the local rows are in, and the steps between layouts.

    Cheap to make: a view of the runtime store's :class:`PreparedRequest` plus the current layer. ``inputs`` are the
    request's checked inputs; ``grids`` the batch's stage-0 model grids; ``stage_model_grids`` /
    ``stage_laid_grids`` those of every stage.
    """

    def __init__(self, runtime: "WindowRuntime", prepared: PreparedRequest, inputs: CheckedRequest) -> None:
        self.runtime = runtime
        self.prepared = prepared
        self.inputs = inputs
        self.grids = self.model_grids = inputs.grids
        self.stage_model_grids, self.stage_laid_grids = prepared.stage_model_grids, prepared.stage_laid_grids
        self.text_lengths = inputs.text_lengths
        self.num_text_rows = sum(inputs.text_lengths)
        self.text_layers = inputs.text_layers or (True,) * len(prepared.slot_of_layer)
        self.device = inputs.device
        self.group = runtime.group
        self.layer: int | None = None
        self.transitions_done = 0
        # the current layout, kept as an object and a slot so the per-layer steps never specialise on the layer index
        self._slot: int | None = None
        self._now: LayoutTensors | None = None
        self._dtypes_checked = False  # attention's input dtypes, checked across ranks at the first attention
        # the last to_layer that moved rows: (layer, from slot, to slot, weak refs to its input and output), so that
        # a second to_layer into the same layer with another tensor is never a silent no-op (see to_layer)
        self._last_move: tuple[int, int, int, Any, Any] | None = None

    # ---- plans and layouts -------------------------------------------------------------------------------

    def _check_layer(self, layer: object) -> int:
        n = len(self.prepared.slot_of_layer)
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise ValueError(f"layer must be an integer layer index, got {layer!r}")
        if not 0 <= layer < n:
            raise ValueError(f"layer {layer} is outside the schedule of {n} layers")
        return int(layer)

    def _current(self) -> int:
        if self.layer is None:
            raise RuntimeError("call scatter() first: the request has no local rows yet")
        return self.layer

    def _current_layout(self) -> LayoutTensors:
        if self._now is None:
            raise RuntimeError("call scatter() first: the request has no local rows yet")
        return self._now

    def _current_slot(self) -> int:
        if self._slot is None:
            raise RuntimeError("call scatter() first: the request has no local rows yet")
        return self._slot

    def _enter(self, layer: int) -> int:
        """Make ``layer`` current; returns its layout slot."""
        slot = self.prepared.slot_of_layer[layer]
        self.layer, self._slot, self._now = layer, slot, self.prepared.layouts[slot]
        return slot

    def _layer_layout(self, layer: object) -> LayoutTensors:
        """The current layout, checked to be ``layer``'s (the rows of a layer must be in that layer's layout)."""
        layer = self._check_layer(layer)
        now = self._current_layout()
        if self.prepared.slot_of_layer[layer] != self._slot:
            schedule, here = self.runtime.schedule, self._current()
            raise ValueError(
                f"rank {self.group.rank}: layer {layer} attends in the windows of {schedule[layer]!r}, but the rows "
                f"are in layer {here}'s layout ({schedule[here]!r}); call request.to_layer(x, {layer}) "
                f"before layer {layer}'s attention"
            )
        return now

    def plan(self, layer: int) -> Plan:
        """The plan of layer ``layer``'s layout (layers with equal geometry share one plan object)."""
        return self.prepared.plans[self._check_layer(layer)]

    def layout(self, layer: int | None = None) -> LayoutTensors:
        """This rank's prepared share of ``layer``'s layout (default: the current layer)."""
        if layer is None:
            return self._current_layout()
        return self.prepared.layouts[self.prepared.slot_of_layer[self._check_layer(layer)]]

    def local(self, layer: int | None = None) -> LocalWindows:
        """This rank's windows in ``layer``'s layout (default: the current layer), CPU side."""
        return self.layout(layer).local

    @property
    def stage(self) -> int:
        """The stage of the current layer (0 for a model on one grid)."""
        return self.runtime.stage_of_layer[self._current()]

    def geometry(self, layer: int | None = None) -> WindowGeometry:
        """The window geometry of ``layer`` (default: the current layer)."""
        return self.runtime.schedule[self._current() if layer is None else self._check_layer(layer)]

    def _rows(self, layer: int | None = None) -> StageRows:
        slot = self._current_slot() if layer is None else self.prepared.slot_of_layer[self._check_layer(layer)]
        return self.prepared.stage_rows[slot]

    @property
    def valid_rows(self) -> Tensor:
        """[L_local] bool: True for rows inside the model grid, False for padding rows of a padded stage grid."""
        return self._rows().valid

    @property
    def model_rows(self) -> Tensor:
        """[L_local] canonical id of each local row in the current stage's *model* grids (the row of the original
        model's ``[N, ...]`` tensor it is; ``num_model_rows`` for a padding row)."""
        return self._rows().scatter_index

    @property
    def num_model_rows(self) -> int:
        """Rows of the original model's tensor on the current stage's grids (padding excluded)."""
        return sum(t * h * w for t, h, w in self.stage_model_grids[self.stage])

    @property
    def laid_grid(self) -> Tensor:
        """[L_local, 3] the laid-out (padded) grid of each local row's sample (``grid_coords`` live in it)."""
        return self._rows().laid_grid

    @property
    def window_coords(self) -> Tensor:
        """[L_local, 3] window-local (dt, dh, dw) of each local row in the current layout."""
        return self._current_layout().window_coords

    @property
    def window_shape(self) -> Tensor:
        """[L_local, 3] extent (t, h, w) of the window of each local row (for window-size-relative positions)."""
        return self._current_layout().window_shape

    @property
    def grid_coords(self) -> Tensor:
        """[L_local, 3] global (t, h, w) of each local row inside its sample's grid, in the current layout."""
        return self._current_layout().grid_coords

    @property
    def token_ids(self) -> Tensor:
        """[L_local] canonical packed token id of each local row in the current layout."""
        return self._current_layout().token_ids

    @property
    def row_sample(self) -> Tensor:
        """[L_local] sample index of each local row in the current layout."""
        return self._current_layout().row_sample

    def sample_rows(self, x: Tensor) -> Tensor:
        """This rank's local rows (current layout) of a per-sample tensor ``[B, ...]``: ``x[row_sample]``.

        For what the original broadcasts over its tokens per sample (a conditioning vector ``[B, C]`` viewed as
        ``[B, 1, 1, C]``: adaLN, a timestep embedding). No collective; backward sums into each sample's row.
        """
        samples = len(self.stage_model_grids[self.stage])
        if x.dim() == 0 or x.shape[0] != samples:
            raise ValueError(f"sample_rows: expected a per-sample tensor [{samples}, ...] (the request has {samples} "
                             f"samples), got {list(x.shape)}")
        return x.index_select(0, self.row_sample)

    def grid_rows(self, x: Tensor, *, spatial_dims: int | None = None, axes: str | None = None) -> Tensor:
        """This rank's local rows (current layout) of a tensor given per position of the current stage's grid and
        shared by every sample: ``[T, H, W, ...]`` (``spatial_dims=3``), ``[H, W, ...]`` (2, a grid ``(1, H, W)``)
        or ``[W, ...]`` (1); None: the most grid dimensions whose sizes ``x`` starts with, else a flat table
        ``[T * H * W, ...]`` (the grid's positions row-major, as diffusers' RoPE angles come). For positions (axial
        RoPE), per-token tables, masks. Padding rows get zeros.

        ``axes``: a table over some of the grid's axes, shared along the others: ``"t"`` a table per frame
        ``[T, ...]``, ``"hw"`` one per position of a frame ``[H, W, ...]`` or ``[H * W, ...]`` (any frame), ``"thw"``
        the whole grid; the axes in (t, h, w) order.

        No collective; backward sums into the positions read.
        """
        if axes is not None:
            return self._axes_rows(x, axes)
        if spatial_dims not in (None, 1, 2, 3):
            raise ValueError(f"grid_rows: spatial_dims must be 1, 2 or 3, got {spatial_dims!r}")
        grids = sorted(set(self.stage_model_grids[self.stage]))
        if spatial_dims is None:
            spatial_dims = next((d for d in (3, 2, 1) if all(g == 1 for g in grids[0][:3 - d])
                                 and tuple(x.shape[:d]) == grids[0][3 - d:]), 3) if len(grids) == 1 else 3
            if len(grids) == 1 and x.dim() and tuple(x.shape[:spatial_dims]) != grids[0][3 - spatial_dims:] \
                    and x.shape[0] == grids[0][0] * grids[0][1] * grids[0][2]:
                x = x.unflatten(0, grids[0])  # a flat table of the grid's positions
        if len(grids) != 1:
            raise ValueError(f"grid_rows: the samples are on different grids {grids} in stage {self.stage}; a tensor "
                             f"per grid position shared by every sample cannot describe them (give canonical rows "
                             f"[N, ...] to request.scatter instead)")
        grid = grids[0]
        if any(g != 1 for g in grid[:3 - spatial_dims]) or tuple(x.shape[:spatial_dims]) != grid[3 - spatial_dims:]:
            raise ValueError(f"grid_rows: a tensor with {spatial_dims} grid dimension(s) {list(x.shape)} does not "
                             f"match stage {self.stage}'s grid (t, h, w) = {grid} (spatial_dims=3 takes [T, H, W, ...],"
                             f" 2 [H, W, ...] for t = 1, 1 [W, ...] for t = h = 1)")
        per_sample = grid[0] * grid[1] * grid[2]
        rows = self._rows()
        flat = x.reshape((per_sample,) + tuple(x.shape[spatial_dims:]))
        if not rows.padded:
            return flat.index_select(0, rows.scatter_index % per_sample)
        index = torch.where(rows.valid, rows.scatter_index % per_sample, per_sample)
        return torch.cat([flat, flat.new_zeros((1,) + tuple(flat.shape[1:]))]).index_select(0, index)

    def _axes_rows(self, x: Tensor, axes: str) -> Tensor:
        """:meth:`grid_rows` of a table over the grid ``axes`` (a part of ``"thw"``), shared along the others."""
        if not isinstance(axes, str) or not axes or [a for a in "thw" if a in axes] != list(axes):
            raise ValueError(f"grid_rows: axes must be grid axes in (t, h, w) order, a non-empty part of 'thw' ('t', "
                             f"'hw', 'thw', ...), got {axes!r}")
        grids = sorted(set(self.stage_model_grids[self.stage]))
        if len(grids) != 1:
            raise ValueError(f"grid_rows: the samples are on different grids {grids} in stage {self.stage}; a table "
                             f"shared by every sample cannot describe them")
        grid, picked = grids[0], ["thw".index(a) for a in axes]
        sizes = tuple(grid[i] for i in picked)
        n = int(np.prod(sizes))
        if tuple(x.shape[:len(sizes)]) == sizes:
            flat = x.reshape((n,) + tuple(x.shape[len(sizes):]))
        elif x.dim() and x.shape[0] == n:
            flat = x
        else:
            raise ValueError(f"grid_rows(axes={axes!r}): a table {list(x.shape)} does not start with stage "
                             f"{self.stage}'s sizes {list(sizes)} along {axes!r} (grid (t, h, w) = {grid}) nor with "
                             f"their product {n}")
        rows = self._rows()
        within = rows.scatter_index % (grid[0] * grid[1] * grid[2])
        coords = (within // (grid[1] * grid[2]), (within // grid[2]) % grid[1], within % grid[2])
        index = torch.zeros_like(within)
        for i in picked:
            index = index * grid[i] + coords[i]
        if not rows.padded:
            return flat.index_select(0, index)
        index = torch.where(rows.valid, index, n)
        return torch.cat([flat, flat.new_zeros((1,) + tuple(flat.shape[1:]))]).index_select(0, index)

    @property
    def window_ids(self) -> Tensor:
        """[L_local] id of each local row's window in the current layout (the geometry's window order per sample)."""
        return self._current_layout().window_ids

    @property
    def local_window(self) -> Tensor:
        """[L_local] index of each local row's window among this rank's windows (local rows are window-major)."""
        return self._current_layout().local_window

    def layout_data(self, name: str, layer: int | None = None) -> Any:
        """What layout hook ``name`` (:meth:`WindowRuntime.register_layout_hook`) built for the current layer's layout
        (or ``layer``'s)."""
        slot = self._current_slot() if layer is None else self.prepared.slot_of_layer[self._check_layer(layer)]
        if (slot, name) not in self.prepared.hook_data:
            raise ValueError(f"no layout hook named {name!r} was registered before this request was made; "
                             f"registered: {sorted(self.runtime.layout_hooks)}")
        return self.prepared.hook_data[(slot, name)]

    def _runner(self, slot: int, dtype: torch.dtype | None, modded: bool = False, *,
                bare: bool = False) -> tuple[str, Runner, tuple]:
        """The backend for ``slot``'s layout (``bare``: planned without text, for layers the text does not join)."""
        key = (slot, dtype, modded, bare)
        found = self.prepared.runners.get(key)
        if found is None:
            lay = self.prepared.bare[slot] if bare else self.prepared.layouts[slot]
            name, why = explain_backend(self.device, lay.segments, self.runtime.attention_backend, dtype=dtype,
                                        modded=modded)
            found = self.prepared.runners[key] = (name, bind_backend(name, lay.segments, lay.index), why)
        return found

    def backend(self, dtype: torch.dtype | None = None, *, modded: bool = False) -> str:
        """The attention backend of this request's layouts for ``dtype`` and calls with (``modded``) or without score
        mods (names joined by '+' where they differ)."""
        names = dict.fromkeys(self._runner(slot, dtype, modded)[0] for slot in range(len(self.prepared.layouts)))
        return "+".join(names)

    def backend_reasons(self, dtype: torch.dtype | None = None, *, modded: bool = False) -> tuple[str, ...]:
        """Why ``"auto"`` passed over the backends before the one :meth:`backend` names (empty for an explicit one)."""
        return tuple(dict.fromkeys(r for slot in range(len(self.prepared.layouts))
                                   for r in self._runner(slot, dtype, modded)[2]))

    @property
    def execution_path(self) -> str:
        """The runtime's :meth:`~WindowRuntime.describe` for this request's device and backend."""
        return self.runtime.describe(self.device, self.backend(None))

    # ---- the steps ---------------------------------------------------------------------------------------

    def scatter(self, x: Tensor, layer: int = 0) -> Tensor:
        """Entry: this rank's rows of a canonical packed tensor [N, ...] (the same on every rank) of ``layer``'s stage's
        model grids, in ``layer``'s layout (padding rows of a padded grid: zeros).

        Backward: the gradient of this rank's rows of its own copy (no collective).
        """
        layer = self._check_layer(layer)
        stage = self.runtime.stage_of_layer[layer]
        grids = self.stage_model_grids[stage]
        total = sum(t * h * w for t, h, w in grids)
        if x.shape[0] != total:
            where = f"stage {stage}'s grids" if len(self.runtime.stages) > 1 else "the batch's grids"
            raise ValueError(f"scatter: the canonical tensor has {x.shape[0]} rows but {where} {grids} have {total} "
                             f"tokens")
        rows = self._rows(layer)
        self._enter(layer)
        self._last_move = None
        if not rows.padded:
            return x.index_select(0, self._current_layout().token_ids)
        return torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))]).index_select(0, rows.scatter_index)

    def to_layer(self, x: Tensor, layer: int, *, source: int | None = None) -> Tensor:
        """Bring local rows into ``layer``'s layout; nothing happens if it is the current one.

        ``source``: the rows are in that earlier layer's layout (a skip kept from it); the current layer stays. Both
        layers must lie on one grid (the same stage, or a stage cropped ``like`` it); :meth:`to_grid` changes grids.

        A second call into the layer the previous call moved into, with another tensor, cannot tell whether that
        tensor is still in the old layout: the tensor the previous call was given is moved the same way (its layout
        is known); the one it returned comes back as it is; any other is refused, asking for ``source=`` (a tensor of
        the old layout) or for no call (one computed from the moved rows). Without this, the second call would do
        nothing and attention would run on rows of the wrong windows.
        """
        layer = self._check_layer(layer)
        if source is not None:
            source = self._check_layer(source)
            src, dst = (self.prepared.slot_of_layer[i] for i in (source, layer))
            if src == dst:
                return x
            self._check_same_grid(source, layer, f"to_layer(source={source})")
            return redistribute_rows(x, self._transition(src, dst), self.group)
        here = self._current()
        self._check_same_grid(here, layer, "to_layer")
        src = self._current_slot()
        dst = self._enter(layer)
        tracking = not torch.compiler.is_compiling()
        if src == dst:
            if tracking and self._last_move is not None:
                return self._repeated_move(x, layer)
            return x
        self.transitions_done += 1
        out = redistribute_rows(x, self._transition(src, dst), self.group)
        if tracking:
            self._last_move = (layer, src, dst, weakref.ref(x), weakref.ref(out))
        return out

    def _repeated_move(self, x: Tensor, layer: int) -> Tensor:
        """``to_layer(x, layer)`` that finds the rows already in ``layer``'s layout (see :meth:`to_layer`)."""
        if self._last_move is None:
            return x
        moved_layer, src, dst, moved_in, moved_out = self._last_move
        if moved_layer != layer or dst != self._slot:
            self._last_move = None  # another layer: the caller moves on from that move
            return x
        if x is moved_out():
            return x
        if x is moved_in():
            return redistribute_rows(x, self._transition(src, dst), self.group)
        previous = next(i for i, slot in enumerate(self.prepared.slot_of_layer) if slot == src)
        raise ValueError(
            f"to_layer(x, {layer}): the rows were already moved into layer {layer}'s layout by an earlier "
            f"to_layer({layer}) call, so this one would do nothing, but x is another tensor whose layout is unknown. "
            f"If x is still in the previous layout (that of layer {previous}), call to_layer(x, {layer}, "
            f"source={previous}); if it was computed from the moved rows, it is already in place: drop this call"
        )

    def _check_same_grid(self, here: int, layer: int, what: str) -> None:
        stage_of = self.runtime.stage_of_layer
        if self.stage_laid_grids[stage_of[here]] != self.stage_laid_grids[stage_of[layer]]:
            raise ValueError(
                f"{what}: layer {layer} is in stage {stage_of[layer]}, on another grid than layer {here} (stage "
                f"{stage_of[here]}); a grid change (request.to_grid(x, stage)) must come between them. If the model "
                f"does run them in this order, the plan's stages or layer order do not follow the forward"
            )

    def _transition(self, src: int, dst: int):
        step = self.prepared.steps.get((src, dst))
        if step is None:  # a jump the schedule does not make between neighbours: prepared now, once
            step = self.prepared.steps[(src, dst)] = self.runtime._step(
                self.prepared.layouts[src].plan, self.prepared.layouts[dst].plan, self.device)
        return step

    def to_grid(self, x: Tensor, stage: int) -> Tensor:
        """The grid change into ``stage`` (the next one): local rows of its first layer's layout (of stage s's last
        layer for a split cropped ``like`` s: see :meth:`WindowRuntime.landing_layer`).

        A merge returns ``[L, K * C, ...]`` (children's channels side by side in the stage's ``order``, zeros for
        children outside the grid); a split takes ``[L, C, ...]`` with ``C = K * C'`` and returns ``[L, C', ...]``.
        Only rows whose output row lives on another rank move (one all-to-all, none if no row does).
        """
        self._check_grid_change(stage)
        out = self.runtime._grid_step(self, self._current_slot(), stage)(x, self.group)
        self._enter(self.runtime.landing_layer(stage))
        self._last_move = None
        self.transitions_done += 1
        return out

    def _check_grid_change(self, stage: object) -> None:
        stages = self.runtime.stages
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 < stage < len(stages):
            raise ValueError(f"to_grid: stage must be 1 .. {len(stages) - 1}, got {stage!r}")
        if not stages[stage].changes_grid:
            raise ValueError(f"to_grid: stage {stage} keeps the previous grid; use to_layer")
        here = self.stage
        if here != stage - 1:
            raise ValueError(f"to_grid: rows are in stage {here}; stage {stage} follows stage {stage - 1}")

    def grid_step(self, stage: int) -> GridStep:
        """The prepared step :meth:`to_grid` takes from the current layout into ``stage`` (``rows_moved`` etc.)."""
        self._check_grid_change(stage)
        return self.runtime._grid_step(self, self._current_slot(), stage)

    def gather(self, x: Tensor) -> Tensor:
        """Exit: the canonical tensor [N, ...] of the current stage's model grids from every rank's local rows,
        complete on every rank (padding rows dropped).

        Backward: a reduce-scatter: this rank's rows receive the sum over ranks of the gradients of every rank's copy
        of them (each rank's copy is its own contribution; :func:`winsp.sync_gradients` averages afterwards).
        """
        lay = self._current_layout()
        rows = self._rows()
        out = gather_rows(x, lay.plan, self.group, lay.gather_order)
        return out.index_select(0, rows.crop_index) if rows.padded else out

    def active(self):
        """``with request.active():`` makes this request the one :func:`winsp.current_request` returns."""
        from winsp.runtime.context import active_request

        return active_request(self)

    def reduce_text(self, window_text: Tensor) -> Tensor:
        """Mean over all windows (all ranks) of window-major per-window text outputs; identical on every rank."""
        return reduce_window_text(window_text, self._current_layout().text, self.group)

    def attention(
        self,
        q_vid: Tensor,
        k_vid: Tensor,
        v_vid: Tensor,
        q_txt: Tensor | None = None,
        k_txt: Tensor | None = None,
        v_txt: Tensor | None = None,
        *,
        layer: int,
        score_mod=None,
        mask_mod=None,
        softmax_scale: float | None = None,
        text_output: bool = True,
        dropout_p: float = 0.0,
        text_padded: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Window attention of layer ``layer`` on local rows over [window video, sample text], then the text reduction.

        Video tensors are [L_local, heads, head_dim]; text tensors [sum(text_lengths), heads, head_dim] replicated
        (or None). Returns (video output [L_local, heads, head_dim], text output [L_txt, heads, head_dim] or None).
        The rows must be in ``layer``'s layout (``to_layer(x, layer)`` first), else a ValueError names both layouts.
        ``score_mod(score, head, q_row, k_row)`` / ``mask_mod(head, q_row, k_row)`` modify video x video scores, rows
        being local row indices (:mod:`winsp.attention.score_mods`). ``text_output=False`` (a layer whose text output is
        never read, e.g. a model's last block) skips the text reduction and its all-reduce; every rank must pass the
        same value. Text is replicated tokens in general (a CLS or register token: one row per sample); a layer that
        ``text_layers`` marks False (tokens that join some layers only) takes none, and its video attends alone.

        ``v`` has ``q``'s (and ``k``'s) head size: ``[rows, heads, head_dim]`` for all three (a model whose values are
        wider or narrower is refused with the sizes).

        ``dropout_p``: the original attention's probability dropout (0 in eval); pass it, so that a training forward
        with it on is refused by name (``docs/adopting_a_model.md``): winsp offers none, as no window layout can draw
        the original's mask over its ``[heads, n, n]`` probabilities.

        ``text_padded=True``: the text tensors hold every sample's text padded to one row count, its valid rows (its
        ``text_lengths`` entry: ``Replicated(valid=...)``) first, as a model that masks padded text holds them; only
        the valid rows take part, and the padding rows' output is zeros (what SDPA gives a fully masked row).
        """
        if dropout_p:
            names = self.runtime.layer_names
            name = f" ({names[layer]!r})" if names and isinstance(layer, int) and 0 <= layer < len(names) else ""
            raise ValueError(f"layer {layer}{name}: attention-probability dropout (dropout_p={dropout_p}) is not "
                             f"offered by winsp: the original draws its mask over each attention's [heads, n, n] "
                             f"probabilities of its own batch and order, which no window layout reproduces; train "
                             f"with the attention's dropout off (p=0) or in eval mode")
        if text_padded and q_txt is not None:
            return self._attention_padded_text(layer, (q_vid, k_vid, v_vid), (q_txt, k_txt, v_txt), dict(
                score_mod=score_mod, mask_mod=mask_mod, softmax_scale=softmax_scale, text_output=text_output))
        if not self._dtypes_checked and not torch.compiler.is_compiling():
            self._check_dtypes((q_vid, k_vid, v_vid, q_txt, k_txt, v_txt))
        lay = self._layer_layout(layer)
        joins = self.text_layers[layer]
        if not joins:
            if q_txt is not None or k_txt is not None or v_txt is not None:
                raise ValueError(f"layer {layer} does not take the replicated tokens (the request's text_layers say "
                                 f"so: ParallelPlan.replicated.joins), but attention got text tensors")
            lay = self.prepared.bare[self.prepared.slot_of_layer[layer]]
        if q_vid.dim() != 3 or k_vid.shape != q_vid.shape or v_vid.shape != q_vid.shape:
            raise ValueError(f"attention takes q, k and v as [rows, heads, head_dim] of one shape (v with q's head "
                             f"size); got q {list(q_vid.shape)}, k {list(k_vid.shape)}, v {list(v_vid.shape)}")
        if q_vid.shape[0] != lay.num_rows:
            raise ValueError(
                f"rank {self.group.rank}: attention got {q_vid.shape[0]} video rows, layer {self.layer}'s layout "
                f"gives this rank {lay.num_rows}"
            )
        has_text = q_txt is not None
        if has_text:
            for name, t in (("q_txt", q_txt), ("k_txt", k_txt), ("v_txt", v_txt)):
                if t is not None and t.shape[0] != self.num_text_rows:
                    raise ValueError(
                        f"{name} has {t.shape[0]} rows but the request's text_lengths {self.text_lengths} describe "
                        f"{self.num_text_rows}"
                    )
        elif self.num_text_rows and joins:
            raise ValueError(f"the request has text lengths {self.text_lengths} but attention got no text tensors "
                             f"(layer {layer} takes them)")
        mods = check_score_mods(score_mod, mask_mod)
        if mods:
            self.runtime._modded_seen = True
        if is_neighborhood(self.runtime.schedule[layer]):  # halo exchange + local neighbourhoods (winsp.planning.halo)
            return neighborhood_layer(self, layer, (q_vid, k_vid, v_vid), (q_txt, k_txt, v_txt), mods,
                                      softmax_scale, has_text and text_output)
        if lay.plan.has_split_windows:
            refuse_score_mods(lay.plan, score_mod, mask_mod)
            return self._attention_split(lay, self._runner(self._current_slot(), q_vid.dtype, False, bare=not joins)[1],
                                         (q_vid, k_vid, v_vid), (q_txt, k_txt, v_txt), softmax_scale,
                                         has_text and text_output, self.text_lengths if joins else None)
        runner = self._runner(self._current_slot(), q_vid.dtype, bool(mods), bare=not joins)[1]
        vid_out, window_text = attend(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, lay.segments, lay.index, runner,
                                      softmax_scale=softmax_scale, mods=mods)
        if not (has_text and text_output):
            return vid_out, None
        return vid_out, reduce_window_text(window_text, lay.text, self.group)

    def _attention_padded_text(self, layer: int, qkv: tuple, qkv_txt: tuple,
                               options: dict) -> tuple[Tensor, Tensor | None]:
        """:meth:`attention` with ``text_padded``: the valid rows of each sample's padded text in, zeros out for the
        padding (slices, no index tensors)."""
        samples, lengths = len(self.text_lengths), self.text_lengths
        rows = {t.shape[0] for t in qkv_txt if t is not None}
        per = next(iter(rows)) // samples if len(rows) == 1 and samples else -1
        if len(rows) != 1 or per * samples != next(iter(rows)) or per < max(lengths, default=0):
            raise ValueError(f"attention(text_padded=True): the text tensors have {sorted(rows)} rows; they must hold "
                             f"the {samples} sample(s)' text padded to one row count of at least their text lengths "
                             f"{lengths} (each sample's valid rows first)")
        valid = (None if t is None else torch.cat([t[i * per:i * per + n] for i, n in enumerate(lengths)])
                 for t in qkv_txt)
        vid, txt = self.attention(*qkv, *valid, layer=layer, **options)
        if txt is None:
            return vid, None
        pad = [txt.new_zeros((per - n,) + tuple(txt.shape[1:])) for n in lengths]
        ends = [sum(lengths[:i + 1]) for i in range(samples)]
        return vid, torch.cat([part for i, n in enumerate(lengths) for part in (txt[ends[i] - n:ends[i]], pad[i])])

    def joint_attention(self, q: Tensor, k: Tensor, v: Tensor, *, layer: int, text_first: bool = True,
                        **options: Any) -> Tensor:
        """:meth:`attention` for a model that attends its text (replicated tokens) and video jointly, holding both in
        one tensor: ``q``, ``k``, ``v`` are ``[num_text_rows + L_local, heads, head_dim]`` with the request's text
        rows first (``text_first``; else last); returns the output in the same arrangement, the text part reduced by
        the window-mean rule. ``options``: :meth:`attention`'s keywords (``score_mod``, ``softmax_scale``, ...).
        On a layer the text does not join (``text_layers``), ``q``, ``k``, ``v`` are the video rows alone, and so is
        the output: one call serves both kinds of layer."""
        if not self.text_layers[self._check_layer(layer)]:
            return self.attention(q, k, v, layer=layer, **options)[0]
        n = self.num_text_rows
        cut = n if text_first else q.shape[0] - n
        (vq, tq), (vk, tk), (vv, tv) = ((t[n:], t[:n]) if text_first else (t[:cut], t[cut:]) for t in (q, k, v))
        vid, txt = self.attention(vq, vk, vv, tq, tk, tv, layer=layer, **options)
        if txt is None:
            raise ValueError(f"joint_attention: layer {layer} returned no text output (text_output=False); call "
                             f"attention() to drop it")
        return torch.cat([txt, vid] if text_first else [vid, txt])

    def _check_dtypes(self, tensors: tuple) -> None:
        """Once per request, at its first attention, on every rank of the group at once (one small all-gather): q/k/v
        real floating point, one dtype, the same on every rank (:mod:`winsp.attention.input_dtypes`). On a CPU the
        table is read back, so every rank raises the same error; on a GPU (where that read would stall the device in
        the first layer) each rank checks its own row and the group compares rows on the device."""
        codes = dtype_codes(tensors)
        if self.device.type != "cpu":
            problem = dtype_problem([codes], first_rank=self.group.rank)
            if problem is not None:
                raise ValueError(f"rank {self.group.rank}: {problem}")
            self.group.assert_same_ints(codes, self.device, "winsp: attention inputs have different dtypes on the "
                                        "ranks of the SP group (run on CPU ranks for the table of dtypes)")
            self._dtypes_checked = True
            return
        rows = self.group.all_gather_ints(codes, self.device)
        problem = dtype_problem(rows)
        if problem is not None:
            raise ValueError(f"rank {self.group.rank}: {problem}")
        self._dtypes_checked = True

    def _attention_split(self, lay: LayoutTensors, runner: Runner, qkv: tuple, qkv_txt: tuple,
                         softmax_scale: float | None, text_output: bool,
                         text_lengths: tuple[int, ...] | None) -> tuple[Tensor, Tensor | None]:
        """:meth:`attention` on a layout with split windows: whole windows as usual, split ones head-parallel
        (``text_lengths`` None: a layer the text does not join)."""
        q = qkv[0]
        key = (self._current_slot(), q.shape[1], text_lengths is None)
        split = self.prepared.splits.get(key)
        if split is None:  # first call at this head count: prepared once, then a plain look-up like the runners
            lengths = text_lengths if text_lengths is not None else (0,) * len(self.text_lengths)
            split = self.prepared.splits[key] = self.runtime._split(lay.plan, lengths, q.shape[1], self.device)
        # slices where the local rows allow (no copy)
        (q_whole, q_split), (k_whole, k_split), (v_whole, v_split) = (split_local_rows(t, split) for t in qkv)
        q_txt, k_txt, v_txt = qkv_txt
        vid_whole, window_text = attend(q_whole, k_whole, v_whole, q_txt, k_txt, v_txt,
                                        lay.segments, lay.index, runner, softmax_scale=softmax_scale)
        no_text = q.new_zeros((0,) + tuple(q.shape[1:]))
        qt, kt, vt = (no_text if t is None else t for t in qkv_txt)
        vid_split, txt_split = split_attention(q_split, k_split, v_split, qt, kt, vt, split, self.group,
                                               _scale(q, softmax_scale))
        vid_out = join_local_rows(vid_whole, vid_split, split)
        if not text_output:
            return vid_out, None
        acc = sum_window_text(window_text, lay.text, self.group)
        acc = acc.view(-1, q.shape[-1]).index_add(0, split.text_index, txt_split.to(acc.dtype)).view_as(acc)
        return vid_out, finish_text_reduction(acc, lay.text, self.group, q.dtype)
