"""LPT planner: the exact rule, determinism, plan data, and the fingerprinted LRU cache."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import winsp
from winsp.planner import PLANNER_VERSION, Plan, PlanCache, lpt_assign
from winsp.layout import build_layout


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
    assert plan.imbalance == max(plan.rank_token_counts) / plan.ideal_lower_bound
    ids = np.concatenate([plan.rank_token_ids(r) for r in range(8)])
    assert np.array_equal(np.sort(ids), np.arange(12 * 45 * 80))
    for r in range(8):
        windows = plan.rank_windows[r]
        assert list(windows) == sorted(windows)
        expected = np.concatenate([plan.layout.window_token_ids(w) for w in windows])
        assert np.array_equal(plan.rank_token_ids(r), expected)
        assert np.array_equal(plan.token_local_index[expected], np.arange(expected.size))
        assert (plan.token_owner[expected] == r).all()


def test_plans_are_deterministic_across_fresh_caches():
    geom = winsp.make_geometry("shifted", (4, 3, 3))
    a = PlanCache().get([(12, 68, 120), (5, 9, 7)], geom, 6)
    b = PlanCache().get([(12, 68, 120), (5, 9, 7)], geom, 6)
    assert a.rank_windows == b.rank_windows and a.key == b.key


def test_cache_key_covers_degree_grid_geometry_and_versions():
    cache = PlanCache(maxsize=32)
    regular, shifted = winsp.make_geometry("regular", (4, 3, 3)), winsp.make_geometry("shifted", (4, 3, 3))
    base = cache.get([(12, 45, 80)], regular, 4)
    assert cache.get([(12, 45, 80)], regular, 4) is base
    assert cache.cache_info().hits == 1 and cache.cache_info().misses == 1
    variants = [
        cache.get([(12, 45, 80)], regular, 8),
        cache.get([(12, 45, 81)], regular, 4),
        cache.get([(12, 45, 80), (1, 2, 2)], regular, 4),
        cache.get([(12, 45, 80)], shifted, 4),
        cache.get([(12, 45, 80)], winsp.make_geometry("regular", (4, 3, 2)), 4),
    ]

    class V2(winsp.SeedVR2Windows):
        version = 2

    variants.append(cache.get([(12, 45, 80)], V2((4, 3, 3)), 4))
    assert all(v is not base for v in variants)
    assert len({v.key for v in variants} | {base.key}) == 7
    assert base.key[-1] == PLANNER_VERSION
    assert variants[0].world_size == 8 and len(variants[0].rank_windows) == 8


def test_cache_is_lru_bounded():
    cache = PlanCache(maxsize=2)
    geom = winsp.make_geometry("regular", (4, 3, 3))
    a = cache.get([(2, 8, 8)], geom, 2)
    cache.get([(2, 8, 9)], geom, 2)
    cache.get([(2, 8, 8)], geom, 2)  # touch a: now most recent
    cache.get([(2, 8, 10)], geom, 2)  # evicts (2, 8, 9)
    info = cache.cache_info()
    assert info.currsize == 2 and info.maxsize == 2
    assert cache.get([(2, 8, 8)], geom, 2) is a
    misses = cache.cache_info().misses
    cache.get([(2, 8, 9)], geom, 2)
    assert cache.cache_info().misses == misses + 1
    with pytest.raises(ValueError, match="maxsize"):
        PlanCache(0)
