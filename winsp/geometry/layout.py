"""Layouts: the windows of a packed batch, and the canonical token ids inside each window.

A packed batch concatenates samples of possibly different grids; inside a sample the canonical token id is
``(t * H + h) * W + w`` and sample ``s`` starts at the sum of the earlier samples' token counts. A layout lists every
window of every sample (samples in order, each sample's windows in geometry order) with its tokens row-major in
(t, h, w). All of it is computed with numpy broadcasting, one step per distinct window shape, never per token.
"""

from __future__ import annotations

from functools import cached_property
from typing import Sequence

import numpy as np

from winsp.geometry.windows import Grid, WindowGeometry, check_grid

__all__ = ["Grids", "Layout", "build_layout", "check_grids", "inverse_permutation"]


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] = i``: where each value of a permutation of ``0..n-1`` sits."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


class Grids(tuple[Grid, ...]):
    """The (t, h, w) grids of a packed batch, one per sample, that :func:`check_grids` has checked.

    A plain tuple of int triples that says by its type that it needs no further check: grids are checked once, where
    they enter (:meth:`winsp.WindowRuntime.request`, or a public planning function given plain tuples), and the code
    further in takes :class:`Grids` as they are (:func:`check_grids` returns one unchanged).
    """

    __slots__ = ()


def check_grids(grids: Sequence[Sequence[int]]) -> Grids:
    """Validate a list of (T, H, W) grids (one per sample) and return them as :class:`Grids` (returned as they are
    when they already are: checked once)."""
    if isinstance(grids, Grids):
        return grids
    if isinstance(grids, (str, bytes)) or not hasattr(grids, "__len__") or len(grids) == 0:
        raise ValueError(f"grids must be a non-empty list of (T, H, W) grids, got {grids!r}")
    if len(grids) == 3 and all(isinstance(g, (int, np.integer)) for g in grids):
        raise ValueError(f"grids must be a list of (T, H, W) grids, one per sample; got a single grid {tuple(grids)}:"
                         f" wrap it as [{tuple(grids)}]")
    return Grids(check_grid(g, f"grids[{i}]") for i, g in enumerate(grids))


def _is_index(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_boxes(boxes, grid: Grid, geometry: WindowGeometry) -> None:
    """Every box must be three non-empty half-open slices with step 1 inside the grid (never clipped silently)."""
    for i, box in enumerate(boxes):
        if len(box) != 3 or not all(isinstance(s, slice) for s in box):
            raise ValueError(f"geometry {geometry!r}: window {i} of grid {grid} is not three slices: {box!r}")
        for axis, s, size in zip("thw", box, grid, strict=True):
            if s.step not in (None, 1) or not _is_index(s.start) or not _is_index(s.stop) \
                    or not 0 <= s.start < s.stop <= size:
                raise ValueError(
                    f"geometry {geometry!r}: window {i} of grid {grid} has {axis}-slice {s}, which is not a "
                    f"non-empty range inside [0, {size})"
                )


class Layout:
    """The windows of a packed batch under one geometry.

    Attributes (numpy int64 arrays unless stated):
        grids: the (T, H, W) grid of each sample.
        geometry: the geometry that produced the windows.
        window_sample: [n] sample index of each window.
        window_start, window_shape: [n, 3] corner and extent of each window.
        token_counts: [n] tokens in each window; offsets: [n + 1] their prefix sums (layout positions).
        token_ids: [N] canonical packed token id at each layout position.
        sample_offsets: [b + 1] first canonical id of each sample.
    """

    def __init__(self, grids: Sequence[Sequence[int]], geometry: WindowGeometry) -> None:
        self.grids = check_grids(grids)
        self.geometry = geometry
        sizes = np.array([t * h * w for t, h, w in self.grids], dtype=np.int64)
        self.sample_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

        starts, shapes, samples = [], [], []
        for s, grid in enumerate(self.grids):
            boxes = geometry.slices(grid)
            if not boxes:
                raise ValueError(f"geometry {geometry!r} produced no windows for grid {grid}")
            _check_boxes(boxes, grid, geometry)
            starts += [(bt.start, bh.start, bw.start) for bt, bh, bw in boxes]
            shapes += [(bt.stop - bt.start, bh.stop - bh.start, bw.stop - bw.start) for bt, bh, bw in boxes]
            samples += [s] * len(boxes)
        self.window_start = np.asarray(starts, dtype=np.int64).reshape(-1, 3)
        self.window_shape = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
        self.window_sample = np.asarray(samples, dtype=np.int64)
        self.token_counts = self.window_shape.prod(axis=1)
        self.offsets = np.concatenate([[0], np.cumsum(self.token_counts)]).astype(np.int64)
        self._num_tokens = int(self.offsets[-1])
        if int(self.offsets[-1]) != int(sizes.sum()):
            raise ValueError(
                f"geometry {geometry!r} does not partition the grids {self.grids}: windows cover "
                f"{int(self.offsets[-1])} tokens, the grids have {int(sizes.sum())}"
            )

    @cached_property
    def token_ids(self) -> np.ndarray:
        """[N] canonical packed token id at each layout position (built on first use, not by the planner)."""
        ids = self._fill(self._window_token_ids)
        if np.bincount(ids, minlength=self.num_tokens).max(initial=0) != 1:
            raise ValueError(f"geometry {self.geometry!r} does not partition the grids {self.grids}: windows overlap")
        return ids

    # ---- sizes ---------------------------------------------------------------------------------------

    @property
    def num_windows(self) -> int:
        return int(self.token_counts.shape[0])

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_samples(self) -> int:
        return len(self.grids)

    @cached_property
    def windows_per_sample(self) -> np.ndarray:
        """[b] how many windows each sample has (the divisor of the text reduction)."""
        return np.bincount(self.window_sample, minlength=self.num_samples).astype(np.int64)

    def token_coords(self, ids: np.ndarray, sample: np.ndarray) -> np.ndarray:
        """[n, 3] the (t, h, w) of canonical packed token ``ids`` inside their ``sample``'s grid."""
        grids = np.asarray(self.grids, dtype=np.int64)[sample] if ids.size else np.zeros((0, 3), np.int64)
        within = ids - self.sample_offsets[sample]
        h, w = grids[:, 1], grids[:, 2]
        return np.stack([within // (h * w), (within // w) % h, within % w], axis=-1).astype(np.int64)

    # ---- per-position data ---------------------------------------------------------------------------

    def _fill(self, per_window) -> np.ndarray:
        """Evaluate ``per_window(window_ids, lt, lh, lw)`` -> [G, K] for each group of equal-shaped windows."""
        out = None
        shapes, group_of = np.unique(self.window_shape, axis=0, return_inverse=True)
        group_of = group_of.reshape(-1)
        for g, (dt, dh, dw) in enumerate(shapes):
            members = np.nonzero(group_of == g)[0]
            lt, lh, lw = (a.reshape(-1) for a in np.meshgrid(
                np.arange(dt), np.arange(dh), np.arange(dw), indexing="ij"))
            values = per_window(members, lt, lh, lw)  # [G, K] or [G, K, c]
            if out is None:
                out = np.empty((self.num_tokens,) + values.shape[2:], dtype=np.int64)
            positions = self.offsets[members][:, None] + np.arange(lt.size)[None, :]
            out[positions.reshape(-1)] = values.reshape((-1,) + values.shape[2:])
        assert out is not None, "a layout has at least one window (every grid axis is >= 1)"
        return out

    def _window_token_ids(self, members, lt, lh, lw) -> np.ndarray:
        grids = np.asarray(self.grids, dtype=np.int64)[self.window_sample[members]]  # [G, 3]
        hw = grids[:, 1] * grids[:, 2]
        width = grids[:, 2]
        t0, h0, w0 = self.window_start[members].T
        base = self.sample_offsets[self.window_sample[members]] + (t0 * grids[:, 1] + h0) * width + w0
        return base[:, None] + lt[None, :] * hw[:, None] + lh[None, :] * width[:, None] + lw[None, :]

    @cached_property
    def window_coords(self) -> np.ndarray:
        """[N, 3] window-local (dt, dh, dw) of each layout position (what window-local RoPE needs)."""
        def coords(members, lt, lh, lw):
            local = np.stack([lt, lh, lw], axis=-1)
            return np.broadcast_to(local, (len(members),) + local.shape)
        return self._fill(coords)

    @cached_property
    def position_of_token(self) -> np.ndarray:
        """[N] layout position of each canonical token id (the inverse of ``token_ids``)."""
        return inverse_permutation(self.token_ids)

    @cached_property
    def window_of_position(self) -> np.ndarray:
        """[N] window id of each layout position."""
        return np.repeat(np.arange(self.num_windows, dtype=np.int64), self.token_counts)

    def window_token_ids(self, window: int) -> np.ndarray:
        """Canonical ids of one window, row-major in (t, h, w)."""
        return self.token_ids[self.offsets[window]:self.offsets[window + 1]]

    def __repr__(self) -> str:
        return f"Layout(grids={self.grids}, geometry={self.geometry!r}, windows={self.num_windows})"


def build_layout(grids: Sequence[Sequence[int]], geometry: WindowGeometry) -> Layout:
    """The :class:`Layout` of a packed batch of ``grids`` under ``geometry``."""
    if not isinstance(geometry, WindowGeometry):
        raise ValueError(f"geometry must be a WindowGeometry, got {type(geometry).__name__}")
    return Layout(grids, geometry)
