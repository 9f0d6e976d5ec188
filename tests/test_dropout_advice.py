"""Dropout refusals that are right, or silent about fixes (``winsp.adoption.dropout_advice``), and attention-probability
dropout refused by name.

- A window attention whose ``proj_drop`` the original applies to the padded, window-cut tensor: a row-wise draw
  (``RowDropout``, ``dropout='rows'``) is not its draw even on one rank, so the refusal does not suggest it: winsp
  cannot tell, and says so, pointing to ``check_parallel``.
- The divided space-time video transformer (``examples.divided_video``): its MLP dropout takes the class tokens next to
  the rows, and its tokens are flattened frames fastest; both are named as the cause, with no row-wise fix offered.
- Attention-probability dropout: refused by name, in ``request.attention`` and in ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import winsp
from examples.divided_video.adapter import parallelize as parallel_divided
from examples.divided_video.model import DividedVideoTransformer
from winsp.testing import check_parallel

DIM, HEADS = 8, 2


class WindowAttention(nn.Module):
    """Attention inside each window of ``[windows, n, C]``; ``proj_drop`` on that window-cut tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj, self.proj_drop = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        return self.proj_drop(self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)))


class CutBlock(nn.Module):
    """Pads ``[B, H, W, C]`` to whole 2 x 2 windows, cuts them, attends, puts them back."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(DIM), WindowAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        y = F.pad(self.norm(x), (0, 0, 0, w % 2, 0, h % 2))
        hp, wp = y.shape[1:3]
        windows = y.view(b, hp // 2, 2, wp // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)
        out = self.attn(windows).view(b, hp // 2, wp // 2, 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        return x + out[:, :h, :w]


class CutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(CutBlock(), CutBlock())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def attend(a, x):  # on this rank's rows [L, C]; padding rows are the original's zero padding
    x = x * a.request.valid_rows[:, None].to(x.dtype)
    q, k, v = a.qkv(x).unflatten(-1, (3, HEADS, -1)).unbind(-3)
    return a.proj_drop(a.proj(a.request.attention(q, k, v, layer=a.index)[0].flatten(1)))


def cut_plan(**fields) -> winsp.ParallelPlan:
    return winsp.ParallelPlan(
        region=winsp.Region("blocks", "blocks", winsp.ChannelsLast(2)), attention="blocks.*.attn",
        stages=[winsp.Stage([winsp.FixedWindows((1, 2, 2))] * 2)], make_attention=winsp.swapped(attend),
        swaps=[("blocks.*", winsp.swapped(lambda m, x: x + m.attn(m.norm(x))))], **fields)


def test_a_window_cut_proj_drop_is_not_offered_a_row_wise_fix_which_would_be_wrong_even_on_one_rank():
    torch.manual_seed(0)
    original = CutNet().double()
    x = torch.randn(2, 4, 6, DIM, dtype=torch.float64)
    model = winsp.parallelize(copy.deepcopy(original), cut_plan()).train()
    with pytest.raises(ValueError) as refused:
        model(x)
    message = str(refused.value)
    assert "'blocks.0.attn.proj_drop' (Dropout, p=0.3)" in message
    assert "it runs inside 'blocks.0.attn', whose forward the plan replaced: winsp cannot tell which tensor the " \
        "original applies it to" in message
    assert "winsp.testing.check_parallel(..., train=True)" in message and "swap it:" not in message
    # what the old refusal suggested: exact in eval, but in training not the original's draws, even on one rank
    for fields in ({"dropout": "rows"}, {}):
        swapped = cut_plan(**fields)
        if not fields:
            swapped = winsp.ParallelPlan(**{**swapped.__dict__, "swaps": swapped.swaps + (
                ("blocks.*.attn.proj_drop", winsp.RowDropout.like),)})
        model = winsp.parallelize(copy.deepcopy(original), swapped)
        torch.testing.assert_close(model.eval()(x), original.eval()(x), rtol=1e-12, atol=1e-12)
        torch.manual_seed(3)
        got = model.train()(x)
        torch.manual_seed(3)
        want = original.train()(x)
        assert ((got - want).norm() / (want - x).norm()).item() > 0.1


def test_the_divided_video_models_mlp_dropout_suggests_only_the_plan_wide_draw_and_says_winsp_cannot_know():
    torch.manual_seed(0)
    model = parallel_divided(DividedVideoTransformer(drop=0.2).double()).train()
    with pytest.raises(ValueError, match=r"'encoder.blocks.0.mlp.3' \(Dropout, p=0.2\) would draw .*it runs inside "
                                         r"'encoder.blocks.0', whose forward the plan replaced: winsp cannot tell.*A "
                                         r"row-wise draw \(ParallelPlan\(..., dropout='rows'\)\) is the original's "
                                         r"only where.*check_parallel") as refused:
        model(torch.randn(2, 3, 3, 4, 6, dtype=torch.float64))
    assert "RowDropout" not in str(refused.value)  # it draws row-major over the rows alone: not offered here


def make_dropping() -> DividedVideoTransformer:
    return DividedVideoTransformer(drop=0.3).double()


def parallel_dropping(original: DividedVideoTransformer, world_size: int) -> DividedVideoTransformer:
    return parallel_divided(original, winsp.DiffusionParallelConfig(ulysses_degree=world_size), dropout="rows")


def clips() -> torch.Tensor:
    return torch.randn(2, 3, 3, 4, 6, dtype=torch.float64).requires_grad_()


def test_dropout_rows_draws_the_mlp_dropout_over_class_token_and_frames_fastest_patches_exactly_at_sp_2_and_3():
    """The plan says the MLP's dropout takes the region's tokens as they came in ([B, 1 + S*T, C], the class token
    first, frames fastest): dropout='rows' draws that mask, and training matches the untouched model."""
    report = check_parallel(make_dropping, parallel_dropping, clips, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0
    torch.manual_seed(0)
    original = make_dropping()
    model, x = parallel_dropping(copy.deepcopy(original), 1), clips()
    torch.manual_seed(1)
    dropped = model.train()(x)[0]
    torch.manual_seed(1)
    assert not torch.allclose(dropped, original.eval()(x)[0])  # it did drop


class Opaque(winsp.TokenIO):
    """``[B, H, W, C]`` tokens, read as ``ChannelsLast(2)`` does, by a TokenIO that may or may not say its order."""

    def __init__(self, row_major=None) -> None:
        self.inner = winsp.ChannelsLast(2)
        if row_major is not None:
            self.row_major = row_major

    def read(self, args, kwargs):
        return self.inner.read(args, kwargs)

    def with_rows(self, args, kwargs, rows):
        return self.inner.with_rows(args, kwargs, rows)

    def output_rows(self, output):
        return self.inner.output_rows(output)

    def with_output(self, output, rows, grids):
        return self.inner.with_output(output, rows, grids)


@pytest.mark.parametrize("row_major, match", [
    (None, r"the region's Opaque does not say in which order it holds the tokens \(give it row_major = True or "
           r"False\)\. A row-wise draw .*check_parallel"),
    (False, r"no row-wise draw reproduces it here: the region's Opaque presents the tokens otherwise than as rows")])
def test_a_token_io_that_does_not_say_its_order_or_says_it_holds_no_rows(row_major, match):
    plan = winsp.ParallelPlan(**{**cut_plan().__dict__, "region": winsp.Region("blocks", "blocks", Opaque(row_major))})
    model = CutNet().double()
    model.blocks[0].attn.proj_drop.p = model.blocks[1].attn.proj_drop.p = 0.0
    model.blocks[0].norm = nn.Sequential(model.blocks[0].norm, nn.Dropout(0.1))  # on the rows
    model = winsp.parallelize(model, plan)
    with pytest.raises(ValueError, match=match):
        model.train()(torch.randn(2, 4, 6, DIM, dtype=torch.float64))


def test_attention_probability_dropout_is_refused_by_name():
    torch.manual_seed(0)
    model = parallel_divided(DividedVideoTransformer(attn_drop=0.1).double())
    x = torch.randn(1, 2, 3, 4, 6, dtype=torch.float64)
    model.eval()(x)  # eval: no dropout, nothing to refuse
    with pytest.raises(ValueError, match=r"layer 0 \('encoder.blocks.0.attn_t'\): attention-probability dropout "
                                         r"\(dropout_p=0.1\) is not offered by winsp"):
        model.train()(x)
    # an unswapped attention calling scaled_dot_product_attention with dropout inside the region
    model = winsp.parallelize(CutNet().double(), cut_plan())
    model.blocks[0].attn.proj_drop.p = model.blocks[1].attn.proj_drop.p = 0.0
    model.blocks[0].register_forward_pre_hook(lambda m, a: F.scaled_dot_product_attention(*[a[0][None, None]] * 3,
                                                                                          dropout_p=0.2) and None)
    with pytest.raises(ValueError, match=r"'blocks.0' calls scaled_dot_product_attention\(dropout_p=0.2\) in a "
                                         r"training forward inside the region"):
        model.train()(torch.randn(2, 4, 6, DIM, dtype=torch.float64))


def test_row_dropout_on_the_rows_and_class_tokens_together_is_refused_for_dropout_rows():
    torch.manual_seed(0)
    model = parallel_divided(DividedVideoTransformer(drop=0.2).double())
    plan = model._winsp_parallel.plan
    plan = winsp.ParallelPlan(**{**plan.__dict__, "swaps": plan.swaps + (("**.mlp.3", winsp.RowDropout.like),)})
    model = winsp.parallelize(winsp.unparallelize(model), plan)
    with pytest.raises(ValueError, match=r"'encoder.blocks.0.mlp.3' \(RowDropout, p=0.2\) draws row-major over this "
                                         r"rank's rows alone, but .* with replicated tokens beside them: drop the swap "
                                         r"and set ParallelPlan\(..., dropout='rows'\)"):
        model.train()(torch.randn(2, 3, 3, 4, 6, dtype=torch.float64))
    request = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))]).request([(1, 2, 2)])
    request.scatter(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"takes this rank's 4 local rows \[L, ...\], got \[5, 3\]"):
        winsp.runtime.row_dropout(torch.zeros(5, 3), 0.5, request)  # the request API's draw, outside any plan


@pytest.mark.parametrize("at", ["first", "last"])
@pytest.mark.parametrize("order", ["thw", "hwt", "wth"])
def test_the_rows_draw_reads_each_row_where_the_region_input_held_it(at, order):
    """Each row of ``[held; local]`` (``[local; held]``) is drawn at its own place in the region's input ``[B, count +
    L, C]`` flattened: the input's own row numbers, scattered as the region scatters them, are the draw's index."""
    from winsp.adoption.dropout_advice import _positions

    count, grid = 2, (2, 3, 4)
    ids = torch.arange(2 * (count + 24), dtype=torch.float64).view(2, count + 24, 1)
    replicated, io = winsp.adoption.Replicated(at=at, count=count), winsp.FlatTokens(grid=grid, order=order)
    args, kwargs, held, counts = replicated.take(nn.Module(), (ids,), {})
    rows, grids = io.read(args, kwargs)
    request = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))]).request(grids, replicated.lengths(counts, 2))
    x = replicated.join(request.scatter(rows), held)
    index, total = _positions(request, order, replicated)
    assert total == ids.numel() and torch.equal(x[:, 0].long(), index)
