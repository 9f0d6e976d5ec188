"""Nested cuts for neighborhood layers: a grid cut into one box per rank by recursive two-way cuts (a guillotine tree),
not only a product of per-axis runs.

A product cut gives every run of an axis the same length, so on a strided layer it must choose between whole stride
groups (unbalanced when the groups do not share out evenly) and balanced runs that cut groups in two (a cut group is
reached whole from both sides: wider halos). A nested cut first splits the grid in two along one axis with ``r1`` and
``r2`` ranks, then each part on its own: the parts can end at different positions, so most boxes get whole stride
groups and balanced work at once. HunyuanVideo 1.5's 720p sliding tile layer at 8 ranks, planned for PCIe links:
halos of 0.79x Ulysses' bytes at 1.045x the mean work, where the best balanced product cut moves 1.01x.

:func:`nested_blocks` finds, per grid, the tree whose slowest box (rows, attention work and halo bytes, weighed by
:mod:`winsp.planning.costs`) is fastest and, among those, moves the fewest halo rows (ties broken part by part), with
every box within ``limit`` of the mean attention work. A dynamic program over sub-boxes; the cuts it tries along an
axis are the stride-group edges and, for each split of the ranks, the two positions nearest that split's share of the
work. Its state count is bounded (``MAX_STATES``): past it the grid gets no nested candidate.

A second objective, ``"bytes"``, finds the balanced tree that moves the fewest halo rows in all (a sum over boxes, so
the same program serves), ties broken by the slowest box's time: the halo planner weighs it against the fastest tree
(:func:`winsp.planning.halo.choose_blocks` takes the fewest rows among cuts predicted as fast, to a tolerance).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from winsp.geometry.neighborhood import Neighborhood, axis_reach, axis_work
from winsp.geometry.windows import Grid, WindowGeometry, WindowSlices, check_grid
from winsp.planning.costs import DEFAULT_COSTS, CostConstants

__all__ = ["NestedBlocks", "nested_blocks", "MAX_STATES", "OBJECTIVES"]

#: The most sub-box states the dynamic program visits for one grid before it gives up on a nested cut.
MAX_STATES = 60_000

#: What :func:`nested_blocks` minimises: the slowest box's predicted time (ties: fewer halo rows), or the halo rows of
#: all boxes (ties: the slowest box's time).
OBJECTIVES = ("time", "bytes")

Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


@dataclass(frozen=True)
class NestedBlocks(WindowGeometry):
    """The layout of neighborhood layers as explicit boxes: ``boxes[i]`` is ``(grid, per-rank boxes)``, rank ``r``
    owning ``((t0, t1), (h0, h1), (w0, w1))`` of that grid (empty boxes have ``lo == hi`` on some axis).

    Built by :func:`nested_blocks` for the grids a schedule plans; other grids are refused. Its "windows" are the
    non-empty boxes in rank order, as :class:`~winsp.planning.halo.NeighborhoodBlocks`'.
    """

    world_size: int
    boxes: tuple[tuple[Grid, tuple[Box, ...]], ...]

    def params(self) -> dict:
        return {"world_size": self.world_size, "boxes": [[list(g), [list(map(list, b)) for b in bs]]
                                                         for g, bs in self.boxes]}

    def rank_boxes(self, grid: Grid) -> tuple[Box, ...]:
        """The ``world_size`` boxes of ``grid``, in rank order."""
        grid = check_grid(grid)
        for g, bs in self.boxes:
            if g == grid:
                return bs
        raise ValueError(f"grid {grid} has no nested cut: these blocks were planned for grids "
                         f"{[g for g, _ in self.boxes]}")

    def slices(self, grid: Grid) -> list[WindowSlices]:
        return [tuple(slice(lo, hi) for lo, hi in box) for box in self.rank_boxes(grid)  # type: ignore[misc]
                if all(hi > lo for lo, hi in box)]


def _reach_table(n: int, k: int, d: int, causal: bool, s: int) -> np.ndarray:
    """[n + 1, n + 1]: ``table[lo, hi]`` the number of positions the queries in ``[lo, hi)`` reach along one axis."""
    table = np.zeros((n + 1, n + 1), np.int64)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            table[lo, hi] = axis_reach(n, k, d, causal, lo, hi, s).size
    return table


@lru_cache(maxsize=64)
def _axis_tables(geometry: Neighborhood, grid: Grid) -> tuple[tuple[list[list[int]], list[int]], ...]:
    """Per axis: the reach table and the prefix sums of attention work (keys per position)."""
    out = []
    for axis in geometry.axes(grid):
        work = np.concatenate([[0], np.cumsum(axis_work(*axis), dtype=np.int64)])
        out.append((_reach_table(*axis).tolist(), work.tolist()))  # Python ints: the search indexes them one by one
    return tuple(out)


def nested_blocks(grids: Sequence[Grid], geometries: Sequence[Neighborhood], world_size: int,
                  costs: CostConstants = DEFAULT_COSTS, limit: float = 0.05,
                  objective: str = "time") -> NestedBlocks | None:
    """The nested cut of every grid into ``world_size`` boxes that minimises ``objective`` (one of ``OBJECTIVES``; see
    the module docstring), or None where a grid has no balanced one within ``MAX_STATES`` (or there are no strided
    geometries to align to: a product cut serves)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: expected one of {OBJECTIVES}")
    return _nested_blocks(tuple(dict.fromkeys(check_grid(g) for g in grids)), tuple(geometries), int(world_size),
                          costs, float(limit), objective)


@lru_cache(maxsize=64)
def _nested_blocks(grids: tuple[Grid, ...], geometries: tuple[Neighborhood, ...], world_size: int,
                   costs: CostConstants, limit: float, objective: str) -> NestedBlocks | None:
    """:func:`nested_blocks`, cached per objective: every rank plans the same grids."""
    if world_size < 2 or not geometries:
        return None
    out = []
    for grid in grids:
        boxes = _grid_boxes(grid, geometries, world_size, costs, limit, objective == "bytes")
        if boxes is None:
            return None
        out.append((grid, boxes))
    return NestedBlocks(world_size, tuple(out))


def _grid_boxes(grid: Grid, geometries: tuple[Neighborhood, ...], p: int, costs: CostConstants,
                limit: float, by_bytes: bool = False) -> tuple[Box, ...] | None:
    tables = [_axis_tables(g, grid) for g in geometries]
    total = sum(math.prod(w[-1] for _, w in t) for t in tables)
    if total == 0:
        return None
    upper = (1 + limit) * total / p * (1 + 1e-12)  # a box's most work
    lower = (1 - limit) * total / p / (1 + 1e-12)  # a box's least: the tree keeps every box near the mean
    halo_s = 2 * costs.row_bytes * costs.byte_s

    def work(box: Box) -> int:
        return sum(math.prod(w[hi] - w[lo] for (_, w), (lo, hi) in zip(t, box, strict=True)) for t in tables)

    leaves_seen: dict[Box, tuple[float, int]] = {}

    def leaf(box: Box) -> tuple[float, int]:
        """(predicted time, halo rows) of ``box`` on one rank (cached: the bounds of the bytes objective ask again)."""
        if box not in leaves_seen:
            leaves_seen[box] = _leaf(box)
        return leaves_seen[box]

    def _leaf(box: Box) -> tuple[float, int]:
        own = math.prod(hi - lo for lo, hi in box)
        time, halo = 0.0, 0
        for t in tables:
            reach = math.prod(r[lo][hi] for (r, _), (lo, hi) in zip(t, box, strict=True))
            pairs = math.prod(w[hi] - w[lo] for (_, w), (lo, hi) in zip(t, box, strict=True))
            time += own * costs.row_s + pairs * costs.pair_s + (reach - own) * halo_s
            halo += reach - own
        return time, halo

    units = [math.lcm(*(g.stride[a] * g.dilation[a] for g in geometries if g.stride[a] > 1), 1) for a in range(3)]

    def _cuts(box: Box, axis: int, r: int, w: int) -> list[tuple[int, int]]:
        """(position, ranks of the first part) to try, both parts within the balance bounds: the axis's stride-group
        edges inside the box (on an axis without stride, none) and, for each rank count, the two positions nearest its
        share of the work."""
        lo, hi = box[axis]
        if hi - lo < 2:
            return []
        weights = [(math.prod(t[a][1][box[a][1]] - t[a][1][box[a][0]] for a in range(3) if a != axis), t[axis][1])
                   for t in tables]
        per = [sum(c * (pre[x] - pre[lo]) for c, pre in weights) for x in range(lo, hi + 1)]  # first part's work
        unit = units[axis]
        out = []
        for r1 in range(1, r):
            least, most = max(r1 * lower, w - (r - r1) * upper), min(r1 * upper, w - (r - r1) * lower)
            if least > most:
                continue
            i = bisect.bisect_left(per, w * r1 / r)
            tries = {i - 1, i}
            if unit > 1:
                first, last = bisect.bisect_left(per, least), bisect.bisect_right(per, most)
                tries.update(x - lo for x in range(-(-(lo + first) // unit) * unit, lo + last, unit))
            out += [(lo + x, r1) for x in sorted(tries) if 0 < x < hi - lo and least <= per[x] <= most]
        return out

    memo: dict[tuple[Box, int], tuple[float, int, tuple | None]] = {}
    inf: tuple[float, int, tuple | None] = (math.inf, _NO_ROWS, None)  # no balanced tree: last by either objective

    def order(x: tuple[float, int, tuple | None]) -> tuple[float, float]:
        """What the program minimises, first key first: (time, halo rows), or (halo rows, time) by bytes."""
        return (x[1], x[0]) if by_bytes else (x[0], x[1])

    def best(box: Box, r: int) -> tuple[float, int, tuple | None]:
        """(slowest box's time, halo rows, tree) of ``box`` on ``r`` ranks, the least by ``order``."""
        key = (box, r)
        if key in memo:
            return memo[key]
        if len(memo) > MAX_STATES:
            raise _TooMany
        w = work(box)
        if w > r * upper or w < r * lower:
            result = inf
        elif r == 1:
            result = (*leaf(box), None)
        else:
            result = inf
            for axis in range(3):
                for x, r1 in _cuts(box, axis, r, w):
                    first = tuple((box[axis][0], x) if a == axis else box[a] for a in range(3))
                    second = tuple((x, box[axis][1]) if a == axis else box[a] for a in range(3))
                    if by_bytes and leaf(first)[1] + leaf(second)[1] > result[1]:  # type: ignore[arg-type]
                        continue  # a part's halo rows, uncut, bound those of any cut of it from below
                    parts = [(first, r1), (second, r - r1)]
                    if (second, r - r1) in memo and (first, r1) not in memo:
                        parts.reverse()  # a part already solved may rule the cut out before the other is visited
                    a = best(*parts[0])  # type: ignore[arg-type]
                    if order(a) >= order(result) or order(a)[0] > order(result)[0]:
                        continue  # the other part can only add to both
                    if by_bytes and a[1] + leaf(parts[1][0])[1] > result[1]:  # type: ignore[arg-type]
                        continue
                    b = best(*parts[1])  # type: ignore[arg-type]
                    cand = (max(a[0], b[0]), a[1] + b[1], (first, r1, second, r - r1))
                    if order(cand) < order(result):
                        result = cand
        memo[key] = result
        return result

    root: Box = ((0, grid[0]), (0, grid[1]), (0, grid[2]))
    try:
        if best(root, p)[0] == math.inf:
            return None
    except _TooMany:
        return None

    def leaves(box: Box, r: int) -> list[Box]:
        tree = memo[(box, r)][2]
        return [box] if tree is None else leaves(tree[0], tree[1]) + leaves(tree[2], tree[3])

    return tuple(leaves(root, p))


#: The halo rows of no tree: more than any grid has.
_NO_ROWS = 1 << 62


class _TooMany(Exception):
    """The dynamic program passed ``MAX_STATES``."""
