"""Plans for a whole layer schedule: one :class:`~winsp.planning.plan.Plan` per layer, chosen by a named planner.

A placement may depend on the layouts around it (a locality-aware planner keeps rows where the previous layout put
them), so plans are made for the schedule, not for one geometry at a time. Layers with equal geometry share one plan
object, which is what tells the runtime that no redistribution is needed between them. Planning is pure and
deterministic: every rank computes the same plans with no communication. Caching is the runtime store's job.
"""

from __future__ import annotations

import functools
from itertools import pairwise
from typing import Sequence

from winsp.geometry.layout import build_layout, check_grids
from winsp.geometry.neighborhood import is_neighborhood
from winsp.geometry.windows import WindowGeometry
from winsp.planning.balance import choose_placement, heads_placement, split_placement
from winsp.planning.costs import DEFAULT_COSTS, CostConstants
from winsp.planning.locality import locality_placement
from winsp.planning.plan import PLANNER_VERSION, Plan, _check_world_size

__all__ = ["PLANNERS", "PLANNER_VERSIONS", "plan_schedule", "check_planner", "schedule_key"]

#: Planner names in the order they are documented; ``"auto"`` is the default.
PLANNERS: tuple[str, ...] = ("auto", "lpt", "locality", "split", "heads")
#: The version of each planner's rule, part of every plan key (bump when a rule's output changes).
PLANNER_VERSIONS: dict[str, int] = {"auto": 2, "lpt": PLANNER_VERSION, "locality": 2, "split": 1, "heads": 1}
#: The planners that share windows' rows between ranks (refused for a model whose attention takes score mods).
SPLITTING_PLANNERS: tuple[str, ...] = ("split", "heads")


def check_planner(planner: object) -> str:
    """``planner`` if it names a known planner, else a ValueError listing the known ones."""
    if not isinstance(planner, str) or planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; choose one of {list(PLANNERS)}")
    return planner


def _check_schedule(schedule: Sequence[WindowGeometry]) -> tuple[WindowGeometry, ...]:
    schedule = tuple(schedule)
    if not schedule:
        raise ValueError("schedule must list one window geometry per layer; it is empty")
    for i, geom in enumerate(schedule):
        if not isinstance(geom, WindowGeometry):
            raise ValueError(f"schedule[{i}] must be a WindowGeometry, got {type(geom).__name__}")
    return schedule


def schedule_key(grids: Sequence[Sequence[int]], schedule: Sequence[WindowGeometry], world_size: int,
                 planner: str = "auto", *, split_windows: bool = True, costs: CostConstants = DEFAULT_COSTS) -> tuple:
    """The identity of ``plan_schedule(grids, schedule, world_size, planner, split_windows=..., costs=...)``'s
    result."""
    return (check_grids(grids), tuple((g.fingerprint, g.version) for g in _check_schedule(schedule)),
            _check_world_size(world_size), check_planner(planner), PLANNER_VERSIONS[planner], bool(split_windows),
            _check_costs(costs))


def _check_costs(costs: object) -> CostConstants:
    if not isinstance(costs, CostConstants):
        raise ValueError(f"costs must be a winsp.planning.costs.CostConstants, got {type(costs).__name__}")
    return costs


def plan_schedule(
    grids: Sequence[Sequence[int]],
    schedule: Sequence[WindowGeometry],
    world_size: int,
    planner: str = "auto",
    *,
    split_windows: bool = True,
    costs: CostConstants = DEFAULT_COSTS,
) -> list[Plan]:
    """One plan per layer of ``schedule`` for a packed batch of ``grids`` on ``world_size`` ranks.

    Layers with equal geometry (equal fingerprints) get the same :class:`Plan` object. ``"auto"`` (the default)
    chooses per layout among whole windows, split windows and head parallelism: the fastest the cost constants
    predict among the placements that keep rows and attention within 5 % of a perfect split
    (:func:`winsp.planning.balance.choose_placement`). ``"lpt"`` places each layout's windows whole and independently by
    the LPT rule (:func:`winsp.lpt_assign`). ``"locality"`` places all the schedule's whole windows together so that
    few rows change rank between consecutive layers (:func:`winsp.planning.locality.locality_placement`); its plans
    depend on the whole schedule, and their keys say so. ``"split"`` always cuts the rows into equal contiguous runs
    (:func:`winsp.planning.balance.split_placement`), splitting the windows that straddle a cut. ``"heads"`` is head
    parallelism (Ulysses) in the same machinery: every window split over all ranks, each computing ``1 / P`` of its
    heads (:func:`winsp.planning.balance.heads_placement`). ``split_windows=False`` (a model whose attention takes a
    ``score_mod`` / ``mask_mod``) keeps ``"auto"`` on whole windows and refuses ``"split"`` and ``"heads"``.
    ``costs`` are the constants ``"auto"`` and ``"split"`` weigh work and exchanges with (default: SeedVR2 3B on an
    NVLink GPU node; ``benchmarks/cost_model.py --fit-wall`` refits them on measured wall time).
    """
    grids = check_grids(grids)
    schedule = _check_schedule(schedule)
    world_size = _check_world_size(world_size)
    planner = check_planner(planner)
    costs = _check_costs(costs)
    if any(is_neighborhood(g) for g in schedule):  # neighborhood layers: one shared block plan (winsp.planning.halo)
        return plan_with_neighborhoods(grids, schedule, world_size, planner, split_windows,
                                       functools.partial(plan_schedule, costs=costs), costs)
    if planner in SPLITTING_PLANNERS and not split_windows:
        raise ValueError(f'planner "{planner}" splits windows, but these windows are kept whole (split_windows=False: '
                         'a runtime built so, a request with score_mods=True, or a Stage(split_windows=False)): use '
                         'planner "auto", "lpt" or "locality", or allow splitting where no score_mod / mask_mod runs')
    version = PLANNER_VERSIONS[planner]
    distinct: dict[str, WindowGeometry] = {}
    for geom in schedule:
        distinct.setdefault(geom.fingerprint, geom)
    layouts = {fp: build_layout(grids, geom) for fp, geom in distinct.items()}
    if planner == "locality":
        placements = _locality(layouts, schedule, world_size)
        context: tuple = (tuple(g.fingerprint for g in schedule),)  # the placement depends on the neighbours
    elif planner == "auto":
        placements = {fp: choose_placement(lay, world_size, costs, allow_split=split_windows)
                      for fp, lay in layouts.items()}
        context = (bool(split_windows),) + (() if costs == DEFAULT_COSTS else (costs,))
    elif planner == "split":
        placements = {fp: {"rank_pieces": split_placement(lay, world_size, costs)} for fp, lay in layouts.items()}
        context = () if costs == DEFAULT_COSTS else (costs,)
    elif planner == "heads":
        placements = {fp: {"rank_pieces": heads_placement(lay, world_size)} for fp, lay in layouts.items()}
        context = ()
    else:
        placements = {fp: {"rank_windows": None} for fp in layouts}
        context = ()
    by_geometry: dict[str, Plan] = {}
    for fp, geom in distinct.items():
        key = (grids, geom.fingerprint, geom.version, world_size, planner, version) + context
        by_geometry[fp] = Plan(layouts[fp], world_size, key=key, **placements[fp])
    return [by_geometry[g.fingerprint] for g in schedule]


def plan_with_neighborhoods(grids, schedule, world_size: int, planner: str, split_windows: bool,
                            plan_windows, costs: CostConstants = DEFAULT_COSTS) -> list[Plan]:
    """Plans of a schedule with :class:`~winsp.Neighborhood` layers: they share one block plan
    (:func:`winsp.planning.halo.neighborhood_plan`, its cut weighed with ``costs``); the window layers are planned by
    ``plan_windows`` as a schedule alone."""
    from winsp.planning.halo import neighborhood_plan

    neighborhoods = list({g.fingerprint: g for g in schedule if is_neighborhood(g)}.values())
    shared = neighborhood_plan(grids, neighborhoods, world_size, costs)
    windows = [g for g in schedule if not is_neighborhood(g)]
    window_plans = iter(plan_windows(grids, windows, world_size, planner, split_windows=split_windows)
                        if windows else [])
    return [shared if is_neighborhood(g) else next(window_plans) for g in schedule]


def _locality(layouts: dict, schedule: tuple[WindowGeometry, ...], world_size: int) -> dict:
    """The locality placement of each distinct layout, minimising rows moved over the schedule's transitions."""
    index = {fp: i for i, fp in enumerate(layouts)}
    transitions: dict[tuple[int, int], int] = {}
    for prev, cur in pairwise(schedule):
        i, j = sorted((index[prev.fingerprint], index[cur.fingerprint]))
        if i != j:
            transitions[(i, j)] = transitions.get((i, j), 0) + 1
    placed = locality_placement(list(layouts.values()), transitions, world_size)
    return {fp: {"rank_windows": rw} for fp, rw in zip(layouts, placed, strict=True)}
