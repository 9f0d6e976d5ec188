"""Plans for a whole layer schedule: one :class:`~winsp.planner.Plan` per layer, chosen by a named planner.

A placement may depend on the layouts around it (a locality-aware planner keeps rows where the previous layout put
them), so plans are made for the schedule, not for one geometry at a time. Layers with equal geometry share one plan
object, which is what tells the runtime that no redistribution is needed between them. Planning is pure and
deterministic: every rank computes the same plans with no communication. Caching is the runtime store's job.
"""

from __future__ import annotations

from typing import Sequence

from .balance import choose_placement, split_placement
from .geometry import WindowGeometry
from .layout import build_layout, check_grids
from .locality import locality_placement
from .neighborhood import is_neighborhood
from .planner import PLANNER_VERSION, Plan, _check_world_size

__all__ = ["PLANNERS", "PLANNER_VERSIONS", "plan_schedule", "check_planner", "schedule_key"]

#: Planner names in the order they are documented; ``"auto"`` is the default.
PLANNERS: tuple[str, ...] = ("auto", "lpt", "locality", "split")
#: The version of each planner's rule, part of every plan key (bump when a rule's output changes).
PLANNER_VERSIONS: dict[str, int] = {"auto": 1, "lpt": PLANNER_VERSION, "locality": 2, "split": 1}


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
                 planner: str = "auto", *, split_windows: bool = True) -> tuple:
    """The identity of ``plan_schedule(grids, schedule, world_size, planner, split_windows=...)``'s result."""
    return (check_grids(grids), tuple((g.fingerprint, g.version) for g in _check_schedule(schedule)),
            _check_world_size(world_size), check_planner(planner), PLANNER_VERSIONS[planner], bool(split_windows))


def plan_schedule(
    grids: Sequence[Sequence[int]],
    schedule: Sequence[WindowGeometry],
    world_size: int,
    planner: str = "auto",
    *,
    split_windows: bool = True,
) -> list[Plan]:
    """One plan per layer of ``schedule`` for a packed batch of ``grids`` on ``world_size`` ranks.

    Layers with equal geometry (equal fingerprints) get the same :class:`Plan` object. ``"auto"`` (the default)
    chooses per layout between LPT's whole windows and the split placement, whichever the cost constants predict is
    faster (:func:`winsp.balance.choose_placement`). ``"lpt"`` places each layout's windows whole and independently by
    the LPT rule (:func:`winsp.lpt_assign`). ``"locality"`` places all the schedule's whole windows together so that
    few rows change rank between consecutive layers (:func:`winsp.locality.locality_placement`); its plans depend on
    the whole schedule, and their keys say so. ``"split"`` always cuts the rows into equal contiguous runs
    (:func:`winsp.balance.split_placement`), splitting the windows that straddle a cut. ``split_windows=False`` (a
    model whose attention takes a ``score_mod`` / ``mask_mod``) keeps ``"auto"`` on whole windows and refuses
    ``"split"``.
    """
    grids = check_grids(grids)
    schedule = _check_schedule(schedule)
    world_size = _check_world_size(world_size)
    planner = check_planner(planner)
    if any(is_neighborhood(g) for g in schedule):  # neighborhood layers: one shared block plan (winsp.halo)
        return plan_with_neighborhoods(grids, schedule, world_size, planner, split_windows, plan_schedule)
    if planner == "split" and not split_windows:
        raise ValueError('planner "split" splits windows, but split_windows=False (the model declares a score_mod or '
                         'mask_mod): use planner "auto", "lpt" or "locality"')
    version = PLANNER_VERSIONS[planner]
    distinct: dict[str, WindowGeometry] = {}
    for geom in schedule:
        distinct.setdefault(geom.fingerprint, geom)
    layouts = {fp: build_layout(grids, geom) for fp, geom in distinct.items()}
    if planner == "locality":
        placements = _locality(layouts, schedule, world_size)
        context: tuple = (tuple(g.fingerprint for g in schedule),)  # the placement depends on the neighbours
    elif planner == "auto":
        placements = {fp: choose_placement(lay, world_size, allow_split=split_windows) for fp, lay in layouts.items()}
        context = (bool(split_windows),)
    elif planner == "split":
        placements = {fp: {"rank_pieces": split_placement(lay, world_size)} for fp, lay in layouts.items()}
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
                            plan_windows) -> list[Plan]:
    """Plans of a schedule with :class:`~winsp.Neighborhood` layers: they share one block plan
    (:func:`winsp.halo.neighborhood_plan`); the window layers are planned by ``plan_windows`` as a schedule alone."""
    from .halo import neighborhood_plan

    neighborhoods = list({g.fingerprint: g for g in schedule if is_neighborhood(g)}.values())
    shared = neighborhood_plan(grids, neighborhoods, world_size)
    windows = [g for g in schedule if not is_neighborhood(g)]
    window_plans = iter(plan_windows(grids, windows, world_size, planner, split_windows=split_windows)
                        if windows else [])
    return [shared if is_neighborhood(g) else next(window_plans) for g in schedule]


def _locality(layouts: dict, schedule: tuple[WindowGeometry, ...], world_size: int) -> dict:
    """The locality placement of each distinct layout, minimising rows moved over the schedule's transitions."""
    index = {fp: i for i, fp in enumerate(layouts)}
    transitions: dict[tuple[int, int], int] = {}
    for prev, cur in zip(schedule, schedule[1:]):
        i, j = sorted((index[prev.fingerprint], index[cur.fingerprint]))
        if i != j:
            transitions[(i, j)] = transitions.get((i, j), 0) + 1
    placed = locality_placement(list(layouts.values()), transitions, world_size)
    return {fp: {"rank_windows": rw} for fp, rw in zip(layouts, placed)}
