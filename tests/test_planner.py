"""LPT planner: the exact rule, determinism, plan data, and the fingerprinted LRU cache."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import winsp
from winsp.geometry.layout import build_layout
from winsp.planning.plan import PLANNER_VERSION, Plan, lpt_assign
from winsp.planning.schedule import PLANNER_VERSIONS, plan_schedule


def brute_force_lpt(counts, world_size):
    """The design's rule, stated as plainly as possible (quadratic, no heap)."""
    order = sorted(range(len(counts)), key=lambda w: (-counts[w], w))
    loads = [0] * world_size
    owned = [[] for _ in range(world_size)]
    for w in order:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owned[rank].append(w)
        loads[rank] += counts[w]
    return [sorted(ws) for ws in owned]


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 50), max_size=40), world_size=st.integers(1, 9))
def test_lpt_matches_the_rule_exactly(counts, world_size):
    assert lpt_assign(counts, world_size) == brute_force_lpt(counts, world_size)


def test_lpt_ties_and_empty_ranks():
    assert lpt_assign([5, 5, 5], 2) == [[0, 2], [1]]
    assert lpt_assign([3], 4) == [[0], [], [], []]
    assert lpt_assign([], 2) == [[], []]
    assert lpt_assign([1, 9, 4, 4], 2) == [[1], [0, 2, 3]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_lpt_rejects_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        lpt_assign([1, 2], bad)


def test_plan_data_for_the_720p_grid():
    geom = winsp.make_geometry("regular", (4, 3, 3))
    plan = Plan(build_layout([(12, 45, 80)], geom), 8)
    assert sum(plan.rank_token_counts) == 12 * 45 * 80
    assert plan.ideal_lower_bound == max(int(plan.layout.token_counts.max()), math.ceil(12 * 45 * 80 / 8))
    assert plan.window_bound_imbalance == max(plan.rank_token_counts) / plan.ideal_lower_bound
    assert 1 <= plan.imbalance <= max(plan.row_imbalance, plan.attention_imbalance)
    assert plan.row_imbalance == max(plan.rank_rows) * 8 / (12 * 45 * 80)
    ids = np.concatenate([plan.rank_token_ids(r) for r in range(8)])
    assert np.array_equal(np.sort(ids), np.arange(12 * 45 * 80))
    for r in range(8):
        windows = plan.rank_windows[r]
        assert list(windows) == sorted(windows)
        expected = np.concatenate([plan.layout.window_token_ids(w) for w in windows])
        assert np.array_equal(plan.rank_token_ids(r), expected)
        assert np.array_equal(plan.token_local_index[expected], np.arange(expected.size))
        assert (plan.token_owner[expected] == r).all()


def _plan(grids, geom, world_size):
    return plan_schedule(grids, [geom], world_size)[0]


def test_plans_are_deterministic_across_calls():
    geom = winsp.make_geometry("shifted", (4, 3, 3))
    a = _plan([(12, 68, 120), (5, 9, 7)], geom, 6)
    b = _plan([(12, 68, 120), (5, 9, 7)], geom, 6)
    assert a is not b and a.rank_windows == b.rank_windows and a.key == b.key


def test_plan_key_covers_degree_grid_geometry_and_versions():
    regular, shifted = winsp.make_geometry("regular", (4, 3, 3)), winsp.make_geometry("shifted", (4, 3, 3))
    base = _plan([(12, 45, 80)], regular, 4)
    assert _plan([(12, 45, 80)], regular, 4).key == base.key
    variants = [
        _plan([(12, 45, 80)], regular, 8),
        _plan([(12, 45, 81)], regular, 4),
        _plan([(12, 45, 80), (1, 2, 2)], regular, 4),
        _plan([(12, 45, 80)], shifted, 4),
        _plan([(12, 45, 80)], winsp.make_geometry("regular", (4, 3, 2)), 4),
    ]

    class V2(winsp.SeedVR2Windows):
        version = 2

    variants.append(_plan([(12, 45, 80)], V2((4, 3, 3)), 4))
    assert len({v.key for v in variants} | {base.key}) == 7
    assert base.key[-3:] == ("auto", PLANNER_VERSIONS["auto"], True)
    assert plan_schedule([(12, 45, 80)], [regular], 4, "lpt")[0].key[-2:] == ("lpt", PLANNER_VERSION)
    assert variants[0].world_size == 8 and len(variants[0].rank_windows) == 8


def test_schedule_shares_one_plan_per_geometry():
    regular, shifted = winsp.make_geometry("regular", (4, 3, 3)), winsp.make_geometry("shifted", (4, 3, 3))
    plans = plan_schedule([(5, 20, 30)], [regular, shifted, regular, shifted, shifted], 3)
    assert plans[0] is plans[2] and plans[1] is plans[3] is plans[4] and plans[0] is not plans[1]
    with pytest.raises(ValueError, match="unknown planner"):
        plan_schedule([(5, 20, 30)], [regular], 3, planner="greedy")
    with pytest.raises(ValueError, match="empty"):
        plan_schedule([(5, 20, 30)], [], 3)


def test_given_placement_is_used_and_checked():
    lay = winsp.geometry.build_layout([(4, 8, 8)], winsp.FixedWindows((2, 4, 4)))  # 8 windows
    plan = Plan(lay, 2, rank_windows=[[7, 0, 3], [1, 2, 4, 5, 6]])
    assert plan.rank_windows == ((7, 0, 3), (1, 2, 4, 5, 6))
    expected = np.concatenate([lay.window_token_ids(w) for w in (7, 0, 3)])
    assert np.array_equal(plan.rank_token_ids(0), expected)
    for bad in ([[0, 1, 2], [3, 4, 5, 6]], [[0, 1, 2, 3], [3, 4, 5, 6, 7]], [[0, 1, 2, 3, 4, 5, 6, 7]],
                [[0, 1, 2, 3], [4, 5, 6, 8]]):
        with pytest.raises(ValueError, match="rank_windows"):
            Plan(lay, 2, rank_windows=bad)


def test_lpt_refuses_non_integer_counts():
    with pytest.raises(ValueError, match=r"window_token_counts\[0\]"):
        lpt_assign([1.5, 2.0], 2)
    with pytest.raises(ValueError, match=r"window_token_counts\[1\]"):
        lpt_assign([1, True], 2)
    assert lpt_assign(np.array([3, 1, 2]), 2) == [[0], [1, 2]]
