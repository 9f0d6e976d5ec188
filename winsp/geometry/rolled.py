"""Windows of models that roll the grid: a cyclic ``torch.roll`` by ``roll`` tokens, windows of a fixed size laid on
the rolled grid from its origin, and a mask keeping the strip that wrapped around apart from the rest of its window.

Swin-family models shift this way (Swin rolls by ``-s``; k-diffusion's HDiT rolls by ``+s``). On each axis a token at
``p`` of a grid of ``n`` lands at ``(p + roll) mod n``, in window ``(p + roll) mod n // window``; two tokens attend to
each other when they share that window on every axis *and* agree on every axis about having wrapped
(``p + roll`` outside ``[0, n)``). Each such group is a contiguous box of the unrolled grid, so the windows are plain
boxes and no roll is needed on local rows: rolling by ``+s`` cuts each axis at ``(window - s) % window`` plus
multiples of ``window``, rolling by ``-s`` at ``s``. :class:`GlobalWindow` is one window over the whole grid.
"""

from __future__ import annotations

from dataclasses import dataclass

from winsp.geometry.windows import Grid, WindowGeometry, WindowSlices, _positive_int_triple, check_grid

__all__ = ["RolledWindows", "GlobalWindow", "rolled_cuts"]


def rolled_cuts(size: int, window: int, roll: int) -> list[tuple[int, int]]:
    """Half-open runs of one axis of ``size`` tokens that share a window and a wrap flag after rolling by ``roll``."""
    runs: list[tuple[int, int]] = []
    previous = None
    for p in range(size):
        moved = p + roll
        group = ((moved % size) // window, moved < 0 or moved >= size)
        if group != previous:
            runs.append((p, p + 1))
            previous = group
        else:
            runs[-1] = (runs[-1][0], p + 1)
    return runs


def _last_axes(value, fill: int, name: str) -> tuple:
    """A 2-D ``(h, w)`` or 3-D ``(t, h, w)`` size as ``(t, h, w)``, the missing leading axes ``fill`` (a 1-D ``(l,)``
    too: grid ``(1, 1, L)``)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not 1 <= len(value) <= 3:
        raise ValueError(f"RolledWindows.{name} must be two or three integers, (h, w) or (t, h, w), got {value!r}")
    return (fill,) * (3 - len(value)) + tuple(value)


@dataclass(frozen=True)
class RolledWindows(WindowGeometry):
    """Windows of ``window_size`` tokens on the grid rolled by ``roll`` per (t, h, w) axis, the wrapped strip masked
    (module docstring). ``roll`` is signed as ``torch.roll``'s ``shifts``: ``(0, s, s)`` for a model that calls
    ``torch.roll(x, (s, s), dims=(h, w))`` before cutting windows, ``(0, -s, -s)`` for Swin's ``-shift``. 2-D and 3-D
    sizes alike: two values are the last axes (``((w, w), (s, s))`` for a 2D model: window ``(1, w, w)``, roll
    ``(0, s, s)``)."""

    window_size: Grid
    roll: Grid = (0, 0, 0)

    def __post_init__(self) -> None:
        window, roll = (_last_axes(v, fill, name) for v, fill, name in ((self.window_size, 1, "window_size"),
                                                                         (self.roll, 0, "roll")))
        object.__setattr__(self, "window_size", _positive_int_triple(window, "RolledWindows.window_size"))
        if any(isinstance(r, bool) or not isinstance(r, int) for r in roll):
            raise ValueError(f"RolledWindows.roll must be integers, got {self.roll!r}")
        object.__setattr__(self, "roll", roll)

    def slices(self, grid: Grid) -> list[WindowSlices]:
        grid = check_grid(grid)
        t, h, w = (rolled_cuts(n, k, r) for n, k, r in zip(grid, self.window_size, self.roll, strict=True))
        return [(slice(*a), slice(*b), slice(*c)) for c in w for b in h for a in t]


@dataclass(frozen=True)
class GlobalWindow(WindowGeometry):
    """One window over the whole grid: global attention (a stage may let the planner split it across ranks)."""

    def slices(self, grid: Grid) -> list[WindowSlices]:
        t, h, w = check_grid(grid)
        return [(slice(0, t), slice(0, h), slice(0, w))]
