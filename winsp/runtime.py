"""The per-request runtime: it owns the layer schedule, the store of prepared data, and every step that crosses ranks.

A model builds one :class:`WindowRuntime` (the schedule of window geometries, one per layer, and the SP group), then
for each forward asks it for a :class:`WindowRequest` over that batch's grids. Making the request is the *planning*
phase: plans, transitions, each rank's windows and every device index tensor come from the runtime's store (built on
a miss, numpy on the CPU). It is marked for torch.compile to leave alone. The request's steps are the *per-layer*
phase, made only of tensor ops on prepared tensors and Python constants, so they trace without graph breaks:
``scatter`` (canonical rows -> this rank's rows of layer 0), ``to_layer`` before each layer (a redistribution only
where the layout really changes), ``attention`` (window attention on local rows plus the replicated-text reduction),
and ``gather`` (the canonical output on every rank). Model code calls only these; it never sees a collective.

Gradient convention: every rank computes the same loss from replicated values, each rank's copy of a replicated value
is its own contribution, and after ``backward`` :func:`winsp.sync_gradients` averages the gradients over the SP group
(as DDP does). Each step's backward is its forward's exact adjoint (``scatter``: this rank's rows; ``to_layer``: the
reverse all-to-all; ``attention``'s text reduction: an all-reduce; ``gather``: a reduce-scatter), so that holds
wherever a model scatters and gathers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from .attention import _scale, attend
from .backends import REGISTRY, Runner, available_backends, bind_backend, check_backend_name, explain_backend
from .checks import count_tuple
from .compile import planning
from .config import DiffusionParallelConfig
from .costs import DEFAULT_COSTS, CostConstants
from .geometry import WindowGeometry
from .group import SPGroup
from .layout import check_grids
from .planner import Plan
from .score_mods import check_score_mods
from .redistribute import RankTransitionTensors, Transition, gather_rows, redistribute_rows
from .schedule import _check_schedule, check_planner, plan_schedule
from .segments import WindowIndexTensors, WindowSegments
from .split import (SplitAttention, SplitAttentionTensors, join_local_rows, refuse_score_mods, split_attention,
                    split_local_rows)
from .store import CacheInfo, RuntimeStore
from .text import (TextReduction, TextReductionTensors, finish_text_reduction, reduce_window_text,
                   sum_window_text)

__all__ = ["WindowRuntime", "WindowRequest", "LocalWindows", "LayoutTensors", "PreparedRequest"]

_log = logging.getLogger("winsp")


class LocalWindows:
    """One rank's share of one plan, on the CPU: its windows, rows, positions and attention segments.

    ``windows``, ``segments`` and ``text`` describe the windows this rank holds whole; the rows of split windows'
    pieces (a plan with split windows) are in ``positions`` too, and :mod:`winsp.split` computes their attention.
    """

    def __init__(self, plan: Plan, rank: int, text_lengths: tuple[int, ...]) -> None:
        self.plan, self.rank = plan, rank
        lay = plan.layout
        self.windows = np.asarray(plan.rank_windows[rank], dtype=np.int64)
        self.num_rows = plan.rank_token_counts[rank]
        self.positions = plan.rank_positions(rank)
        counts = lay.token_counts[self.windows]
        samples = lay.window_sample[self.windows]
        text_len = np.asarray(text_lengths, dtype=np.int64)
        text_start = np.concatenate([[0], np.cumsum(text_len)[:-1]]).astype(np.int64)
        self.segments = WindowSegments(
            vid_counts=tuple(int(c) for c in counts),
            txt_lengths=tuple(int(text_len[s]) for s in samples),
            txt_starts=tuple(int(text_start[s]) for s in samples),
        )
        # window-text row k -> packed text row; each text row is divided by its sample's global window count
        lengths = text_len[samples]
        row_target = (np.repeat(text_start[samples] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
                      + np.arange(int(lengths.sum()), dtype=np.int64)) if lengths.size else np.empty(0, np.int64)
        self.text = TextReduction(
            row_target=row_target.astype(np.int64),
            row_divisor=np.repeat(lay.windows_per_sample, text_len),
            num_text_rows=int(text_len.sum()),
        )

    @cached_property
    def token_ids(self) -> np.ndarray:
        """[L] canonical packed token id of each local row."""
        return self.plan.layout.token_ids[self.positions]

    @cached_property
    def window_ids(self) -> np.ndarray:
        """[L] id of each local row's window in the plan's layout (the geometry's window order, sample by sample)."""
        return self.plan.layout.window_of_position[self.positions]

    @cached_property
    def local_window(self) -> np.ndarray:
        """[L] index of each local row's window among this rank's windows or window pieces (local order; equal to
        the index in ``self.windows`` when every window is whole)."""
        lengths = [b - a for _, a, b in self.plan.rank_pieces[self.rank]]
        return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)

    @cached_property
    def row_sample(self) -> np.ndarray:
        """[L] sample index of each local row."""
        lay = self.plan.layout
        return lay.window_sample[lay.window_of_position[self.positions]]

    @cached_property
    def window_coords(self) -> np.ndarray:
        """[L, 3] window-local (dt, dh, dw) of each local row."""
        return self.plan.layout.window_coords[self.positions]

    @cached_property
    def window_shape(self) -> np.ndarray:
        """[L, 3] extent (t, h, w) of the window each local row belongs to."""
        lay = self.plan.layout
        return lay.window_shape[lay.window_of_position[self.positions]]

    @cached_property
    def grid_coords(self) -> np.ndarray:
        """[L, 3] global (t, h, w) of each local row inside its sample's grid."""
        lay = self.plan.layout
        sample = self.row_sample
        within = self.token_ids - lay.sample_offsets[sample]
        grids = np.asarray(lay.grids, dtype=np.int64)[sample] if sample.size else np.zeros((0, 3), np.int64)
        h, w = grids[:, 1], grids[:, 2]
        return np.stack([within // (h * w), (within // w) % h, within % w], axis=-1).astype(np.int64)


@dataclass(frozen=True, eq=False)
class LayoutTensors:
    """One rank's share of one plan on one device: everything the per-layer steps read, prepared once."""

    plan: Plan
    local: LocalWindows
    index: WindowIndexTensors
    text: TextReductionTensors
    token_ids: Tensor
    row_sample: Tensor
    window_coords: Tensor
    window_shape: Tensor
    grid_coords: Tensor
    window_ids: Tensor
    local_window: Tensor
    gather_order: Tensor

    @property
    def segments(self) -> WindowSegments:
        return self.local.segments

    @property
    def num_rows(self) -> int:
        return self.local.num_rows


def _tensor(array: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


@dataclass(eq=False)
class PreparedRequest:
    """A store entry: the plans of one request shape and, for this rank and device, every prepared tensor.

    ``slot_of_layer[i]`` is the index in ``layouts`` of layer i's plan (layers with equal geometry share a slot);
    ``steps[(a, b)]`` moves rows from slot a's layout to slot b's; ``runners[(slot, dtype, modded)]`` is the attention
    backend chosen for that layout, dtype and whether the call modifies scores, as ``(name, runner, why)``;
    ``hook_data[(slot, name)]`` is what layout hook ``name`` built for that layout.
    """

    plans: tuple[Plan, ...]
    slot_of_layer: tuple[int, ...]
    layouts: tuple[LayoutTensors, ...]
    steps: dict
    runners: dict
    hook_data: dict
    splits: dict = field(default_factory=dict)  # (slot, heads) -> SplitAttentionTensors, for layouts that split


class WindowRuntime:
    """Window-parallel execution of a model whose layer ``i`` attends inside ``schedule[i]``'s windows.

    Args:
        schedule: one :class:`~winsp.geometry.WindowGeometry` per layer.
        group: a :class:`~winsp.group.SPGroup`, a ``torch.distributed`` process group, or None (one rank).
        attention_backend: ``"auto"`` or a backend name of :mod:`winsp.backends`.
        planner: a name of :data:`winsp.schedule.PLANNERS` (``"auto"`` by default: whole or split windows per
            layout, whichever is predicted faster).
        store_size: how many entries the runtime's store keeps (LRU).
        split_windows: False for a model whose attention takes a ``score_mod`` / ``mask_mod``: ``"auto"`` then keeps
            whole windows (a split window has no per-local-row tensors for them to index).
        costs: the cost constants the planner weighs placements with (None: :data:`winsp.costs.DEFAULT_COSTS`).
    """

    def __init__(
        self,
        schedule: Sequence[WindowGeometry],
        *,
        group=None,
        attention_backend: str = "auto",
        planner: str = "auto",
        store_size: int = 64,
        split_windows: bool = True,
        costs: CostConstants | None = None,
    ) -> None:
        self.schedule = _check_schedule(schedule)
        self.costs = DEFAULT_COSTS if costs is None else costs  # checked by plan_schedule
        if not isinstance(split_windows, bool):
            raise ValueError(f"split_windows must be True or False, got {split_windows!r}")
        self.split_windows = split_windows
        self.group = group if isinstance(group, SPGroup) else SPGroup(group)
        self.attention_backend = check_backend_name(attention_backend)
        self.planner = check_planner(planner)
        self.store = RuntimeStore(store_size)
        self.layout_hooks: dict[str, Callable[[LocalWindows, torch.device], Any]] = {}
        self._modded_seen = False  # an attention call passed a score_mod / mask_mod: prepare that backend too
        self._last: tuple[torch.device, torch.dtype | None, str] | None = None

    @classmethod
    def from_config(
        cls,
        config: DiffusionParallelConfig | None,
        schedule: Sequence[WindowGeometry],
        *,
        group=None,
    ) -> "WindowRuntime":
        """Build the runtime a :class:`DiffusionParallelConfig` asks for.

        ``ulysses_degree`` N = 1 needs no process group. For N > 1 torch.distributed must be initialised; ``group``
        defaults to the world, and its size must equal N.
        """
        config = config if config is not None else DiffusionParallelConfig()
        if not isinstance(config, DiffusionParallelConfig):
            raise ValueError(f"parallel_config must be a DiffusionParallelConfig, got {type(config).__name__}")
        n = config.ulysses_degree
        if isinstance(group, SPGroup):
            sp = group
        elif group is not None:
            sp = SPGroup(group)
        elif n == 1:
            sp = SPGroup(None)
        else:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    f"ulysses_degree={n} needs an initialised torch.distributed world (e.g. launch with torchrun and "
                    f"call torch.distributed.init_process_group), or a process group passed as group="
                )
            sp = SPGroup(dist.group.WORLD)
        if sp.size != n:
            raise ValueError(
                f"ulysses_degree={n} but the SP group has {sp.size} ranks; pass a subgroup of exactly {n} ranks"
            )
        runtime = cls(schedule, group=sp, attention_backend=config.attention_backend, planner=config.planner,
                      store_size=config.plan_cache_size, costs=config.costs)
        _log.info("winsp rank %d: %s (%d layers, %d layout transitions per forward)", runtime.rank,
                  runtime.execution_path, len(runtime.schedule), runtime.num_transitions)
        return runtime

    @property
    def world_size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    @cached_property
    def layout_changes(self) -> tuple[int, ...]:
        """Layers before which the layout changes (derived from the schedule, not assumed to alternate)."""
        fps = [g.fingerprint for g in self.schedule]
        return tuple(i for i in range(1, len(fps)) if fps[i] != fps[i - 1])

    @property
    def num_transitions(self) -> int:
        """Inter-layer layout transitions per forward (31 for SeedVR2 3B's 32 alternating layers)."""
        return len(self.layout_changes)

    def cache_info(self) -> CacheInfo:
        """Hits, misses, bound and size of the runtime's store."""
        return self.store.cache_info()

    def backend_for(self, device: torch.device | str) -> str:
        """The attention backend this runtime uses on ``device`` in general (a request knows its own exactly)."""
        device = torch.device(device)
        if self.attention_backend != "auto":
            return self.attention_backend
        usable = [b for b in available_backends(device)
                  if b != "batched_sdpa" and REGISTRY[b].auto_rule(device, False) is None]
        return usable[0] if usable else "grouped_sdpa"

    def describe(self, device: torch.device | str = "cpu", backend: str | None = None) -> str:
        """A one-line report of the execution path, e.g. ``window-aligned SP, Plan A (auto), 4 ranks, grouped SDPA``."""
        backend = (backend or self.backend_for(device)).replace("_", " ").replace("sdpa", "SDPA")
        if self.world_size == 1:
            return f"window attention, single rank (no communication), {backend}"
        return f"window-aligned SP, Plan A ({self.planner}), {self.world_size} ranks, {backend}"

    @property
    def execution_path(self) -> str:
        """:meth:`describe` for the latest request's device, dtype and the backend it actually uses."""
        if self._last is None:
            return self.describe("cpu")
        device, _, backend = self._last
        return self.describe(device, backend)

    # ---- planning (eager, cached in the store) ----------------------------------------------------------

    def register_layout_hook(self, name: str, fn: Callable[[LocalWindows, torch.device], Any]) -> None:
        """Have every request build ``fn(local, device)`` once per layout, in the planning phase.

        ``local`` is this rank's :class:`LocalWindows` of a layout (its windows, rows, positions, window ids,
        ``window_coords``, ...); whatever ``fn`` returns (typically index tensors on ``device``, e.g. a relative
        position bias index per local row) is kept in the runtime's store with the layout and read in the forward
        with :meth:`WindowRequest.layout_data`, so blocks build nothing on first use and compile with
        ``fullgraph=True``. Registering a name again replaces its function (entries built by the old one are not
        reused).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a layout hook needs a non-empty string name, got {name!r}")
        if not callable(fn):
            raise ValueError(f"layout hook {name!r}: fn must be callable fn(local, device), got {type(fn).__name__}")
        self.layout_hooks[name] = fn

    def _hook_data(self, name: str, layout: LayoutTensors, text_lengths: tuple[int, ...], device: torch.device):
        fn = self.layout_hooks[name]
        key = ("hook", name, id(fn), layout.plan.key or id(layout.plan), self.rank, text_lengths, str(device))
        return self.store.get(key, lambda: fn(layout.local, device))

    def plans(self, grids: Sequence[Sequence[int]], *, split_windows: bool | None = None) -> tuple[Plan, ...]:
        """One plan per layer for a packed batch of ``grids`` (from the store; :func:`winsp.plan_schedule`).

        ``split_windows`` (default: the runtime's) False keeps every window whole (attention with score mods).
        """
        grids = check_grids(grids)
        split = self.split_windows if split_windows is None else bool(split_windows)
        return self.store.get(("plans", grids, split), lambda: tuple(plan_schedule(
            grids, self.schedule, self.world_size, self.planner, split_windows=split, costs=self.costs)))

    def _step(self, src: Plan, dst: Plan, device: torch.device) -> RankTransitionTensors:
        key = ("transition", src.key or id(src), dst.key or id(dst), self.rank, str(device))
        return self.store.get(key, lambda: Transition(src, dst).for_rank(self.rank).to(device))

    def _split(self, plan: Plan, text_lengths: tuple[int, ...], heads: int,
               device: torch.device) -> SplitAttentionTensors:
        key = ("split", plan.key or id(plan), self.rank, heads, text_lengths, str(device))
        return self.store.get(key, lambda: SplitAttention.build(plan, self.rank, heads, text_lengths).to(device))

    def _layout(self, plan: Plan, text_lengths: tuple[int, ...], device: torch.device) -> LayoutTensors:
        def build() -> LayoutTensors:
            local = LocalWindows(plan, self.rank, text_lengths)
            return LayoutTensors(
                plan=plan, local=local, index=local.segments.index_tensors(device), text=local.text.to(device),
                token_ids=_tensor(local.token_ids, device), row_sample=_tensor(local.row_sample, device),
                window_coords=_tensor(local.window_coords, device), window_shape=_tensor(local.window_shape, device),
                grid_coords=_tensor(local.grid_coords, device),
                window_ids=_tensor(local.window_ids, device), local_window=_tensor(local.local_window, device),
                gather_order=_tensor(plan.gather_order, device),
            )

        return self.store.get(("layout", plan.key or id(plan), self.rank, text_lengths, str(device)), build)

    def _prepare(self, grids, text_lengths: tuple[int, ...], device: torch.device,
                 split_windows: bool) -> PreparedRequest:
        def build() -> PreparedRequest:
            plans = self.plans(grids, split_windows=split_windows)
            distinct: list[Plan] = []
            slot_of_layer = []
            for plan in plans:
                if not any(plan is p for p in distinct):
                    distinct.append(plan)
                slot_of_layer.append(next(i for i, p in enumerate(distinct) if p is plan))
            layouts = tuple(self._layout(p, text_lengths, device) for p in distinct)
            steps = {}
            for a, b in zip(slot_of_layer, slot_of_layer[1:]):
                if a != b and (a, b) not in steps and distinct[a].layout.grids == distinct[b].layout.grids:
                    steps[(a, b)] = self._step(distinct[a], distinct[b], device)
            return PreparedRequest(plans=plans, slot_of_layer=tuple(slot_of_layer), layouts=layouts,
                                   steps=steps, runners={}, hook_data={})

        return self.store.get(("request", grids, text_lengths, self.rank, str(device), split_windows), build)

    @planning
    def request(
        self,
        grids: Sequence[Sequence[int]],
        text_lengths: Sequence[int] | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        score_mods: bool | None = None,
    ) -> "WindowRequest":
        """Start one forward over a packed batch with these post-patch grids (and text lengths, one per sample).

        Everything the forward needs is prepared here (or found in the store), including what every registered
        layout hook builds. Give ``dtype`` (the attention inputs' dtype) so the attention backend is chosen here too;
        without it, it is chosen on the first attention call (which a ``fullgraph=True`` compile cannot trace).
        ``score_mods`` says whether attention calls will pass a ``score_mod`` / ``mask_mod`` (their backend is then
        chosen here as well, and the default planner keeps every window whole, since a split window has no
        per-local-row tensors for them); None: as this runtime's earlier requests did.
        """
        grids = check_grids(grids)
        text_lengths = _check_text_lengths(text_lengths, len(grids))
        device = torch.device(device) if device is not None else torch.device("cpu")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        if score_mods is not None and not isinstance(score_mods, bool):
            raise ValueError(f"score_mods must be True, False or None, got {score_mods!r}")
        modded = self._modded_seen if score_mods is None else score_mods
        prepared = self._prepare(grids, text_lengths, device, self.split_windows and not modded)
        for name in self.layout_hooks:
            for slot, layout in enumerate(prepared.layouts):
                prepared.hook_data[(slot, name)] = self._hook_data(name, layout, text_lengths, device)
        request = WindowRequest(self, prepared, grids, text_lengths, device)
        if dtype is not None:
            for slot in range(len(prepared.layouts)):
                request._runner(slot, dtype, modded)
        self._last = (device, dtype, request.backend(dtype, modded=modded))
        return request


def _check_text_lengths(text_lengths, num_samples: int) -> tuple[int, ...]:
    if text_lengths is None:
        return (0,) * num_samples
    out = count_tuple("text_lengths", text_lengths)
    if len(out) != num_samples:
        raise ValueError(f"text_lengths has {len(out)} entries but there are {num_samples} samples")
    return out


class WindowRequest:
    """One forward's window-parallel state: which layout the local rows are in, and the steps between layouts.

    Cheap to make: a view of the runtime store's :class:`PreparedRequest` plus the current layer.
    """

    def __init__(self, runtime: WindowRuntime, prepared: PreparedRequest, grids, text_lengths,
                 device: torch.device) -> None:
        self.runtime = runtime
        self.prepared = prepared
        self.grids = grids
        self.text_lengths = text_lengths
        self.num_text_rows = sum(text_lengths)
        self.device = device
        self.group = runtime.group
        self.layer: int | None = None
        self.transitions_done = 0
        # the current layout, kept as an object and a slot so the per-layer steps never specialise on the layer index
        self._slot: int | None = None
        self._now: LayoutTensors | None = None

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
            schedule = self.runtime.schedule
            raise ValueError(
                f"rank {self.group.rank}: layer {layer} attends in the windows of {schedule[layer]!r}, but the rows "
                f"are in layer {self.layer}'s layout ({schedule[self.layer]!r}); call request.to_layer(x, {layer}) "
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
        slot = self._slot if layer is None else self.prepared.slot_of_layer[self._check_layer(layer)]
        if slot is None:
            raise RuntimeError("call scatter() first: the request has no local rows yet")
        if (slot, name) not in self.prepared.hook_data:
            raise ValueError(f"no layout hook named {name!r} was registered before this request was made; "
                             f"registered: {sorted(self.runtime.layout_hooks)}")
        return self.prepared.hook_data[(slot, name)]

    def _runner(self, slot: int, dtype: torch.dtype | None, modded: bool = False) -> tuple[str, Runner, tuple]:
        key = (slot, dtype, modded)
        found = self.prepared.runners.get(key)
        if found is None:
            lay = self.prepared.layouts[slot]
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
        """Entry: this rank's rows of a canonical packed tensor [N, ...] (the same on every rank) in ``layer``'s layout.

        Backward: the gradient of this rank's rows of its own copy (no collective).
        """
        layer = self._check_layer(layer)
        lay = self.layout(layer)
        if x.shape[0] != lay.plan.layout.num_tokens:
            raise ValueError(
                f"scatter: the canonical tensor has {x.shape[0]} rows but the batch has {lay.plan.layout.num_tokens} "
                f"tokens (grids {self.grids})"
            )
        self._enter(layer)
        return x.index_select(0, lay.token_ids)

    def to_layer(self, x: Tensor, layer: int) -> Tensor:
        """Bring local rows into ``layer``'s layout; nothing happens if it is the current one."""
        layer = self._check_layer(layer)
        self._current_layout()
        src = self._slot
        dst = self._enter(layer)
        if src == dst:
            return x
        step = self.prepared.steps.get((src, dst))
        if step is None:  # a jump the schedule does not make between neighbours: prepared now, once
            step = self.prepared.steps[(src, dst)] = self.runtime._step(
                self.prepared.layouts[src].plan, self.prepared.layouts[dst].plan, self.device)
        self.transitions_done += 1
        return redistribute_rows(x, step, self.group)

    def gather(self, x: Tensor) -> Tensor:
        """Exit: the canonical tensor [N, ...] from every rank's local rows, complete on every rank.

        Backward: a reduce-scatter: this rank's rows receive the sum over ranks of the gradients of every rank's copy
        of them (each rank's copy is its own contribution; :func:`winsp.sync_gradients` averages afterwards).
        """
        lay = self._current_layout()
        return gather_rows(x, lay.plan, self.group, lay.gather_order)

    def active(self):
        """``with request.active():`` makes this request the one :func:`winsp.current_request` returns."""
        from .context import active_request

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
    ) -> tuple[Tensor, Tensor | None]:
        """Window attention of layer ``layer`` on local rows over [window video, sample text], then the text reduction.

        Video tensors are [L_local, heads, head_dim]; text tensors [sum(text_lengths), heads, head_dim] replicated
        (or None). Returns (video output [L_local, heads, head_dim], text output [L_txt, heads, head_dim] or None).
        The rows must be in ``layer``'s layout (``to_layer(x, layer)`` first), else a ValueError names both layouts.
        ``score_mod(score, head, q_row, k_row)`` / ``mask_mod(head, q_row, k_row)`` modify video x video scores, rows
        being local row indices (:mod:`winsp.score_mods`). ``text_output=False`` (a layer whose text output is never
        read, e.g. a model's last block) skips the text reduction and its all-reduce; every rank must pass the same
        value.
        """
        lay = self._layer_layout(layer)
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
        elif self.num_text_rows:
            raise ValueError(f"the request has text lengths {self.text_lengths} but attention got no text tensors")
        mods = check_score_mods(score_mod, mask_mod)
        if mods:
            self.runtime._modded_seen = True
        if lay.plan.has_split_windows:
            refuse_score_mods(lay.plan, score_mod, mask_mod)
            return self._attention_split(lay, self._runner(self._slot, q_vid.dtype, False)[1], (q_vid, k_vid, v_vid),
                                         (q_txt, k_txt, v_txt), softmax_scale, has_text and text_output)
        runner = self._runner(self._slot, q_vid.dtype, bool(mods))[1]
        vid_out, window_text = attend(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, lay.segments, lay.index, runner,
                                      softmax_scale=softmax_scale, mods=mods)
        if not (has_text and text_output):
            return vid_out, None
        return vid_out, reduce_window_text(window_text, lay.text, self.group)

    def _attention_split(self, lay: LayoutTensors, runner: Runner, qkv: tuple, qkv_txt: tuple,
                         softmax_scale: float | None, text_output: bool) -> tuple[Tensor, Tensor | None]:
        """:meth:`attention` on a layout with split windows: whole windows as usual, split ones head-parallel."""
        q = qkv[0]
        split = self.prepared.splits.get((self._slot, q.shape[1]))
        if split is None:  # first call at this head count: prepared once, then a plain look-up like the runners
            split = self.prepared.splits[(self._slot, q.shape[1])] = self.runtime._split(
                lay.plan, self.text_lengths, q.shape[1], self.device)
        parts = [split_local_rows(t, split) for t in qkv]  # slices where the local rows allow (no copy)
        vid_whole, window_text = attend(*(w for w, _ in parts), *qkv_txt,
                                        lay.segments, lay.index, runner, softmax_scale=softmax_scale)
        txt = tuple(t if t is not None else q.new_zeros((0,) + tuple(q.shape[1:])) for t in qkv_txt)
        vid_split, txt_split = split_attention(*(p for _, p in parts), *txt, split, self.group,
                                               _scale(q, softmax_scale))
        vid_out = join_local_rows(vid_whole, vid_split, split)
        if not text_output:
            return vid_out, None
        acc = sum_window_text(window_text, lay.text, self.group)
        acc = acc.view(-1, q.shape[-1]).index_add(0, split.text_index, txt_split.to(acc.dtype)).view_as(acc)
        return vid_out, finish_text_reduction(acc, lay.text, self.group, q.dtype)
