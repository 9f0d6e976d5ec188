"""Planning a hierarchy: one plan per layer over several stages, placed so that grid changes move few rows.

Pure functions of (stages, grids, world size, planner), the same on every rank with no communication; the runtime
(:class:`winsp.WindowRuntime`) caches and executes what they return. Each stage is planned like a flat schedule
(:func:`winsp.plan_schedule`); after a grid change the stage's plans are relabelled (a permutation of ranks, which
keeps their balance) so that as many input rows of the merge or split as possible already sit on the rank that needs
them, and the ``"locality"`` planner may also place the stage's windows where their input rows are.

Skip connections: a split cropped ``like`` stage s lands in the layout of stage s's last layer, where a skip kept
from the end of stage s (a U-net level's output) already lies (:meth:`winsp.WindowRuntime.landing_layer`).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Optional, Sequence

import numpy as np
import torch

from winsp.geometry.layout import Layout, check_grids
from winsp.planning.costs import DEFAULT_COSTS, CostConstants
from winsp.planning.grid_step import GridStep, StageRows
from winsp.planning.locality import SLACK_LIMIT
from winsp.planning.plan import Plan
from winsp.planning.schedule import plan_schedule
from winsp.planning.stages import Stage, check_stages, grid_sources, logical_ids, stage_grids

__all__ = ["staged_plans", "grid_change_rows", "affinity_placement",
           # re-exported from winsp.planning.stages / winsp.planning.grid_step, where they live
           "Stage", "GridStep", "StageRows", "grid_sources", "stage_grids", "logical_ids"]


def _relabel(prev: Plan, stage_plans: list[Plan], sources: np.ndarray) -> list[Plan]:
    """The stage's plans with ranks permuted so that most rows of the grid change stay where they are."""
    first = stage_plans[0]
    p = prev.world_size
    rows, cols = np.nonzero(sources >= 0)
    overlap = np.bincount(prev.token_owner[sources[rows, cols]] * p + first.token_owner[rows],
                          minlength=p * p).reshape(p, p)  # [old rank, new rank]
    perm = [-1] * p  # perm[new rank] = the rank its windows go to
    taken: set[int] = set()
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        old, new = divmod(int(flat), p)
        if perm[new] < 0 and old not in taken:
            perm[new], taken = old, taken | {old}
    if perm == list(range(p)):
        return stage_plans
    relabelled: dict[int, Plan] = {}
    out = []
    for plan in stage_plans:
        if id(plan) not in relabelled:
            pieces = [()] * p
            for new, ps in enumerate(plan.rank_pieces):  # whole windows or pieces of split windows alike
                pieces[perm[new]] = ps
            relabelled[id(plan)] = Plan(plan.layout, p, key=plan.key + (("ranks", tuple(perm)),),
                                        rank_pieces=pieces)
        out.append(relabelled[id(plan)])
    return out


def _owner_weights(window_of: np.ndarray, owner: np.ndarray, num_windows: int, world_size: int) -> np.ndarray:
    """[windows, P]: how many rows of each window have their input on each rank."""
    return np.bincount(window_of * world_size + owner, minlength=num_windows * world_size).reshape(
        num_windows, world_size)


def affinity_placement(layout: Layout, weights: np.ndarray, world_size: int) -> Optional[list[list[int]]]:
    """Windows of ``layout`` on the rank holding most of their input rows (``weights`` [windows, P]), under a cap.

    Largest windows first (most-attached first among equals), each to its best rank whose load stays under
    ``(1 + SLACK_LIMIT)`` x the ideal, else to the least-loaded rank. None if the result is less balanced than
    ``max(1 + SLACK_LIMIT, LPT's imbalance + 0.01)`` (the locality planner's promise).
    """
    counts = layout.token_counts
    ideal = max(int(counts.max()), -(-layout.num_tokens // world_size))
    cap = (1 + SLACK_LIMIT) * ideal
    load = np.zeros(world_size, dtype=np.int64)
    placed: list[list[int]] = [[] for _ in range(world_size)]
    strength = weights.max(axis=1) / np.maximum(counts, 1)
    for w in np.lexsort((np.arange(counts.size), -strength, -counts)):
        fits = load + counts[w] <= cap
        rank = int(np.argmax(np.where(fits, weights[w], -1))) if fits.any() else int(np.argmin(load))
        placed[rank].append(int(w))
        load[rank] += counts[w]
    lpt = Plan(layout, world_size).window_bound_imbalance
    if load.max() / ideal > max(1 + SLACK_LIMIT, lpt + 0.01):
        return None
    return [sorted(ws) for ws in placed]


def _rows_moved(prev: Plan, plans: Sequence[Plan], sources: np.ndarray) -> int:
    """Rows moved by the grid change into ``plans[0]`` plus every layout change between the stage's layers."""
    rows, cols = np.nonzero(sources >= 0)
    needed = np.unique(plans[0].token_owner[rows] * prev.layout.num_tokens + sources[rows, cols])
    moved = int((prev.token_owner[needed % prev.layout.num_tokens] != needed // prev.layout.num_tokens).sum())
    for a, b in pairwise(plans):
        if a is not b:
            moved += int((a.token_owner != b.token_owner).sum())
    return moved


def _place_stage(prev: Plan, plans: list[Plan], sources: np.ndarray, planner: str) -> list[Plan]:
    """The stage's plans, placed so that the grid change moves few rows.

    Every planner: the stage's ranks relabelled (:func:`_relabel`, balance unchanged). ``"locality"`` also tries
    placing each of the stage's layouts where its input rows are (the first after the previous stage, each next one
    after the one before) and keeps whichever moves fewer rows over the grid change and the stage's own layer changes.
    """
    relabelled = _relabel(prev, plans, sources)
    if planner != "locality":
        return relabelled
    p = prev.world_size
    rows = np.nonzero((sources >= 0).any(axis=1))[0]
    first = plans[0].layout
    # each destination row's input rank: the rank holding most of its children (ties: the first child's)
    owners = np.where(sources[rows] >= 0, prev.token_owner[np.maximum(sources[rows], 0)], -1)
    votes = np.stack([(owners == r).sum(axis=1) for r in range(p)], axis=1)
    weights = _owner_weights(first.window_of_position[first.position_of_token[rows]], votes.argmax(axis=1),
                             first.num_windows, p)
    placement = affinity_placement(first, weights, p)
    if placement is None:
        return relabelled
    chained: dict[int, Plan] = {}
    out: list[Plan] = []
    for plan in plans:
        if id(plan) not in chained:
            if out:
                lay = plan.layout
                weights = _owner_weights(lay.window_of_position[lay.position_of_token], out[-1].token_owner,
                                         lay.num_windows, p)
                placement = affinity_placement(lay, weights, p)
                if placement is None:
                    return relabelled
            # the placement follows from the plan it was placed after: that plan's key makes this key unique
            anchor = out[-1] if out else prev
            chained[id(plan)] = Plan(plan.layout, p, key=plan.key + (("affinity", anchor.key),),
                                     rank_windows=placement)
        out.append(chained[id(plan)])
    return min((relabelled, out), key=lambda ps: _rows_moved(prev, ps, sources))


def staged_plans(stages: Sequence[Stage], grids: Sequence[Sequence[int]], world_size: int,
                 planner: str = "lpt", *, split_windows: bool = False,
                 costs: CostConstants = DEFAULT_COSTS) -> tuple[Plan, ...]:
    """One plan per layer over all ``stages`` (what :meth:`WindowRuntime.plans` returns; pure, no process group).

    Each stage is planned as a flat schedule (:func:`winsp.plan_schedule` on its laid-out grids, so a single stage
    gives exactly the flat plans), then, after a grid change, its ranks are relabelled (and with ``"locality"``
    possibly re-placed) so that the grid change moves few rows. ``split_windows`` (a stage's own
    ``Stage.split_windows`` wins) lets ``"auto"`` / ``"split"`` cut windows across ranks; it is off by default here
    because adopted attention modules commonly take a ``score_mod`` (Swin's relative position bias), which a split
    window cannot run. ``costs``: the cost constants ``"auto"`` plans with (:func:`winsp.plan_schedule`).
    """
    stages = check_stages(stages)
    model, laid = stage_grids(stages, grids)
    out: list[Plan] = []
    for s, st in enumerate(stages):
        split = split_windows if st.split_windows is None else st.split_windows
        plans = plan_schedule(laid[s], st.layers, world_size, planner, split_windows=split, costs=costs)
        if s and st.changes_grid and world_size > 1:
            sources, _ = grid_sources(st, model[s - 1], laid[s - 1], model[s], laid[s])
            plans = _place_stage(out[-1], plans, sources, planner)
        out.extend(plans)
    return tuple(out)


def grid_change_rows(stages: Sequence[Stage], grids: Sequence[Sequence[int]], world_size: int,
                     planner: str = "lpt") -> list[tuple[int, int, int]]:
    """For each grid change of a forward: ``(stage, rows to_grid moves between ranks, rows an all-gather of the same
    activations would move)``; the all-gather moves every row to every rank that does not hold it, ``N * (P - 1)``."""
    stages, grids = check_stages(stages), check_grids(grids)  # checked once here: the calls below take them as they are
    model, laid = stage_grids(stages, grids)
    plans = staged_plans(stages, grids, world_size, planner)
    starts = np.concatenate([[0], np.cumsum([len(st.layers) for st in stages])]).astype(int)
    out = []
    for s, st in enumerate(stages):
        if not st.changes_grid:
            continue
        landing = starts[st.like + 1] - 1 if st.like is not None else starts[s]
        sources, chunk = grid_sources(st, model[s - 1], laid[s - 1], model[s], laid[s])
        split = st.split != (1, 1, 1)
        step = GridStep.build(plans[starts[s] - 1], plans[landing], sources, chunk if split else None,
                              st.children if split else 1, 0, torch.device("cpu"))
        rows = sum(t * h * w for t, h, w in model[s - 1])
        out.append((s, step.rows_moved, rows * (world_size - 1)))
    return out

