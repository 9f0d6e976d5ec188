"""Split windows: plans that share a window's rows between ranks, and their exact head-parallel attention."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import winsp
from winsp.attention.split import head_bounds
from winsp.comm.redistribute import Transition
from winsp.geometry.layout import build_layout
from winsp.planning.balance import choose_placement, split_placement
from winsp.testing import run_ranks

GEOMETRIES = [winsp.FixedWindows((2, 5, 6)), winsp.FixedWindows((2, 5, 6), (1, 2, 3))]
# a packed batch with samples of very different sizes, and one with fewer rows than some worlds have ranks
BATCHES = {
    "packed": ([(3, 10, 12), (1, 3, 2), (2, 7, 9)], [5, 3, 8]),
    "tiny": ([(1, 1, 3)], [2]),
    "few": ([(3, 16, 24), (1, 4, 6)], [7, 3]),  # SeedVR2 windows of a 9x256x384 clip: 3 windows, auto splits them
    "mixed": ([(1, 4, 7)], [4]),  # at P = 3 auto takes the mixed placement (rows and pairs balanced together)
}
SEEDVR2 = [winsp.make_geometry("regular", (4, 3, 3)), winsp.make_geometry("shifted", (4, 3, 3))]


def _layout(grids, geometry=GEOMETRIES[0]):
    return build_layout(grids, geometry)


# ---- plans --------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(grid=st.tuples(st.integers(1, 4), st.integers(1, 12), st.integers(1, 12)), p=st.integers(1, 9),
       shifted=st.booleans())
def test_split_placement_is_contiguous_and_balanced(grid, p, shifted):
    lay = _layout([grid], GEOMETRIES[int(shifted)])
    plan = winsp.planning.Plan(lay, p, rank_pieces=split_placement(lay, p))
    positions = np.concatenate([plan.rank_positions(r) for r in range(p)])
    assert np.array_equal(positions, np.arange(lay.num_tokens))  # rank after rank, in window order
    n = lay.num_tokens
    assert sum(plan.rank_rows) == n
    if n >= 8 * p:  # rows per rank dominate the rounding: within the snap of equal work
        assert plan.row_imbalance <= 1.2


def test_plan_reports_rows_attention_and_both_bounds():
    lay = build_layout([(1, 6, 6)], winsp.FixedWindows((1, 3, 3)))  # 4 windows of 9 tokens
    lpt = winsp.planning.Plan(lay, 3)
    assert lpt.rank_rows == (18, 9, 9) and lpt.rank_attention == (162, 81, 81)
    assert lpt.imbalance == pytest.approx(18 / 12) == lpt.row_imbalance == lpt.window_bound_imbalance
    split = winsp.planning.Plan(lay, 3, rank_pieces=[[(0, 0, 9), (1, 0, 3)], [(1, 3, 9), (2, 0, 6)], [(2, 6, 9), (3, 0, 9)]])
    assert split.rank_rows == (12, 12, 12) and split.imbalance == 1.0 == split.row_imbalance
    assert split.window_holders == {1: ((0, 0, 3), (1, 3, 9)), 2: ((1, 0, 6), (2, 6, 9))}
    assert split.rank_windows == ((0,), (), (3,))
    assert list(split.window_owner) == [0, 0, 1, 2]


@pytest.mark.parametrize("pieces, match", [
    ([[(0, 0, 9), (1, 0, 9), (2, 0, 9)], [(3, 0, 8)]], "not covered"),
    ([[(0, 0, 9), (1, 0, 9), (2, 0, 9), (3, 2, 4)], [(3, 0, 9)]], "overlap"),
    ([[(0, 0, 9), (1, 0, 9), (2, 0, 10)], [(3, 0, 9)]], "non-empty row range"),
    ([[(0, 0, 9)]], "2 ranks"),
    ([[(0, 0, 4), (0, 4, 9), (1, 0, 9)], [(2, 0, 9), (3, 0, 9)]], "two pieces of window 0"),
])
def test_bad_pieces_are_refused(pieces, match):
    with pytest.raises(ValueError, match=match):
        winsp.planning.Plan(build_layout([(1, 6, 6)], winsp.FixedWindows((1, 3, 3))), 2, rank_pieces=pieces)


def test_head_bounds_tile_the_heads_in_proportion():
    for rows, heads, cuts in [(10, 4, [0, 3, 10]), (7, 3, [0, 1, 2, 7]), (5, 8, [0, 5])]:
        spans = [head_bounds(a, b, rows, heads) for a, b in pairwise(cuts)]
        assert spans[0][0] == 0 and spans[-1][1] == heads
        assert all(x[1] == y[0] and x[0] <= x[1] for x, y in pairwise(spans))
        for (h0, h1), a, b in zip(spans, cuts, cuts[1:]):
            assert abs((h1 - h0) - heads * (b - a) / rows) <= 1


def test_auto_splits_only_where_whole_windows_cannot_balance():
    few = build_layout([(3, 16, 24)], winsp.make_geometry("regular", (4, 3, 3)))  # 9x256x384: 3 windows
    assert "rank_pieces" in choose_placement(few, 2)
    assert "rank_windows" in choose_placement(few, 2, allow_split=False)
    many = build_layout([(12, 45, 80)], winsp.make_geometry("regular", (4, 3, 3)))  # 720p x 45: 27 windows
    plan = winsp.planning.Plan(many, 2, **choose_placement(many, 2))
    assert not plan.has_split_windows and plan.imbalance < 1.05


def test_split_planner_refuses_a_model_with_score_mods():
    with pytest.raises(ValueError, match="split_windows=False"):
        winsp.planning.plan_schedule([(1, 6, 6)], GEOMETRIES, 2, "split", split_windows=False)


def test_transitions_between_split_and_whole_layouts_move_each_row_once():
    grids = BATCHES["packed"][0]
    split = winsp.planning.plan_schedule(grids, GEOMETRIES, 3, "split")
    whole = winsp.planning.plan_schedule(grids, GEOMETRIES, 3, "lpt")
    assert split[0].has_split_windows
    for a, b in [(split[0], whole[1]), (whole[0], split[1]), (split[0], split[1])]:
        t = Transition(a, b)
        assert t.count_matrix.sum() == a.layout.num_tokens
        assert list(t.count_matrix.sum(axis=1)) == list(a.rank_rows)


# ---- exact attention on ranks ---------------------------------------------------------------------------------

HEADS, HEAD_DIM = 3, 4


def _inputs(grids, text_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(math.prod(grid) for grid in grids)
    x = torch.randn(n, HEADS * HEAD_DIM, dtype=torch.float64, generator=g)
    txt = torch.randn(sum(text_lengths), HEADS * HEAD_DIM, dtype=torch.float64, generator=g)
    w = torch.randn(4, HEADS * HEAD_DIM, HEADS * HEAD_DIM, dtype=torch.float64, generator=g) / 4
    return x, txt, w


def _forward(runtime, grids, text_lengths, x, txt, w, layers=(0, 1, 0)):
    """Three attention layers over two layouts (split -> whole / split -> split and back), text included."""
    req = runtime.request(grids=grids, text_lengths=text_lengths, dtype=torch.float64)
    h = req.scatter(x, layers[0])
    shape = (-1, HEADS, HEAD_DIM)
    for layer in layers:
        h = req.to_layer(h, layer)
        q, k, v = (torch.tanh(h @ w[j]).view(shape) for j in range(3))
        qt, kt, vt = (torch.tanh(txt @ w[j]).view(shape) for j in range(3))
        out, txt_out = req.attention(q, k, v, qt, kt, vt, layer=layer)
        h = h + out.reshape(h.shape) @ w[3]
        txt = txt + txt_out.reshape(txt.shape)
    return req.gather(h), txt


def _schedule(batch):
    return SEEDVR2 if batch == "few" else GEOMETRIES


def _rank_main(rank, world_size, planner, batch):
    grids, text_lengths = BATCHES[batch]
    x, txt, w = _inputs(grids, text_lengths)
    x.requires_grad_(True)
    w.requires_grad_(True)
    runtime = winsp.WindowRuntime(_schedule(batch), group=winsp.comm.SPGroup.world(), planner=planner)
    out, txt_out = _forward(runtime, grids, text_lengths, x, txt, w)
    out.square().sum().backward()
    winsp.sync_gradients([w], runtime)  # the gradient convention: every rank's share, averaged over the group
    grad_w = w.grad.clone()
    split = [runtime.plans(grids)[i].has_split_windows for i in range(2)]
    return out.detach(), txt_out.detach(), grad_w, split


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, planner, batch", [
    (3, "split", "packed"), pytest.param(4, "split", "tiny", marks=pytest.mark.slow), (2, "auto", "few"),
    (2, "heads", "few"), (3, "heads", "packed"), pytest.param(4, "heads", "packed", marks=pytest.mark.slow),  # 3 heads: uneven at 2, fewer than 4 ranks
    (3, "auto", "mixed"),
])
def test_split_windows_equal_one_rank(world_size, planner, batch):
    grids, text_lengths = BATCHES[batch]
    x, txt, w = _inputs(grids, text_lengths)
    x.requires_grad_(True)
    w.requires_grad_(True)
    ref_out, ref_txt = _forward(winsp.WindowRuntime(_schedule(batch)), grids, text_lengths, x, txt, w)
    ref_out.square().sum().backward()
    results = run_ranks(_rank_main, world_size, planner, batch, timeout=120)
    for out, txt_out, grad_w, split in results:
        assert any(split), split
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(txt_out, ref_txt.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_w, w.grad, rtol=1e-10, atol=1e-10)


def _score_mod_rank(rank, world_size):
    grids, text_lengths = BATCHES["few"]
    runtime = winsp.WindowRuntime(SEEDVR2, group=winsp.comm.SPGroup.world())
    out = {"auto_splits": runtime.plans(grids)[0].has_split_windows}
    req = runtime.request(grids=grids, text_lengths=text_lengths)
    q = torch.randn(req.layout(0).num_rows, HEADS, HEAD_DIM)
    t = torch.randn(sum(text_lengths), HEADS, HEAD_DIM)
    req.scatter(torch.zeros(sum(math.prod(g) for g in grids)), 0)
    try:
        req.attention(q, q, q, t, t, t, layer=0, score_mod=lambda s, h, qr, kr: s)
        out["error"] = None
    except ValueError as err:
        out["error"] = str(err)
    # a request that declares score mods gets whole windows from the default planner
    whole = runtime.request(grids=grids, text_lengths=text_lengths, score_mods=True)
    out["declared_splits"] = any(whole.plan(i).has_split_windows for i in range(2))
    return out


@pytest.mark.multirank
def test_score_mods_are_refused_on_split_layouts_and_avoided_when_declared():
    for res in run_ranks(_score_mod_rank, 2, timeout=60):
        assert res["auto_splits"]
        assert res["error"] is not None and "split_windows=False" in res["error"]
        assert not res["declared_splits"]


# ---- the split path's local fast paths ------------------------------------------------------------------------

def test_local_rows_of_whole_and_split_windows_are_slices_where_the_order_allows():
    from winsp.attention.split import SplitAttention, join_local_rows, split_local_rows

    lay = build_layout([(3, 16, 24)], SEEDVR2[0])  # 3 windows of 384 rows
    small = build_layout([(1, 6, 6)], winsp.FixedWindows((1, 3, 3)))  # 4 windows of 9 rows
    cases = [(winsp.planning.Plan(lay, 2, rank_pieces=split_placement(lay, 2)), ["whole_first", "split_first"]),
             (winsp.planning.Plan(small, 3, rank_pieces=[[(0, 0, 9), (1, 0, 3)], [(1, 3, 9), (2, 0, 9), (3, 0, 5)],
                                                [(3, 5, 9)]]), ["whole_first", "gather", "whole_first"])]
    for plan, orders in cases:
        for rank, order in enumerate(orders):
            split = SplitAttention.build(plan, rank, 4, (5,))
            assert split.row_order == order, (rank, plan.rank_pieces[rank])
            tensors = split.to("cpu")
            x = torch.arange(plan.rank_rows[rank] * 2, dtype=torch.float64).view(-1, 2)
            whole, pieces = split_local_rows(x, tensors)
            assert torch.equal(whole, x.index_select(0, tensors.whole_rows))
            assert torch.equal(pieces, x.index_select(0, tensors.split_rows))
            assert torch.equal(join_local_rows(whole, pieces, tensors), x)
    heads = winsp.planning.Plan(lay, 2, rank_pieces=winsp.planning.balance.heads_placement(lay, 2))
    assert SplitAttention.build(heads, 1, 4, (5,)).row_order == "whole_first"  # no whole window: all slices


def test_a_transition_that_keeps_every_row_in_place_does_nothing():
    from winsp.comm.redistribute import redistribute_rows

    # a 9x256x384 clip's shifted windows are its regular ones (the half-window shift moves no edge)
    plans = winsp.planning.plan_schedule([(3, 16, 24)], SEEDVR2, 2)
    assert plans[0] is not plans[1]
    step = Transition(plans[0], plans[1]).for_rank(0).to("cpu")
    assert step.keeps_rows
    x = torch.randn(plans[0].rank_rows[0], 3)
    assert redistribute_rows(x, step, winsp.comm.SPGroup(None)) is x
    lpt = winsp.planning.plan_schedule([(3, 10, 12)], GEOMETRIES, 2, "lpt")
    assert not Transition(lpt[0], lpt[1]).for_rank(0).to("cpu").keeps_rows
