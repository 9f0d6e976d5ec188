"""Balance of real work: whole windows, split windows or head parallelism, and the default planner's choice.

Whole windows cap the speed-up when windows per rank are few (three windows on two ranks: 2 : 1), and even with
many windows a rank may get its share of rows but far from its share of attention (small border windows on one
rank, large ones on another). Three placements share windows' rows between ranks instead (a split window is computed
head-parallel by the ranks holding it, :mod:`winsp.attention.split`, which moves ``4 w (W - w) / W`` rows' worth per
rank holding ``w`` of its ``W`` rows):

* :func:`split_placement` cuts the layout's rows, in window order, into ``P`` runs of equal predicted work (a row's
  tokenwise work plus its window's attention pairs); a cut within ``SNAP`` of a window edge moves onto the edge.
* :func:`mixed_placement` balances rows *and* attention pairs exactly: windows in order of size, each rank takes one
  run from the small end and one from the large end, sized so that both its rows and its pairs are the remaining
  share (at most ``2 (P - 1)`` windows split).
* :func:`heads_placement` is head parallelism (Ulysses) in the same terms: every window's rows cut into ``P`` equal
  runs, so every rank computes ``1 / P`` of every window's heads (uneven head counts rotate over the windows).

:func:`choose_placement` is the default planner's rule, per layout: among LPT's whole windows, whole windows placed
on rows and pairs together, and the three placements above, the one the cost constants (:mod:`winsp.planning.costs`)
predict fastest (slowest rank's compute plus the in-window exchange) among those that keep both rows and attention
within ``BALANCE_CAP`` (5 %) of a perfect split; if none does, the best balanced one. Everything is numpy on the
CPU and deterministic, so every rank chooses the same with no communication.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from winsp.geometry.layout import Layout
from winsp.planning.costs import DEFAULT_COSTS, CostConstants
from winsp.planning.plan import Plan, _check_world_size, lpt_assign

__all__ = ["BALANCE_CAP", "SNAP", "PLACEMENTS", "split_placement", "mixed_placement", "heads_placement",
           "work_balanced_windows", "placement_candidates", "choose_placement", "predicted_compute",
           "exchange_rows", "predicted_exchange"]

#: The balance promise: the default planner keeps every rank's rows and attention pairs within this factor of a
#: perfect split (``N / P`` and ``sum W^2 / P``) wherever some placement can.
BALANCE_CAP = 1.05
#: A cut within this share of a rank's work from a window edge moves onto the edge (keeps the window whole).
SNAP = 0.02
#: The placements :func:`choose_placement` weighs, in its tie-break order.
PLACEMENTS = ("lpt", "work", "split", "mixed", "heads")


def _row_costs(layout: Layout, costs: CostConstants) -> np.ndarray:
    """[n] predicted seconds of one row of each window: tokenwise work plus its queries' pairs with the window."""
    return costs.row_s + costs.pair_s * layout.token_counts.astype(np.float64)


def split_placement(layout: Layout, world_size: int, costs: CostConstants = DEFAULT_COSTS,
                    snap: float = SNAP) -> list[list[tuple[int, int, int]]]:
    """Per rank, ``(window, first row, end row)`` pieces of one contiguous run of the layout's rows.

    The runs have equal predicted work up to one row, except where a cut moved onto a window edge (at most ``snap``
    of a rank's work). Ranks get nothing only when there are fewer rows than ranks.
    """
    p = _check_world_size(world_size)
    counts = layout.token_counts
    offsets = layout.offsets
    unit = _row_costs(layout, costs)
    bounds = np.concatenate([[0.0], np.cumsum(counts * unit)])
    share = bounds[-1] / p
    cuts = [0]
    for r in range(1, p):
        target = r * share
        k = int(min(np.searchsorted(bounds, target, side="right") - 1, counts.size - 1))
        below, above = target - bounds[k], bounds[k + 1] - target
        if below <= above and below <= snap * share:
            pos = int(offsets[k])
        elif above <= snap * share:
            pos = int(offsets[k + 1])
        else:
            rows = int(round(below / unit[k]))
            pos = int(offsets[k]) + min(max(rows, 1), int(counts[k]) - 1)
        cuts.append(max(pos, cuts[-1]))
    cuts.append(int(offsets[-1]))
    out: list[list[tuple[int, int, int]]] = []
    for start, end in pairwise(cuts):
        if end <= start:
            out.append([])
            continue
        first = int(np.searchsorted(offsets, start, side="right") - 1)
        last = int(np.searchsorted(offsets, end - 1, side="right") - 1)
        out.append([(w, int(max(start, offsets[w]) - offsets[w]), int(min(end, offsets[w + 1]) - offsets[w]))
                    for w in range(first, last + 1)])
    return out


def _rows_from_small_end(pairs: Callable[[int], float], lo: int, hi: int, take: int, target: float) -> int:
    """The ``y`` in ``[0, take]`` whose ``y`` rows from ``lo`` up plus ``take - y`` rows from ``hi`` down hold the
    pairs closest to ``target`` (``pairs(x)``: pairs of the first ``x`` sorted rows). Their pairs do not increase
    with ``y``, so bisection finds the smallest ``y`` at or under ``target``, then the nearer of it and ``y - 1``."""

    def got(y: int) -> float:
        return pairs(lo + y) - pairs(lo) + pairs(hi) - pairs(hi - take + y)

    a, b = 0, take
    while a < b:
        m = (a + b) // 2
        if got(m) <= target:
            b = m
        else:
            a = m + 1
    return a if a == 0 or abs(got(a) - target) <= abs(got(a - 1) - target) else a - 1


def mixed_placement(layout: Layout, world_size: int) -> list[list[tuple[int, int, int]]]:
    """Per rank, ``(window, first row, end row)`` pieces with equal rows and equal attention pairs (up to a row).

    Windows are laid end to end in order of size (ascending, then window id). Rank ``r`` takes ``y`` rows from the
    small end of what is left and ``R - y`` from the large end, where ``R`` is the remaining rows' share: a piece
    from the large end has at least the remaining average pairs per row and one from the small end at most, so some
    ``y`` gives exactly the remaining pairs' share too (found by bisection). Each rank's pieces are listed in window
    order.
    """
    p = _check_world_size(world_size)
    counts = layout.token_counts.astype(np.int64)
    order = np.lexsort((np.arange(counts.size), counts))
    c = counts[order]
    rows_at = np.concatenate([[0], np.cumsum(c)])  # sorted-row position where each sorted window starts
    pairs_at = np.concatenate([[0], np.cumsum(c * c)]).astype(np.float64)

    def pairs(x: int) -> float:  # pairs of the first x rows in sorted order
        k = min(int(np.searchsorted(rows_at, x, side="right")) - 1, c.size - 1)
        return float(pairs_at[k] + (x - rows_at[k]) * c[k])

    lo, hi = 0, int(rows_at[-1])
    ranges: list[list[tuple[int, int]]] = []
    for r in range(p):
        left = p - r
        if left == 1:
            ranges.append([(lo, hi)])
            break
        take = int(round((hi - lo) / left))
        target = (pairs(hi) - pairs(lo)) / left
        y = _rows_from_small_end(pairs, lo, hi, take, target)
        if y:  # one piece per window and rank: a window both runs reach has equal pairs per row, take it from above
            k = int(np.searchsorted(rows_at, lo + y - 1, side="right")) - 1
            if rows_at[k + 1] > hi - take + y:
                y = max(int(rows_at[k]) - lo, 0)
        ranges.append([(lo, lo + y), (hi - take + y, hi)])
        lo, hi = lo + y, hi - take + y
    out: list[list[tuple[int, int, int]]] = []
    for spans in ranges:
        pieces = []
        for x0, x1 in spans:
            if x1 <= x0:
                continue
            k0 = int(np.searchsorted(rows_at, x0, side="right")) - 1
            k1 = int(np.searchsorted(rows_at, x1 - 1, side="right")) - 1
            for k in range(k0, k1 + 1):
                a, b = max(x0, int(rows_at[k])) - int(rows_at[k]), min(x1, int(rows_at[k + 1])) - int(rows_at[k])
                pieces.append((int(order[k]), a, b))
        out.append(sorted(pieces))
    out += [[] for _ in range(p - len(out))]
    return out


def heads_placement(layout: Layout, world_size: int) -> list[list[tuple[int, int, int]]]:
    """Head parallelism (Ulysses) as a placement: every window cut into ``P`` near-equal row runs, one a rank.

    Run ``j`` of window ``w`` goes to rank ``(j + w) % P``. A split window's heads follow its rows
    (:func:`winsp.attention.split.head_bounds`), so every rank computes about ``H / P`` heads of every window; where
    ``P`` does not divide the head count, the rotation hands the extra heads to a different rank in each window. A
    window with fewer rows than ranks is shared by as many ranks as it has rows.
    """
    p = _check_world_size(world_size)
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]
    for w, count in enumerate(layout.token_counts.tolist()):
        cuts = [j * count // p for j in range(p + 1)]
        for j in range(p):
            if cuts[j + 1] > cuts[j]:
                out[(j + w) % p].append((w, cuts[j], cuts[j + 1]))
    return out


def work_balanced_windows(layout: Layout, world_size: int) -> list[list[int]]:
    """Whole windows placed on rows and attention pairs together (ascending window ids per rank).

    Windows by descending size (then id) each go to the rank whose larger normalised load (rows against ``N / P``,
    pairs against ``sum W^2 / P``) would be smallest after taking it, the lower rank id on ties.
    """
    p = _check_world_size(world_size)
    counts = layout.token_counts.astype(np.float64)
    rows_share = max(counts.sum() / p, 1.0)
    pairs_share = max((counts * counts).sum() / p, 1.0)
    rows, pairs = np.zeros(p), np.zeros(p)
    out: list[list[int]] = [[] for _ in range(p)]
    for w in np.lexsort((np.arange(counts.size), -counts)).tolist():
        c = counts[w]
        rank = int(np.argmin(np.maximum((rows + c) / rows_share, (pairs + c * c) / pairs_share)))
        rows[rank] += c
        pairs[rank] += c * c
        out[rank].append(w)
    return [sorted(ws) for ws in out]


@dataclass(frozen=True)
class Candidate:
    """One placement :func:`choose_placement` weighs: its name, ``Plan`` keyword, balance and predicted time."""

    name: str
    placement: dict
    row_imbalance: float
    attention_imbalance: float
    compute_s: float
    exchange_s: float

    @property
    def imbalance(self) -> float:
        return max(self.row_imbalance, self.attention_imbalance)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.exchange_s


def _candidate(name: str, placement: dict, counts: np.ndarray, p: int, costs: CostConstants) -> Candidate:
    """Balance and predicted time of a placement from its pieces, without building (and validating) a Plan."""
    if "rank_windows" in placement:
        pieces = [[(w, 0, int(counts[w])) for w in ws] for ws in placement["rank_windows"]]
    else:
        pieces = placement["rank_pieces"]
    flat = np.asarray([(r, w, a, b) for r, ps in enumerate(pieces) for w, a, b in ps], dtype=np.int64).reshape(-1, 4)
    rank, window = flat[:, 0], flat[:, 1]
    n, size = (flat[:, 3] - flat[:, 2]).astype(np.float64), counts[window].astype(np.float64)
    rows = np.bincount(rank, weights=n, minlength=p)
    pairs = np.bincount(rank, weights=n * size, minlength=p)
    shared = np.bincount(window, minlength=counts.size)[window] > 1
    moved = np.bincount(rank, weights=np.where(shared, 4.0 * n * (size - n) / size, 0.0), minlength=p)
    total_rows, total_pairs = float(counts.sum()), float((counts.astype(np.float64) ** 2).sum())
    exchange = (2 * costs.latency_s + moved.max() * costs.row_bytes * costs.byte_s) if moved.any() else 0.0
    return Candidate(name, placement,
                     row_imbalance=rows.max() * p / total_rows if total_rows else 1.0,
                     attention_imbalance=pairs.max() * p / total_pairs if total_pairs else 1.0,
                     compute_s=float((rows * costs.row_s + pairs * costs.pair_s).max()), exchange_s=float(exchange))


def placement_candidates(layout: Layout, world_size: int, costs: CostConstants = DEFAULT_COSTS,
                         allow_split: bool = True) -> list[Candidate]:
    """Every placement :func:`choose_placement` weighs for ``layout`` (whole windows only without ``allow_split``)."""
    p = _check_world_size(world_size)
    counts = layout.token_counts
    made: dict[str, dict[str, list]] = {"lpt": {"rank_windows": lpt_assign(counts.tolist(), p)}}
    if p > 1:
        made["work"] = {"rank_windows": work_balanced_windows(layout, p)}
        if allow_split:
            made["split"] = {"rank_pieces": split_placement(layout, p, costs)}
            made["mixed"] = {"rank_pieces": mixed_placement(layout, p)}
            made["heads"] = {"rank_pieces": heads_placement(layout, p)}
    return [_candidate(name, made[name], counts, p, costs) for name in PLACEMENTS if name in made]


def choose_placement(layout: Layout, world_size: int, costs: CostConstants = DEFAULT_COSTS,
                     allow_split: bool = True) -> dict:
    """The default planner's choice for one layout: ``{"rank_windows": ...}`` or ``{"rank_pieces": ...}``.

    The fastest predicted placement (compute plus exchange, :data:`PLACEMENTS` order on ties) among those whose
    rows and attention pairs both stay within :data:`BALANCE_CAP` of a perfect split; when none does (whole windows
    only, or fewer rows than ranks), the best balanced one.
    """
    cands = placement_candidates(layout, world_size, costs, allow_split)
    within = [c for c in cands if c.imbalance <= BALANCE_CAP]
    if within:
        return min(within, key=lambda c: c.time_s).placement
    return min(cands, key=lambda c: (round(c.imbalance, 9), c.time_s)).placement


def predicted_compute(plan: Plan, costs: CostConstants = DEFAULT_COSTS) -> float:
    """The slowest rank's predicted tokenwise plus attention time of one layer under ``plan``."""
    rows = np.asarray(plan.rank_rows, dtype=np.float64)
    pairs = np.asarray(plan.rank_attention, dtype=np.float64)
    return float((rows * costs.row_s + pairs * costs.pair_s).max())


def exchange_rows(plan: Plan) -> np.ndarray:
    """[P] rows' worth of data each rank sends (= receives) per layer in the in-window exchanges of split windows.

    A rank holding ``w`` of a split window's ``W`` rows computes about ``w / W`` of its heads; it sends q, k, v of its
    rows for the other heads and receives the output back: ``4 w (W - w) / W`` rows' worth.
    """
    out = np.zeros(plan.world_size, dtype=np.float64)
    for window, holders in plan.window_holders.items():
        total = float(plan.layout.token_counts[window])
        for rank, a, b in holders:
            out[rank] += 4.0 * (b - a) * (total - (b - a)) / total
    return out


def predicted_exchange(plan: Plan, costs: CostConstants = DEFAULT_COSTS) -> float:
    """Predicted time of ``plan``'s in-window exchanges in one layer (two all-to-alls; zero without split windows)."""
    if not plan.has_split_windows:
        return 0.0
    return 2 * costs.latency_s + float(exchange_rows(plan).max()) * costs.row_bytes * costs.byte_s


