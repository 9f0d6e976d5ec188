"""Plans for a whole layer schedule: one :class:`~winsp.planner.Plan` per layer, chosen by a named planner.

A placement may depend on the layouts around it (a locality-aware planner keeps rows where the previous layout put
them), so plans are made for the schedule, not for one geometry at a time. Layers with equal geometry share one plan
object, which is what tells the runtime that no redistribution is needed between them. Planning is pure and
deterministic: every rank computes the same plans with no communication. Caching is the runtime store's job.
"""

from __future__ import annotations

from typing import Sequence

from .geometry import WindowGeometry
from .layout import build_layout, check_grids
from .planner import PLANNER_VERSION, Plan, _check_world_size

__all__ = ["PLANNERS", "PLANNER_VERSIONS", "plan_schedule", "check_planner", "schedule_key"]

#: Planner names in the order they are documented; ``"lpt"`` is the default.
PLANNERS: tuple[str, ...] = ("lpt",)
#: The version of each planner's rule, part of every plan key (bump when a rule's output changes).
PLANNER_VERSIONS: dict[str, int] = {"lpt": PLANNER_VERSION}


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
                 planner: str = "lpt") -> tuple:
    """The identity of ``plan_schedule(grids, schedule, world_size, planner)``'s result (a cache key)."""
    return (check_grids(grids), tuple((g.fingerprint, g.version) for g in _check_schedule(schedule)),
            _check_world_size(world_size), check_planner(planner), PLANNER_VERSIONS[planner])


def plan_schedule(
    grids: Sequence[Sequence[int]],
    schedule: Sequence[WindowGeometry],
    world_size: int,
    planner: str = "lpt",
) -> list[Plan]:
    """One plan per layer of ``schedule`` for a packed batch of ``grids`` on ``world_size`` ranks.

    Layers with equal geometry (equal fingerprints) get the same :class:`Plan` object. ``"lpt"`` places each
    layout's windows independently by the LPT rule (:func:`winsp.lpt_assign`).
    """
    grids = check_grids(grids)
    schedule = _check_schedule(schedule)
    world_size = _check_world_size(world_size)
    planner = check_planner(planner)
    version = PLANNER_VERSIONS[planner]
    by_geometry: dict[str, Plan] = {}
    for geom in schedule:
        if geom.fingerprint not in by_geometry:
            key = (grids, geom.fingerprint, geom.version, world_size, planner, version)
            by_geometry[geom.fingerprint] = Plan(build_layout(grids, geom), world_size, key=key)
    return [by_geometry[g.fingerprint] for g in schedule]
