"""A region that does not fit the model is named as such before the model's own code fails on local rows: a region
that ends at a patch merge the plan does not list, a channels-first input read as channels-last; and a region may end
with a grid change (``Stage((), merge=...)``), which the first refusal's fix says and which is then exact."""

from __future__ import annotations

import copy

import pytest
import torch

import winsp
from examples.swin_seg3d.adapter import attend
from examples.swin_seg3d.model import SegNet3d
from winsp.adoption import ChannelsFirst
from winsp.geometry import RolledWindows
from winsp.testing import check_parallel


def _model():
    torch.manual_seed(0)
    return SegNet3d(windows=((2, 4, 4), (2, 4, 2))).double()  # a 4 x 8 x 12 grid: channels (8) differ from W (12)


def _stage0(model, **extra):
    windows = [RolledWindows(b.attn.window, tuple(-s for s in b.attn.shift)) for b in model.encoder.stages[0].blocks]
    return [winsp.Stage(windows)] + ([winsp.Stage((), **extra)] if extra else [])


def make_input():  # a volume of 8 x 16 x 24: grid 4 x 8 x 12 (at SP 3: 6 windows), merged to 2 x 4 x 6
    torch.manual_seed(1)
    return torch.randn(1, 1, 8, 16, 24, dtype=torch.float64).requires_grad_()


X = make_input().detach()


def test_a_region_that_ends_at_an_unlisted_patch_merge_is_named_with_the_exact_fix():
    model = _model()
    plan = winsp.ParallelPlan(region=winsp.Region("encoder.stages.0.blocks.0", "encoder.stages.0.merge"),
                              stages=_stage0(model), attention="encoder.stages.0.**.attn",
                              make_attention=winsp.swapped(attend))
    winsp.parallelize(model, plan)
    with pytest.raises(ValueError, match=r"the region's end 'encoder.stages.0.merge' returns tokens on grids "
                                         r"\(2, 4, 6\), but the plan's stages end on \(4, 8, 12\): the region ends "
                                         r"with a grid change the plan does not list .* winsp.Stage\(\(\), "
                                         r"merge=\(2, 2, 2\)\), with the module in ParallelPlan.grid_changes .* "
                                         r"before any rows moved"):
        model(X)


def merge_rows(m, x):  # local rows [L, C] -> the merged grid's rows [L', 2C]
    return m.reduction(m.norm(m.request.to_grid(x, m.index)))


def merge_plan(model) -> winsp.ParallelPlan:
    return winsp.ParallelPlan(region=winsp.Region("encoder.stages.0.blocks.0", "encoder.stages.0.merge"),
                              stages=_stage0(model, merge=(2, 2, 2)), attention="encoder.stages.0.**.attn",
                              make_attention=winsp.swapped(attend), grid_changes="encoder.stages.0.merge",
                              make_grid_change=winsp.swapped(merge_rows))


def make_parallel(model, world_size: int):
    return winsp.parallelize(model, merge_plan(model), winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def test_following_it_a_region_ending_with_the_merge_is_exact():
    original = _model()
    model = winsp.parallelize(copy.deepcopy(original), merge_plan(original))
    torch.testing.assert_close(model(X), original(X), rtol=0, atol=1e-12)
    report = check_parallel(_model, make_parallel, make_input, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("input") > 0


def test_a_stage_without_layers_must_change_the_grid_and_come_last():
    with pytest.raises(ValueError, match=r"a stage without layers must merge or split"):
        winsp.Stage(())
    with pytest.raises(ValueError, match=r"stages\[1\] has no layers: only the last stage may"):
        winsp.WindowRuntime([winsp.Stage([winsp.FixedWindows((1, 2, 2))]), winsp.Stage((), merge=(1, 2, 2)),
                             winsp.Stage([winsp.FixedWindows((1, 2, 2))], merge=(1, 2, 2))])


def test_a_channels_first_input_read_as_channels_last_is_named_as_such():
    model = _model()
    plan = winsp.ParallelPlan(region=winsp.Region("encoder.stages.0", "encoder.stages.0"), stages=_stage0(model),
                              attention="encoder.stages.0.**.attn", make_attention=winsp.swapped(attend))
    winsp.parallelize(model, plan)
    with pytest.raises(ValueError, match=r"the region's input \[1, 8, 4, 8, 12\] at 'encoder.stages.0' is read by "
                                         r"ChannelsLast as tokens of 12 channels .* first layer entry "
                                         r"'encoder.stages.0.blocks.0' takes \[1, 4, 8, 12, 8\]: tokens of 8 "
                                         r"channels, the size of the input's dim 1. The region's input is "
                                         r"channels-first: give Region\(..., "
                                         r"tokens=winsp.adoption.ChannelsFirst\(\)\)"):
        model(X)


def test_a_channels_last_input_read_as_channels_first_is_named_as_such():
    model = _model()
    plan = winsp.ParallelPlan(region=winsp.Region("encoder.stages.0.blocks.0", "encoder.stages.0.blocks.1",
                                                  ChannelsFirst()), stages=_stage0(model),
                              attention="encoder.stages.0.**.attn", make_attention=winsp.swapped(attend))
    winsp.parallelize(model, plan)
    with pytest.raises(ValueError, match=r"is read by ChannelsFirst as tokens of 4 channels .* The region's input is "
                                         r"channels-last: give Region\(..., tokens=winsp.ChannelsLast\(\)\)"):
        model(X)
