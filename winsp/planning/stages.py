"""Stages of a hierarchical model: the chain of token grids a forward runs on, and which rows a grid change reads.

Swin, HDiT and U-shaped DiTs attend at several resolutions: a *stage* is a run of attention layers on one token grid,
and between stages a patch merging (2 x 2 tokens -> one token of 4x the channels) or its inverse changes the grid. A
model on one grid is one stage. Everything here is pure geometry on the CPU (no ranks, no tensors): the planner
(:mod:`winsp.planning.hierarchy`) and the prepared grid-change steps (:mod:`winsp.planning.grid_step`) build on it.

Padding: a stage's grid is laid out as ``layers[0].padded_grid(grid)`` (Swin pads to whole windows); rows of the laid
grid outside the model grid are padding rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from winsp.geometry.layout import Grids, check_grids
from winsp.geometry.windows import Grid, WindowGeometry, _positive_int_triple
from winsp.planning.schedule import _check_schedule

__all__ = ["Stage", "check_stages", "stage_grids", "grid_sources", "logical_ids"]


@dataclass(frozen=True)
class Stage:
    """One resolution level: its attention layers' window geometries and how its grid follows from the previous one.

    Args:
        layers: one :class:`~winsp.geometry.windows.WindowGeometry` per attention layer of the stage, in forward order.
        merge: this stage's grid is ``ceil(previous / merge)`` per axis (patch merging; (1, 2, 2) for Swin).
        split: or ``previous * split`` per axis (the inverse: patch expanding, a U-net's way up).
        like: with ``split``: crop the grid to stage ``like``'s grid (a U-net level whose grid was odd on the way down).
        order: the (t, h, w) offsets of a merged token's children in the order their channels are concatenated
            (default raster order, t slowest); the same order splits channels back.
        split_windows: whether the planner may split this stage's windows across ranks (head-parallel: the way a
            global-attention level, one window over the whole grid, runs on every rank); None: the runtime's
            setting. Its attention layers must then not pass a ``score_mod`` / ``mask_mod``.
    """

    layers: tuple[WindowGeometry, ...]
    merge: Grid = (1, 1, 1)
    split: Grid = (1, 1, 1)
    like: Optional[int] = None
    order: Optional[tuple[Grid, ...]] = None
    split_windows: Optional[bool] = None

    def __post_init__(self) -> None:
        merge = _positive_int_triple(self.merge, "Stage.merge")
        split = _positive_int_triple(self.split, "Stage.split")
        # whatever a flat schedule accepts as a layer geometry, a stage accepts (one rule: winsp.planning.schedule);
        # a stage that changes the grid may have none: the last step of a region that ends with a grid change
        empty = isinstance(self.layers, (tuple, list)) and not self.layers
        if not (empty and (merge, split) != ((1, 1, 1), (1, 1, 1))):
            try:
                object.__setattr__(self, "layers", _check_schedule(self.layers))
            except ValueError as err:
                hint = " (a stage without layers must merge or split: the grid change a region ends with)" \
                    if empty else ""
                raise ValueError(f"Stage.layers: {err}{hint}") from None
        else:
            object.__setattr__(self, "layers", ())
        if merge != (1, 1, 1) and split != (1, 1, 1):
            raise ValueError(f"a stage either merges or splits, got merge={merge} and split={split}")
        object.__setattr__(self, "merge", merge)
        object.__setattr__(self, "split", split)
        if self.like is not None and split == (1, 1, 1):
            raise ValueError("Stage.like crops the grid of a splitting stage; give split= too")
        factor = self.factor
        default = tuple((a, b, c) for a in range(factor[0]) for b in range(factor[1]) for c in range(factor[2]))
        order = default if self.order is None else tuple(tuple(int(v) for v in o) for o in self.order)
        if sorted(order) != sorted(default):
            raise ValueError(f"Stage.order must list every child offset of the factor {factor} once, got {order}")
        object.__setattr__(self, "order", order)
        if self.split_windows is not None and not isinstance(self.split_windows, bool):
            raise ValueError(f"Stage.split_windows must be True, False or None, got {self.split_windows!r}")

    @property
    def factor(self) -> Grid:
        """The merge or split factor ((1, 1, 1) when the grid does not change)."""
        return self.merge if self.merge != (1, 1, 1) else self.split

    @property
    def changes_grid(self) -> bool:
        return self.factor != (1, 1, 1)

    @property
    def children(self) -> int:
        """Rows one merged row is made of (or one row splits into): the product of :attr:`factor`."""
        return math.prod(self.factor)


def _merged(grid: Grid, merge: Grid) -> Grid:
    """The grid after merging ``merge`` tokens per axis (a partial group at the end still makes one token)."""
    (t, h, w), (ft, fh, fw) = grid, merge
    return (-(-t // ft), -(-h // fh), -(-w // fw))


def _split(grid: Grid, split: Grid) -> Grid:
    """The grid after splitting every token into ``split`` tokens per axis."""
    (t, h, w), (ft, fh, fw) = grid, split
    return (t * ft, h * fh, w * fw)


def check_stages(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """``stages`` as a tuple, checked: Stage objects, the first on the input grid, ``like`` naming earlier ones."""
    stages = tuple(stages)
    if not stages:
        raise ValueError("a runtime needs at least one Stage")
    for i, st in enumerate(stages):
        if not isinstance(st, Stage):
            raise ValueError(f"stages[{i}] must be a winsp.Stage, got {type(st).__name__}")
        if i == 0 and st.changes_grid:
            raise ValueError("stages[0] is the input grid: it cannot merge or split")
        if st.like is not None and not 0 <= st.like < i:
            raise ValueError(f"stages[{i}].like={st.like} must name an earlier stage")
        if not st.layers and i != len(stages) - 1:
            raise ValueError(f"stages[{i}] has no layers: only the last stage may (a region that ends with a grid "
                             f"change); stage {i + 1} follows it")
    return stages


def stage_grids(stages: Sequence[Stage], grids: Sequence[Sequence[int]]) -> tuple[tuple[Grids, ...],
                                                                                   tuple[Grids, ...]]:
    """(model grids, laid-out grids) of every stage for a batch whose stage-0 grids are ``grids``.

    The laid-out grid is the model grid padded by the stage's geometry; every layer of a stage must agree on it.
    ``grids`` are checked here unless they already are :class:`~winsp.geometry.layout.Grids`; a later stage's model
    grids follow from them (merged or split), and the laid-out grids, which the geometry computes, are checked once,
    here.
    """
    grids = check_grids(grids)
    model: list[Grids] = []
    laid: list[Grids] = []
    for i, st in enumerate(stages):
        cur: Grids
        if i == 0:
            cur = grids
        elif st.merge != (1, 1, 1):
            cur = Grids(_merged(grid, st.merge) for grid in model[-1])
        elif st.split != (1, 1, 1):
            cur = Grids(_split(grid, st.split) for grid in model[-1])
            if st.like is not None:
                target = model[st.like]
                for s, (big, want) in enumerate(zip(cur, target, strict=True)):
                    if any(w > b for w, b in zip(want, big, strict=True)):
                        raise ValueError(f"stage {i}: sample {s}'s split grid {big} is smaller than stage "
                                         f"{st.like}'s grid {want}, which it is cropped to")
                cur = target
        else:
            cur = model[-1]
        padded = tuple(st.layers[0].padded_grid(g) for g in cur)
        for j, geom in enumerate(st.layers[1:], 1):
            other = tuple(geom.padded_grid(g) for g in cur)
            if other != padded:
                raise ValueError(f"stage {i}: layer {j}'s geometry pads the grids to {other}, layer 0's to "
                                 f"{padded}; the layers of one stage must share one laid-out grid")
        model.append(cur)
        laid.append(cur if padded == cur else check_grids(padded))  # a geometry's padding, checked once
    return tuple(model), tuple(laid)


def _coords(grids: Sequence[Grid]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample, [N, 3] coordinates, [N, 3] grid of the row's sample) of every canonical row of packed ``grids``."""
    sizes = [t * h * w for t, h, w in grids]
    sample = np.repeat(np.arange(len(grids), dtype=np.int64), sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    g = np.asarray(grids, dtype=np.int64)[sample].reshape(-1, 3)
    within = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[sample]
    coords = np.stack([within // (g[:, 1] * g[:, 2]), (within // g[:, 2]) % g[:, 1], within % g[:, 2]], axis=-1)
    return sample, coords.reshape(-1, 3), g


def _ids(sample: np.ndarray, coords: np.ndarray, grids: Sequence[Grid]) -> np.ndarray:
    """Canonical ids of (sample, coords) rows in packed ``grids``."""
    g = np.asarray(grids, dtype=np.int64)[sample].reshape(-1, 3)
    offsets = np.concatenate([[0], np.cumsum([t * h * w for t, h, w in grids])]).astype(np.int64)
    return offsets[sample] + (coords[:, 0] * g[:, 1] + coords[:, 1]) * g[:, 2] + coords[:, 2]


def logical_ids(model: Sequence[Grid], laid: Sequence[Grid]) -> np.ndarray:
    """[N_laid] canonical id in the model grids of each laid-out row, or -1 for a padding row."""
    sample, coords, _ = _coords(laid)
    inside = (coords < np.asarray(model, dtype=np.int64)[sample]).all(axis=1)
    out = np.full(sample.size, -1, dtype=np.int64)
    out[inside] = _ids(sample[inside], coords[inside], model)
    return out


def grid_sources(stage: Stage, src_model, src_laid, dst_model, dst_laid) -> tuple[np.ndarray, np.ndarray]:
    """Which source rows build each destination row of a grid change.

    Returns ``(sources [N_dst, K], chunk [N_dst])``: for a merge, the K children (canonical ids in the source's laid
    grids, -1 where a child is outside the source model grid or the row is padding) in ``stage.order``; for a split,
    the parent (K = 1) and which of its channel chunks the row takes.
    """
    sample, coords, _ = _coords(dst_laid)
    dst_inside = (coords < np.asarray(dst_model, dtype=np.int64)[sample]).all(axis=1)
    src_model_rows = np.asarray(src_model, dtype=np.int64)[sample]
    order = np.asarray(stage.order, dtype=np.int64)  # [K, 3]
    if stage.merge != (1, 1, 1):
        child = coords[:, None, :] * np.asarray(stage.merge, dtype=np.int64) + order[None]  # [N, K, 3]
        ok = dst_inside[:, None] & (child < src_model_rows[:, None, :]).all(axis=2)
        k = order.shape[0]
        flat_sample = np.repeat(sample, k)
        ids = _ids(flat_sample, child.reshape(-1, 3), src_laid).reshape(-1, k)
        return np.where(ok, ids, -1), np.zeros(sample.size, dtype=np.int64)
    factor = np.asarray(stage.split, dtype=np.int64)
    parent = coords // factor
    ok = dst_inside & (parent < src_model_rows).all(axis=1)
    ids = np.where(ok, _ids(sample, parent, src_laid), -1)
    lookup = np.empty(int(factor.prod()), dtype=np.int64)  # raveled child offset -> its place in stage.order
    lookup[(order[:, 0] * factor[1] + order[:, 1]) * factor[2] + order[:, 2]] = np.arange(order.shape[0])
    rem = coords % factor
    chunk = lookup[(rem[:, 0] * factor[1] + rem[:, 1]) * factor[2] + rem[:, 2]]
    return ids[:, None], np.where(ok, chunk, 0)


_check_stages = check_stages  # the name earlier callers import

