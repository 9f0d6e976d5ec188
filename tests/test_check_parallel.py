"""``winsp.testing.check_parallel`` compares a parallelised model with the ORIGINAL one, so it catches a model that is
wrong at every rank count (a missing ``to_layer``, per-row randomness), which comparing with itself at one rank cannot.

The original here is the README's tiny DiT written without winsp: a plain loop over Swin-style windows, each attending
over [its video rows, the text], the text output averaged over the windows.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import winsp
from winsp.testing import check_parallel

DIM, HEADS, GRID, TEXT, WINDOW, LAYERS = 16, 2, (2, 8, 8), 5, (2, 4, 4), 4


def window_ids(grid, size, shift) -> list[torch.Tensor]:
    """Canonical row ids of every window: cuts every ``size`` tokens, moved forward by ``shift``, clipped at the
    borders (no winsp code)."""
    def cuts(n, k, s):
        starts = [0] + list(range(s if s else k, n, k))
        return [range(a, min(b, n)) for a, b in zip(starts, starts[1:] + [n])]

    t_cuts, h_cuts, w_cuts = (cuts(n, k, s) for n, k, s in zip(grid, size, shift))
    ids = torch.arange(grid[0] * grid[1] * grid[2]).reshape(grid)
    return [ids[t.start:t.stop, h.start:h.stop, w.start:w.stop].reshape(-1)
            for t in t_cuts for h in h_cuts for w in w_cuts]


def shift_of(layer: int):
    return tuple(k // 2 for k in WINDOW) if layer % 2 else (0, 0, 0)


class Block(nn.Module):
    """The README's block; ``attend(q, k, v, qt, kt, vt)`` is the model's window attention."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, vid, txt, attend, keep=None):
        q, k, v = self.qkv(vid).unflatten(-1, (3, HEADS, -1)).unbind(-3)
        qt, kt, vt = self.qkv(txt).unflatten(-1, (3, HEADS, -1)).unbind(-3)
        attn_vid, attn_txt = attend(q, k, v, qt, kt, vt)
        update = self.out(attn_vid.flatten(1))
        if keep is not None:  # stochastic depth: the residual branch kept or dropped per row's sample
            update = update * keep.unsqueeze(-1)
        return vid + update, txt + self.out(attn_txt.flatten(1))


def per_window_attention(windows, q, k, v, qt, kt, vt):
    """Each window over [its video rows, the text]; the text output is the mean over windows."""
    out, txt_out = torch.zeros_like(q), torch.zeros_like(qt)
    for ids in windows:
        o = F.scaled_dot_product_attention(*(torch.cat([a[ids], b]).transpose(0, 1)
                                             for a, b in ((q, qt), (k, kt), (v, vt)))).transpose(0, 1)
        out = out.index_copy(0, ids, o[:ids.numel()])
        txt_out = txt_out + o[ids.numel():]
    return out, txt_out / len(windows)


def sample_keep(drop: float, samples: int) -> torch.Tensor | None:
    """Stochastic depth's per-sample draw: 1 / (1 - drop) to keep, 0 to drop; one draw per sample."""
    if drop == 0.0:
        return None
    return (torch.rand(samples) >= drop).double() / (1 - drop)


class OriginalTinyDiT(nn.Module):
    """The README model before winsp: one sample, video rows in canonical order, a plain loop over windows."""

    def __init__(self, drop: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.drop = drop

    def forward(self, vid, txt):
        for i, block in enumerate(self.blocks):
            windows = window_ids(GRID, WINDOW, shift_of(i))
            keep = sample_keep(self.drop, 1) if self.training else None
            vid, txt = block(vid, txt, functools.partial(per_window_attention, windows),
                             None if keep is None else keep.expand(vid.shape[0]))
        return vid, txt


class TinyDiT(winsp.WindowParallel, nn.Module):
    """The README model on winsp. ``to_layer=False`` forgets the layout change (wrong at every rank count);
    ``per_row_drop`` draws stochastic depth per local row instead of per sample (wrong too); ``detach_last`` cuts
    the video gradient before the last block (the output is right, the earlier blocks' gradients are not)."""

    def __init__(self, drop: float = 0.0, to_layer: bool = True, per_row_drop: bool = False,
                 detach_last: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.drop, self.use_to_layer, self.per_row_drop = drop, to_layer, per_row_drop
        self.detach_last = detach_last

    def window_schedule(self):
        return [winsp.FixedWindows(WINDOW, shift=shift_of(i)) for i in range(LAYERS)]

    def forward(self, vid, txt):
        request = self.require_runtime().request([GRID], [TEXT], dtype=vid.dtype)
        x = request.scatter(vid)
        for i, block in enumerate(self.blocks):
            if self.use_to_layer:
                x = request.to_layer(x, i)
            if self.detach_last and i == LAYERS - 1:
                x = x.detach()
            keep = None
            if self.training:
                if self.per_row_drop:  # wrong: dim 0 holds this rank's rows, not samples
                    keep = sample_keep(self.drop, x.shape[0])
                else:  # right: one draw per sample, picked by each row's sample
                    keep = sample_keep(self.drop, len(request.grids))
                    keep = None if keep is None else keep.index_select(0, request.row_sample)
            x, txt = block(x, txt, functools.partial(request.attention, layer=request.layer), keep)
        return request.gather(x), txt


def make_original(drop: float = 0.0) -> nn.Module:
    return OriginalTinyDiT(drop).double()


def make_parallel(original: nn.Module, world_size: int, **options) -> nn.Module:
    model = TinyDiT(original.drop, **options).double()
    model.load_state_dict(original.state_dict())
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    return model


def make_inputs():
    vid = torch.randn(GRID[0] * GRID[1] * GRID[2], DIM, dtype=torch.float64)
    return vid.requires_grad_(), torch.randn(TEXT, DIM, dtype=torch.float64).requires_grad_()


@pytest.mark.multirank
def test_the_readme_model_equals_its_original():
    report = check_parallel(make_original, make_parallel, make_inputs, world_sizes=(2,))
    assert report.ok and report.world_sizes == (2,)
    assert {("output", "output[0]"), ("output", "output[1]"), ("param", "blocks.3.qkv.weight"),
            ("input", "args[0]"), ("input", "args[1]")} <= set(report.items)
    assert report.max_error("param") <= 1e-12 and report.max_error("output") <= 1e-12
    assert all(f"{kind}s (" in str(report) for kind in ("output", "param", "input"))


@pytest.mark.multirank
def test_a_missing_to_layer_is_caught():
    """Comparing with itself at one rank passes this model (both runs are wrong the same way); the original does
    not."""
    wrong = functools.partial(make_parallel, to_layer=False)
    with pytest.raises(AssertionError, match=r"differs from the original by") as caught:
        check_parallel(make_original, wrong, make_inputs, world_sizes=(2,))
    report = caught.value.report
    assert report.max_error("output") > 1e-3
    assert report.failures[0].world_size == 2


@pytest.mark.multirank
def test_a_wrong_gradient_with_a_right_output_names_the_parameter():
    wrong = functools.partial(make_parallel, detach_last=True)
    with pytest.raises(AssertionError, match=r"check_parallel: param blocks\.\d\.\w+\.\w+ differs") as caught:
        check_parallel(make_original, wrong, make_inputs, world_sizes=(1,))
    report = caught.value.report
    assert report.max_error("output") <= 1e-12  # the forward is right
    assert report.failures[0].kind == "param" and report.worst("param") is report.failures[0]


@pytest.mark.multirank
def test_per_sample_stochastic_depth_equals_the_original_and_per_row_does_not():
    original = functools.partial(make_original, drop=0.5)
    report = check_parallel(original, make_parallel, make_inputs, world_sizes=(3,), train=True)
    assert report.ok
    per_row = functools.partial(make_parallel, per_row_drop=True)
    with pytest.raises(AssertionError, match="differs from the original"):
        check_parallel(original, per_row, make_inputs, world_sizes=(1,), train=True)


def test_the_per_sample_draws_drop_some_blocks():
    """With this seed the 0.5 drop keeps some blocks and drops others (so the test above can see a wrong drop)."""
    torch.manual_seed(0)
    draws = [sample_keep(0.5, 1).item() for _ in range(LAYERS)]
    assert 0.0 in draws and 2.0 in draws


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world_sizes"):
        check_parallel(make_original, make_parallel, make_inputs, world_sizes=(0,))
    with pytest.raises(ValueError, match="rtol"):
        check_parallel(make_original, make_parallel, make_inputs, world_sizes=(1,), rtol=-1.0)
