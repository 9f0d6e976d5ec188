"""Swin geometry: torchvision's clamping rule, clipped shifted windows == roll + mask, padding, bias raster positions.

- An axis whose grid is not larger than the window takes the grid's size and no shift (at swin3d_t's last stage, grid
  2 x 7 x 7 is one window, where plain ``FixedWindows`` splits 7 into 3 + 4).
- On a grid that is a multiple of the window, the clipped shifted windows are exactly the groups of torchvision's
  roll + mask (its own ``_compute_attention_mask_3d``).
- Otherwise padding decides: with ``pad=True`` the windows lie on the padded grid and winsp's attention (padding rows
  zeroed before qkv) equals torchvision's; clipping instead (``pad=False``) drops the padded keys and differs.
- :func:`winsp.geometry.swin.window_raster` is the raster position torchvision indexes its bias with, clamped axes
  included.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import winsp
from winsp.geometry.swin import window_raster

if importlib.util.find_spec("torchvision") is None:
    pytest.skip("torchvision is not installed (pip install -e '.[test]')", allow_module_level=True)

from examples.swin3d import SwinAttention3d, import_torchvision  # noqa: E402

import_torchvision()
from torchvision.models.video.swin_transformer import (  # noqa: E402
    ShiftedWindowAttention3d,
    _compute_attention_mask_3d,
)


def _rolled_windows(grid, window, shift):
    """[nW, V] canonical ids of each rolled window's raster positions (torchvision's partition after the roll)."""
    t, h, w = grid
    ids = torch.arange(t * h * w).reshape(1, t, h, w, 1)
    if sum(shift):
        ids = torch.roll(ids, shifts=tuple(-s for s in shift), dims=(1, 2, 3))
    parts = ids.view(1, t // window[0], window[0], h // window[1], window[1], w // window[2], window[2], 1)
    return parts.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, window[0] * window[1] * window[2])


def _roll_mask_groups(grid, window, shift):
    """torchvision's attention groups: within each rolled window, tokens whose mask entry is 0 attend each other."""
    windows = _rolled_windows(grid, window, shift)
    groups = set()
    if not sum(shift):
        return {frozenset(row.tolist()) for row in windows}
    mask = _compute_attention_mask_3d(torch.zeros(1), grid, window, shift)  # [nW, V, V]: 0 same region, -100 not
    for row, m in zip(windows, mask):
        for i in range(row.numel()):
            groups.add(frozenset(row[m[i] == 0].tolist()))
    return groups


def _winsp_groups(geometry, grid):
    t, h, w = grid
    ids = torch.arange(t * h * w).reshape(t, h, w)
    return {frozenset(ids[box].reshape(-1).tolist()) for box in geometry.slices(grid)}


@settings(max_examples=30, deadline=None)
@given(window=st.tuples(*[st.integers(1, 4)] * 3), multiple=st.tuples(*[st.integers(2, 3)] * 3),
       data=st.data())
def test_clipped_shifted_windows_equal_roll_and_mask_on_whole_windows(window, multiple, data):
    shift = tuple(data.draw(st.integers(0, k - 1)) for k in window)
    grid = tuple(k * m for k, m in zip(window, multiple))
    geometry = winsp.SwinWindows(window, shift)
    assert geometry.padded_grid(grid) == grid
    assert _winsp_groups(geometry, grid) == _roll_mask_groups(grid, window, shift)


def test_window_clamps_to_the_grid_without_shift():
    geometry = winsp.SwinWindows((8, 7, 7), (4, 3, 3))
    assert geometry.effective((2, 7, 7)) == ((2, 7, 7), (0, 0, 0))
    assert geometry.slices((2, 7, 7)) == [(slice(0, 2), slice(0, 7), slice(0, 7))]
    assert len(winsp.FixedWindows((8, 7, 7), (4, 3, 3)).slices((2, 7, 7))) == 4  # 7 = 3 + 4 on two axes
    assert geometry.effective((16, 4, 9)) == ((8, 4, 7), (4, 0, 3))
    assert geometry.padded_grid((16, 4, 9)) == (16, 4, 14)
    assert winsp.SwinWindows((8, 7, 7), (4, 3, 3), pad=False).padded_grid((16, 4, 9)) == (16, 4, 9)
    with pytest.raises(ValueError, match="shift\\[h\\]=7 must be smaller"):
        winsp.SwinWindows((8, 7, 7), (0, 7, 0))


@pytest.mark.parametrize("grid, window, shift", [((4, 6, 9), (2, 3, 3), (1, 1, 1)), ((2, 4, 4), (8, 7, 7), (4, 3, 3)),
                                                  ((8, 14, 7), (8, 7, 7), (4, 3, 3)), ((3, 2, 5), (2, 7, 7), (1, 3, 3))])
def test_window_raster_is_torchvisions_raster_position(grid, window, shift):
    geometry = winsp.SwinWindows(window, shift)
    laid = geometry.padded_grid(grid)
    eff_window, eff_shift = geometry.effective(laid)
    expected = torch.empty(laid[0] * laid[1] * laid[2], dtype=torch.long)
    for row in _rolled_windows(laid, eff_window, eff_shift):
        expected[row] = torch.arange(row.numel())
    t, h, w = laid
    ids = torch.arange(t * h * w)
    coords = torch.stack([ids // (h * w), (ids // w) % h, ids % w], -1)
    got = window_raster(geometry, coords, torch.tensor(laid).expand(ids.numel(), 3))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("shift", [(0, 0, 0), (1, 1, 1)])
def test_padding_is_what_keeps_a_non_multiple_grid_exact(shift):
    torch.manual_seed(0)
    original = ShiftedWindowAttention3d(16, [2, 3, 3], list(shift), num_heads=2).double()
    with torch.no_grad():
        original.qkv.bias.normal_()  # padded keys carry this bias
    x = torch.randn(2, 3, 4, 5, 16, dtype=torch.float64)  # grid 3 x 4 x 5: no axis is a multiple of the window
    expected = original(x)
    errors = {}
    for pad in (True, False):
        runtime = winsp.runtime.StagedRuntime([winsp.Stage([winsp.SwinWindows((2, 3, 3), shift, pad=pad)])])
        request = runtime.request([(3, 4, 5)] * 2)
        with request.active():
            out = SwinAttention3d(original, 0)(request.scatter(x.reshape(-1, 16)))
            errors[pad] = (request.gather(out).reshape(x.shape) - expected).abs().max().item()
    assert errors[True] < 1e-12
    assert errors[False] > 1e-3  # clipping instead of padding drops torchvision's padded keys
