"""The adoption helpers of issue 29 on their own: an Hourglass declaration read from a model (its stages, grid
changes, forward order and region) and its refusals; a per-sample module run per row, and its refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import winsp
from examples.hourglass import HourglassNet
from examples.hourglass.adapter import attend, hourglass_plan, resize
from winsp.adoption import Hourglass, PerSampleOnRows
from winsp.geometry import GlobalWindow


def windows(a):
    return winsp.FixedWindows(a.window, a.shift) if a.window else None


def declaration(**changes) -> Hourglass:
    fields = dict(down="body.down.*", mid="body.mid", up="body.up.*", merges="body.merges.*", splits="body.splits.*",
                  windows=windows)
    return Hourglass(**{**fields, **changes})


def test_the_declaration_reads_stages_grid_changes_order_and_region_from_the_model():
    model = winsp.parallelize(HourglassNet().double(), winsp.ParallelPlan(
        stages=declaration(), attention="body.**.attn", make_attention=winsp.swapped(attend),
        make_grid_change=winsp.swapped(resize)))
    plan = model._winsp_parallel.plan
    assert plan.region == winsp.Region("body.down.0", "body.up.0")
    assert plan.forward_order == ("body.down.0", "body.merges.0", "body.down.1", "body.merges.1", "body.mid",
                                  "body.splits.1", "body.up.1", "body.splits.0", "body.up.0")
    assert plan.grid_changes == ("body.merges.0", "body.merges.1", "body.splits.1", "body.splits.0")
    merges = [st.merge for st in plan.stages]
    splits = [(st.split, st.like) for st in plan.stages]
    assert merges == [(1, 1, 1), (1, 2, 2), (1, 2, 2), (1, 1, 1), (1, 1, 1)]
    assert splits[3:] == [((1, 2, 2), 1), ((1, 2, 2), 0)]
    assert plan.stages[2].layers == (GlobalWindow(),) and plan.stages[2].split_windows
    assert plan.stages[0].split_windows is None and len(plan.stages[0].layers) == 2


def test_the_declaration_refuses_what_is_not_a_u_net_by_name():
    model = HourglassNet().double()
    base = dict(attention="body.**.attn", make_attention=winsp.swapped(attend), make_grid_change=winsp.swapped(resize))
    with pytest.raises(ValueError, match=r"Hourglass: 2 down levels, 1 up levels"):
        winsp.parallelize(model, winsp.ParallelPlan(stages=declaration(up="body.up.0"), **base))
    with pytest.raises(ValueError, match=r"Hourglass.windows returned str"):
        winsp.parallelize(model, winsp.ParallelPlan(stages=declaration(windows=lambda a: "global"), **base))
    with pytest.raises(ValueError, match="leave grid_changes and forward_order out"):
        winsp.ParallelPlan(stages=declaration(), grid_changes="body.merges.*", **base)
    with pytest.raises(ValueError, match="ParallelPlan.region must be a winsp.Region"):
        winsp.ParallelPlan(stages=[winsp.Stage([GlobalWindow()])], **base)
    assert not winsp.adoption.is_parallelized(model)  # every refusal left the model as it was


class AdaNorm(nn.Module):
    """``x [N, H, W, C]`` scaled per sample: ``x * (1 + linear(cond)[:, None, None, :])``."""

    def __init__(self, dim: int = 8, cond: int = 3) -> None:
        super().__init__()
        self.linear = nn.Linear(cond, dim)

    def forward(self, x, cond):
        return x * (1 + self.linear(cond)[:, None, None, :])


def test_a_per_sample_module_runs_unchanged_per_row_and_as_the_original_outside_a_region():
    torch.manual_seed(0)
    norm = AdaNorm().double()
    wrapped = PerSampleOnRows(norm, 2, "norm")
    x, cond = torch.randn(2, 4, 6, 8, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    assert torch.equal(wrapped(x, cond), norm(x, cond))  # no request: the original
    runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))], split_windows=False)
    request = runtime.request([(1, 4, 6)] * 2)
    rows = request.scatter(x.reshape(-1, 8))
    with request.active():
        got = request.gather(wrapped(rows, cond))
    assert torch.allclose(got, norm(x, cond).reshape(-1, 8), rtol=0, atol=1e-15)
    assert list(wrapped.state_dict()) == list(norm.state_dict())


class Pool(nn.Module):
    def forward(self, x, cond):
        return x.mean(dim=(1, 2)) * cond.sum()


def test_a_per_sample_module_that_mixes_tokens_is_refused_by_path():
    runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))], split_windows=False)
    request = runtime.request([(1, 2, 2)])
    rows = request.scatter(torch.randn(4, 8))
    with request.active(), pytest.raises(ValueError, match=r"per_sample: 'body.pool' \(Pool\) ran on local rows "
                                                           r"viewed as \[4, 1, 1, 8\] and returned \[4, 8\]"):
        PerSampleOnRows(Pool(), 2, "body.pool")(rows, torch.randn(1, 3))


def test_per_sample_needs_the_regions_grid_dimensions():
    model = HourglassNet().double()
    plan = hourglass_plan(model)
    tokens = winsp.Region("body", "body", winsp.FlatTokens())
    with pytest.raises(ValueError, match="ParallelPlan.per_sample needs the region's grid dimensions; FlatTokens"):
        winsp.parallelize(model, winsp.ParallelPlan(**{**plan.__dict__, "region": tokens, "per_sample": "**.norm1"}))
