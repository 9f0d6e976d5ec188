"""Neighborhood attention as a layer geometry: NATTEN's neighbourhoods on a (T, H, W) token grid.

Each query attends to the ``kernel`` nearest keys per axis in its own dilation group. NATTEN's rules, per axis of
size ``n`` with kernel ``k``, stride ``s`` and dilation ``d``: position ``i`` lies in dilation group ``g = i % d`` at
index ``j = i // d`` of that group (which has ``n_g`` members). The group's members are cut into *stride groups* of
``s`` consecutive members (the last one ragged); every query of a stride group takes the window of its *leader*.
Without causality the leader is the stride group's centre member (``start + s // 2``, at most ``n_g - 1``) and the
neighbourhood is the ``k`` consecutive members around it, *clamped* to stay inside the dilation group: it shifts inward
at the borders, so every query always has exactly ``k`` keys per axis (``k // 2`` before and ``k // 2 - (1 - k % 2)``
after the centre ``clamp(leader, k // 2, n_g - 1 - right)``). On a causal axis the leader is the stride group's last
member (at most ``n_g - 1``) and a query takes the members in ``(leader - k, j]``: never a key after itself, fewer
near the start. Stride 1 makes every query its own leader (plain neighbourhood attention); ``s == k`` is blocked
attention; ``k = tile * tiles`` with ``s = tile`` is sliding tile attention. The neighbourhood of a 3D query is the
product of its per-axis neighbourhoods.

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

__all__ = ["Neighborhood", "axis_neighbours", "axis_reach", "neighbourhood_ids", "is_neighborhood", "axis_work"]


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
        stride: NATTEN's ``stride`` per axis, read the same way (default 1), at most the kernel: the queries of each
            stride group share one neighbourhood (its leader's). ``stride == kernel`` is blocked attention;
            :meth:`sliding_tile` is sliding tile attention. Pass it by keyword (the positional order
            ``kernel, dilation, causal`` predates it).

    A grid axis of size ``n`` needs ``kernel * dilation <= n`` (as in NATTEN). Used as a layer's entry in a
    :class:`winsp.WindowRuntime` schedule; its rows are then cut into blocks, one per rank (:mod:`winsp.planning.halo`),
    and attention exchanges only halos.
    """

    kernel: Grid
    dilation: Grid = (1, 1, 1)
    causal: tuple[bool, bool, bool] = (False, False, False)
    stride: Grid = (1, 1, 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", _triple(self.kernel, "kernel", 1, int))
        object.__setattr__(self, "dilation", _triple(self.dilation, "dilation", 1, int))
        object.__setattr__(self, "causal", _triple(self.causal, "causal", False, bool))
        object.__setattr__(self, "stride", _triple(self.stride, "stride", 1, int))
        for axis, k, s in zip("thw", self.kernel, self.stride, strict=True):
            if s > k:
                raise ValueError(f"Neighborhood stride[{axis}] = {s} is larger than kernel[{axis}] = {k}: NATTEN's "
                                 "stride is at most the kernel on every axis (stride == kernel is blocked attention)")

    @classmethod
    def sliding_tile(cls, tile: int | Sequence[int], tiles: int | Sequence[int],
                     causal: bool | Sequence[bool] = False) -> "Neighborhood":
        """Sliding tile attention (STA): the grid cut into tiles of ``tile`` positions per axis, every query of a tile
        attending to the ``tiles`` tiles centred on its own, the window shifted inward at the borders so that it stays
        in the grid.

        It is exactly ``Neighborhood(kernel=tile * tiles, stride=tile)``: a stride group is a tile and its leader's
        window of ``tile * tiles`` positions starts ``tiles // 2`` tiles before it. ``tiles`` must be odd on every axis
        (an even window has no centre tile). On an axis that is not whole tiles (STA's kernels pad the grid to whole
        tiles), NATTEN's rule holds: the last window is the axis's last ``tile * tiles`` positions. ``tile`` and
        ``tiles`` are read like ``kernel`` (one int for every axis; fewer values are the last axes).
        """
        tile_t = _triple(tile, "sliding_tile tile", 1, int)
        tiles_t = _triple(tiles, "sliding_tile tiles", 1, int)
        for axis, k in zip("thw", tiles_t, strict=True):
            if k % 2 == 0:
                raise ValueError(f"Neighborhood.sliding_tile tiles[{axis}] = {k} is even: a window of tiles centred on "
                                 "the query's tile has an odd number of tiles")
        kernel = tuple(t * k for t, k in zip(tile_t, tiles_t, strict=True))
        return cls(kernel=kernel, causal=_triple(causal, "causal", False, bool), stride=tile_t)

    def params(self) -> dict:
        """The fingerprint's parameters; a stride of 1 everywhere is left out (the fingerprints predating it)."""
        params = super().params()
        if self.stride == (1, 1, 1):
            del params["stride"]
        return params

    def axes(self, grid: Sequence[int]) -> list[tuple[int, int, int, bool, int]]:
        """``(n, kernel, dilation, causal, stride)`` of each axis of ``grid``: the arguments of the per-axis tables."""
        return [(int(n), k, d, c, s) for n, k, d, c, s in
                zip(grid, self.kernel, self.dilation, self.causal, self.stride, strict=True)]

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
def axis_neighbours(n: int, k: int, d: int, causal: bool, s: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-axis neighbourhoods: ``keys[i, m]`` the m-th key position of position ``i`` and ``valid[i, m]`` ([n, k]),
    for kernel ``k``, dilation ``d`` and stride ``s``.

    Non-causal neighbourhoods always hold ``k`` valid keys; a causal one's invalid slots (before the axis start, or
    after the query itself when its stride group's leader is later) hold the query's own position, masked by
    ``valid``. Cached (read-only arrays): planning asks for the same axes many times.
    """
    i = np.arange(n, dtype=np.int64)
    g, j = i % d, i // d
    group_size = n // d + (g < n % d)
    m = np.arange(k, dtype=np.int64)
    first = (j // s) * s  # the first member of j's stride group
    if causal:
        leader = np.minimum(first + s - 1, group_size - 1)
        idx = (leader - (k - 1))[:, None] + m[None, :]
        valid = (idx >= 0) & (idx <= j[:, None])
        idx = np.where(valid, idx, j[:, None])
    else:
        left, right = k // 2, k // 2 + (k % 2 - 1)
        centre = np.clip(np.minimum(first + s // 2, group_size - 1), left, group_size - 1 - right)
        idx = (centre - left)[:, None] + m[None, :]
        valid = np.ones((n, k), dtype=bool)
    keys = idx * d + g[:, None]
    keys.flags.writeable = False
    valid.flags.writeable = False
    return keys, valid


def axis_reach(n: int, k: int, d: int, causal: bool, lo: int, hi: int, s: int = 1) -> np.ndarray:
    """Sorted positions of one axis that the queries in ``[lo, hi)`` reach (the union of their neighbourhoods)."""
    if hi <= lo:
        return np.empty(0, dtype=np.int64)
    keys, valid = axis_neighbours(int(n), int(k), int(d), bool(causal), int(s))
    keys, valid = keys[lo:hi], valid[lo:hi]
    return np.unique(keys if valid.all() else keys[valid])


def axis_work(n: int, k: int, d: int, causal: bool, s: int = 1) -> np.ndarray:
    """[n] keys each position of one axis attends along it: ``k`` without causality, fewer near a causal start.

    A query's attention work (its key count) is the product of its axes' entries, so a box's work is the product of
    per-axis sums.
    """
    return axis_neighbours(int(n), int(k), int(d), bool(causal), int(s))[1].sum(axis=1)


def neighbourhood_ids(coords: np.ndarray, grid: Grid, geometry: Neighborhood) -> tuple[np.ndarray, np.ndarray]:
    """Canonical in-sample ids ``(t * H + h) * W + w`` of the keys of queries at ``coords`` [L, 3], and validity.

    Returns ``ids`` [L, K] and ``valid`` [L, K] with ``K = prod(kernel)``, keys in row-major kernel order.
    """
    t_, h_, w_ = grid
    tables = [axis_neighbours(*axis) for axis in geometry.axes(grid)]
    (kt, vt), (kh, vh), (kw, vw) = ((keys[coords[:, a]], valid[coords[:, a]]) for a, (keys, valid) in enumerate(tables))
    ids = (kt[:, :, None, None] * h_ + kh[:, None, :, None]) * w_ + kw[:, None, None, :]
    valid = vt[:, :, None, None] & vh[:, None, :, None] & vw[:, None, None, :]
    return ids.reshape(len(coords), -1), valid.reshape(len(coords), -1)
