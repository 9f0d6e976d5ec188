"""An unchanged U-shaped model through ``winsp.parallelize``: down level, 2 x 2 patch merge, middle level, patch
expand back (cropped to the odd skip grid), skip added by the model's own code, up level. Built from torchvision's
Swin blocks and merging, plus a plain patch-expand written here as any model would. float64, SP = 1 in process and
SP = 3 through ``winsp.testing.check_parallel`` in training mode (every output, parameter and input gradient)."""

from __future__ import annotations

import importlib.util
from functools import partial

import pytest
import torch
from torch import nn

import winsp
from winsp.testing import check_parallel

if importlib.util.find_spec("torchvision") is None:
    pytest.skip("torchvision is not installed (pip install -e '.[test]')", allow_module_level=True)

from examples.swin3d import SwinAttention3d, SwinPatchMerging, import_torchvision  # noqa: E402
from examples.swin3d.adapter import MERGE_ORDER  # noqa: E402

import_torchvision()
from torchvision.models.swin_transformer import PatchMerging, SwinTransformerBlock  # noqa: E402
from torchvision.models.video.swin_transformer import ShiftedWindowAttention3d  # noqa: E402

WINDOW = [2, 3, 3]
EXPAND_ORDER = ((0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1))  # '(p1 p2 c)' channels: h offset slowest


class PatchExpand(nn.Module):
    """Swin-Unet style: a linear to 4 C' channels, depth-to-space 2 x 2 on (h, w), cropped to the skip's grid."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.expand = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        b, t, h, w, c = x.shape
        x = self.expand(x).reshape(b, t, h, w, 2, 2, c // 2).permute(0, 1, 2, 4, 3, 5, 6)
        return x.reshape(b, t, 2 * h, 2 * w, c // 2)[:, :, :like.shape[2], :like.shape[3]]


class UNetBody(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        block = partial(SwinTransformerBlock, window_size=WINDOW, attn_layer=ShiftedWindowAttention3d,
                        stochastic_depth_prob=0.3)
        self.down = nn.Sequential(block(dim, 2, shift_size=[0, 0, 0]), block(dim, 2, shift_size=[1, 1, 1]))
        self.merge = PatchMerging(dim)
        self.mid = block(2 * dim, 2, shift_size=[0, 0, 0])
        self.expand = PatchExpand(2 * dim)
        self.up = block(dim, 2, shift_size=[0, 0, 0])  # not the skip's windows: the skip must not move first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down(x)
        y = self.expand(self.mid(self.merge(skip)), skip)
        return self.up(y + skip)


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Linear(3, 8), UNetBody(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


class ExpandRows(nn.Module):
    """PatchExpand on local rows: the same linear, then the sharded split (the crop is the stage's ``like``)."""

    def __init__(self, original: PatchExpand, stage: int) -> None:
        super().__init__()
        winsp.adopt(self, original)
        self.stage = stage

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return winsp.current_request().to_grid(self.expand(x), self.stage)


def unet_plan() -> winsp.ParallelPlan:
    regular, shifted = winsp.SwinWindows(WINDOW), winsp.SwinWindows(WINDOW, (1, 1, 1))
    return winsp.ParallelPlan(
        region=winsp.Region("body", "body"),
        stages=[winsp.Stage([regular, shifted]), winsp.Stage([regular], merge=(1, 2, 2), order=MERGE_ORDER),
                winsp.Stage([regular], split=(1, 2, 2), like=0, order=EXPAND_ORDER)],
        attention="body.**.attn", make_attention=SwinAttention3d,
        grid_changes=("body.merge", "body.expand"),
        make_grid_change=lambda m, stage: (SwinPatchMerging if isinstance(m, PatchMerging) else ExpandRows)(m, stage),
        swaps=[("body.**.stochastic_depth", lambda m: winsp.SampleDropPath(m.p))])


def make_unet() -> UNet:
    return UNet().double()


def parallel_unet(original: UNet, world_size: int) -> UNet:
    return winsp.parallelize(original, unet_plan(), winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def unet_input() -> torch.Tensor:
    return torch.randn(2, 3, 7, 5, 3, dtype=torch.float64).requires_grad_()  # odd grid: merge pads, expand crops


def test_unchanged_unet_with_a_skip_across_levels():
    report = check_parallel(make_unet, parallel_unet, unet_input, world_sizes=(3,), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0


def test_the_skip_needs_no_move():
    torch.manual_seed(0)
    model = parallel_unet(make_unet(), 1)
    runtime = model._winsp_runtime
    assert runtime.landing_layer(2) == 1  # the split lands in stage 0's last layout, where `skip` is
    original = make_unet()
    original.load_state_dict(model.state_dict())
    x = unet_input()
    model.eval(), original.eval()
    assert (model(x) - original(x)).abs().max() < 1e-12
