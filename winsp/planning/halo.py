"""Halo planning for neighborhood layers: cut the grid into one block per rank, and list the rows each block reaches.

A neighborhood layer keeps its rows where they are: rank ``r`` owns block ``r`` of every sample (a box of the grid,
from cutting t, h and w into ``splits`` runs of balanced attention work, at whole stride groups of a strided layer
where that stays balanced, or from a nested cut, :mod:`winsp.planning.halo_cuts`) and needs only the key rows its
queries can reach that other ranks own, its *halo*.
Because a block is a box and a neighbourhood is a product over axes, the rows a block reaches are exactly the product
of three per-axis sets (:func:`winsp.geometry.neighborhood.axis_reach`): halos are computed per axis, never per token.

:func:`choose_blocks` picks the cut (along t, h, w or a 2D/3D tiling, at stride groups or anywhere, or nested) by the
predicted time of the slowest rank, its rows, attention work and halo bytes weighed with :mod:`winsp.planning.costs`,
among the cuts within ``BALANCE_LIMIT`` of balanced attention work when there are any: of the cuts predicted within
``TIME_TOLERANCE`` of the fastest (as fast as peak figures can tell), the one that moves the fewest halo rows.
Every neighborhood layer of a schedule shares one cut (the one best for all of them together), so consecutive
neighborhood layers share one plan and move nothing but halos; transitions to window layouts are ordinary
redistributions. :class:`HaloExchange` is one rank's share: what it sends to whom, and for each local query the key
rows (local rows first, then received halo rows) of its neighbourhood.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Sequence

import numpy as np
import torch

from winsp.geometry.layout import build_layout
from winsp.geometry.neighborhood import Neighborhood, axis_neighbours, axis_reach, axis_work
from winsp.geometry.windows import Grid, WindowGeometry, WindowSlices, check_grid
from winsp.planning.costs import DEFAULT_COSTS, CostConstants
from winsp.planning.halo_cuts import OBJECTIVES, NestedBlocks, nested_blocks
from winsp.planning.plan import Plan

__all__ = ["NeighborhoodBlocks", "axis_cuts", "choose_splits", "choose_blocks", "block_halo_rows", "block_work",
           "neighborhood_plan", "query_tile_length", "BALANCE_LIMIT", "TIME_TOLERANCE",
           "HaloExchange", "HaloTensors", "NEIGHBORHOOD_PLANNER_VERSION"]

NEIGHBORHOOD_PLANNER_VERSION = 4

#: A cut whose heaviest rank carries more than (1 + BALANCE_LIMIT) x the mean attention work is chosen only when no cut
#: is balanced that well.
BALANCE_LIMIT = 0.05

#: Predicted times within this fraction of the fastest cut's are as fast as the cost model (peak figures) can tell:
#: among those, :func:`choose_blocks` takes the cut of fewest halo rows.
TIME_TOLERANCE = 0.02


def axis_cuts(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous runs of ``[0, n)`` whose lengths differ by at most one (longer runs first; some empty
    when ``parts > n``)."""
    base, extra = divmod(n, parts)
    bounds = np.concatenate([[0], np.cumsum([base + (i < extra) for i in range(parts)])])
    return [(int(a), int(b)) for a, b in pairwise(bounds)]


def _weighted_cuts(weights: np.ndarray, parts: int, unit: int) -> list[tuple[int, int]]:
    """``parts`` contiguous runs of an axis whose heaviest run (sum of ``weights``) is as light as it can be, with
    every cut at a multiple of ``unit`` (or the axis end); runs may be empty. Uniform weights at unit 1 give
    :func:`axis_cuts` (its longer runs first)."""
    n = weights.size
    if unit == 1 and (n == 0 or np.all(weights == weights[0])):
        return axis_cuts(n, parts)
    allowed = np.unique(np.concatenate([np.arange(0, n, unit), [n]]))
    cum = np.concatenate([[0.0], np.cumsum(weights, dtype=np.float64)])[allowed]
    m = allowed.size
    # best[q][i]: the least heaviest run cutting [0, allowed[i]) into q runs; from[q][i] the previous cut
    best = np.full((parts + 1, m), np.inf)
    best[0, 0] = 0.0
    back = np.zeros((parts + 1, m), dtype=np.int64)
    for q in range(1, parts + 1):
        for i in range(m):
            cand = np.maximum(best[q - 1, : i + 1], cum[i] - cum[: i + 1])
            j = i - int(np.argmin(cand[::-1]))  # the latest best previous cut: longer runs first, as axis_cuts
            best[q, i], back[q, i] = cand[j], j
    bounds, i = [m - 1], m - 1
    for q in range(parts, 0, -1):
        i = int(back[q, i])
        bounds.append(i)
    edges = allowed[np.asarray(bounds[::-1])]
    return [(int(a), int(b)) for a, b in pairwise(edges)]


def _axis_weights(grid: Grid, geometries: Sequence[Neighborhood], axis: int) -> np.ndarray:
    """Attention work per position of one axis, summed over ``geometries`` (each weighed by its work on the other
    axes): what a cut along that axis balances."""
    out = np.zeros(grid[axis])
    for geom in geometries:
        per_axis = [axis_work(*a) for a in geom.axes(grid)]
        others = math.prod(float(per_axis[b].sum()) for b in range(3) if b != axis)
        out += per_axis[axis] * others
    return out if geometries else np.ones(grid[axis])


def _world(blocks: Grid | NeighborhoodBlocks | NestedBlocks) -> int:
    """How many ranks ``blocks`` cut a grid for."""
    if isinstance(blocks, NestedBlocks):
        return blocks.world_size
    return math.prod(blocks.splits if isinstance(blocks, NeighborhoodBlocks) else blocks)


def _blocks(grid: Grid, blocks: Grid | NeighborhoodBlocks | NestedBlocks) -> list[tuple[int, WindowSlices]]:
    """(rank, box) of every non-empty block of ``grid``; block ``(it, ih, iw)`` of a product cut belongs to rank
    ``(it * ph + ih) * pw + iw``, box ``r`` of a nested cut to rank ``r``."""
    if isinstance(blocks, NestedBlocks):
        return [(r, (slice(*box[0]), slice(*box[1]), slice(*box[2]))) for r, box in enumerate(blocks.rank_boxes(grid))
                if all(hi > lo for lo, hi in box)]
    if not isinstance(blocks, NeighborhoodBlocks):
        blocks = NeighborhoodBlocks(check_grid(blocks, "splits"))
    splits = blocks.splits
    cuts = blocks.axis_runs(grid)
    out = []
    for it, (t0, t1) in enumerate(cuts[0]):
        for ih, (h0, h1) in enumerate(cuts[1]):
            for iw, (w0, w1) in enumerate(cuts[2]):
                if t1 > t0 and h1 > h0 and w1 > w0:
                    out.append(((it * splits[1] + ih) * splits[2] + iw, (slice(t0, t1), slice(h0, h1), slice(w0, w1))))
    return out


@dataclass(frozen=True)
class NeighborhoodBlocks(WindowGeometry):
    """The layout of neighborhood layers: each sample's grid cut into ``splits[a]`` runs per axis.

    The runs balance the attention work of ``geometries`` (keys per query: fewer near a causal start), with every cut
    at a multiple of ``unit[a]`` (a strided layer's stride groups, ``stride * dilation`` positions, kept whole on one
    rank; 1: anywhere). Without geometries, or with uniform work at unit 1, the runs are balanced rows (longer runs
    first). Its "windows" are the blocks, in rank order (block ``(it, ih, iw)`` is rank ``(it * ph + ih) * pw +
    iw``'s); empty blocks (an axis shorter than its split) are left out, so their rank holds nothing of that sample.
    """

    splits: Grid
    unit: Grid = (1, 1, 1)
    geometries: tuple[Neighborhood, ...] = ()

    def params(self) -> dict:
        return {"splits": list(self.splits), "unit": list(self.unit),
                "geometries": [g.fingerprint for g in self.geometries]}

    def axis_runs(self, grid: Grid) -> list[list[tuple[int, int]]]:
        """Per axis, the ``splits[a]`` runs ``(lo, hi)`` of ``grid`` (some empty)."""
        return [list(runs) for runs in _axis_runs(self, check_grid(grid))]

    def slices(self, grid: Grid) -> list[WindowSlices]:
        return [box for _, box in _blocks(check_grid(grid), self)]


@lru_cache(maxsize=1024)
def _axis_runs(blocks: NeighborhoodBlocks, grid: Grid) -> tuple[tuple[tuple[int, int], ...], ...]:
    """:meth:`NeighborhoodBlocks.axis_runs`, cached: the split chooser and every rank's plan ask for the same cuts."""
    return tuple(tuple(_weighted_cuts(_axis_weights(grid, blocks.geometries, a), p, u))
                 for a, (p, u) in enumerate(zip(blocks.splits, blocks.unit, strict=True)))


def _factorisations(p: int) -> list[Grid]:
    return [(a, b, p // (a * b)) for a in range(1, p + 1) if p % a == 0
            for b in range(1, p // a + 1) if (p // a) % b == 0]


def block_halo_rows(grid: Grid, splits: Grid | NeighborhoodBlocks | NestedBlocks,
                    geometry: Neighborhood) -> list[tuple[int, int]]:
    """(own rows, halo rows) of each rank for one sample: the halo is what its block's queries reach outside it."""
    grid = check_grid(grid)
    out = [(0, 0)] * _world(splits)
    for rank, box in _blocks(grid, splits):
        reach = [axis_reach(n, k, d, c, sl.start, sl.stop, s).size
                 for (n, k, d, c, s), sl in zip(geometry.axes(grid), box, strict=True)]
        own = math.prod(sl.stop - sl.start for sl in box)
        out[rank] = (own, math.prod(reach) - own)
    return out


def block_work(grid: Grid, blocks: Grid | NeighborhoodBlocks | NestedBlocks, geometry: Neighborhood) -> list[int]:
    """Attention work (query x key pairs of the neighbourhoods) of each rank's block of one sample."""
    grid = check_grid(grid)
    out = [0] * _world(blocks)
    per_axis = [axis_work(*a) for a in geometry.axes(grid)]
    for rank, box in _blocks(grid, blocks):
        out[rank] = math.prod(int(w[sl].sum()) for w, sl in zip(per_axis, box, strict=True))
    return out


def _stride_unit(geometries: Sequence[Neighborhood]) -> Grid:
    """Per axis, the positions of a stride group of every strided geometry (their lcm; 1 where none is strided)."""
    return tuple(math.lcm(*(g.stride[a] * g.dilation[a] for g in geometries if g.stride[a] > 1), 1)
                 for a in range(3))  # type: ignore[return-value]


def choose_blocks(grids: Sequence[Grid], geometries: Sequence[Neighborhood], world_size: int,
                  costs: CostConstants = DEFAULT_COSTS) -> NeighborhoodBlocks | NestedBlocks:
    """The cut of every sample's grid into ``world_size`` blocks for these neighborhood layers.

    Candidates: each ``(pt, ph, pw)`` with ``pt * ph * pw = world_size``, and per strided axis cuts at whole stride
    groups or anywhere (a stride group cut in two is reached whole from both sides: a wider halo). Each is scored by
    the slowest rank's predicted time summed over the layers: its rows (tokenwise work), its attention work (query x
    key pairs) and the bytes of its halo (k and v, received), plus one collective a layer. Only candidates whose
    heaviest rank carries at most ``1 + BALANCE_LIMIT`` of the mean attention work compete, when there are any.
    Ties go to the first candidate (splits in (pt, ph, pw) order, aligned cuts first).

    A strided schedule also has two nested candidates (:func:`winsp.planning.halo_cuts.nested_blocks`: two-way cuts in
    a tree, so that boxes keep whole stride groups and balanced work at once), the fastest tree and the tree of fewest
    halo rows, scored the same way.

    The cost constants are published peak figures, so times within ``TIME_TOLERANCE`` of each other are as fast as
    the model can tell: among the candidates as balanced as the fastest and predicted within ``1 + TIME_TOLERANCE``
    of its time, the one with the fewest halo rows wins (ties: the faster, then the first). Halo bytes share links
    with FSDP's collectives and received rows cost memory, which the time alone does not weigh.
    """
    geometries = tuple(geometries)
    stride_unit = _stride_unit(geometries)
    scored: list[tuple[bool, float, float, int, NeighborhoodBlocks | NestedBlocks]] = []

    def score(blocks: NeighborhoodBlocks | NestedBlocks) -> tuple[bool, float, float]:
        """(unbalanced, predicted time of the slowest rank, halo rows of all ranks)."""
        rank_time, work, halo_rows = np.zeros(world_size), np.zeros(world_size), 0.0
        for geom in geometries:
            for grid in grids:
                pairs = np.asarray(block_work(grid, blocks, geom), np.float64)
                own, halo = np.asarray(block_halo_rows(grid, blocks, geom), np.float64).T
                work += pairs
                halo_rows += float(halo.sum())
                rank_time += own * costs.row_s + pairs * costs.pair_s + 2 * halo * costs.row_bytes * costs.byte_s
        cost = float(rank_time.max()) + (costs.latency_s if world_size > 1 else 0.0) * len(geometries)
        balanced = work.sum() == 0 or work.max() <= (1 + BALANCE_LIMIT) * work.mean() * (1 + 1e-12)
        return not balanced, cost, halo_rows

    def add(blocks: NeighborhoodBlocks | NestedBlocks) -> None:
        scored.append((*score(blocks), len(scored), blocks))

    for splits in _factorisations(world_size):
        # aligned cuts first; an axis that is not cut has one run whatever its unit
        units = sorted({tuple(stride_unit[a] if aligned[a] and splits[a] > 1 else 1 for a in range(3))
                        for aligned in np.ndindex(2, 2, 2)}, key=lambda u: (-sum(x > 1 for x in u), u))
        for unit in units:
            add(NeighborhoodBlocks(splits, unit, geometries))  # type: ignore[arg-type]
    if world_size > 1 and stride_unit != (1, 1, 1):
        planned = tuple(check_grid(g) for g in grids)
        for objective in OBJECTIVES:
            nested = nested_blocks(planned, geometries, world_size, costs, BALANCE_LIMIT, objective)
            if nested is not None:
                add(nested)
    fastest = min(scored, key=lambda x: (x[0], x[1], x[3]))
    as_fast = [x for x in scored if x[0] == fastest[0] and x[1] <= (1 + TIME_TOLERANCE) * fastest[1]]
    return min(as_fast, key=lambda x: (x[2], x[1], x[3]))[4]


def choose_splits(grids: Sequence[Grid], geometries: Sequence[Neighborhood], world_size: int,
                  costs: CostConstants = DEFAULT_COSTS) -> Grid:
    """The ``(pt, ph, pw)`` of :func:`choose_blocks` (``(0, 0, 0)`` for a nested cut, which is no product)."""
    blocks = choose_blocks(grids, geometries, world_size, costs)
    return blocks.splits if isinstance(blocks, NeighborhoodBlocks) else (0, 0, 0)


def neighborhood_plan(grids: Sequence[Grid], geometries: Sequence[Neighborhood], world_size: int,
                      costs: CostConstants = DEFAULT_COSTS) -> Plan:
    """The plan every neighborhood layer of a schedule shares: block ``r`` of each sample on rank ``r`` (the cut of
    :func:`choose_blocks`, weighed with ``costs``)."""
    for geom in geometries:
        for i, grid in enumerate(grids):
            geom.check_fits(grid, f"grids[{i}]")
    blocks = choose_blocks(grids, geometries, world_size, costs)
    layout = build_layout(grids, blocks)
    rank_windows: list[list[int]] = [[] for _ in range(world_size)]
    window = 0
    for grid in layout.grids:
        for rank, _ in _blocks(grid, blocks):
            rank_windows[rank].append(window)
            window += 1
    key = (tuple(grids), blocks.fingerprint, blocks.version, world_size, "neighborhood", NEIGHBORHOOD_PLANNER_VERSION)
    return Plan(layout, world_size, key=key, rank_windows=rank_windows)


# ---- one rank's exchange and key index ---------------------------------------------------------------------


def _box_ids(sets: Sequence[np.ndarray], grid: Grid) -> np.ndarray:
    """Canonical in-sample ids of the product of three sorted per-axis position sets (ascending)."""
    t, h, w = sets
    return ((t[:, None, None] * grid[1] + h[None, :, None]) * grid[2] + w[None, None, :]).reshape(-1)


def query_tile_length(k: int, d: int, s: int) -> int:
    """The longest query tile along an axis: ``k * d`` (a tile of neighbours reaches under ``2 k d`` positions), or
    one stride group, ``s * d``, on a strided axis (its queries share one window, so the tile reaches just that)."""
    return s * d if s > 1 else k * d


def _axis_tiles(n: int, k: int, d: int, causal: bool, box: slice, s: int = 1) -> list[tuple[int, int]]:
    """One axis of a box cut into query tiles. Strided: the box's pieces of each stride group (``s * d`` positions
    from 0). Else near-equal tiles of at most ``k * d``: the longer tiles first or last, whichever makes fewer
    (query, reached key) pairs. A tile's reach is clamped at the grid's border, so there a longer tile costs less
    padding (a rank whose box ends at the far border would otherwise pay more than its neighbour)."""
    if s > 1:
        step = s * d
        edges = sorted({box.start, box.stop, *range((box.start // step + 1) * step, box.stop, step)})
        return [(int(lo), int(hi)) for lo, hi in pairwise(edges)]
    extent = box.stop - box.start
    parts = -(-extent // max(1, k * d))
    lengths = [hi - lo for lo, hi in axis_cuts(extent, parts)]
    best, best_pairs = None, None
    for order in (lengths, lengths[::-1]):
        bounds = np.concatenate([[0], np.cumsum(order)]) + box.start
        tiles = [(int(lo), int(hi)) for lo, hi in pairwise(bounds)]
        pairs = sum((hi - lo) * axis_reach(n, k, d, causal, lo, hi).size for lo, hi in tiles)
        if best_pairs is None or pairs < best_pairs:
            best, best_pairs = tiles, pairs
    assert best is not None  # the loop runs twice
    return best


@dataclass(frozen=True, eq=False)
class HaloTensors:
    """A :class:`HaloExchange` on one device (index tensors; split sizes as Python ints).

    Query tiles, in groups of one shape: each group is ``(query [G, Q], key [G, K], mask [G, Q, K], sample [G])``:
    the local row of tile g's i-th query, the key row of its j-th key (the product of the tile's per-axis reach),
    whether that query attends that key, and the tile's sample. The first ``interior_groups`` groups are *interior*:
    their tiles reach local rows only (key rows below ``num_rows``), so they can run while the halos are in flight.
    ``row_slot[l]`` is where local row ``l`` sits in the groups' flattened outputs, concatenated.
    ``edge_rows`` are the local rows the other (edge) groups reach and ``edge_keys`` those groups' key rows renumbered
    into ``[edge_rows, halo rows]``: a key buffer of just those rows serves the edge tiles.
    """

    send_index: torch.Tensor
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    exchange: bool
    tiles: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]
    interior_groups: int
    row_slot: torch.Tensor
    edge_rows: torch.Tensor
    edge_keys: tuple[torch.Tensor, ...]
    query_coords: torch.Tensor
    key_coords: torch.Tensor
    row_sample: torch.Tensor
    key_sample: torch.Tensor
    num_rows: int
    num_keys: int
    num_samples: int


def _axis_mask(n: int, k: int, d: int, causal: bool, s: int, lo: int, hi: int, reach: np.ndarray) -> np.ndarray:
    """[hi - lo, len(reach)]: whether query position ``lo + i`` of one axis has ``reach[j]`` among its neighbours."""
    keys, valid = axis_neighbours(int(n), int(k), int(d), bool(causal), int(s))
    hit = (keys[lo:hi, :, None] == reach[None, None, :]) & valid[lo:hi, :, None]
    return hit.any(axis=1)


def _rank_boxes(plan: Plan) -> list[dict[int, WindowSlices]]:
    """Per sample, rank -> the box it owns, read from the plan (so a relabelled plan is followed too)."""
    lay = plan.layout
    out: list[dict[int, WindowSlices]] = [{} for _ in lay.grids]
    for w in range(lay.num_windows):
        rank, sample = int(plan.window_owner[w]), int(lay.window_sample[w])
        if rank in out[sample] or plan.has_split_windows:
            raise ValueError(f"a neighborhood plan gives rank {rank} one box per sample, whole: sample {sample} breaks "
                             "that")
        (t, h, w0), (dt, dh, dw) = lay.window_start[w].tolist(), lay.window_shape[w].tolist()
        out[sample][rank] = (slice(t, t + dt), slice(h, h + dh), slice(w0, w0 + dw))
    return out


class HaloExchange:
    """What rank ``rank`` of a neighborhood plan does in one neighborhood layer.

    ``send_index`` picks the local rows other ranks' queries reach, grouped by destination rank (in each group
    ascending canonical id); ``input_split_sizes`` / ``output_split_sizes`` are the exchange's split sizes. The key
    rows are the local rows followed by the received halo rows (source rank order), and ``tiles`` the query tiles
    (see :class:`HaloTensors`). ``halo_rows`` is how many rows this rank receives.
    """

    def __init__(self, plan: Plan, rank: int, geometry: Neighborhood) -> None:
        lay = plan.layout
        p = plan.world_size
        boxes = _rank_boxes(plan)
        reach = [{r: [axis_reach(n, k, d, c, sl.start, sl.stop, st) for (n, k, d, c, st), sl in
                      zip(geometry.axes(grid), box, strict=True)]
                  for r, box in sample_boxes.items()} for grid, sample_boxes in zip(lay.grids, boxes, strict=True)]

        def rows_from(src: int, dst: int) -> np.ndarray:
            """Canonical packed ids of src's rows that dst's queries reach (empty for src == dst)."""
            if src == dst:
                return np.empty(0, np.int64)
            parts = []
            for s, grid in enumerate(lay.grids):
                if src not in boxes[s] or dst not in reach[s]:
                    continue
                box = boxes[s][src]
                sets = [r[(r >= b.start) & (r < b.stop)] for r, b in zip(reach[s][dst], box, strict=True)]
                if all(x.size for x in sets):
                    parts.append(lay.sample_offsets[s] + _box_ids(sets, grid))
            return np.concatenate(parts) if parts else np.empty(0, np.int64)

        sent = [rows_from(rank, d) for d in range(p)]
        received = [rows_from(s, rank) for s in range(p)]
        self.send_index = (plan.token_local_index[np.concatenate(sent)] if p > 1 else np.empty(0, np.int64))
        self.input_split_sizes = tuple(int(x.size) for x in sent)
        self.output_split_sizes = tuple(int(x.size) for x in received)
        self.halo_rows = int(sum(self.output_split_sizes))
        own = plan.rank_token_ids(rank)
        key_ids = np.concatenate([own] + received).astype(np.int64)
        self.key_ids = key_ids
        self.token_ids = own
        order = np.argsort(key_ids, kind="stable")
        sorted_ids = key_ids[order]

        sample_of = np.searchsorted(lay.sample_offsets, key_ids, side="right") - 1
        self.key_sample = sample_of.astype(np.int64)
        self.key_coords = lay.token_coords(key_ids, sample_of)
        row_sample = self.key_sample[:own.size]
        self.row_sample = row_sample
        self.query_coords = self.key_coords[:own.size]
        self.num_samples = len(lay.grids)
        self.exchange = p > 1 and any(rows_from(s, d).size for s in range(p) for d in range(p) if s != d)
        self._tiles(plan, rank, geometry, boxes, sorted_ids, order)

    def _tiles(self, plan: Plan, rank: int, geometry: Neighborhood, boxes, sorted_ids, order) -> None:
        """Cut each of this rank's boxes into query tiles (:func:`_axis_tiles`: at most ``kernel * dilation`` per
        axis, or one stride group on a strided axis);
        a tile attends densely to the box of rows its queries reach, masked to each query's neighbourhood."""
        lay = plan.layout
        tiles = []  # (query local rows, key ids, sample)
        own_sorted = np.argsort(self.token_ids, kind="stable")
        own_ids_sorted = self.token_ids[own_sorted]
        for s, grid in enumerate(lay.grids):
            box = boxes[s].get(rank)
            if box is None:
                continue
            axes = geometry.axes(grid)
            spans = [_axis_tiles(n, k, d, c, sl, st) for (n, k, d, c, st), sl in zip(axes, box, strict=True)]
            for t0, t1 in spans[0]:
                for h0, h1 in spans[1]:
                    for w0, w1 in spans[2]:
                        q_ids = lay.sample_offsets[s] + _box_ids(
                            [np.arange(t0, t1), np.arange(h0, h1), np.arange(w0, w1)], grid)
                        spans3 = ((t0, t1), (h0, h1), (w0, w1))
                        reach = [axis_reach(n, k, d, c, lo, hi, st) for (n, k, d, c, st), (lo, hi) in
                                 zip(axes, spans3, strict=True)]
                        k_ids = lay.sample_offsets[s] + _box_ids(reach, grid)
                        q_rows = own_sorted[np.searchsorted(own_ids_sorted, q_ids)]
                        # the mask is the outer product of per-axis masks: a neighbourhood is a product over axes
                        axis_masks = [_axis_mask(n, k, d, c, st, lo, hi, r) for (n, k, d, c, st), (lo, hi), r in
                                      zip(axes, spans3, reach, strict=True)]
                        # interior: the keys (a box) lie inside this rank's box, so it needs no halo row
                        interior = all(r[0] >= sl.start and r[-1] < sl.stop for r, sl in zip(reach, box, strict=True))
                        tiles.append((q_rows, k_ids, s, axis_masks, interior))
        by_shape: dict[tuple[bool, int, int], list] = {}
        for tile in tiles:  # tiles of one shape run as one batch (no padding); interior tiles first
            by_shape.setdefault((not tile[4], tile[0].size, tile[1].size), []).append(tile)
        groups, offset = [], 0
        row_slot = np.zeros(self.token_ids.size, np.int64)
        self.interior_groups = sum(1 for needs_halo, _, _ in by_shape if not needs_halo)
        for (_, nq, nk), members in sorted(by_shape.items()):
            query = np.stack([m[0] for m in members])
            where = np.stack([np.searchsorted(sorted_ids, m[1]) for m in members])
            if where.max() >= sorted_ids.size or not np.array_equal(sorted_ids[where],
                                                                   np.stack([m[1] for m in members])):
                raise AssertionError("halo planning missed a key row a query tile reaches")  # a winsp bug
            key = order[where]
            mask = np.stack([(mt[:, None, None, :, None, None] & mh[None, :, None, None, :, None]
                              & mw[None, None, :, None, None, :]).reshape(nq, nk) for *_, (mt, mh, mw), _ in members])
            row_slot[query.reshape(-1)] = offset + np.arange(query.size)
            offset += query.size
            groups.append((query, key, mask, np.asarray([m[2] for m in members], np.int64)))
        self.tiles, self.row_slot = groups, row_slot
        edge_keys = [key for _, key, _, _ in groups[self.interior_groups:]]
        rows = self.token_ids.size
        local = [key[key < rows] for key in edge_keys]
        self.edge_rows = np.unique(np.concatenate(local)) if local else np.empty(0, np.int64)
        renumber = np.full(self.key_ids.size, -1, np.int64)  # key row -> its row in [edge rows, halo rows]
        renumber[self.edge_rows] = np.arange(self.edge_rows.size)
        renumber[rows:] = self.edge_rows.size + np.arange(self.key_ids.size - rows)
        self.edge_keys = [renumber[key] for key in edge_keys]

    def to(self, device: torch.device | str) -> HaloTensors:
        def t(a, dtype=torch.int64):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        return HaloTensors(
            send_index=t(self.send_index), input_split_sizes=self.input_split_sizes,
            output_split_sizes=self.output_split_sizes, exchange=self.exchange,
            tiles=tuple((t(q), t(k), t(m, torch.bool), t(smp)) for q, k, m, smp in self.tiles),
            interior_groups=self.interior_groups,
            row_slot=t(self.row_slot), edge_rows=t(self.edge_rows), edge_keys=tuple(t(k) for k in self.edge_keys),
            query_coords=t(self.query_coords), key_coords=t(self.key_coords), row_sample=t(self.row_sample),
            key_sample=t(self.key_sample), num_rows=int(self.token_ids.size), num_keys=int(self.key_ids.size),
            num_samples=self.num_samples,
        )
