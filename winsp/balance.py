"""Split windows where whole windows cannot balance: the contiguous cut and the whole-or-split choice.

Whole windows cap the speed-up when windows per rank are few (three windows on two ranks: 2 : 1). The *split*
placement instead cuts the layout's rows, in window order, into ``P`` ranges of equal predicted work (a row's
tokenwise work plus its window's attention pairs), so each rank gets a contiguous run of rows: whole windows in the
middle, and at each end possibly a piece of a window it shares with its neighbours. A cut that falls within ``SNAP``
of a window edge moves onto the edge (no split for a 2 % imbalance). A split window is computed head-parallel by
the ranks holding it (:mod:`winsp.split`), which moves ``4 w (W - w) / W`` rows' worth of bytes per rank holding
``w`` of its ``W`` rows: at most what Ulysses moves inside that small group.

:func:`choose_placement` is the default planner's rule, per layout: the LPT placement of whole windows, or the split
placement when the cost constants (:mod:`winsp.costs`) predict it is faster, exchange included, or when whole
windows would leave a rank more than ``BALANCE_CAP`` (5 %) over a perfect split. Everything is numpy
on the CPU and deterministic, so every rank chooses the same with no communication.
"""

from __future__ import annotations

import numpy as np

from .costs import DEFAULT_COSTS, CostConstants
from .layout import Layout
from .planner import Plan, _check_world_size, lpt_assign

__all__ = ["BALANCE_CAP", "SNAP", "split_placement", "choose_placement", "predicted_compute", "exchange_rows",
           "predicted_exchange"]

#: Whole windows that leave a rank more than this over a perfect split of the work are split even where the cost
#: constants call it a tie or a small loss (a 5 % imbalance against one exchange's latency on small inputs).
BALANCE_CAP = 1.05
#: A cut within this share of a rank's work from a window edge moves onto the edge (keeps the window whole).
SNAP = 0.02


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
    for start, end in zip(cuts, cuts[1:]):
        if end <= start:
            out.append([])
            continue
        first = int(np.searchsorted(offsets, start, side="right") - 1)
        last = int(np.searchsorted(offsets, end - 1, side="right") - 1)
        out.append([(w, int(max(start, offsets[w]) - offsets[w]), int(min(end, offsets[w + 1]) - offsets[w]))
                    for w in range(first, last + 1)])
    return out


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


def choose_placement(layout: Layout, world_size: int, costs: CostConstants = DEFAULT_COSTS,
                     allow_split: bool = True) -> dict:
    """The default planner's choice for one layout: ``{"rank_windows": ...}`` or ``{"rank_pieces": ...}``.

    Whole windows by LPT, unless splitting is allowed and either the split placement's predicted compute plus
    exchange is lower than LPT's predicted compute, or LPT leaves a rank more than :data:`BALANCE_CAP` over a
    perfect split and the split placement does better.
    """
    p = _check_world_size(world_size)
    whole = {"rank_windows": lpt_assign(layout.token_counts.tolist(), p)}
    if not allow_split or p == 1:
        return whole
    split = {"rank_pieces": split_placement(layout, p, costs)}
    whole_plan, split_plan = Plan(layout, p, **whole), Plan(layout, p, **split)
    t_whole = predicted_compute(whole_plan, costs)
    t_split = predicted_compute(split_plan, costs) + predicted_exchange(split_plan, costs)
    if t_split < t_whole:
        return split
    # the balance promise: no rank more than BALANCE_CAP over a perfect split where splitting can avoid it
    if whole_plan.imbalance > BALANCE_CAP and split_plan.imbalance < whole_plan.imbalance:
        return split
    return whole
