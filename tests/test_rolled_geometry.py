"""RolledWindows and GlobalWindow against dense references of each model family's own rule: Swin's roll by ``-s``
with its region labels, k-diffusion HDiT's roll by ``+s`` with its top / left window masks, and global attention."""

from __future__ import annotations

import itertools

import pytest
import torch

from winsp.geometry import FixedWindows, GlobalWindow, Neighborhood, RolledWindows


def same_window(geometry, grid) -> torch.Tensor:
    """[P, P] bool: positions (row-major t, h, w) that share one of the geometry's windows."""
    ids = torch.full(grid, -1)
    for i, (t, h, w) in enumerate(geometry.slices(grid)):
        assert (ids[t, h, w] == -1).all()  # a partition: no position in two windows
        ids[t, h, w] = i
    assert (ids >= 0).all()
    flat = ids.reshape(-1)
    return flat[:, None] == flat[None, :]


def swin_reference(grid, window, shift) -> torch.Tensor:
    """Swin's rule: roll by -shift, cut windows, label the regions (0, -window), (-window, -shift), (-shift, None) per
    axis, and let pairs of one window with equal labels attend."""
    label = torch.zeros(grid, dtype=torch.long)
    count = 0
    per_axis = [((slice(0, -k), slice(-k, -s), slice(-s, None)) if s else (slice(None),))
                for k, s in zip(window, shift, strict=True)]
    for t, h, w in itertools.product(*per_axis):
        label[t, h, w] = count
        count += 1
    pos = torch.arange(label.numel()).reshape(grid)
    rolled_pos = torch.roll(pos, [-s for s in shift], dims=(0, 1, 2))
    win = [torch.arange(n) // k for n, k in zip(grid, window, strict=True)]
    win_id = (win[0][:, None, None] * 1000 + win[1][None, :, None] * 100 + win[2][None, None, :])
    allowed = torch.zeros(label.numel(), label.numel(), dtype=torch.bool)
    p, wid, lab = rolled_pos.reshape(-1), win_id.reshape(-1), label.reshape(-1)  # labels: rolled frame
    allowed[p[:, None], p[None, :]] = (wid[:, None] == wid[None, :]) & (lab[:, None] == lab[None, :])
    return allowed


def hdit_reference(h, w, window, shift) -> torch.Tensor:
    """k-diffusion HDiT's rule on an [H, W] grid: roll by +shift, cut windows; inside the top windows rows above the
    shift only see rows above it, inside the left windows columns left of the shift only see columns left of it."""
    pos = torch.roll(torch.arange(h * w).reshape(h, w), (shift, shift), dims=(0, 1))
    allowed = torch.zeros(h * w, h * w, dtype=torch.bool)
    for y0 in range(0, h, window):
        for x0 in range(0, w, window):
            cells = [(y, x) for y in range(y0, y0 + window) for x in range(x0, x0 + window)]
            for (qy, qx), (ky, kx) in itertools.product(cells, cells):
                ok = True
                if y0 == 0 and ((qy - y0) < shift) != ((ky - y0) < shift):
                    ok = False
                if x0 == 0 and ((qx - x0) < shift) != ((kx - x0) < shift):
                    ok = False
                allowed[pos[qy, qx], pos[ky, kx]] = ok
    return allowed


@pytest.mark.parametrize("grid,window,shift", [((4, 8, 8), (2, 4, 4), (1, 2, 2)), ((2, 6, 9), (2, 3, 3), (0, 1, 2)),
                                               ((3, 4, 4), (3, 4, 4), (0, 0, 0)), ((4, 6, 6), (2, 3, 3), (1, 1, 1))])
def test_rolled_back_by_s_is_swins_roll_and_region_mask(grid, window, shift):
    geometry = RolledWindows(window, tuple(-s for s in shift))
    assert torch.equal(same_window(geometry, grid), swin_reference(grid, window, shift))


@pytest.mark.parametrize("h,w,window,shift", [(8, 8, 4, 2), (8, 12, 4, 2), (6, 6, 3, 1), (4, 4, 4, 0), (9, 6, 3, 2)])
def test_rolled_forward_by_s_is_hdits_roll_and_top_left_masks(h, w, window, shift):
    geometry = RolledWindows((1, window, window), (0, shift, shift))
    assert torch.equal(same_window(geometry, (1, h, w)), hdit_reference(h, w, window, shift))


@pytest.mark.parametrize("window,s", [(4, 0), (4, 1), (4, 2), (4, 3), (3, 2)])
def test_rolled_forward_by_s_equals_fixed_windows_cut_at_window_minus_s_modulo_window(window, s):
    grid = (1, 2 * window, 3 * window)
    fixed = FixedWindows((1, window, window), (0, (window - s) % window, (window - s) % window))
    assert torch.equal(same_window(RolledWindows((1, window, window), (0, s, s)), grid), same_window(fixed, grid))


def test_the_global_window_is_every_pair():
    assert same_window(GlobalWindow(), (2, 3, 5)).all() and len(GlobalWindow().slices((2, 3, 5))) == 1
    assert GlobalWindow().fingerprint != RolledWindows((2, 3, 5)).fingerprint


def test_bad_rolls_are_refused_by_name():
    with pytest.raises(ValueError, match=r"RolledWindows.roll must be two or three integers, \(h, w\) or \(t, h, w\)"):
        RolledWindows((1, 4, 4), (0, 2, 2, 2))
    with pytest.raises(ValueError, match="RolledWindows.roll must be integers"):
        RolledWindows((1, 4, 4), (0, 2.0, 2))
    assert RolledWindows((4, 4), (2, 2)) == RolledWindows((1, 4, 4), (0, 2, 2))  # a 2D model: the last axes
    with pytest.raises(ValueError, match=r"window_size\[h\] must be >= 1"):
        RolledWindows((1, 0, 4))


def test_2d_and_3d_sizes_are_taken_alike_and_the_message_says_so():
    assert RolledWindows((4, 4), (2, 2)) == RolledWindows((1, 4, 4), (0, 2, 2))
    assert RolledWindows((2, 4, 4), (1, 2, 2)).window_size == (2, 4, 4)
    for window, roll in [(4, (2, 2)), ((4, 4), 2), ((1, 2, 4, 4), (0, 0))]:  # a bare int is neither: say so
        with pytest.raises(ValueError, match=r"must be two or three integers, \(h, w\) or \(t, h, w\), got"):
            RolledWindows(window, roll)
    assert Neighborhood((3, 3)) == Neighborhood((1, 3, 3)) and Neighborhood(3).kernel == (3, 3, 3)
    with pytest.raises(ValueError, match=r"Neighborhood kernel must be two or three values, \(h, w\) or \(t, h, w\)"):
        Neighborhood((1, 3, 3, 3))
