"""CPU benchmarks of winsp's core: planning, the one-time index build, and the local permutation.

Run from the repository root: ``OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_core.py --benchmark-only -q``.
At the end of the run a summary lists each median against its goal and prints the communication tables of
:mod:`comm_table`. Shapes are SeedVR2 3B's (4, 3, 3) windows at the post-patch grids of 720p x 45 frames,
1080p x 45 frames and 4K x 121 frames, planned for 8 ranks.

Goals: plan on a cache miss <= 10 ms, on a cache hit <= 50 us; a world-size-1 redistribution <= 1.3x a plain
``index_select`` with the same index. The index build has no goal and is reported as measured.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark")

import torch  # noqa: E402

import winsp  # noqa: E402
from winsp.comm.group import SPGroup  # noqa: E402
from winsp.comm.redistribute import Transition, redistribute_rows  # noqa: E402

try:  # pytest puts this folder on sys.path (rootdir-less "prepend" import mode)
    from comm_table import collect, tables_markdown
except ImportError:  # pragma: no cover - importlib import mode
    from benchmarks.comm_table import collect, tables_markdown

WORLD_SIZE = 8
NUM_WINDOWS = (4, 3, 3)
GEOMETRIES = {layout: winsp.make_geometry(layout, NUM_WINDOWS) for layout in ("regular", "shifted")}
GRIDS = {
    "720p": (12, 45, 80),
    "1080p": (12, 68, 120),
    "4K": (31, 135, 240),
}
MISS_GOAL_S = 10e-3
HIT_GOAL_S = 50e-6
PERMUTATION_GOAL_RATIO = 1.3


PLAN_CASES = [(shape, layout) for shape in GRIDS for layout in GEOMETRIES]


# ---- 1. planning ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, layout", PLAN_CASES)
def test_plan_cache_miss(benchmark, goal_report, shape, layout):
    grid, geometry = GRIDS[shape], GEOMETRIES[layout]
    benchmark.group = "plan: cache miss (plan_schedule, nothing cached)"

    def plan_fresh():
        return winsp.planning.plan_schedule([grid], [geometry], WORLD_SIZE)[0]

    plan = benchmark(plan_fresh)
    assert plan.world_size == WORLD_SIZE and sum(plan.rank_token_counts) == grid[0] * grid[1] * grid[2]
    goal_report.goal(f"plan miss {shape} {grid} {layout}, P={WORLD_SIZE}",
                     goal_report.median_seconds(benchmark), MISS_GOAL_S)


@pytest.mark.parametrize("shape, layout", PLAN_CASES)
def test_plan_cache_hit(benchmark, goal_report, shape, layout):
    grid, geometry = GRIDS[shape], GEOMETRIES[layout]
    benchmark.group = "plan: cache hit (the runtime store)"
    runtime = winsp.WindowRuntime([geometry])
    first = runtime.plans([grid])
    plans = benchmark(runtime.plans, [grid])
    assert plans is first and runtime.cache_info().misses == 1
    goal_report.goal(f"plan hit  {shape} {grid} {layout}, P={WORLD_SIZE}",
                     goal_report.median_seconds(benchmark), HIT_GOAL_S)


def build_rank0_indices(regular: winsp.planning.Plan, shifted: winsp.planning.Plan) -> None:
    """Every index rank 0 needs for a forward that alternates the two layouts, built from fresh plans.

    Both plans' local token ids for all ranks (scatter, and the per-token owner / local row maps behind them), both
    transitions' rank-0 send/receive indices as CPU tensors (what the first redistribution builds), and the final
    gather order.
    """
    for plan in (regular, shifted):
        for rank in range(plan.world_size):
            plan.rank_token_ids(rank)
    for src, dst in ((regular, shifted), (shifted, regular)):
        Transition(src, dst).for_rank(0).to(torch.device("cpu"))
    _ = shifted.gather_order


INDEX_BUILD_ROUNDS = {"720p": 10, "1080p": 10, "4K": 3}


@pytest.mark.parametrize("shape", list(GRIDS))
def test_index_build(benchmark, goal_report, shape):
    grid = GRIDS[shape]
    benchmark.group = "one-time index build after planning (rank 0, both layouts, both transitions)"

    def fresh_plans():
        plans = tuple(winsp.planning.plan_schedule([grid], [GEOMETRIES[layout]], WORLD_SIZE)[0] for layout in GEOMETRIES)
        return plans, {}

    benchmark.pedantic(build_rank0_indices, setup=fresh_plans, rounds=INDEX_BUILD_ROUNDS[shape], iterations=1)
    goal_report.goal(f"index build {shape} {grid}, P={WORLD_SIZE}", goal_report.median_seconds(benchmark), None)


# ---- 2. the local permutation -----------------------------------------------------------------------------------

PERMUTATION_GRID = (12, 45, 80)
PERMUTATION_CHANNELS = (64, 256)
_permutation_medians: dict[int, dict[str, float]] = {}


def permutation_inputs(channels: int):
    """A regular -> shifted transition at world size 1, its rank-0 gather index, and a float32 [N, channels] tensor."""
    src, dst = winsp.planning.plan_schedule([PERMUTATION_GRID], [GEOMETRIES["regular"], GEOMETRIES["shifted"]], 1)
    step = Transition(src, dst).for_rank(0).to(torch.device("cpu"))  # built once, outside the timing
    x = torch.randn(src.layout.num_tokens, channels, generator=torch.Generator().manual_seed(0))
    return step, step.send_index, x


@pytest.mark.parametrize("channels", PERMUTATION_CHANNELS)
@pytest.mark.parametrize("impl", ["index_select", "redistribute"])
def test_local_permutation(benchmark, goal_report, impl, channels):
    step, index, x = permutation_inputs(channels)
    group = SPGroup(None)
    benchmark.group = f"local permutation {PERMUTATION_GRID} x {channels} float32 (regular -> shifted, P=1)"
    if impl == "index_select":
        out = benchmark(x.index_select, 0, index)
    else:
        out = benchmark(redistribute_rows, x, step, group)
    assert torch.equal(out, x.index_select(0, index))
    median = goal_report.median_seconds(benchmark)
    if median is None:
        return
    pair = _permutation_medians.setdefault(channels, {})
    pair[impl] = median
    if len(pair) == 2:
        goal_report.goal(f"redistribute / index_select, {channels} channels",
                         pair["redistribute"] / pair["index_select"], PERMUTATION_GOAL_RATIO, unit="x")


# ---- 3. the communication tables --------------------------------------------------------------------------------

def test_comm_tables(benchmark, goal_report):
    benchmark.group = "communication tables (plans + count matrices for 4 shapes x P in 2, 4, 8)"
    text = benchmark.pedantic(tables_markdown, rounds=1, iterations=1)
    comm, balance = collect()
    for row in comm:
        assert 0 < row.rows_moved < row.tokens, row
        assert 0.1 < row.ratio < 0.5, row  # every token at most once, against Ulysses' four all-to-alls
    for row in balance:
        assert row.imbalance >= 1.0, row
    goal_report.text("communication and balance tables (benchmarks/comm_table.py)", text)
