"""The balance promise: every default plan keeps rows *and* attention within 5 % of a perfect split (planning only).

SeedVR2 windowing ((4, 3, 3) windows, regular and shifted layers), post-patch grids of the cases issue 21 lists, each
with at least 128 rows per rank; all layers of a 32-layer schedule.
"""

from __future__ import annotations

import math
import time
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import winsp
from winsp.geometry.layout import build_layout
from winsp.planning.balance import (
    BALANCE_CAP,
    heads_placement,
    mixed_placement,
    placement_candidates,
    work_balanced_windows,
)

SEEDVR2 = [winsp.make_geometry(m, (4, 3, 3)) for m in ("regular", "shifted")]
SCHEDULE = [SEEDVR2[i % 2] for i in range(32)]
# (name, post-patch grid: 1 + (frames - 1) / 4 latent frames, 16x spatial), degrees
CASES = [
    ("9x256x384", (3, 16, 24), (2, 4, 8)),
    ("720p image", (1, 45, 80), (2, 4, 8)),
    ("1080p image", (1, 68, 120), (4, 8)),
    ("480p x 21", (6, 30, 53), (8,)),
    ("720p x 45", (12, 45, 80), (8,)),
    ("4K x 121", (31, 135, 240), (8,)),
]
PROMISE = [pytest.param(grid, p, id=f"{name}-P{p}") for name, grid, ps in CASES for p in ps]


def _shares(plan):
    counts = plan.layout.token_counts.astype(np.float64)
    rows = max(plan.rank_rows) * plan.world_size / counts.sum()
    attention = max(plan.rank_attention) * plan.world_size / (counts * counts).sum()
    return rows, attention


@pytest.mark.parametrize("costs", ["default", "gloo-cpu"])
@pytest.mark.parametrize("grid, p", PROMISE)
def test_default_plans_balance_rows_and_attention(grid, p, costs):
    from winsp.planning.costs import DEFAULT_COSTS, GLOO_CPU_COSTS

    assert math.prod(grid) // p >= 128
    plans = winsp.planning.plan_schedule([grid], SCHEDULE, p, costs=GLOO_CPU_COSTS if costs == "gloo-cpu" else DEFAULT_COSTS)
    for plan in {id(pl): pl for pl in plans}.values():
        rows, attention = _shares(plan)  # recomputed here from the plan's per-rank figures
        assert rows <= BALANCE_CAP and attention <= BALANCE_CAP, (plan.layout.geometry, rows, attention)
        assert plan.imbalance == pytest.approx(max(rows, attention))
        assert plan.imbalance == max(plan.row_imbalance, plan.attention_imbalance)


def test_the_issues_unbalanced_cases_were_whole_windows():
    """480p x 21 at P = 8: LPT's shifted layer gives one rank 1.58x the mean attention; the default does not."""
    lpt = winsp.planning.plan_schedule([(6, 30, 53)], SEEDVR2, 8, "lpt")[1]
    assert lpt.attention_imbalance > 1.5 and lpt.row_imbalance < 1.05 and lpt.imbalance == lpt.attention_imbalance
    assert winsp.planning.plan_schedule([(6, 30, 53)], SEEDVR2, 8)[1].imbalance <= BALANCE_CAP


def test_planning_4k_x_121_at_p8_is_fast():
    grid = (31, 135, 240)
    winsp.planning.plan_schedule([grid], SCHEDULE, 8)  # warm imports
    start = time.process_time()
    winsp.planning.plan_schedule([grid], SCHEDULE, 8)
    assert time.process_time() - start < 1.0


@settings(max_examples=30, deadline=None)
@given(grid=st.tuples(st.integers(1, 8), st.integers(2, 40), st.integers(2, 40)), p=st.integers(2, 9),
       shifted=st.booleans())
def test_mixed_placement_balances_both_exactly(grid, p, shifted):
    lay = build_layout([grid], SEEDVR2[int(shifted)])
    plan = winsp.planning.Plan(lay, p, rank_pieces=mixed_placement(lay, p))  # Plan checks the pieces tile every window
    counts = lay.token_counts
    assert len(plan.window_holders) <= 2 * (p - 1)
    n, largest = lay.num_tokens, int(counts.max())
    if n >= 16 * p:
        # rows within rounding; pairs within two rows' worth of the largest window
        assert max(plan.rank_rows) <= math.ceil(n / p) + p
        assert max(plan.rank_attention) <= (counts.astype(np.int64) ** 2).sum() / p + (2 + p) * largest


@pytest.mark.parametrize("grid", [(6, 30, 53), (12, 45, 80)])
def test_whole_windows_on_rows_and_pairs(grid):
    lay = build_layout([grid], SEEDVR2[1])
    placed = work_balanced_windows(lay, 8)
    plan = winsp.planning.Plan(lay, 8, rank_windows=placed)
    assert not plan.has_split_windows
    assert plan.attention_imbalance <= winsp.planning.Plan(lay, 8).attention_imbalance


def test_candidates_are_the_documented_placements():
    lay = build_layout([(3, 16, 24)], SEEDVR2[0])
    names = [c.name for c in placement_candidates(lay, 2)]
    assert names == ["lpt", "work", "split", "mixed", "heads"]
    assert [c.name for c in placement_candidates(lay, 2, allow_split=False)] == ["lpt", "work"]
    heads = [c for c in placement_candidates(lay, 2) if c.name == "heads"][0]
    split = [c for c in placement_candidates(lay, 2) if c.name == "split"][0]
    assert heads.exchange_s > split.exchange_s > 0  # head parallelism moves every window, the split one window
    assert heads.placement["rank_pieces"] == heads_placement(lay, 2)


def test_whole_windows_only_keeps_the_best_balanced_whole_placement():
    lay = build_layout([(6, 30, 53)], SEEDVR2[1])
    plan = winsp.planning.Plan(lay, 8, **winsp.planning.balance.choose_placement(lay, 8, allow_split=False))
    assert not plan.has_split_windows
    assert plan.imbalance <= winsp.planning.Plan(lay, 8).imbalance


def test_refitted_costs_steer_auto_and_are_part_of_the_key():
    from winsp.planning.costs import DEFAULT_COSTS, CostConstants

    grid = [(1, 45, 80)]  # a 720p image: its regular layer splits one window at P = 2 under the default constants
    default = winsp.planning.plan_schedule(grid, SEEDVR2, 2)
    assert default[0].has_split_windows
    # a link so slow that any exchange costs more than a whole layer: only balanced placements are still weighed,
    # and among them the one that splits fewest rows' worth
    slow = CostConstants(row_s=DEFAULT_COSTS.row_s, pair_s=DEFAULT_COSTS.pair_s, byte_s=1.0, latency_s=1.0,
                         row_bytes=DEFAULT_COSTS.row_bytes)
    plans = winsp.planning.plan_schedule(grid, SEEDVR2, 2, costs=slow)
    assert plans[0].key != default[0].key
    assert all(p.imbalance <= BALANCE_CAP for p in plans)
    runtime = winsp.WindowRuntime(SEEDVR2, costs=slow)
    assert runtime.plans(grid)[0].key == winsp.planning.plan_schedule(grid, SEEDVR2, 1, costs=slow)[0].key
    with pytest.raises(ValueError, match="costs must be"):
        winsp.DiffusionParallelConfig(costs=1.0)
    with pytest.raises(ValueError, match="costs must be"):
        winsp.planning.plan_schedule(grid, SEEDVR2, 2, costs="fast")


def test_auto_takes_the_mixed_placement_where_only_it_balances():
    """The toy batch test_split.py runs exactly at P = 3 under auto: both layouts get the mixed placement."""
    from winsp.planning.balance import choose_placement

    for geometry in (winsp.FixedWindows((2, 5, 6)), winsp.FixedWindows((2, 5, 6), (1, 2, 3))):
        lay = build_layout([(1, 4, 7)], geometry)
        assert choose_placement(lay, 3) == {"rank_pieces": mixed_placement(lay, 3)}


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 60), min_size=1, max_size=12), p=st.integers(2, 9))
def test_mixed_placement_gives_each_rank_one_piece_per_window(counts, p):
    grid = (1, 1, sum(counts))
    cuts = np.concatenate([[0], np.cumsum(counts)])

    class Runs(winsp.WindowGeometry):  # windows of the given sizes along w
        fingerprint = "runs"
        version = 1

        def slices(self, g):
            return [(slice(0, 1), slice(0, 1), slice(int(a), int(b))) for a, b in pairwise(cuts)]

    lay = build_layout([grid], Runs())
    plan = winsp.planning.Plan(lay, p, rank_pieces=mixed_placement(lay, p))  # refuses two pieces of a window on one rank
    assert sum(plan.rank_rows) == lay.num_tokens


def test_cost_constants_refit_on_wall_times_recovers_known_constants():
    """``benchmarks/cost_model.py --fit-wall``: forward times made from known constants give those constants back."""
    from benchmarks.bench_split import plan_stats
    from benchmarks.cost_model import fit_wall, wall_features

    true = np.array([2e-4, 3e-8, 5e-6, 2e-3, 0.05])  # row, pair, row moved, collective, fixed
    records = []
    for grid in [(3, 16, 24), (1, 45, 80), (6, 30, 53)]:
        rec = {"clip": list(grid), "wall": {}, "stats": {}}
        for name in ("sp1", "lpt", "split", "heads", "auto"):
            p = 1 if name == "sp1" else 2
            stats = plan_stats(winsp.planning.plan_schedule([grid], SEEDVR2, p, "lpt" if name == "sp1" else name))
            rec["stats"][name] = stats
            rec["wall"][name] = [float(np.dot(true, wall_features(stats, p)))]
        records.append(rec)
    fit = fit_wall(records)
    got = np.array([fit["constants"][k] for k in ("row_s", "pair_s", "moved_row_s", "latency_s", "fixed_s")])
    np.testing.assert_allclose(got, true, rtol=1e-6)
    assert all(abs(model / measured - 1) < 1e-6 for _, measured, model in fit["points"])
    assert fit["costs"].row_s == pytest.approx(true[0])
