"""Neighborhood attention as a layer geometry: NATTEN's neighbourhoods on a (T, H, W) token grid.

Each query attends to the ``kernel`` nearest keys per axis in its own dilation group. NATTEN's rules, per axis of
size ``n`` with kernel ``k`` and dilation ``d``: position ``i`` lies in dilation group ``g = i % d`` at index
``j = i // d`` of that group (which has ``n_g`` members). Without causality its neighbourhood is the ``k``
consecutive group members around ``j``, *clamped* to stay inside the group: it shifts inward at the borders, so
every query always has exactly ``k`` keys per axis (``k // 2`` before and ``k // 2 - (1 - k % 2)`` after the centre
``clamp(j, k // 2, n_g - 1 - right)``). A causal axis takes the ``k`` members ending at ``j`` (fewer near the
start). The neighbourhood of a 3D query is the product of its per-axis neighbourhoods.

1D and 2D models use grids ``(1, 1, L)`` and ``(1, H, W)``: a kernel, dilation or causal flag with fewer than three
entries is read as the last axes (leading axes get kernel 1). The per-axis tables here are numpy, computed once per
grid; :mod:`winsp.planning.halo` turns them into per-rank key indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from winsp.geometry.windows import Grid, WindowGeometry, WindowSlices, check_grid

__all__ = ["Neighborhood", "axis_neighbours", "axis_reach", "neighbourhood_ids", "is_neighborhood"]


def _triple(value, name: str, fill, kind) -> tuple:
    if kind is int and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,) * 3
    if kind is bool and isinstance(value, (bool, np.bool_)):
        value = (value,) * 3
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not 1 <= len(value) <= 3:
        raise ValueError(f"Neighborhood {name} must be two or three values, (h, w) or (t, h, w) (or one for every "
                         f"axis), got {value!r}")
    out = (fill,) * (3 - len(value)) + tuple(value)
    for axis, v in zip("thw", out, strict=True):
        if kind is bool:
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"Neighborhood {name}[{axis}] must be a bool, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"Neighborhood {name}[{axis}] must be a positive integer, got {v!r}")
    return tuple(kind(v) for v in out)


@dataclass(frozen=True)
class Neighborhood(WindowGeometry):
    """Neighborhood attention of a layer: ``kernel`` keys per axis, ``dilation`` groups, ``causal`` axes (NATTEN's).

    Args:
        kernel: keys per axis, 2-D ``(h, w)`` or 3-D ``(t, h, w)`` alike: fewer than three values are the last axes (a
            2D kernel ``(7, 7)`` is ``(1, 7, 7)``, a 1-D ``(7,)`` is ``(1, 1, 7)``); one int means the same on all three
            axes.
        dilation: dilation per axis, read the same way (default 1).
        causal: per-axis causality (typically time only: ``(True, False, False)``); one bool applies to all axes.

    A grid axis of size ``n`` needs ``kernel * dilation <= n`` (as in NATTEN). Used as a layer's entry in a
    :class:`winsp.WindowRuntime` schedule; its rows are then cut into blocks, one per rank (:mod:`winsp.planning.halo`),
    and attention exchanges only halos.
    """

    kernel: Grid
    dilation: Grid = (1, 1, 1)
    causal: tuple[bool, bool, bool] = (False, False, False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", _triple(self.kernel, "kernel", 1, int))
        object.__setattr__(self, "dilation", _triple(self.dilation, "dilation", 1, int))
        object.__setattr__(self, "causal", _triple(self.causal, "causal", False, bool))

    @property
    def kernel_volume(self) -> int:
        """Keys per query away from causal borders (the product of the kernel)."""
        return int(np.prod(self.kernel))

    def check_fits(self, grid: Sequence[int], where: str = "grid") -> Grid:
        """``grid`` if every axis holds ``kernel * dilation`` tokens, else a ValueError naming the axis."""
        grid = check_grid(grid, where)
        for axis, n, k, d in zip("thw", grid, self.kernel, self.dilation, strict=True):
            if k * d > n:
                hint = "" if n > 1 else (f"; a 1D or 2D model's grid is (1, 1, L) / (1, H, W) and one int is a kernel "
                                         f"on all three axes: give the kernel of the model's axes only, e.g. "
                                         f"Neighborhood({tuple(self.kernel[a] for a in range(3) if grid[a] > 1)})")
                raise ValueError(f"{where} {grid}: neighborhood kernel {k} x dilation {d} along {axis} needs at least "
                                 f"{k * d} tokens there, the grid has {n} ({self!r}){hint}")
        return grid

    def slices(self, grid: Grid) -> list[WindowSlices]:
        raise ValueError(f"{self!r} is not a partition into windows: plan it with winsp.plan_schedule (its rows are "
                         "cut into per-rank blocks with halos), not as a window layout")


def is_neighborhood(geometry: object) -> bool:
    """Whether ``geometry`` is a :class:`Neighborhood` layer."""
    return isinstance(geometry, Neighborhood)


@lru_cache(maxsize=256)
def axis_neighbours(n: int, k: int, d: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-axis neighbourhoods: ``keys[i, m]`` the m-th key position of position ``i`` and ``valid[i, m]`` ([n, k]).

    Non-causal neighbourhoods always hold ``k`` valid keys; a causal one's invalid slots (before the axis start)
    hold the query's own position, masked by ``valid``. Cached (read-only arrays): planning asks for the same axes
    many times.
    """
    i = np.arange(n, dtype=np.int64)
    g, j = i % d, i // d
    group_size = n // d + (g < n % d)
    m = np.arange(k, dtype=np.int64)
    if causal:
        start = j - (k - 1)
        idx = start[:, None] + m[None, :]
        valid = idx >= 0
        idx = np.where(valid, idx, j[:, None])
    else:
        left, right = k // 2, k // 2 + (k % 2 - 1)
        centre = np.clip(j, left, group_size - 1 - right)
        idx = (centre - left)[:, None] + m[None, :]
        valid = np.ones((n, k), dtype=bool)
    keys = idx * d + g[:, None]
    keys.flags.writeable = False
    valid.flags.writeable = False
    return keys, valid


def axis_reach(n: int, k: int, d: int, causal: bool, lo: int, hi: int) -> np.ndarray:
    """Sorted positions of one axis that the queries in ``[lo, hi)`` reach (the union of their neighbourhoods)."""
    if hi <= lo:
        return np.empty(0, dtype=np.int64)
    keys, valid = axis_neighbours(int(n), int(k), int(d), bool(causal))
    keys, valid = keys[lo:hi], valid[lo:hi]
    return np.unique(keys if valid.all() else keys[valid])


def neighbourhood_ids(coords: np.ndarray, grid: Grid, geometry: Neighborhood) -> tuple[np.ndarray, np.ndarray]:
    """Canonical in-sample ids ``(t * H + h) * W + w`` of the keys of queries at ``coords`` [L, 3], and validity.

    Returns ``ids`` [L, K] and ``valid`` [L, K] with ``K = prod(kernel)``, keys in row-major kernel order.
    """
    t_, h_, w_ = grid
    tables = [axis_neighbours(n, k, d, c) for n, k, d, c in zip(grid, geometry.kernel, geometry.dilation,
                                                                  geometry.causal, strict=True)]
    (kt, vt), (kh, vh), (kw, vw) = ((keys[coords[:, a]], valid[coords[:, a]]) for a, (keys, valid) in enumerate(tables))
    ids = (kt[:, :, None, None] * h_ + kh[:, None, :, None]) * w_ + kw[:, None, None, :]
    valid = vt[:, :, None, None] & vh[:, None, :, None] & vw[:, None, None, :]
    return ids.reshape(len(coords), -1), valid.reshape(len(coords), -1)
