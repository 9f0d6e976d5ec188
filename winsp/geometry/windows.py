"""3D window geometry: which windows tile a post-patch token grid, in which order.

A *geometry* turns a token grid (T, H, W) into an ordered list of half-open boxes that partition it. SeedVR2's
720p-normalised regular and shifted windowings are built in and reproduce the reference exactly; other models bring
their own by subclassing :class:`WindowGeometry` (see :class:`FixedWindows` for Swin-style fixed-size windows).
Every geometry has a stable SHA-1 fingerprint over its kind, parameters and version, which is what plan caches key on.
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Sequence

__all__ = [
    "Grid",
    "WindowSlices",
    "WindowGeometry",
    "SeedVR2Windows",
    "FixedWindows",
    "make_geometry",
    "window_slices",
    "check_grid",
    "REGULAR_METHOD",
    "SHIFTED_METHOD",
    "MAX_TEMPORAL_WINDOW",
    "REFERENCE_AREA",
]

Grid = tuple[int, int, int]
WindowSlices = tuple[slice, slice, slice]

REGULAR_METHOD = "720pwin_by_size_bysize"
SHIFTED_METHOD = "720pswin_by_size_bysize"
_METHOD_ALIASES = {REGULAR_METHOD: False, SHIFTED_METHOD: True, "regular": False, "shifted": True}
MAX_TEMPORAL_WINDOW = 30  # frames of post-patch tokens a SeedVR2 window may span (BYTEDANCE_MAX_TEMPORAL_WINDOW)
REFERENCE_AREA = (45, 80)  # post-patch token grid of a 720p frame: window sizes are normalised to this area


def _positive_int_triple(value: Sequence[int], name: str) -> Grid:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 3:
        raise ValueError(f"{name} must be three integers (t, h, w), got {value!r}")
    out = []
    for axis, v in zip("thw", value, strict=True):
        if isinstance(v, bool) or not isinstance(v, int):
            # numpy / torch integer scalars are accepted, floats are not
            if hasattr(v, "__index__") and not isinstance(v, bool):
                v = v.__index__()
            else:
                raise ValueError(f"{name}[{axis}] must be an integer, got {v!r}")
        if v < 1:
            raise ValueError(f"{name}[{axis}] must be >= 1, got {v}")
        out.append(int(v))
    return out[0], out[1], out[2]


def check_grid(grid: Sequence[int], name: str = "grid") -> Grid:
    """Validate a (T, H, W) token grid and return it as a tuple of ints."""
    return _positive_int_triple(grid, name)


class WindowGeometry(ABC):
    """How a model partitions a post-patch token grid into attention windows.

    Subclasses are frozen dataclasses (hashable, comparable) implementing :meth:`slices`. The windows must be an exact
    partition of the grid; their order is the window id order that plans and layouts use.
    """

    #: bump when the windows produced for the same parameters change, so stale cached plans can never be reused
    version: int = 1

    @property
    def kind(self) -> str:
        return type(self).__name__

    @abstractmethod
    def slices(self, grid: Grid) -> list[WindowSlices]:
        """Ordered half-open (t, h, w) slices of the non-empty windows of ``grid``."""

    def padded_grid(self, grid: Grid) -> Grid:
        """The grid the windows are laid on for a model grid ``grid``: ``grid`` itself unless the model pads.

        A geometry that pads (:class:`winsp.SwinWindows` with ``pad=True``: torchvision's Swin pads the grid to whole
        windows) returns the larger grid; :class:`winsp.StagedRuntime` then keeps padding rows, which the request
        marks as such (``request.valid_rows``) and which never appear in a gathered output.
        """
        return check_grid(grid)

    def params(self) -> dict:
        """The parameters that determine the windows (for the fingerprint)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @cached_property
    def fingerprint(self) -> str:
        """SHA-1 over the geometry kind, its parameters and its version: stable across processes and runs."""
        payload = json.dumps(
            {"kind": self.kind, "params": self.params(), "version": self.version}, sort_keys=True, default=list
        )
        return hashlib.sha1(payload.encode()).hexdigest()


def _seedvr2_window_size(grid: Grid, num_windows: Grid) -> Grid:
    t, h, w = grid
    nt, nh, nw = num_windows
    scale = math.sqrt(REFERENCE_AREA[0] * REFERENCE_AREA[1] / (h * w))
    wh = math.ceil(round(h * scale) / nh)
    ww = math.ceil(round(w * scale) / nw)
    wt = math.ceil(min(t, MAX_TEMPORAL_WINDOW) / nt)
    if wh < 1 or ww < 1:
        axis = "height" if wh < 1 else "width"
        raise ValueError(
            f"grid {grid}: the 720p-normalised window {axis} rounds to 0 tokens (the grid is too elongated: "
            f"SeedVR2 windows need round(H * s) >= 1 and round(W * s) >= 1 with s = sqrt({REFERENCE_AREA[0]} * "
            f"{REFERENCE_AREA[1]} / (H * W)), i.e. an aspect ratio W:H or H:W below "
            f"{REFERENCE_AREA[0] * REFERENCE_AREA[1] * 4}:1)"
        )
    return wt, wh, ww


def _regular_cuts(size: int, win: int) -> list[tuple[int, int]]:
    return [(i * win, min((i + 1) * win, size)) for i in range(math.ceil(size / win))]


def _shifted_cuts(size: int, win: int) -> list[tuple[int, int]]:
    # Cuts moved by half a window and clipped to [0, size]: a half-size window at each end, not a cyclic roll.
    if win >= size:
        return [(0, size)]
    count = math.ceil((size - 0.5) / win) + 1
    cuts = [(max(int((i - 0.5) * win), 0), min(int((i + 0.5) * win), size)) for i in range(count)]
    return [(a, b) for a, b in cuts if b > a]


def _boxes(grid: Grid, cut_fn, win: Grid) -> list[WindowSlices]:
    ct, ch, cw = (cut_fn(s, k) for s, k in zip(grid, win, strict=True))
    # Enumeration: w outermost, then h, then t innermost (the reference's window id order).
    return [
        (slice(t0, t1), slice(h0, h1), slice(w0, w1))
        for (w0, w1) in cw
        for (h0, h1) in ch
        for (t0, t1) in ct
        if t1 > t0 and h1 > h0 and w1 > w0
    ]


@dataclass(frozen=True)
class SeedVR2Windows(WindowGeometry):
    """SeedVR2's windowing: a fixed *number* of windows per 720p-equivalent area, regular or shifted by half a window.

    The window size is ``ceil(round(H * s) / nh)`` x ``ceil(round(W * s) / nw)`` with ``s = sqrt(45*80 / (H*W))``, and
    ``ceil(min(T, 30) / nt)`` in time, so larger frames get more windows, never larger ones.
    """

    num_windows: Grid
    shifted: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_windows", _positive_int_triple(self.num_windows, "num_windows"))
        if not isinstance(self.shifted, bool):
            raise ValueError(f"shifted must be a bool, got {self.shifted!r}")

    @property
    def method(self) -> str:
        return SHIFTED_METHOD if self.shifted else REGULAR_METHOD

    def window_size(self, grid: Grid) -> Grid:
        """The (unclipped) window extent used for ``grid``."""
        return _seedvr2_window_size(check_grid(grid), self.num_windows)

    def slices(self, grid: Grid) -> list[WindowSlices]:
        grid = check_grid(grid)
        win = _seedvr2_window_size(grid, self.num_windows)
        return _boxes(grid, _shifted_cuts if self.shifted else _regular_cuts, win)


def _checked_window_and_shift(window_size: Sequence[int], shift: Sequence[int]) -> tuple[Grid, Grid]:
    """``(window_size, shift)`` as three ints each, checked: windows positive, ``0 <= shift < window`` per axis."""
    window = _positive_int_triple(window_size, "window_size")
    moved = tuple(shift)
    if len(moved) != 3 or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in moved):
        raise ValueError(f"shift must be three non-negative integers, got {shift!r}")
    for axis, s, k in zip("thw", moved, window, strict=True):
        if s >= k:
            raise ValueError(f"shift[{axis}]={s} must be smaller than window_size[{axis}]={k}")
    return window, (moved[0], moved[1], moved[2])


@dataclass(frozen=True)
class FixedWindows(WindowGeometry):
    """Swin-style windows of a fixed token size, optionally shifted (clipped at the borders, no cyclic roll).

    ``shift`` moves every cut forward by that many tokens per axis, producing partial windows at both ends.
    """

    window_size: Grid
    shift: Grid = (0, 0, 0)

    def __post_init__(self) -> None:
        window, shift = _checked_window_and_shift(self.window_size, self.shift)
        object.__setattr__(self, "window_size", window)
        object.__setattr__(self, "shift", shift)

    def slices(self, grid: Grid) -> list[WindowSlices]:
        grid = check_grid(grid)

        def cuts(axis: int):
            size, win, s = grid[axis], self.window_size[axis], self.shift[axis]
            starts = [0] + list(range(s if s else win, size, win))
            return [(a, min(b, size)) for a, b in zip(starts, starts[1:] + [size], strict=True) if b > a]

        per_axis = [cuts(a) for a in range(3)]
        return [
            (slice(t0, t1), slice(h0, h1), slice(w0, w1))
            for (w0, w1) in per_axis[2]
            for (h0, h1) in per_axis[1]
            for (t0, t1) in per_axis[0]
        ]


def make_geometry(method: str, num_windows: Sequence[int]) -> SeedVR2Windows:
    """The SeedVR2 geometry for a reference method name (or the short names ``"regular"`` / ``"shifted"``)."""
    if method not in _METHOD_ALIASES:
        raise ValueError(
            f"unknown window method {method!r}; expected one of {sorted(_METHOD_ALIASES)}"
        )
    return SeedVR2Windows(num_windows=_positive_int_triple(num_windows, "num_windows"), shifted=_METHOD_ALIASES[method])


def window_slices(grid: Sequence[int], num_windows: Sequence[int], method: str) -> list[WindowSlices]:
    """SeedVR2 windows of a post-patch grid (T, H, W): ordered (t, h, w) slices, w outermost and t innermost."""
    if not isinstance(method, str):
        raise ValueError(f"method must be a string, got {method!r}")
    grid = check_grid(grid, "grid")
    num_windows = _positive_int_triple(num_windows, "num_windows")
    return make_geometry(method, num_windows).slices(grid)
