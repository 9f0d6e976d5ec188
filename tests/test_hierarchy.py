"""Hierarchical requests: sharded grid changes (2 x 2 merge and its inverse), padding rows, skips across levels.

Checked against dense tensor code (torchvision's patch-merge order, zero padding past odd edges) at SP = 1, 2, 3 in
float64, forward and input gradient, on a packed batch of two different grids; plus the planning side: a grid change
moves only rows whose output lives elsewhere, and relabelling a stage's ranks keeps balance and never moves more.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import winsp
from winsp.comm.group import new_subgroup
from winsp.planning.hierarchy import (
    GridStep,
    Stage,
    _place_stage,
    _relabel,
    _rows_moved,
    grid_change_rows,
    grid_sources,
    stage_grids,
)
from winsp.planning.schedule import plan_schedule
from winsp.testing import run_ranks

ORDER = ((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))  # torchvision's x0, x1, x2, x3
GRIDS = [(3, 7, 5), (2, 4, 6)]
C = 3


def _stages():
    regular, shifted = winsp.SwinWindows((2, 3, 3)), winsp.SwinWindows((2, 3, 3), (1, 1, 1))
    return [Stage([regular, shifted]),                                    # layers 0, 1 (padded to whole windows)
            Stage([shifted], merge=(1, 2, 2), order=ORDER),              # layer 2: grids (3, 4, 3), (2, 2, 3)
            Stage([regular], split=(1, 2, 2), like=0, order=ORDER)]      # layer 3: back on stage 0's grids


def _dense_merge(x: torch.Tensor, grids) -> torch.Tensor:
    """torchvision's PatchMerging without norm/reduction: pad H, W to even, concatenate x0..x3 on channels."""
    out, start = [], 0
    for t, h, w in grids:
        v = x[start:start + t * h * w].reshape(t, h, w, -1)
        start += t * h * w
        v = torch.nn.functional.pad(v, (0, 0, 0, w % 2, 0, h % 2))
        v = torch.cat([v[:, 0::2, 0::2], v[:, 1::2, 0::2], v[:, 0::2, 1::2], v[:, 1::2, 1::2]], -1)
        out.append(v.reshape(-1, v.shape[-1]))
    return torch.cat(out)


def _down_up(sp: int, group=None, planner: str = "lpt") -> dict:
    config = winsp.DiffusionParallelConfig(ulysses_degree=sp, planner=planner)
    runtime = winsp.runtime.StagedRuntime.from_config(config, _stages(), group=group)
    torch.manual_seed(0)
    n = sum(t * h * w for t, h, w in GRIDS)
    x = torch.randn(n, C, dtype=torch.float64, requires_grad=True)
    w_merged = torch.randn(_dense_merge(x, GRIDS).shape, dtype=torch.float64)
    w_out = torch.randn(n, C, dtype=torch.float64)
    request = runtime.request(GRIDS)
    rows0 = request.scatter(x) * 2                  # layer 0's layout
    rows = request.to_layer(rows0, 1)               # stage 0's last layer: the skip of an unchanged U-net
    padding = int((~request.valid_rows).sum())
    merged = request.to_grid(rows, 1)
    stage1 = request.gather(merged)
    up = request.to_grid(merged, 2)                 # lands where that skip is: `up + rows` needs no move
    out = request.gather(request.to_layer(up + rows, 3) + request.to_layer(rows0, 3, source=0))
    loss = (stage1 * w_merged).sum() + (out * w_out).sum()
    loss.backward()
    winsp.sync_gradients([x], runtime)
    expected_x = x.detach().clone().requires_grad_(True)
    want_stage1, want_out = _dense_merge(expected_x * 2, GRIDS), expected_x * 6
    ((want_stage1 * w_merged).sum() + (want_out * w_out).sum()).backward()
    return {"stage1": (stage1 - want_stage1).abs().max().item(), "out": (out - want_out).abs().max().item(),
            "grad": (x.grad - expected_x.grad).abs().max().item(), "padding": padding,
            "layer": request.layer, "stage": request.stage}


def _sp2_and_sp3(rank: int, world_size: int) -> dict:
    groups = {2: new_subgroup([0, 1]), 3: new_subgroup([0, 1, 2])}  # every rank makes every subgroup, in order
    out = {sp: _down_up(sp, group) for sp, group in groups.items() if rank < sp}
    out["locality"] = _down_up(3, groups[3], "locality")
    return out


def test_merge_split_and_skip_equal_dense_code():
    """One world of 3 ranks: SP = 2 on ranks {0, 1}, then SP = 3 (one spawn for both: the machine is small)."""
    per_rank = run_ranks(_sp2_and_sp3, 3, timeout=240)
    for sp, results in ((1, [_down_up(1)]), (2, [r[2] for r in per_rank[:2]]), (3, [r[3] for r in per_rank]),
                        ("3, locality", [r["locality"] for r in per_rank])):
        for r in results:
            assert r["stage1"] < 1e-12 and r["out"] < 1e-12 and r["grad"] < 1e-12, (sp, r)
            assert (r["layer"], r["stage"]) == (3, 2)
        assert sum(r["padding"] for r in results) == 4 * 9 * 6 - 3 * 7 * 5 + 2 * 6 * 6 - 2 * 4 * 6  # padding rows


def test_stage_grids_merge_ceil_split_crop_and_pad():
    model, laid = stage_grids(_stages(), GRIDS)
    assert model == (tuple(GRIDS), ((3, 4, 3), (2, 2, 3)), tuple(GRIDS))
    assert laid == (((4, 9, 6), (2, 6, 6)), ((4, 6, 3), (2, 2, 3)), ((4, 9, 6), (2, 6, 6)))
    with pytest.raises(ValueError, match="stage 1.*share one laid-out grid"):
        stage_grids([Stage([winsp.SwinWindows((1, 2, 2))]),
                     Stage([winsp.SwinWindows((1, 2, 2)), winsp.SwinWindows((1, 2, 2), pad=False)], merge=(1, 2, 2))],
                    [(1, 6, 6)])


def test_grid_change_moves_only_rows_whose_output_is_elsewhere_and_relabel_helps():
    geom = winsp.SwinWindows((2, 7, 7), (1, 3, 3))
    stages = [Stage([winsp.SwinWindows((2, 7, 7)), geom]), Stage([winsp.SwinWindows((2, 7, 7))], merge=(1, 2, 2))]
    grids = [(4, 28, 28)]
    model, laid = stage_grids(stages, grids)
    sources, _ = grid_sources(stages[1], model[0], laid[0], model[1], laid[1])
    for world in (2, 3, 4):
        prev = plan_schedule(laid[0], stages[0].layers, world)[-1]
        plans = plan_schedule(laid[1], stages[1].layers, world)
        relabelled = _relabel(prev, plans, sources)
        steps = {name: GridStep.build(prev, ps[0], sources, None, 1, 0, torch.device("cpu"))
                 for name, ps in (("lpt", plans), ("relabelled", relabelled))}
        assert steps["relabelled"].rows_moved <= steps["lpt"].rows_moved
        assert steps["relabelled"].rows_moved < prev.layout.num_tokens * (world - 1) / world  # never all rows
        assert sorted(relabelled[0].rank_token_counts) == sorted(plans[0].rank_token_counts)  # same balance
    single = plan_schedule(laid[0], stages[0].layers, 1)[-1]
    step = GridStep.build(single, plan_schedule(laid[1], stages[1].layers, 1)[0], sources, None, 1, 0,
                          torch.device("cpu"))
    assert not step.network_exchange_required and step.rows_moved == 0


def test_locality_places_a_stage_where_its_input_rows_are():
    stages = [Stage([winsp.SwinWindows((2, 7, 7)), winsp.SwinWindows((2, 7, 7), (1, 3, 3))]),
              Stage([winsp.SwinWindows((2, 7, 7)), winsp.SwinWindows((2, 7, 7), (1, 3, 3))], merge=(1, 2, 2))]
    grids = [(8, 56, 56)]
    model, laid = stage_grids(stages, grids)
    sources, _ = grid_sources(stages[1], model[0], laid[0], model[1], laid[1])
    for world in (2, 4):
        prev = plan_schedule(laid[0], stages[0].layers, world, "locality")[-1]
        alone = plan_schedule(laid[1], stages[1].layers, world, "locality")
        placed = _place_stage(prev, alone, sources, "locality")
        assert _rows_moved(prev, placed, sources) <= _rows_moved(prev, alone, sources)
        assert max(p.window_bound_imbalance for p in placed) <= 1.05 + 1e-9
        moved = GridStep.build(prev, placed[0], sources, None, 1, 0, torch.device("cpu")).rows_moved
        assert moved < 0.15 * prev.layout.num_tokens, moved  # an all-gather would move N * (P - 1)


def test_to_grid_and_to_layer_refuse_wrong_stages():
    runtime = winsp.runtime.StagedRuntime(_stages())
    request = runtime.request(GRIDS)
    rows = request.scatter(torch.zeros(sum(t * h * w for t, h, w in GRIDS), 4))
    with pytest.raises(ValueError, match="another grid"):
        request.to_layer(rows, 2)
    with pytest.raises(ValueError, match="stage 2 follows stage 1"):
        request.to_grid(rows, 2)
    merged = request.to_grid(rows, 1)
    assert merged.shape[1] == 16
    with pytest.raises(ValueError, match="divisible by 4"):
        request.to_grid(merged[:, :6], 2)
    with pytest.raises(ValueError, match="cannot merge or split"):
        winsp.runtime.StagedRuntime([Stage([winsp.SwinWindows((1, 2, 2))], merge=(1, 2, 2))])
    with pytest.raises(ValueError, match="order must list every child"):
        Stage([winsp.SwinWindows((1, 2, 2))], merge=(1, 2, 2), order=((0, 0, 0),))


def _dense_merge_general(x: torch.Tensor, grid, factor, order) -> torch.Tensor:
    """Merge by ``factor`` with zero padding at the far edges, children's channels in ``order`` (dense reference)."""
    t, h, w = grid
    v = x.reshape(t, h, w, -1)
    pad = [(-g) % f for g, f in zip(grid, factor)]
    v = torch.nn.functional.pad(v, (0, 0, 0, pad[2], 0, pad[1], 0, pad[0]))
    return torch.cat([v[a::factor[0], b::factor[1], c::factor[2]] for a, b, c in order], -1).reshape(
        -1, len(order) * x.shape[-1])


@settings(max_examples=25, deadline=None)
@given(grid=st.tuples(st.integers(1, 5), st.integers(1, 7), st.integers(1, 7)),
       factor=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 2)), data=st.data())
def test_merge_and_split_by_any_factor_and_order(grid, factor, data):
    if factor == (1, 1, 1):
        factor = (1, 2, 1)
    children = [(a, b, c) for a in range(factor[0]) for b in range(factor[1]) for c in range(factor[2])]
    order = tuple(data.draw(st.permutations(children)))
    window = data.draw(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)))
    geometry = winsp.SwinWindows(window)
    runtime = winsp.runtime.StagedRuntime([Stage([geometry]), Stage([geometry], merge=factor, order=order),
                                   Stage([geometry], split=factor, like=0, order=order)])
    x = torch.randn(grid[0] * grid[1] * grid[2], 2, dtype=torch.float64)
    request = runtime.request([grid])
    merged = request.to_grid(request.scatter(x), 1)
    assert torch.equal(request.gather(merged), _dense_merge_general(x, grid, factor, order))
    assert torch.equal(request.gather(request.to_grid(merged, 2)), x)


def test_grid_change_rows_reports_each_boundary_against_an_all_gather():
    stages = _stages()
    assert [(s, moved) for s, moved, _ in grid_change_rows(stages, GRIDS, 1)] == [(1, 0), (2, 0)]
    for world in (2, 3):
        report = grid_change_rows(stages, GRIDS, world, "locality")
        assert [s for s, _, _ in report] == [1, 2]
        assert all(0 <= moved < all_gather for _, moved, all_gather in report)
        assert report[0][2] == sum(t * h * w for t, h, w in GRIDS) * (world - 1)


def test_a_flat_schedule_is_one_stage_of_the_same_runtime():
    from winsp.planning.hierarchy import staged_plans

    schedule = [winsp.FixedWindows((1, 2, 2)), winsp.FixedWindows((1, 2, 2), shift=(0, 1, 1))]
    flat, staged = winsp.WindowRuntime(schedule), winsp.WindowRuntime([Stage(schedule)])
    assert flat.stages == staged.stages and flat.schedule == staged.schedule == tuple(schedule)
    grids = [(2, 5, 6), (1, 4, 4)]
    for world in (1, 2, 3):
        for planner in ("auto", "lpt", "split"):
            a = plan_schedule(grids, schedule, world, planner)
            b = staged_plans([Stage(schedule)], grids, world, planner, split_windows=True)
            assert [p.key for p in a] == [p.key for p in b] and [p.rank_pieces for p in a] == [p.rank_pieces for p in b]
    assert isinstance(winsp.runtime.StagedRuntime([Stage(schedule)]), winsp.WindowRuntime)
    assert winsp.runtime.StagedRequest is winsp.runtime.WindowRequest
    request = flat.request(grids)
    x = torch.randn(sum(t * h * w for t, h, w in grids), 3)
    rows = request.scatter(x)
    assert request.stage == 0 and bool(request.valid_rows.all()) and torch.equal(request.model_rows, request.token_ids)
    assert torch.equal(request.gather(request.to_layer(rows, 1)), x)
    with pytest.raises(ValueError, match="not a mix"):
        winsp.WindowRuntime([Stage(schedule), schedule[0]])
