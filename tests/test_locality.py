"""The ``"locality"`` planner: a valid placement, deterministic, balanced within its promise, and moving few rows."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import winsp
from winsp.comm.redistribute import Transition
from winsp.geometry.layout import build_layout
from winsp.planning.locality import cut_weight, locality_placement, overlap_edges
from winsp.planning.plan import Plan
from winsp.planning.schedule import PLANNER_VERSIONS, PLANNERS, check_planner, plan_schedule, schedule_key

REG = winsp.make_geometry("regular", (4, 3, 3))
SHIFT = winsp.make_geometry("shifted", (4, 3, 3))
SEEDVR2 = [REG, SHIFT] * 4  # the 3B alternation, shortened (the placement only sees which layouts follow which)


def _moved(plans) -> int:
    """Rows that change rank over all transitions of a schedule's plans (read off the real count matrices)."""
    return sum(Transition(a, b).rows_moved for a, b in pairwise(plans) if a is not b)


def _balance_limit(plan_locality: Plan, plan_lpt: Plan) -> float:
    return max(1.05, plan_lpt.window_bound_imbalance + 0.01)


def _check_valid(plans, grids, world_size):
    for plan in plans:
        flat = sorted(w for ws in plan.rank_windows for w in ws)
        assert flat == list(range(plan.layout.num_windows))  # every window exactly once
        assert len(plan.rank_windows) == world_size
        assert plan.layout.grids == tuple(tuple(g) for g in grids)


def test_planner_registry():
    assert PLANNERS == ("auto", "lpt", "locality", "split", "heads")
    assert PLANNER_VERSIONS["lpt"] == winsp.planning.PLANNER_VERSION and PLANNER_VERSIONS["locality"] != PLANNER_VERSIONS["lpt"]
    assert check_planner("locality") == "locality"
    with pytest.raises(ValueError, match="unknown planner 'nearest'.*locality"):
        check_planner("nearest")
    grids = [(12, 45, 80)]
    assert schedule_key(grids, SEEDVR2, 4, "locality") != schedule_key(grids, SEEDVR2, 4, "lpt")


def test_plans_are_shared_per_geometry_and_keyed_by_the_schedule():
    grids = [(12, 45, 80)]
    plans = plan_schedule(grids, SEEDVR2, 4, "locality")
    assert plans[0] is plans[2] and plans[1] is plans[3] and plans[0] is not plans[1]
    lpt = plan_schedule(grids, SEEDVR2, 4, "lpt")
    assert plans[0].key != lpt[0].key and "locality" in plans[0].key
    # the same geometry in another schedule is planned with other neighbours: its key must differ
    other = plan_schedule(grids, [REG, winsp.FixedWindows((3, 9, 9), (1, 4, 4))], 4, "locality")
    assert other[0].key != plans[0].key


def test_deterministic():
    grids = [(12, 68, 120), (3, 18, 24)]
    a = plan_schedule(grids, SEEDVR2, 6, "locality")
    b = plan_schedule(grids, SEEDVR2, 6, "locality")
    assert [p.rank_windows for p in a] == [p.rank_windows for p in b]


def test_cut_weight_is_the_transition_rows_moved():
    grids = [(12, 45, 80), (2, 8, 30)]
    reg, shift = plan_schedule(grids, [REG, SHIFT], 4, "locality")
    edges = overlap_edges(reg.layout, shift.layout)
    assert int(edges[2].sum()) == reg.layout.num_tokens  # the overlaps partition the tokens
    assert cut_weight(edges, reg.window_owner, shift.window_owner) == Transition(reg, shift).rows_moved


@pytest.mark.parametrize("geoms", [(REG, SHIFT), (REG, winsp.FixedWindows((2, 5, 7), (1, 2, 3))),
                                   (winsp.FixedWindows((3, 4, 4)), SHIFT)], ids=["seedvr2", "reg-fixed", "fixed-shift"])
def test_overlap_edges_equal_token_level_counts(geoms):
    grids = [(5, 17, 23), (1, 6, 4), (3, 18, 24)]
    a, b = (build_layout(grids, g) for g in geoms)
    ea, eb, ew = overlap_edges(a, b)
    got = {(int(i), int(j)): int(w) for i, j, w in zip(ea, eb, ew)}
    # brute force: the window of every canonical token under each layout, counted per pair
    wa = a.window_of_position[a.position_of_token]
    wb = b.window_of_position[b.position_of_token]
    pairs, counts = np.unique(np.stack([wa, wb]), axis=1, return_counts=True)
    assert got == {(int(i), int(j)): int(c) for (i, j), c in zip(pairs.T, counts)}


@pytest.mark.parametrize("grid", [(12, 45, 80), (12, 68, 120), (12, 90, 160)], ids=["720p", "1080p", "1440p"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_large_grids_move_at_most_half_of_lpt_within_the_balance_promise(grid, world_size):
    loc = plan_schedule([grid], [REG, SHIFT], world_size, "locality")
    lpt = plan_schedule([grid], [REG, SHIFT], world_size, "lpt")
    _check_valid(loc, [grid], world_size)
    assert _moved(loc) <= 0.5 * _moved(lpt), (_moved(loc), _moved(lpt))
    for a, b in zip(loc, lpt):
        assert a.window_bound_imbalance <= _balance_limit(a, b), (a, b)


def test_4k_121_frames_at_8_ranks_moves_at_most_a_quarter():
    # counted on the overlap graph (equal to the count matrix, see above) to skip the 1M-token index build
    grid = (31, 135, 240)
    layouts = [build_layout([grid], REG), build_layout([grid], SHIFT)]
    placed = locality_placement(layouts, {(0, 1): 31}, 8)
    plans = [Plan(lay, 8, rank_windows=rw) for lay, rw in zip(layouts, placed)]
    moved = cut_weight(overlap_edges(*layouts), plans[0].window_owner, plans[1].window_owner)
    assert moved <= 0.25 * layouts[0].num_tokens, moved / layouts[0].num_tokens
    assert max(p.window_bound_imbalance for p in plans) <= 1.05


GRIDS = st.lists(st.tuples(st.integers(1, 9), st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=3)
SCHEDULES = st.sampled_from([
    [REG, SHIFT, REG, SHIFT],
    [SHIFT, REG, SHIFT],
    [REG],
    [REG, REG, SHIFT, SHIFT, REG],
    [REG, SHIFT, winsp.FixedWindows((2, 5, 7), (1, 2, 3)), REG],
])


@settings(max_examples=40, deadline=None)
@given(grids=GRIDS, schedule=SCHEDULES, world_size=st.integers(1, 9))
def test_any_batch_any_degree(grids, schedule, world_size):
    """Packed batches, ranks with no window, P above the window count: valid, balanced as promised, never worse."""
    loc = plan_schedule(grids, schedule, world_size, "locality")
    lpt = plan_schedule(grids, schedule, world_size, "lpt")
    _check_valid(loc, grids, world_size)
    assert _moved(loc) <= _moved(lpt)
    for a, b in zip(loc, lpt):
        assert a.window_bound_imbalance <= _balance_limit(a, b) + 1e-12, (a, b)


def test_more_ranks_than_windows_and_one_rank():
    grids = [(1, 4, 4), (1, 6, 4)]  # one window each, regular and shifted
    plans = plan_schedule(grids, [REG, SHIFT], 8, "locality")
    _check_valid(plans, grids, 8)
    assert sum(1 for ws in plans[0].rank_windows if not ws) == 6
    assert _moved(plans) == 0
    single = plan_schedule([(12, 45, 80)], SEEDVR2, 1, "locality")
    assert single[0].rank_windows == (tuple(range(single[0].layout.num_windows)),)


def test_locality_placement_rejects_bad_transitions():
    lay = build_layout([(3, 18, 24)], REG)
    with pytest.raises(ValueError, match="transition"):
        locality_placement([lay], {(0, 1): 1}, 2)
    with pytest.raises(ValueError, match="same batch"):
        overlap_edges(lay, build_layout([(3, 18, 25)], SHIFT))


# ---- exactness: the SeedVR2 DiT under planner="locality" equals lpt and the golden ------------------------------

def _grids(model, batch) -> list:
    """Post-patch grids of a DiT batch."""
    pt, ph, pw = model.config.patch_size
    return [(-(-t // pt), -(-h // ph), -(-w // pw)) for t, h, w in batch["vid_shape"].tolist()]


def _dit_rank_main(rank: int, world_size: int) -> dict:
    from tests.test_dit import run
    from tests.test_dit_parallel import PACKED, _batch, _golden_model

    model, inputs, expected = _golden_model()
    packed = _batch(model, PACKED, seed=1)
    out = {}
    for planner in ("lpt", "locality", "split"):
        runtime = model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size, planner=planner))
        golden = run(model, inputs)
        out[planner] = {"golden": golden, "packed": run(model, packed)}
        req = runtime.request(grids=[(5, 32, 56)], text_lengths=[17])
        out[planner]["placement"] = [req.plan(i).rank_windows for i in range(2)]
        out[planner]["keyed"] = planner in req.plan(0).key
        out[planner]["split"] = [runtime.plans(_grids(model, batch))[i].has_split_windows
                                 for batch in (inputs, packed) for i in range(2)]
    out["golden_err"] = (out["locality"]["golden"] - expected).abs().max().item()
    return out


def _check_dit_exactness(world_size: int) -> None:
    from winsp.testing import run_ranks

    results = run_ranks(_dit_rank_main, world_size, timeout=300.0)
    for rank, res in enumerate(results):
        assert res["locality"]["keyed"] and res["lpt"]["keyed"], rank
        # the two planners really place windows differently on this input (else the test would prove nothing)
        assert res["locality"]["placement"] != res["lpt"]["placement"], rank
        assert res["golden_err"] <= 1e-4, (rank, res["golden_err"])
        assert any(res["split"]["split"]), rank  # the split planner really splits windows here
        for what in ("golden", "packed"):
            for planner in ("locality", "split"):
                diff = (res[planner][what] - res["lpt"][what]).abs().max().item()
                assert diff <= 1e-4, (rank, planner, what, diff)
            assert torch.allclose(res["locality"][what], results[0]["locality"][what], atol=1e-6, rtol=0), rank


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_dit_locality_equals_lpt_and_golden(world_size):
    _check_dit_exactness(world_size)


@pytest.mark.multirank
@pytest.mark.large_world
@pytest.mark.parametrize("world_size", [6, 8])
def test_dit_locality_equals_lpt_and_golden_large(world_size):
    _check_dit_exactness(world_size)
