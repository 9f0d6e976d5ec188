"""Planning time of a whole SeedVR2 3B schedule (32 layers, regular / shifted) on a cache miss, lpt vs locality.

Run from the repository root: ``OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_locality.py --benchmark-only -q``.
Goal: the locality planner plans a 4K x 121 frames schedule for 8 ranks in <= 250 ms (``plan_schedule``, layouts
and plan objects included, no token-id arrays: those are built on first use by the runtime for both planners).
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark")

import winsp  # noqa: E402
from winsp.planning.schedule import plan_schedule  # noqa: E402

SCHEDULE = [winsp.make_geometry(m, (4, 3, 3)) for m in ("regular", "shifted")] * 16
GRIDS = {"720p x45": (12, 45, 80), "1080p x45": (12, 68, 120), "4K x121": (31, 135, 240)}
LOCALITY_4K_GOAL_S = 0.250


@pytest.mark.parametrize("planner", ["lpt", "locality"])
@pytest.mark.parametrize("shape", list(GRIDS))
def test_plan_schedule_cache_miss(benchmark, goal_report, shape, planner):
    grid = GRIDS[shape]
    benchmark.group = f"plan_schedule, 32 layers, P = 8: {shape}"
    plans = benchmark(plan_schedule, [grid], SCHEDULE, 8, planner)
    assert len(plans) == 32 and plans[0] is plans[2]
    goal = LOCALITY_4K_GOAL_S if (planner == "locality" and shape == "4K x121") else None
    goal_report.goal(f"plan_schedule miss {shape} {grid}, {planner}, P=8", goal_report.median_seconds(benchmark), goal)
