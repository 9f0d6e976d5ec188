"""``winsp.adoption.SpaceTime``: a model that reshapes its own batches between per-frame and per-position.

A latent video DiT with alternating spatial and temporal blocks reshapes its tokens itself between the blocks:
``[B*T, S, C]`` (per-frame batches, for spatial attention) and ``[B*S, T, C]`` (per-position batches, for temporal
attention), with the sizes read from its input. Under ``ParallelPlan(space_time=SpaceTime(...))``:

- the region's tokens reach the model as *one sample of one frame* holding this rank's rows (``[1, 1, 1, L, C]`` for
  a ``[B, T, H, W, C]`` input), so every size the model reads from its input is 1 but the last, and its own reshapes
  leave the rows in order: a per-frame batch is ``[1, L, C]``, a per-position batch ``[L, 1, C]``;
- a block the plan names (``frames=`` / ``positions=``, globs of the layer entries) is handed its rows in its layer's
  layout shaped that way, and returns them in the layout they came in (the region's first layout), so the sizes the
  model read stay true after it; tensor arguments of a per-position block with one row per batch (a timestep embedding
  repeated per position) move with the rows;
- ``tables`` name parameters or buffers the model adds to those batches (``[1, S, C]`` for one frame's positions,
  ``[1, T, C]`` per frame): inside the region, reading them gives this rank's rows of the table indexed by each row's
  grid coordinates (``request.grid_rows(table, axes=...)``), shaped as the batch they are added to.

One sample per call (the presented sample is one: a per-sample conditioning broadcasts over it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch
from torch import Tensor, nn

__all__ = ["SpaceTime", "BATCHES"]

BATCHES = {"frames": "hw", "positions": "t"}  # the kind of batch -> the grid axes a table added to it is over
Globs = Union[str, Sequence[str]]


@dataclass(frozen=True)
class SpaceTime:
    """Which blocks run on per-frame and per-position batches, and the tables added to them (module docstring).

    Args:
        frames: glob(s) of the layer entries (blocks) the model hands ``[B*T, S, C]``.
        positions: glob(s) of the layer entries it hands ``[B*S, T, C]``.
        tables: ``(path, kind)`` pairs: a parameter or buffer path and the batches it is added to, ``"frames"`` (a
            table over a frame's positions, ``[1, H*W, C]`` / ``[H*W, C]`` / ``[H, W, C]``) or ``"positions"`` (a
            table per frame, ``[1, T', C]`` / ``[T', C]`` with ``T' >= T``: its first T are read).
    """

    frames: Globs = ()
    positions: Globs = ()
    tables: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("frames", "positions"):
            value = getattr(self, name)
            globs = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(g, str) and g for g in globs):
                raise ValueError(f"SpaceTime.{name} must be a glob or globs of layer entry paths, got {value!r}")
            object.__setattr__(self, name, globs)
        if not self.frames and not self.positions:
            raise ValueError("SpaceTime needs frames= or positions= (globs of the blocks the model hands per-frame or "
                             "per-position batches)")
        tables = tuple(tuple(t) for t in self.tables)
        for entry in tables:
            if len(entry) != 2 or not isinstance(entry[0], str) or entry[1] not in BATCHES:
                raise ValueError(f"SpaceTime.tables takes (parameter or buffer path, 'frames' | 'positions') pairs, "
                                 f"got {entry!r}")
        object.__setattr__(self, "tables", tables)


def present(rows: Tensor, like: Any) -> Tensor:
    """This rank's rows ``[L, C]`` as one sample of one frame shaped like the region's token input ``like``
    (``[1, ..., 1, L, C]``)."""
    lead = like.dim() - rows.dim() if isinstance(like, Tensor) else 0
    return rows.reshape((1,) * lead + tuple(rows.shape)) if lead > 0 else rows


def check_one_sample(x: Any) -> None:
    if isinstance(x, Tensor) and x.dim() >= 3 and x.shape[0] != 1:
        raise ValueError(f"SpaceTime: a batch of {x.shape[0]} samples ({list(x.shape)}); this rank's rows reach the "
                         f"model as one sample of one frame, so a per-sample conditioning would broadcast over the "
                         f"wrong rows: call the model with one sample at a time")


def batch_rows(x: Any, kind: str, rows: int, path: str) -> None:
    """Refuse a block input that is not this rank's ``rows`` as the batches ``kind`` says, naming both."""
    want = (1, rows) if kind == "frames" else (rows, 1)
    if not isinstance(x, Tensor) or x.dim() < 3 or tuple(x.shape[:2]) != want:
        got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        shape = "[1, L, C] (one frame of L rows)" if kind == "frames" else "[L, 1, C] (L positions of one frame)"
        raise ValueError(f"SpaceTime: {path!r} runs on per-{kind[:-1]} batches, so its input must be this "
                         f"rank's {rows} "
                         f"rows as {shape}, got {got}: the region's tokens must reach it through the model's own "
                         f"reshapes of the presented sample (is it listed under the right kind, and the region's "
                         f"start the module that takes the [B, T, H, W, C] tokens?)")


def move_batches(request, x: Tensor, extra: list[Tensor], move: Callable[[Tensor], Tensor]) -> tuple[Tensor, list]:
    """``x`` (rows first) and the per-batch tensors ``extra`` (one row per batch) moved together by ``move`` (one
    ``to_layer``): their rows side by side, one all-to-all."""
    parts = [x] + extra
    for t in extra:
        if t.dtype != x.dtype:
            raise ValueError(f"SpaceTime: a per-position argument {list(t.shape)} of {t.dtype} moves with the rows "
                             f"({x.dtype}); give it the rows' dtype")
    widths = [math.prod(t.shape[1:]) for t in parts]
    moved = move(torch.cat([t.reshape(t.shape[0], w) for t, w in zip(parts, widths, strict=True)], 1))
    out, at = [], 0
    for t, w in zip(parts, widths, strict=True):
        out.append(moved[:, at:at + w].reshape((moved.shape[0],) + tuple(t.shape[1:])))
        at += w
    return out[0], out[1:]


class TableDict(dict):
    """A module's ``_parameters`` or ``_buffers``: reading a table named in ``kinds`` while ``rows_of`` returns a
    request gives this rank's rows of it; everything else (``state_dict``, ``.to()``, iteration) sees the dict."""

    def __init__(self, base: dict, kinds: dict[str, str], active: Callable[[], Any]) -> None:
        super().__init__(base)
        self.kinds, self.active = kinds, active

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        kind = self.kinds.get(name)
        request = self.active() if kind is not None and isinstance(value, Tensor) else None
        return value if request is None or kind is None else table_rows(request, value, kind, name)


def table_rows(request, table: Tensor, kind: str, name: str) -> Tensor:
    """This rank's rows of ``table`` as the ``kind`` batches it is added to: ``[1, L, C]`` or ``[L, 1, C]``."""
    t = table[0] if table.dim() == 3 and table.shape[0] == 1 else table
    if kind == "positions":
        frames = request.stage_model_grids[request.stage][0][0]
        if t.dim() != 2 or t.shape[0] < frames:
            raise ValueError(f"SpaceTime.tables: {name!r} {list(table.shape)} is added to per-position batches, so it "
                             f"must be a table per frame [1, T', C] or [T', C] with T' >= {frames} frames")
        t = t[:frames]
    rows = request.grid_rows(t, axes=BATCHES[kind])
    return rows[None] if kind == "frames" else rows[:, None]


def install_tables(model: nn.Module, tables: Sequence[tuple[str, str]], active: Callable[[], Any]) -> list:
    """Put :class:`TableDict` s on the modules holding ``tables``; returns ``(module, attribute, original dict)`` to
    put back."""
    owners: dict = {}
    for path, kind in tables:
        parent, _, name = path.rpartition(".")
        try:
            module = model.get_submodule(parent)
        except AttributeError:
            module = None
        where = "_parameters" if module is not None and name in module._parameters else "_buffers"
        if module is None or name not in getattr(module, where):
            raise ValueError(f"SpaceTime.tables: {path!r} is not a parameter or buffer of {type(model).__name__}")
        owners.setdefault((id(module), where), (module, where, {}))[2][name] = kind
    installed = []
    for module, where, kinds in owners.values():
        installed.append((module, where, getattr(module, where)))
        object.__setattr__(module, where, TableDict(getattr(module, where), kinds, active))
    return installed


def remove_tables(installed: list) -> None:
    """Undo :func:`install_tables`, keeping any entry set meanwhile (``.to()`` replaces tensors)."""
    for module, where, original in reversed(installed):
        original.clear()
        original.update(dict(getattr(module, where)))
        object.__setattr__(module, where, original)


def batch_kinds(plan: SpaceTime, entry_paths: Sequence[str]) -> dict[str, str]:
    """Entry path -> ``"frames"`` / ``"positions"`` for the layer entries the plan's globs match (each glob one at
    least, no entry both)."""
    from winsp.adoption.parallelize import path_matches

    kinds: dict[str, str] = {}
    for kind in ("frames", "positions"):
        for glob in getattr(plan, kind):
            hits = [p for p in entry_paths if path_matches(p, glob)]
            if not hits:
                raise ValueError(f"SpaceTime.{kind}={glob!r} matches no layer entry (the plan's entries: "
                                 f"{list(entry_paths)})")
            for path in hits:
                if kinds.setdefault(path, kind) != kind:
                    raise ValueError(f"SpaceTime: {path!r} is listed under both frames and positions")
    return kinds


def _as_rows(x: Tensor, kind: str) -> Tensor:
    return x[0] if kind == "frames" else x.flatten(1)


def _as_batches(rows: Tensor, kind: str, like: Tensor) -> Tensor:
    return rows[None] if kind == "frames" else rows.reshape((rows.shape[0],) + tuple(like.shape[1:]))


def enter_block(request, layer: int, path: str, kind: str, args: tuple, kwargs: dict, returns: list) -> tuple:
    """A block's ``(args, kwargs)`` with its rows moved into ``layer``'s layout as ``kind`` batches (per-position
    arguments with them); notes in ``returns`` where they go back to."""
    returns.append((request.layer, kind))  # first: the block's return hook pops it whatever happens next
    x = args[0] if args else next(iter(kwargs.values()), None)
    rows = request._current_layout().num_rows
    batch_rows(x, kind, rows, path)
    assert isinstance(x, Tensor)  # batch_rows refuses anything else
    key = None if args else next(iter(kwargs))
    extra = {}
    if kind == "positions":
        extra = {k: v for k, v in list(enumerate(args))[1:] + [(k, v) for k, v in kwargs.items() if k != key]
                 if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == rows}
    moved, others = move_batches(request, _as_rows(x, kind), list(extra.values()),
                                 lambda y: request.to_layer(y, layer))
    moved = _as_batches(moved, kind, x)
    new_args, new_kwargs = list(args), dict(kwargs)
    for k, v in zip(extra, others, strict=True):
        if isinstance(k, int):
            new_args[k] = v
        else:
            new_kwargs[k] = v
    if key is None:
        new_args[0] = moved
    else:
        new_kwargs[key] = moved
    return tuple(new_args), new_kwargs


def leave_block(request, out: Tensor, kind: str, back: int) -> Tensor:
    """A block's output rows moved back into layer ``back``'s layout, in the batches shape they have."""
    if not isinstance(out, Tensor) or out.dim() < 2:
        return out
    return _as_batches(request.to_layer(_as_rows(out, kind), back), kind, out)
