"""A model with a relative position bias, on winsp, against its original written without winsp; request safety.

``examples/toy_biased_windows.py`` holds the two: the original (windows cut by hand, bias added to dense scores) and
the winsp model (the bias as a ``score_mod``, its index from a layout hook). They share parameters, so outputs and
gradients must agree at every SP degree, including ranks without windows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import winsp
from examples.toy_biased_windows import BiasedWindows, PlainBiasedWindows
from winsp.testing import run_ranks

GRIDS, LENGTHS = [(3, 6, 8), (2, 5, 4)], [3, 2]
NUM_ROWS = sum(t * h * w for t, h, w in GRIDS)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    vid = torch.randn(NUM_ROWS, 16, generator=gen, dtype=torch.float64)
    txt = torch.randn(sum(LENGTHS), 16, generator=gen, dtype=torch.float64)
    return vid, txt


def _weights(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.double()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


def _run(model, vid, txt, grids=GRIDS):
    vid, txt = vid.clone().requires_grad_(), txt.clone().requires_grad_()
    out = model(vid, txt, grids, LENGTHS[:len(grids)])
    _loss(out).backward()
    return out.detach(), vid.grad, txt.grad, {n: p.grad for n, p in model.named_parameters()}


def _parallel(rank, world_size, grids=GRIDS, backend="auto"):
    model = _weights(BiasedWindows())
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size, attention_backend=backend))
    out, vid_grad, txt_grad, grads = _run(model, *_inputs(), grids=grids)
    winsp.sync_gradients([p for p in model.parameters()] , model.runtime)
    grads = {n: p.grad for n, p in model.named_parameters()}
    empty = any(c == 0 for c in model.runtime.plans(grids, split_windows=False)[0].rank_token_counts)
    return out, grads, empty


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_biased_windows_equal_the_original_model(world_size):
    want_out, _, _, want = _run(_weights(PlainBiasedWindows()), *_inputs())
    results = run_ranks(_parallel, world_size, timeout=240) if world_size > 1 else [_parallel(0, 1)]
    for out, grads, _ in results:
        assert (out - want_out).abs().max() <= 1e-12
        assert grads.keys() == want.keys()
        for name, g in grads.items():
            assert _rel(g, want[name]) <= 1e-9, name


@pytest.mark.multirank
def test_biased_windows_with_a_rank_that_has_no_window():
    grids = [(2, 3, 4)]  # 2 windows in layer 0, 4 in the shifted layer: at 3 ranks one rank holds nothing in layer 0
    vid, txt = _inputs()
    vid = vid[:24]
    want_out, _, _, want = _run(_weights(PlainBiasedWindows()), vid, txt[:3], grids=grids)
    results = run_ranks(_parallel_small, 3, timeout=240)
    assert any(empty for _, _, empty in results)
    for out, grads, _ in results:
        assert (out - want_out).abs().max() <= 1e-12
        for name, g in grads.items():
            assert _rel(g, want[name]) <= 1e-9, name


def _parallel_small(rank, world_size):
    model = _weights(BiasedWindows())
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    vid, txt = _inputs()
    out, _, _, _ = _run(model, vid[:24], txt[:3], grids=[(2, 3, 4)])
    winsp.sync_gradients(list(model.parameters()), model.runtime)
    grads = {n: p.grad for n, p in model.named_parameters()}
    empty = any(c == 0 for c in model.runtime.plans([(2, 3, 4)], split_windows=False)[0].rank_token_counts)
    return out, grads, empty


def test_flex_backend_runs_the_model_in_inference():
    """Eager FlexAttention evaluates the score_mod on every pair, across windows too: it must stay in bounds."""
    plain = _weights(PlainBiasedWindows())
    model = _weights(BiasedWindows())
    model.build_runtime(winsp.DiffusionParallelConfig(attention_backend="flex"))
    with torch.no_grad():
        vid, txt = _inputs()
        assert (model(vid, txt, GRIDS, LENGTHS) - plain(vid, txt, GRIDS, LENGTHS)).abs().max() <= 1e-12


# ---- the request knows which layer it serves ---------------------------------------------------------------------

class _ForgetsToLayer(BiasedWindows):
    """The winsp model with one ``to_layer`` missing: its rows stay in layer 0's layout for layer 1."""

    def forward(self, vid, txt, grids, text_lengths):
        request = self.require_runtime().request(grids, text_lengths)
        x = request.scatter(vid)
        for block in self.blocks:
            q, k, v = block.split(block.qkv(block.norm(x)))
            qt, kt, vt = block.split(block.qkv(block.norm(txt)))
            a, at = request.attention(q, k, v, qt, kt, vt, layer=block.layer)
            x, txt = x + block.out(a.flatten(1)), txt + block.out(at.flatten(1))
        return request.gather(x)


def test_attention_refuses_rows_left_in_another_layers_layout():
    model = _weights(_ForgetsToLayer())
    with pytest.raises(ValueError, match=r"layer 1 attends in the windows of FixedWindows\(.*shift=\(1, 1, 2\)\).*"
                                         r"rows are in layer 0's layout \(FixedWindows\(.*shift=\(0, 0, 0\)\)\).*"
                                         r"to_layer\(x, 1\)"):
        model(*_inputs(), GRIDS, LENGTHS)


def test_layers_of_one_geometry_share_a_layout_without_to_layer():
    rt = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))] * 2)
    req = rt.request([(2, 4, 4)])
    x = req.scatter(torch.randn(32, 1, 4))
    req.attention(x, x, x, layer=1)  # same layout as layer 0: nothing to move, nothing to refuse
    with pytest.raises(TypeError, match="layer"):
        req.attention(x, x, x)
    with pytest.raises(ValueError, match="layer 2 is outside"):
        req.attention(x, x, x, layer=2)


# ---- layout hooks ------------------------------------------------------------------------------------------------

def test_layout_hooks_run_once_per_layout_and_are_read_per_layer():
    calls = []

    def hook(local, device):
        calls.append(local.plan.key)
        return torch.from_numpy(local.window_ids.copy())

    rt = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2)), winsp.FixedWindows((1, 2, 2), shift=(0, 1, 1))] * 2)
    rt.register_layout_hook("ids", hook)
    for _ in range(3):
        req = rt.request([(2, 4, 6)])
    assert len(calls) == 2  # two layouts, built once, then found in the store
    x = req.scatter(torch.randn(48, 3))
    assert torch.equal(req.layout_data("ids"), req.window_ids)
    x = req.to_layer(x, 1)
    assert torch.equal(req.layout_data("ids"), req.window_ids)
    assert torch.equal(req.layout_data("ids", layer=2), req.layout_data("ids", layer=0))
    with pytest.raises(ValueError, match="no layout hook named 'other'.*registered: \\['ids'\\]"):
        req.layout_data("other")
    with pytest.raises(ValueError, match="non-empty string"):
        rt.register_layout_hook("", hook)
    with pytest.raises(ValueError, match="must be callable"):
        rt.register_layout_hook("x", 3)


def test_window_ids_and_row_order_are_the_documented_ones():
    """Local rows are window-major; inside a window, raster (t, h, w) order; ids name the layout's windows."""
    rt = winsp.WindowRuntime([winsp.FixedWindows((2, 2, 3), shift=(1, 1, 1))])
    req = rt.request([(3, 5, 7), (2, 2, 2)])
    req.scatter(torch.zeros(3 * 5 * 7 + 8, 1))
    local = req.local()
    layout = local.plan.layout
    ids, local_window = req.window_ids.numpy(), req.local_window.numpy()
    assert np.array_equal(ids, local.windows[local_window])
    assert np.all(np.diff(local_window) >= 0)
    coords, shapes = req.window_coords.numpy(), req.window_shape.numpy()
    for w in range(len(local.windows)):
        rows = np.flatnonzero(local_window == w)
        assert len(rows) == layout.token_counts[local.windows[w]]
        raster = (coords[rows, 0] * shapes[rows, 1] + coords[rows, 1]) * shapes[rows, 2] + coords[rows, 2]
        assert np.array_equal(raster, np.arange(len(rows)))
        grid = req.grid_coords.numpy()[rows]
        assert np.array_equal(grid - grid[0], coords[rows])  # window-local = global minus the window's corner
