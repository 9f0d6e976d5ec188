"""The ``"locality"`` placement: keep rows on the rank that already holds them across layout changes.

LPT places each layout's windows independently, so at a regular <-> shifted transition most rows change rank. Rows
moved in a transition between layouts A and B is exactly the cut weight of the *overlap graph*: one node per window of
either layout, an edge (a, b) weighing the tokens windows a and b share, cut when a and b live on different ranks. A
placement with little rank boundary moves little. The rule (pure numpy, deterministic, no communication):

1. Overlap edges between the layouts that follow each other in the schedule, from the cells both layouts' window
   edges cut the grid into (volumes are products of 1-D interval lengths).
2. Rank the box splits ``P = pt * ph * pw`` of the grid by an estimate of the rows their boundaries force to move
   (each internal boundary plane moves about half a window's depth of rows), and keep the best few.
3. For each kept split, place the *anchor* layout (the one with the fewest windows) by recursive cuts along the split
   axes at cumulative-token targets. Windows are ordered (sample, cut axis, the other axes), so a cut that falls
   inside a slab of windows becomes a staircase and balance comes out near exact.
4. Give every window of the other layouts to the rank holding most of its rows.
5. Repair balance with the cheapest moves (least added cut), or swaps for a smaller window where no single window
   fits, until every rank is under the cap.
6. Refine all layouts jointly with Fiduccia-Mattheyses-style passes over the overlap graph (best move first,
   negative moves allowed for a while, each window moved once a pass, roll back to the best prefix), never breaking
   the balance cap.

The split with the least total cut wins. Two guards keep the promises of the planner: a layout whose imbalance ends
above ``max(1 + SLACK_LIMIT, LPT's + 0.01)`` falls back to LPT's placement with its ranks relabelled to the anchor's,
and if the result moves more rows per forward than plain LPT, plain LPT is returned.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from winsp.geometry.layout import Layout
from winsp.planning.plan import lpt_assign

__all__ = ["locality_placement", "overlap_edges", "cut_weight", "SLACK", "SLACK_LIMIT"]

#: Balance cap the refinement works under: a rank may hold up to (1 + SLACK) x the ideal lower bound.
SLACK = 0.01
#: The promised bound: above (1 + SLACK_LIMIT) x ideal (and above LPT's own + 0.01) a layout falls back to LPT.
SLACK_LIMIT = 0.05
_SPLITS_KEPT = 3  # box splits fully evaluated, best estimates first
_FM_PASSES = 4
_FM_PATIENCE = 40  # non-improving moves tried before a pass gives up


def overlap_edges(a: Layout, b: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(windows of ``a``, windows of ``b``, shared tokens) for every pair of windows that overlap.

    Both layouts must describe the same batch. Per sample, the window edges of both layouts along each axis cut the
    grid into cells that each lie in one window of ``a`` and one of ``b``: label the cells with both window ids and
    sum cell volumes per id pair (products of 1-D interval lengths). The work grows with windows and cells, never with
    tokens x windows, and windows of different samples never overlap.
    """
    if a.grids != b.grids:
        raise ValueError(f"overlap_edges needs layouts of the same batch: grids {a.grids} vs {b.grids}")
    ea, eb, ew = [], [], []
    a_first = np.searchsorted(a.window_sample, np.arange(a.num_samples + 1))
    b_first = np.searchsorted(b.window_sample, np.arange(b.num_samples + 1))
    for s in range(a.num_samples):
        ia = np.arange(a_first[s], a_first[s + 1])
        ib = np.arange(b_first[s], b_first[s + 1])
        boxes = [(lay.window_start[i], lay.window_start[i] + lay.window_shape[i]) for lay, i in ((a, ia), (b, ib))]
        cuts = [np.unique(np.concatenate([lo[:, k] for lo, _ in boxes] + [hi[:, k] for _, hi in boxes]))
                for k in range(3)]
        labels = [_label_cells(lo, hi, cuts) for lo, hi in boxes]
        lengths = [np.diff(c) for c in cuts]
        volume = (lengths[0][:, None, None] * lengths[1][None, :, None] * lengths[2][None, None, :]).reshape(-1)
        pair, inverse = np.unique(labels[0].reshape(-1) * ib.size + labels[1].reshape(-1), return_inverse=True)
        ea.append(ia[pair // ib.size])
        eb.append(ib[pair % ib.size])
        ew.append(np.bincount(inverse.reshape(-1), weights=volume, minlength=pair.size).astype(np.int64))
    return _concat(ea), _concat(eb), _concat(ew)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _label_cells(lo: np.ndarray, hi: np.ndarray, cuts: list[np.ndarray]) -> np.ndarray:
    """[cells_t, cells_h, cells_w] index (within ``lo``) of the box covering each cell of the ``cuts`` grid."""
    first = np.stack([np.searchsorted(cuts[k], lo[:, k]) for k in range(3)], axis=1)
    last = np.stack([np.searchsorted(cuts[k], hi[:, k]) for k in range(3)], axis=1)
    labels = np.empty(tuple(c.size - 1 for c in cuts), dtype=np.int64)
    for i, ((t0, h0, w0), (t1, h1, w1)) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
        labels[t0:t1, h0:h1, w0:w1] = i
    return labels


def cut_weight(edges: tuple[np.ndarray, np.ndarray, np.ndarray], owner_a: np.ndarray, owner_b: np.ndarray) -> int:
    """Tokens on overlap edges whose two windows sit on different ranks: the rows a transition A <-> B moves."""
    a, b, w = edges
    return int(w[owner_a[a] != owner_b[b]].sum())


# ---- 2. box splits ----------------------------------------------------------------------------------------------

def _factorisations(p: int) -> list[tuple[int, int, int]]:
    return [(pt, ph, p // (pt * ph)) for pt in range(1, p + 1) if p % pt == 0
            for ph in range(1, p // pt + 1) if (p // pt) % ph == 0]


def _split_estimate(layout: Layout, split: tuple[int, int, int]) -> float:
    """Rows a box split's internal boundaries force to move: per axis, (cuts) x cross-section x half a window depth.

    Asking for more pieces along an axis than the anchor has windows there costs a cut through every window.
    """
    total = 0.0
    grids = np.asarray(layout.grids, dtype=np.float64)
    for s, grid in enumerate(grids):
        mine = layout.window_sample == s
        tokens = float(grid.prod())
        for k in range(3):
            if split[k] == 1:
                continue
            starts = np.unique(layout.window_start[mine, k])
            depth = float(layout.window_shape[mine, k].max())
            cuts = split[k] - 1
            cross = tokens / grid[k]
            if split[k] > starts.size:  # staircases inside slabs: the cut runs through windows along other axes
                cuts += (split[k] - starts.size) * 2
            total += cuts * cross * depth / 2
    return total


def _ranked_splits(layout: Layout, p: int) -> list[tuple[int, int, int]]:
    splits = _factorisations(p)
    return sorted(splits, key=lambda sp: (_split_estimate(layout, sp), sp))[:_SPLITS_KEPT]


# ---- 3. recursive staircase cuts ------------------------------------------------------------------------------

def _staircase_cut(layout: Layout, split: tuple[int, int, int]) -> np.ndarray:
    """Owner rank of each anchor window: recursive cuts along the split axes at cumulative-token targets."""
    # the largest factor is cut first; the remaining axes order the windows inside a slab (the staircase)
    axes = sorted(range(3), key=lambda k: (-split[k], k))
    owner = np.zeros(layout.num_windows, dtype=np.int64)
    tokens = layout.token_counts.astype(np.float64)
    start = layout.window_start

    def cut(idx: np.ndarray, rank0: int, level: int) -> None:
        while level < 3 and split[axes[level]] == 1:
            level += 1
        if level == 3 or idx.size == 0:
            owner[idx] = rank0
            return
        k = axes[level]
        f = split[k]
        rest = [axes[j] for j in range(3) if j != level]
        order = idx[np.lexsort((start[idx, rest[1]], start[idx, rest[0]], start[idx, k], layout.window_sample[idx]))]
        cum = np.cumsum(tokens[order])
        mid = cum - tokens[order] / 2  # a window joins the piece its middle token falls in
        piece = np.minimum((mid * f // cum[-1]).astype(np.int64), f - 1)
        ranks_per_piece = math.prod(split[axes[j]] for j in range(level + 1, 3))
        for q in range(f):
            cut(order[piece == q], rank0 + q * ranks_per_piece, level + 1)

    cut(np.arange(layout.num_windows), 0, 0)
    return owner


# ---- the overlap graph over all layouts ----------------------------------------------------------------------

class _Graph:
    """All windows of all layouts as one node list, with the weighted overlap edges between scheduled neighbours."""

    def __init__(self, layouts: Sequence[Layout], pairs: dict[tuple[int, int], int], p: int) -> None:
        self.p = p
        sizes = [lay.num_windows for lay in layouts]
        self.first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.n = int(self.first[-1])
        self.layer = np.repeat(np.arange(len(layouts)), sizes)
        self.tokens = np.concatenate([lay.token_counts for lay in layouts]).astype(np.int64)
        self.pair_edges: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        us, vs, ws = [], [], []
        for (i, j), count in sorted(pairs.items()):
            ea, eb, ew = overlap_edges(layouts[i], layouts[j])
            self.pair_edges[(i, j)] = (ea, eb, ew)
            us.append(ea + self.first[i])
            vs.append(eb + self.first[j])
            ws.append(ew * count)
        u = np.concatenate(us) if us else np.zeros(0, dtype=np.int64)
        v = np.concatenate(vs) if vs else np.zeros(0, dtype=np.int64)
        w = np.concatenate(ws) if ws else np.zeros(0, dtype=np.int64)
        # symmetric CSR adjacency
        src, dst, wt = np.concatenate([u, v]), np.concatenate([v, u]), np.concatenate([w, w])
        order = np.argsort(src, kind="stable")
        self.adj_dst, self.adj_w = dst[order], wt[order]
        self.adj_ptr = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=self.n))]).astype(np.int64)
        self.src, self.dst, self.w = u, v, w

    def connectivity(self, owner: np.ndarray) -> np.ndarray:
        """[n, P] edge weight from each node to the nodes each rank owns (unplaced nodes, owner -1, count for none)."""
        conn = np.zeros((self.n, self.p), dtype=np.int64)
        placed = owner[self.dst] >= 0
        np.add.at(conn, (self.src[placed], owner[self.dst[placed]]), self.w[placed])
        placed = owner[self.src] >= 0
        np.add.at(conn, (self.dst[placed], owner[self.src[placed]]), self.w[placed])
        return conn

    def cut(self, owner: np.ndarray) -> int:
        return int(self.w[owner[self.src] != owner[self.dst]].sum())

    def loads(self, owner: np.ndarray) -> np.ndarray:
        """[layouts, P] tokens per rank in each layout."""
        out = np.zeros((self.first.size - 1, self.p), dtype=np.int64)
        np.add.at(out, (self.layer, owner), self.tokens)
        return out

    def move(self, conn: np.ndarray, v: int, a: int, b: int) -> None:
        lo, hi = self.adj_ptr[v], self.adj_ptr[v + 1]
        nb, w = self.adj_dst[lo:hi], self.adj_w[lo:hi]
        np.subtract.at(conn[:, a], nb, w)
        np.add.at(conn[:, b], nb, w)


# ---- 5. balance repair ----------------------------------------------------------------------------------------

def _repair(g: _Graph, owner: np.ndarray, conn: np.ndarray, cap: np.ndarray, layer: int) -> None:
    """Lower ranks above ``cap`` in one layout by the cheapest (least added cut) move or swap of windows.

    First choice: move one window of the heaviest rank to a rank it fits on under the cap. When no window fits
    anywhere (windows large against the slack), swap a window of the heaviest rank with a smaller one elsewhere so
    that both ranks end under the cap. Failing both, the same two steps may merely lower the heaviest rank's load.
    Each step picks the cheapest candidate of its kind.
    """
    nodes = np.arange(g.first[layer], g.first[layer + 1])
    load = np.bincount(owner[nodes], weights=g.tokens[nodes], minlength=g.p).astype(np.int64)
    worst = np.iinfo(np.int64).max
    for _ in range(4 * nodes.size + 4):  # every step lowers the heaviest rank or empties the set above the cap
        if load.max() <= cap[layer]:
            return
        heavy = int(np.argmax(load))
        mine = nodes[owner[nodes] == heavy]
        moved = False
        for limit in (cap[layer], load[heavy] - 1):  # under the cap, else merely below the current peak
            # single moves: mine[i] -> rank r
            fits = g.tokens[mine, None] + load[None, :] <= limit
            fits[:, heavy] = False
            if fits.any():
                extra = np.where(fits, conn[mine, heavy][:, None] - conn[mine, :], worst)
                i, dst = divmod(int(np.argmin(extra)), g.p)
                _relocate(g, owner, conn, load, int(mine[i]), heavy, dst)
                moved = True
                break
            # swaps: mine[i] <-> others[j], a smaller window on rank r = owner[others[j]]
            others = nodes[owner[nodes] != heavy]
            d = g.tokens[mine][:, None] - g.tokens[others][None, :]
            r = owner[others]
            ok = (d > 0) & (load[r][None, :] + d <= limit)
            if ok.any():
                swap = np.where(ok, (conn[mine, heavy][:, None] - conn[mine][:, r])
                                + (conn[others, r] - conn[others, heavy])[None, :], worst)
                i, j = divmod(int(np.argmin(swap)), others.size)
                dst = int(r[j])
                _relocate(g, owner, conn, load, int(mine[i]), heavy, dst)
                _relocate(g, owner, conn, load, int(others[j]), dst, heavy)
                moved = True
                break
        if not moved:
            return


def _relocate(g: _Graph, owner: np.ndarray, conn: np.ndarray, load: np.ndarray, v: int, a: int, b: int) -> None:
    g.move(conn, v, a, b)
    owner[v] = b
    load[a] -= g.tokens[v]
    load[b] += g.tokens[v]


# ---- 6. Fiduccia-Mattheyses refinement ---------------------------------------------------------------------

def _refine(g: _Graph, owner: np.ndarray, conn: np.ndarray, cap: np.ndarray) -> None:
    """FM passes: best feasible single-window move first, each window once a pass; keep the best prefix."""
    loads = g.loads(owner)
    total = conn.sum(axis=1)  # a window's edge weight to all ranks: moves never change it
    own_conn = conn[np.arange(g.n), owner]
    neg = np.iinfo(np.int64).min

    def apply(v: int, a: int, b: int) -> None:
        g.move(conn, v, a, b)
        owner[v] = b
        loads[g.layer[v], a] -= g.tokens[v]
        loads[g.layer[v], b] += g.tokens[v]
        touched = np.append(g.adj_dst[g.adj_ptr[v]:g.adj_ptr[v + 1]], v)
        own_conn[touched] = conn[touched, owner[touched]]

    for _ in range(_FM_PASSES):
        locked = np.zeros(g.n, dtype=bool)
        gain_total, best_gain, best_len = 0, 0, 0
        moves: list[tuple[int, int, int]] = []  # (window, from rank, to rank)
        while len(moves) - best_len <= _FM_PATIENCE:
            cand = np.nonzero(~locked & (total > own_conn))[0]  # windows on a rank boundary
            if cand.size == 0:
                break
            gain = conn[cand] - own_conn[cand, None]
            lay = g.layer[cand]
            feasible = loads[lay] + g.tokens[cand, None] <= cap[lay, None]
            feasible[np.arange(cand.size), owner[cand]] = False
            gain = np.where(feasible, gain, neg)
            i, b = divmod(int(np.argmax(gain)), g.p)
            if gain[i, b] == neg:
                break
            v, a = int(cand[i]), int(owner[cand[i]])
            gain_total += int(gain[i, b])
            apply(v, a, b)
            locked[v] = True
            moves.append((v, a, b))
            if gain_total > best_gain:
                best_gain, best_len = gain_total, len(moves)
        for v, a, b in reversed(moves[best_len:]):
            apply(v, b, a)
        if best_gain == 0:
            break


# ---- the whole rule -----------------------------------------------------------------------------------------

def _lower_bounds(layouts: Sequence[Layout], p: int) -> np.ndarray:
    return np.array([max(int(lay.token_counts.max()), math.ceil(lay.num_tokens / p)) for lay in layouts],
                    dtype=np.int64)


def _relabel_to(owner_lpt: np.ndarray, tokens_by_rank_pair: np.ndarray) -> np.ndarray:
    """Rank permutation of an LPT placement that keeps most overlap with the reference (greedy matching)."""
    p = tokens_by_rank_pair.shape[0]
    mapping = -np.ones(p, dtype=np.int64)
    used = np.zeros(p, dtype=bool)
    flat_order = np.argsort(-tokens_by_rank_pair, axis=None, kind="stable")
    for f in flat_order:
        src, ref = divmod(int(f), p)
        if mapping[src] < 0 and not used[ref]:
            mapping[src] = ref
            used[ref] = True
    return mapping[owner_lpt]


def _owners_to_rank_windows(owner: np.ndarray, p: int) -> list[list[int]]:
    return [np.nonzero(owner == r)[0].tolist() for r in range(p)]


def locality_placement(
    layouts: Sequence[Layout],
    transitions: dict[tuple[int, int], int],
    world_size: int,
) -> list[list[list[int]]]:
    """Placements (one list of window ids per rank, ascending) for each of ``layouts``, with few rows moved.

    Args:
        layouts: the distinct layouts of one schedule, all of the same batch.
        transitions: ``{(i, j): count}``: layouts i and j follow each other ``count`` times in the schedule
            (``i < j``); rows moved between them are what the placement minimises.
        world_size: the number of ranks.
    """
    p = int(world_size)
    if not layouts:
        raise ValueError("locality_placement needs at least one layout")
    for (i, j) in transitions:
        if not (0 <= i < j < len(layouts)):
            raise ValueError(f"transition {(i, j)} must name two layouts i < j among {len(layouts)}")
    lpt = [np.asarray(_owner_of(lpt_assign(lay.token_counts.tolist(), p), lay.num_windows)) for lay in layouts]
    if p == 1 or not transitions:  # nothing ever moves: LPT's balance is the better placement
        return [_owners_to_rank_windows(o, p) for o in lpt]

    g = _Graph(layouts, transitions, p)
    bound = _lower_bounds(layouts, p)
    lpt_owner = np.concatenate(lpt)
    lpt_peak = g.loads(lpt_owner).max(axis=1)
    limit = np.maximum(np.floor(bound * (1 + SLACK_LIMIT)), np.floor(lpt_peak + 0.01 * bound)).astype(np.int64)
    cap = np.minimum(np.maximum(np.floor(bound * (1 + SLACK)), lpt_peak), limit).astype(np.int64)
    anchor = min(range(len(layouts)), key=lambda i: (layouts[i].num_windows, i))

    best_owner, best_key = lpt_owner, (g.cut(lpt_owner), 0)  # ties go to LPT (its balance is never worse)
    for split in _ranked_splits(layouts[anchor], p):
        owner = -np.ones(g.n, dtype=np.int64)
        owner[g.first[anchor]:g.first[anchor + 1]] = _staircase_cut(layouts[anchor], split)
        # 4. the other layouts, nearest to the anchor first: each window to the rank holding most of its rows
        for i in _placement_order(anchor, transitions, len(layouts)):
            conn = g.connectivity(owner)
            nodes = np.arange(g.first[i], g.first[i + 1])
            owner[nodes] = np.argmax(conn[nodes], axis=1)
        conn = g.connectivity(owner)
        for i in range(len(layouts)):
            _repair(g, owner, conn, cap, i)
        _refine(g, owner, conn, cap)
        # the promise: balance within the limit, else that layout is LPT's, relabelled to keep what overlaps
        loads = g.loads(owner)
        for i in range(len(layouts)):
            if loads[i].max() > limit[i]:
                owner[g.first[i]:g.first[i + 1]] = _relabel_lpt(g, owner, lpt[i], i)
        key = (g.cut(owner), 1)
        if key < best_key:
            best_owner, best_key = owner, key
    return [_owners_to_rank_windows(best_owner[g.first[i]:g.first[i + 1]], p) for i in range(len(layouts))]


def _owner_of(rank_windows: list[list[int]], n: int) -> np.ndarray:
    owner = np.empty(n, dtype=np.int64)
    for r, ws in enumerate(rank_windows):
        owner[ws] = r
    return owner


def _placement_order(anchor: int, transitions: dict[tuple[int, int], int], count: int) -> list[int]:
    """Layouts other than the anchor, breadth-first over the schedule's transitions (then any left, by index)."""
    seen, order, frontier = {anchor}, [], [anchor]
    while frontier:
        nxt = []
        for u in frontier:
            for (i, j) in sorted(transitions):
                v = j if i == u else i if j == u else None
                if v is not None and v not in seen:
                    seen.add(v)
                    order.append(v)
                    nxt.append(v)
        frontier = nxt
    return order + [i for i in range(count) if i not in seen]


def _relabel_lpt(g: _Graph, owner: np.ndarray, lpt_owner: np.ndarray, layer: int) -> np.ndarray:
    """LPT's placement of one layout with ranks renamed to overlap most with its neighbours' current placement."""
    shared = np.zeros((g.p, g.p), dtype=np.int64)
    for (i, j), (ea, eb, ew) in g.pair_edges.items():
        if i == layer:
            np.add.at(shared, (lpt_owner[ea], owner[g.first[j] + eb]), ew)
        elif j == layer:
            np.add.at(shared, (lpt_owner[eb], owner[g.first[i] + ea]), ew)
    return _relabel_to(lpt_owner, shared)
