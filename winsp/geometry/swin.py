"""Swin's windowing, exactly: windows clamped to the grid, no shift on a clamped axis, padding to whole windows.

The Swin papers (and torchvision's ``swin3d_*`` / ``swin_*``) attend inside windows of a fixed size. Their rules:

- on an axis where the grid is not larger than the window, the window shrinks to the grid and does not shift there
  (torchvision's ``_get_window_and_shift_size``; at swin3d_t's last stage, grid 2 x 7 x 7 and window 8 x 7 x 7 give
  one 2 x 7 x 7 window, never a 3 + 4 split);
- the grid is padded with zeros to whole windows (the padding is added to the *normed* input, before qkv, so padded
  keys carry the qkv bias and take part in attention);
- a shifted layer rolls the padded grid by ``-shift`` and masks pairs that the roll brought together.

:class:`SwinWindows` lays windows on the *padded* grid with the clipped-shift formulation: no roll, the shifted
windows are cut at ``shift, shift + window, ...`` and clipped at the borders. On a grid that is a multiple of the
window, these windows are exactly the roll + mask groups (``tests/test_swin_geometry.py`` checks it against
torchvision's own mask); the mask's ``-100`` leaves about ``e**-100`` of weight on masked pairs, which clipping drops.
On any other grid, padding is what keeps the result exact: with ``pad=True`` (the default) :meth:`padded_grid` is the
grid rounded up to whole windows, the padding rows are part of the layout, ``request.valid_rows`` marks them, and an
attention module zeroes them before its qkv, which is what torchvision's ``F.pad`` does. With ``pad=False`` the
windows are clipped at the grid's end and padded keys simply do not exist (a different, cheaper model).

Relative position bias: Swin builds a ``[V, V]`` index for the full window (``V = Wt * Wh * Ww``) and, for a clamped
window of volume ``v``, uses its top-left ``[v, v]`` block, i.e. the pair of *raster positions* inside the rolled
window, read with the full window's strides. :func:`window_raster` gives that raster position for each row, so a
score_mod reproduces Swin's bias in every case, clamped or not (:func:`relative_position_score_mod`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from winsp.geometry.windows import (
    FixedWindows,
    Grid,
    WindowGeometry,
    WindowSlices,
    _checked_window_and_shift,
    check_grid,
)

__all__ = ["SwinWindows", "window_raster", "relative_position_score_mod"]


@dataclass(frozen=True)
class SwinWindows(WindowGeometry):
    """Swin's windows of ``window_size`` tokens, shifted by ``shift`` (torchvision's rules; module docstring).

    Args:
        window_size: the configured (t, h, w) window.
        shift: the configured shift (0 on every axis for a regular layer, ``window // 2`` for a shifted one).
        pad: lay windows on the grid padded to whole windows (exactly Swin); False clips them at the grid's end.
        clamp: shrink the window to a smaller grid and drop its shift there (torchvision's rule, per axis); False keeps
            ``window_size`` and ``shift`` on every grid (a model that clamped them itself, e.g. Hugging Face Swin V2
            from its configured resolution, then pads a smaller input up to one whole window).
    """

    window_size: Grid
    shift: Grid = (0, 0, 0)
    pad: bool = True
    clamp: bool = True

    def __post_init__(self) -> None:
        window, shift = _checked_window_and_shift(self.window_size, self.shift)
        object.__setattr__(self, "window_size", window)
        object.__setattr__(self, "shift", shift)
        for name in ("pad", "clamp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def effective(self, grid: Sequence[int]) -> tuple[Grid, Grid]:
        """(window, shift) used on ``grid``: an axis not larger than the window takes the grid's size and no shift
        (unless ``clamp`` is False)."""
        grid = check_grid(grid)
        if not self.clamp:
            return self.window_size, self.shift
        window = tuple(g if g <= k else k for g, k in zip(grid, self.window_size, strict=True))
        shift = tuple(0 if g <= k else s for g, k, s in zip(grid, self.window_size, self.shift, strict=True))
        return window, shift  # type: ignore[return-value]

    def padded_grid(self, grid: Sequence[int]) -> Grid:
        """``grid`` rounded up to whole (clamped) windows when ``pad`` is set, else ``grid``."""
        grid = check_grid(grid)
        if not self.pad:
            return grid
        window, _ = self.effective(grid)
        return tuple(-(-g // k) * k for g, k in zip(grid, window, strict=True))  # type: ignore[return-value]

    def slices(self, grid: Grid) -> list[WindowSlices]:
        window, shift = self.effective(grid)
        return FixedWindows(window, shift).slices(grid)


def window_raster(geometry: SwinWindows, grid_coords: Tensor, grids: Tensor) -> Tensor:
    """[L] raster position of each row inside its rolled Swin window, read with the *full* window's extent.

    ``grid_coords`` [L, 3] are the rows' (t, h, w) in their sample's laid grid (``request.grid_coords``); ``grids``
    [L, 3] that grid per row (the padded grid). The row's position in the window after Swin's roll is
    ``((coord - shift) mod grid) mod window`` with the clamped window and shift; its raster index in that window is
    what Swin uses to index the full window's relative position table (module docstring).
    """
    full = torch.tensor(geometry.window_size, device=grids.device)
    clamped = (grids <= full) & geometry.clamp  # geometry.clamp False: the window and shift as configured
    window = torch.where(clamped, grids, full)
    shift = torch.where(clamped, 0, torch.tensor(geometry.shift, device=grids.device))
    local = torch.remainder(torch.remainder(grid_coords - shift, grids), window)
    return (local[:, 0] * window[:, 1] + local[:, 1]) * window[:, 2] + local[:, 2]


def relative_position_score_mod(table: Tensor, index: Tensor, raster: Tensor):
    """A score_mod adding Swin's relative position bias ``table[index[raster_q, raster_k], head]``.

    ``table`` [entries, heads] is the learned bias table (it gets its gradient through the score_mod), ``index`` the
    full window's ``[V, V]`` (or flattened ``[V * V]``) relative position index, ``raster`` [L] from
    :func:`window_raster` for the current layout's local rows.
    """
    full = index.reshape(-1)
    volume = int(round(full.numel() ** 0.5))

    def score_mod(score: Tensor, head: Tensor, q_row: Tensor, k_row: Tensor) -> Tensor:
        return score + table[full[raster[q_row] * volume + raster[k_row]], head]

    return score_mod
