"""Replicated tokens in a ``winsp.ParallelPlan`` (``winsp.adoption.Replicated``): a CLS token that joins some layers
and not others, written here in plain PyTorch, exact against the untouched model at SP 2 and 3 (outputs, every
parameter and input gradient, training mode); and CLS / register tokens held in the region's token tensor."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import winsp
from winsp.adoption import Replicated
from winsp.geometry import GlobalWindow
from winsp.testing import check_parallel

DIM, HEADS, BIG = 16, 2, 1 << 20


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, seqs: torch.Tensor) -> torch.Tensor:  # [S, n, C]: attention inside each sequence
        q, k, v = self.qkv(seqs).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2))


class Block(nn.Module):
    """Spatial: each frame attends with its own copy of the CLS token, and the CLS output is the mean of the frames'
    copies. Temporal: each position attends over time; the CLS token takes no part."""

    def __init__(self, spatial: bool) -> None:
        super().__init__()
        self.spatial, self.norm, self.attn = spatial, nn.LayerNorm(DIM), Attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, cls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (b, t, h, w, c), hx, hc = x.shape, self.norm(x), self.norm(cls)
        if self.spatial:
            seqs = torch.cat([hc[:, None, None].expand(b, t, 1, c), hx.flatten(2, 3)], 2).flatten(0, 1)
            out = self.attn(seqs).unflatten(0, (b, t))
            x, cls = x + out[:, :, 1:].unflatten(2, (h, w)), cls + out[:, :, 0].mean(1)
        else:
            out = self.attn(hx.permute(0, 2, 3, 1, 4).flatten(0, 2)).unflatten(0, (b, h, w))
            x = x + out.permute(0, 3, 1, 2, 4)
        return x + self.mlp(x), cls + self.mlp(cls)


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(spatial=i % 2 == 0) for i in range(4)])

    def forward(self, x: torch.Tensor, cls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x, cls = block(x, cls)
        return x, cls


class ClsVideo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Linear(3, DIM), Body(), nn.Linear(DIM, 5)
        self.cls = nn.Parameter(torch.randn(DIM))

    def forward(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, cls = self.body(self.embed(video), self.cls.expand(video.shape[0], DIM))
        return self.head(x), self.head(cls)


def block(m, x, cls):  # a Block on local rows [L, C]; the CLS tokens [B, C] whole on every rank
    qkv = [t.unflatten(-1, (3, HEADS, -1)).unbind(-3) for t in (m.attn.qkv(m.norm(x)), m.attn.qkv(m.norm(cls)))]
    out, c = m.request.attention(*qkv[0], *(qkv[1] if m.spatial else ()), layer=m.index)
    x, cls = x + m.attn.proj(out.flatten(1)), cls if c is None else cls + m.attn.proj(c.flatten(1))
    return x + m.mlp(x), cls + m.mlp(cls)


def cls_plan() -> winsp.ParallelPlan:
    return winsp.ParallelPlan(
        region=winsp.Region("body", "body"), attention="body.blocks.*", layer_entry="body.blocks.*",
        stages=[winsp.Stage([winsp.FixedWindows((1, BIG, BIG)), winsp.FixedWindows((BIG, 1, 1))] * 2)],
        make_attention=winsp.swapped(block), replicated=Replicated(at=1, joins=(True, False, True, False)))


def make_cls() -> ClsVideo:
    return ClsVideo().double()


def parallel_cls(original: ClsVideo, world_size: int) -> ClsVideo:
    return winsp.parallelize(original, cls_plan(), winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def cls_inputs() -> torch.Tensor:
    return torch.randn(2, 3, 4, 5, 3, dtype=torch.float64).requires_grad_()


def test_a_cls_token_in_spatial_layers_only_is_exact_at_sp_2_and_3():
    report = check_parallel(make_cls, parallel_cls, cls_inputs, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0


def test_one_rank_and_the_refusals():
    torch.manual_seed(0)
    original = make_cls()
    model = winsp.parallelize(make_cls(), cls_plan())
    model.load_state_dict(original.state_dict())
    x = cls_inputs()
    for got, want in zip(model(x), original(x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    wrong = winsp.parallelize(make_cls(), winsp.ParallelPlan(**{**cls_plan().__dict__, "replicated": Replicated(at=1)}))
    with pytest.raises(ValueError, match="attention got no text tensors"):
        wrong(x)  # the plan says every layer joins; the temporal block passes none
    with pytest.raises(ValueError, match="one per stage or one per layer"):
        winsp.parallelize(make_cls(), winsp.ParallelPlan(**{**cls_plan().__dict__,
                                                            "replicated": Replicated(at=1, joins=(True, False))}))


# ---- tokens held in the region's token tensor: registers prepended to [B, H*W, C], global layers split over ranks --

class ImageOnly(Attention):
    """Attention over the image tokens only: the registers (the first two tokens) take no part and are left as they
    are."""

    def forward(self, seqs: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(seqs[:, :2]), super().forward(seqs[:, 2:])], 1)


class Flat(nn.Module):
    def __init__(self, joint: bool = True) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(DIM), Attention() if joint else ImageOnly()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class Blocks(nn.ModuleList):
    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        for module in self:
            x = module(x)
        return x


class Registers(nn.Module):
    """Two register tokens prepended to an image's tokens; the first block attends globally over [registers, image],
    the second over the image only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.registers = nn.Linear(3, DIM), nn.Parameter(torch.randn(2, DIM))
        self.blocks = Blocks([Flat(), Flat(joint=False)])

    def forward(self, image: torch.Tensor) -> torch.Tensor:  # [B, H, W, 3] -> [B, 2 + H*W, C]
        x = self.embed(image).flatten(1, 2)
        return self.blocks(torch.cat([self.registers.expand(x.shape[0], -1, -1), x], 1), tuple(image.shape[1:3]))


def flat(m, x):  # the Attention on [2B + L, C]: every sample's registers first, then this rank's rows
    q, k, v = m.qkv(x).unflatten(-1, (3, HEADS, -1)).unbind(-3)
    if m.request.text_layers[m.index]:
        return m.proj(m.request.joint_attention(q, k, v, layer=m.index).flatten(1))
    n = m.request.num_text_rows  # a layer the registers do not join: they are left as they are
    out = m.request.attention(q[n:], k[n:], v[n:], layer=m.index)[0]
    return torch.cat([torch.zeros_like(x[:n]), m.proj(out.flatten(1))])


def register_plan() -> winsp.ParallelPlan:
    return winsp.ParallelPlan(
        region=winsp.Region("blocks", "blocks", winsp.FlatTokens()), attention="blocks.*.attn",
        stages=[winsp.Stage([GlobalWindow()] * 2, split_windows=True)], make_attention=winsp.swapped(flat),
        replicated=Replicated(at="first", count=2, joins=(True, False)))


def parallel_registers(original: Registers, world_size: int) -> Registers:
    config = winsp.DiffusionParallelConfig(ulysses_degree=world_size, planner="split")
    return winsp.parallelize(original, register_plan(), config)


def make_registers() -> Registers:
    return Registers().double()


def register_inputs() -> torch.Tensor:
    return torch.randn(2, 3, 5, 3, dtype=torch.float64).requires_grad_()


def test_prepended_registers_joining_one_of_two_global_layers_split_over_ranks_are_exact_at_sp_2_and_3():
    report = check_parallel(make_registers, parallel_registers, register_inputs, world_sizes=(2, 3), train=True,
                            timeout=300)
    assert report.ok and report.max_error("param") > 0


def test_a_splitting_planner_on_stages_kept_whole_names_the_stage_option():
    plan = winsp.ParallelPlan(**{**register_plan().__dict__, "stages": [winsp.Stage([GlobalWindow()] * 2)]})
    with pytest.raises(ValueError, match=r"keeps every window whole unless the plan's Stage says split_windows=True "
                                         r"\(stages \[0\] do not\)"):
        winsp.parallelize(make_registers(), plan, winsp.DiffusionParallelConfig(planner="split"))


def test_functional_dropout_on_rows_next_to_held_tokens_is_drawn_exactly_by_dropout_rows():
    torch.manual_seed(0)
    original = make_registers()
    models = [original, winsp.parallelize(copy.deepcopy(original), register_plan()),
              winsp.parallelize(copy.deepcopy(original), winsp.ParallelPlan(**{**register_plan().__dict__,
                                                                             "dropout": "rows"}))]
    for model in models:  # the first block drops out on [B, 2 + L, C]: in the region, registers beside the rows
        block = model.blocks[0]
        block.forward = lambda x, block=block: x + block.attn(F.dropout(block.norm(x), 0.2, True))
    x = register_inputs()
    with pytest.raises(ValueError, match=r"on local rows \[34, 16\].*Set ParallelPlan\(..., dropout='rows'\) to draw "
                                         r"exactly the original's mask"):
        models[1](x)
    torch.manual_seed(7)
    want = original(x)
    torch.manual_seed(7)
    torch.testing.assert_close(models[2](x), want, rtol=1e-12, atol=1e-12)


def test_replicated_tokens_are_read_by_name_or_position_or_next_to_the_rows():
    class Region(nn.Module):
        def forward(self, x, text=None):
            return x

    region, x, text = Region(), torch.zeros(2, 7, 4), torch.zeros(2, 3, 4)
    assert Replicated(at=1).take(region, (x,), {"text": text})[3] == (2, 3)  # a positional index passed by keyword
    assert Replicated(at="text").take(region, (x, text), {})[3] == (2, 3)  # a name passed by position
    assert Replicated(at="text").take(region, (x, text[:, 0]), {})[3] == (2, 1)  # [B, C]: one token per sample
    args, _, held, counts = Replicated(at="last", count=2).take(region, (torch.arange(14.0).view(2, 7, 1),), {})
    assert counts == (2, 2) and held.flatten().tolist() == [5, 6, 12, 13] and args[0].shape == (2, 5, 1)
    with pytest.raises(ValueError, match="no tensor argument 'cls'"):
        Replicated(at="cls").take(region, (x,), {})
    with pytest.raises(ValueError, match=r"must be \[B, 8 \+ L, ...\] tokens"):
        Replicated(at="first", count=8).take(region, (x,), {})
    with pytest.raises(ValueError, match="for 2 samples but the region's tokens hold 3"):
        Replicated(at="text").lengths((2, 3), 3)


def test_joins_names_the_attention_modules_by_glob():
    attention = ["blocks.0.attn_t", "blocks.0.attn_s", "blocks.1.attn_t", "blocks.1.attn_s"]
    assert Replicated(joins="**.attn_s").layers([4], attention) == (False, True, False, True)
    assert Replicated(joins=("blocks.0.*", "blocks.1.attn_s")).layers([2, 2], attention) == (True, True, False, True)
    with pytest.raises(ValueError, match=r"matches none of the attention modules \['blocks.0.attn_t'"):
        Replicated(joins="*.attn_x").layers([4], attention)
    with pytest.raises(ValueError, match="or globs of the attention modules they join"):
        Replicated(joins=(True, "*.attn"))
    # by glob, the layers follow the attention modules wherever the forward's recording numbers them
    model = winsp.parallelize(make_cls(), winsp.ParallelPlan(**{**cls_plan().__dict__, "replicated": Replicated(
        at=1, joins=("body.blocks.0", "body.blocks.2"))}))
    assert model._winsp_parallel.text_layers == (True, False, True, False)


class Reversed(Body):
    def forward(self, x: torch.Tensor, cls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in reversed(self.blocks):  # run 3, 2, 1, 0: temporal, spatial, temporal, spatial
            x, cls = block(x, cls)
        return x, cls


def test_joins_by_glob_follow_the_layers_when_the_recorded_order_renumbers_them():
    torch.manual_seed(0)
    original = make_cls()
    original.body = Reversed().double()
    plan = winsp.ParallelPlan(**{**cls_plan().__dict__, "replicated": Replicated(at=1, joins="body.blocks.[02]"),
                                 "stages": [winsp.Stage([winsp.FixedWindows((BIG, 1, 1)),
                                                         winsp.FixedWindows((1, BIG, BIG))] * 2)]})
    model = winsp.parallelize(copy.deepcopy(original), plan)
    x = cls_inputs()
    for got, want in zip(model(x), original(x), strict=True):  # the first forward renumbers the layers
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert model._winsp_runtime.layer_names == ("body.blocks.3", "body.blocks.2", "body.blocks.1", "body.blocks.0")
    assert model._winsp_parallel.text_layers == (False, True, False, True)
