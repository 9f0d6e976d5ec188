"""Functional dropout in a region whose tokens come channels-first (``winsp.adoption.ChannelsFirst``): this rank's rows
reach the model as one sample ``[1, C, L, 1, 1]`` (or ``[1, L, 1, 1, C]`` after its permute), not as rows ``[L, ...]``.

The model is ``examples/swin_seg3d``'s segmentation network whose encoder stages also call ``F.dropout`` themselves:
on their channels-first input, on the channels-last view of it (whose memory is still channels-first, so the
original's draw follows that order), and after each block (a contiguous channels-last tensor). With
``ParallelPlan(dropout="rows")`` the parallel model draws exactly the original's masks (outputs and every gradient,
float64, 2 and 3 ranks, a rank without a window included, channels-first and ``channels_last_3d`` inputs); by default
the call is refused naming the stage; a batch of one laid out otherwise (``[1, L, C]``) is refused by name.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import winsp
from examples.swin_seg3d.adapter import seg_plan
from examples.swin_seg3d.model import SegNet3d, SwinStage3d
from winsp.adoption import ChannelsFirst
from winsp.testing import check_parallel

P = 0.3


class DroppingStage(SwinStage3d):
    """The example's stage, whose forward also drops out (as a model written with functional dropout does)."""

    flat = ""  # "first" / "last": drop out a flattened [B, C, D*H*W] / [B, D*H*W, C] (refused in parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(x) if hasattr(self, "drop") else F.dropout(x, P, self.training)  # [B, C, D, H, W], as it came in
        if self.flat == "first":
            x = F.dropout(x.flatten(2), P, self.training).reshape(x.shape)
        x = x.permute(0, 2, 3, 4, 1)
        if self.flat == "last":
            x = F.dropout(x.flatten(1, 3), P, self.training).reshape(x.shape)
        else:
            x = F.dropout(x, P, self.training)  # a channels-last view, its memory channels-first
        for block in self.blocks:
            x = F.dropout(block(x), P, self.training)  # contiguous channels-last
        return self.merge(x).permute(0, 4, 1, 2, 3)


def make_model(flat: str = "", module: bool = False) -> SegNet3d:
    """``module``: the stages' input dropout is an ``nn.Dropout`` module."""
    model = SegNet3d().double()
    for stage in model.encoder.stages:
        stage.__class__ = DroppingStage  # the same modules and weights, the forward above
        stage.flat = flat
        if module:
            stage.drop = nn.Dropout(P)
    return model


def make_parallel(model, world_size: int, dropout: str = "rows"):
    plan = dataclasses.replace(seg_plan(model), dropout=dropout)
    config = winsp.DiffusionParallelConfig(ulysses_degree=world_size) if world_size > 1 else None
    return winsp.parallelize(model, plan, config)


def inputs(memory_format=torch.contiguous_format):  # grids 4 x 8 x 8, 2 x 4 x 4 (one window), 1 x 2 x 2
    x = torch.randn(2, 1, 8, 16, 16, dtype=torch.float64).to(memory_format=memory_format)
    return x.requires_grad_()


def channels_last_inputs():
    return inputs(torch.channels_last_3d)


@pytest.mark.parametrize("make_inputs", [inputs, channels_last_inputs], ids=["channels_first", "channels_last_3d"])
def test_functional_dropout_on_channels_first_rows_draws_the_originals_masks(make_inputs):
    report = check_parallel(make_model, make_parallel, make_inputs, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("output") <= 1e-12
    assert report.max_error("param") > 0 and report.max_error("input") > 0


def _train_step(model, x) -> tuple[torch.Tensor, list]:
    torch.manual_seed(7)
    out = model.train()(x)
    out.sum().backward()
    return out.detach(), [p.grad for _, p in sorted(model.named_parameters())]


@pytest.mark.parametrize("module", [False, True], ids=["functional", "nn.Dropout"])
def test_one_rank_draws_them_too_and_its_masks_are_not_the_local_ones(module):
    torch.manual_seed(0)
    original = make_model(module=module)
    parallel = make_parallel(copy.deepcopy(original), 1)
    x = inputs()
    (want, want_grads), (got, got_grads) = _train_step(original, x), _train_step(parallel, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # the same model with the dropouts left to run on this rank's rows draws other masks (one rank, window order);
    # dropout modules are refused even so
    unwatched = make_parallel(copy.deepcopy(original), 1, dropout="unchecked")
    if module:
        with pytest.raises(ValueError, match=r"'encoder.stages.0.drop' \(Dropout, p=0.3\)"):
            _train_step(unwatched, x)
    else:
        assert (_train_step(unwatched, x)[0] - want).abs().max() > 1e-3


def test_by_default_it_is_refused_naming_the_stage_and_the_exact_fix():
    torch.manual_seed(0)
    model = make_parallel(make_model(), 1, dropout="refuse").train()
    with pytest.raises(ValueError) as refused:
        model(inputs())
    said = str(refused.value)
    assert "'encoder.stages.0'" in said and "torch.nn.functional.dropout(p=0.3" in said
    assert "channels-first sample [1, 8, 512, 1, 1]" in said and "dropout='rows'" in said
    module = make_parallel(make_model(module=True), 1, dropout="refuse").train()
    with pytest.raises(ValueError) as refused:
        module(inputs())
    said = str(refused.value)
    assert "'encoder.stages.0.drop' (Dropout, p=0.3)" in said and "set ParallelPlan(..., dropout='rows')" in said
    assert "[B, C, T, H, W]" in said and "RowDropout" not in said


@pytest.mark.parametrize("flat, shape", [("last", r"\[1, 512, 8\]"), ("first", r"\[1, 8, 512\]")],
                         ids=["last", "first"])
def test_rows_laid_out_otherwise_in_a_batch_of_one_are_refused_by_name(flat, shape):
    torch.manual_seed(0)
    model = make_parallel(make_model(flat=flat), 1).train()
    with pytest.raises(ValueError, match=r"'encoder.stages.0' calls torch.nn.functional.dropout\(p=0.3, training=True"
                                         rf"\) on local rows {shape}.*presented as a batch of one"):
        model(inputs())


# ---- two spatial dims: [B, C, H, W] --------------------------------------------------------------------------------

class Block2d(nn.Module):
    """2 x 2 window attention (test_functional_dropout's) and a dropped-out linear, on ``[B, H, W, C]``."""

    def __init__(self) -> None:
        super().__init__()
        from tests.test_functional_dropout import DIM, Attention

        self.attn, self.fc = Attention(), nn.Linear(DIM, DIM)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        y = y + self.attn(y)
        return F.dropout(self.fc(y), P, self.training)


class Body2d(nn.Module):
    """Channels-first in and out: a dropout on the input, then the block on the channels-last view."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block2d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(F.dropout(x, P, self.training).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Net2d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from tests.test_functional_dropout import DIM

        self.embed, self.body, self.head = nn.Conv2d(3, DIM, 1), Body2d(), nn.Conv2d(DIM, 3, 1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(image)))


def attend2d(m, x):  # this rank's rows as one sample [1, L, 1, C]
    from tests.test_functional_dropout import HEADS

    q, k, v = m.qkv(x.flatten(0, -2)).unflatten(-1, (3, HEADS, -1)).unbind(-3)
    return m.proj(winsp.current_request().attention(q, k, v, layer=m.index)[0].flatten(1)).reshape(x.shape)


def make_parallel_2d(model, world_size: int):
    plan = winsp.ParallelPlan(region=winsp.Region("body", "body", ChannelsFirst(spatial_dims=2)),
                              stages=[winsp.Stage([winsp.FixedWindows((1, 2, 2))])], attention="body.block.attn",
                              make_attention=winsp.swapped(attend2d), dropout="rows")
    return winsp.parallelize(model, plan, winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def make_model_2d() -> Net2d:
    return Net2d().double()


def inputs_2d():
    return torch.randn(2, 3, 4, 6, dtype=torch.float64).requires_grad_()


def test_two_spatial_dims_draw_the_originals_masks_too():
    report = check_parallel(make_model_2d, make_parallel_2d, inputs_2d, world_sizes=(2,), train=True, timeout=120)
    assert report.ok and report.max_error("output") <= 1e-12
