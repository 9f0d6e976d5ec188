"""``natten`` for neighborhood layers: NATTEN's own kernels on each rank's *extended box*, keeping the block's queries.

A rank holds, per sample, its block and the halo its queries reach: per axis a run of positions around the block.
Where that run is contiguous, the block plus halo is a box of the grid, the *extended box*, whose every row this rank
has; ``natten.na1d/na2d/na3d`` over the box then gives the block's queries their output, **if** NATTEN's rules inside
the box give each of them the neighbourhood it has in the whole grid. That holds where the box's border is the grid's
border, or far enough from every block query that clamping never reaches it; and where the box's dilation groups give
every block query the same group members as the grid's, and on a strided axis the same stride groups (NATTEN's
stride groups count from the box's start, so a box starting inside one is widened to begin at the stride group's start:
``stride * dilation`` positions from 0). :func:`box_is_exact` checks exactly that, per axis, from the per-axis tables
of :mod:`winsp.geometry.neighborhood` (global against box-local, every block position, causal slots included);
:func:`natten_plan_reason` names the rank and axis where it fails (a ragged dilated halo), the same answer on every
rank; ``"auto"`` then takes another backend. Positions a box holds that no block query attends (a causal axis shorter
than NATTEN's ``kernel * dilation`` padded after the block, a stride group's head before the halo) are *padding*: the
rank need not have those rows, and NATTEN reads any row there.

Axes of kernel 1 become batch (a query reaches only its own position there); samples with the same box and text
length run as one batch, text rows as NATTEN's ``additional_keys`` / ``additional_values``. A ``score_mod`` /
``mask_mod`` has no NATTEN equivalent: such calls use another backend.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from winsp.geometry.neighborhood import Neighborhood, axis_neighbours, axis_reach
from winsp.planning.halo import HaloTensors

__all__ = ["box_is_exact", "extended_run", "extended_box", "natten_plan_reason", "NattenBoxes", "natten_boxes",
           "natten_video_queries"]


def box_is_exact(n: int, k: int, d: int, causal: bool, lo: int, hi: int, a: int, b: int, s: int = 1) -> bool:
    """Whether NATTEN over positions ``[a, b)`` of an axis of ``n`` (stride ``s``) gives each query in ``[lo, hi)``
    its neighbourhood in the whole axis (same keys, same causal validity). A causal box may end past the axis
    (padding)."""
    if not (0 <= a <= lo < hi <= b and (b <= n or causal)) or b - a < k * d:
        return False
    g_keys, g_valid = axis_neighbours(int(n), int(k), int(d), bool(causal), int(s))
    l_keys, l_valid = axis_neighbours(int(b - a), int(k), int(d), bool(causal), int(s))
    i = np.arange(lo, hi)
    valid = g_valid[i]
    return bool(np.array_equal(valid, l_valid[i - a])
                and np.array_equal(np.where(valid, g_keys[i], -1), np.where(valid, l_keys[i - a] + a, -1)))


def extended_run(reach: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """The longest run ``[a, b)`` of consecutive positions in sorted ``reach`` that contains ``[lo, hi)``."""
    present = set(reach.tolist())
    a, b = lo, hi
    while a - 1 in present:
        a -= 1
    while b in present:
        b += 1
    return a, b


def _box_candidates(n: int, k: int, d: int, c: bool, s: int, start: int, stop: int) -> list[tuple[int, int]]:
    """NATTEN boxes ``[a, b)`` around the run ``[start, stop)`` to try, least padding first: the run itself, its
    start moved back to a stride group's start, its end moved on to one (inside the axis), and a causal axis padded
    to ``kernel * dilation``."""
    step = s * d
    starts = [start] + ([start - start % step] if start % step else [])
    ends = [stop] + ([min(n, -(-stop // step) * step)] if stop % step and stop < n else [])
    out = []
    for a in starts:
        for b in ends:
            out.append((a, max(b, a + k * d) if c else b))
    return sorted(set(out), key=lambda ab: (ab[1] - ab[0], -ab[0]))


def extended_box(grid, geometry: Neighborhood, block) -> tuple[list, None] | tuple[None, str]:
    """The extended box ``[(a_pad, a, b, b_pad)] * 3`` of a block ``[(lo, hi)] * 3`` of ``grid``, or ``(None, why it
    is not exact)``.

    ``[a, b)`` are rows this rank has; NATTEN runs on ``[a_pad, b_pad)``, whose other positions no block query
    attends (padding: any row may stand there). A causal axis shorter than NATTEN's ``kernel * dilation`` is padded
    after the block; on a strided axis the box may start at its first stride group's start.
    """
    box = []
    for a, ((n, k, d, c, s), (lo, hi)) in enumerate(zip(geometry.axes(grid), block, strict=True)):
        reach = axis_reach(n, k, d, c, lo, hi, s)
        start, stop = extended_run(reach, lo, hi)
        fit = None
        if reach[0] >= start and reach[-1] < stop:  # every key a block query reaches is a row this rank has
            fit = next(((a0, b0) for a0, b0 in _box_candidates(n, k, d, c, s, start, stop)
                        if box_is_exact(n, k, d, c, lo, hi, a0, b0, s)), None)
        if fit is None:
            return None, (f"axis {'thw'[a]}: the block [{lo}, {hi}) with its halo spans [{start}, {stop}), where "
                          f"NATTEN's neighbourhoods differ from the whole grid's (kernel {k}, stride {s}, dilation "
                          f"{d}, causal {c}, axis of {n})")
        box.append((fit[0], start, stop, fit[1]))
    return box, None


def natten_plan_reason(plan, geometry: Neighborhood) -> Optional[str]:
    """Why some rank's extended box of ``plan`` is not exact (None: every rank's is), the same answer on every rank,
    so that all ranks choose the same backend."""
    from winsp.planning.halo import _rank_boxes

    if all(k == 1 for k in geometry.kernel):
        return "the kernel is 1 on every axis (nothing for NATTEN to run)"
    for s, (grid, boxes) in enumerate(zip(plan.layout.grids, _rank_boxes(plan), strict=True)):
        for rank, block in sorted(boxes.items()):
            _, why = extended_box(grid, geometry, [(b.start, b.stop) for b in block])
            if why is not None:
                return f"rank {rank}, sample {s}, {why}"
    return None


@dataclass(frozen=True, eq=False)
class NattenBoxes:
    """One rank's extended boxes for one neighborhood layer, grouped by (box shape, text length).

    Each group is ``(key [B, V], query [B, V], text [B, T] or None, shape (bt, bh, bw), own [n])``: the key rows of
    each sample's box (row-major); the local rows NATTEN's queries are read from (halo positions read any local row:
    their output is dropped); its text rows; the box shape; and where the group's block queries sit in its flattened
    ``[B * V]`` output. ``row_slot[l]`` is where local row ``l`` sits in the groups' selected outputs, concatenated.
    """

    groups: tuple
    row_slot: Tensor
    kernel: tuple[int, ...]
    dilation: tuple[int, ...]
    causal: tuple[bool, ...]
    na_axes: tuple[int, ...]
    stride: tuple[int, ...] = ()


def natten_boxes(halo: HaloTensors, geometry: Neighborhood, grids, text_lengths,
                 device) -> tuple[Optional[NattenBoxes], Optional[str]]:
    """``(boxes, None)`` when every sample's extended box on this rank is exact, else ``(None, why not)``."""
    na_axes = tuple(a for a in range(3) if geometry.kernel[a] > 1)
    if not na_axes:
        return None, "the kernel is 1 on every axis (nothing for NATTEN to run)"
    q_coords, row_sample = halo.query_coords.cpu().numpy(), halo.row_sample.cpu().numpy()
    k_coords, key_sample = halo.key_coords.cpu().numpy(), halo.key_sample.cpu().numpy()
    txt_starts = np.concatenate([[0], np.cumsum(text_lengths)]).astype(np.int64)
    by_key: dict = {}
    for s, grid in enumerate(grids):
        own = np.nonzero(row_sample == s)[0]
        if own.size == 0:
            continue
        keys = np.nonzero(key_sample == s)[0]
        block = [(int(q_coords[own, a].min()), int(q_coords[own, a].max()) + 1) for a in range(3)]
        box, why = extended_box(grid, geometry, block)
        if box is None:
            return None, f"sample {s}, {why}"
        shape = tuple(pad - a for a, _, _, pad in box)
        sets = [np.arange(a, pad) for a, _, _, pad in box]
        inside = [(x >= start) & (x < stop) for x, (_, start, stop, _) in zip(sets, box, strict=True)]
        real = (inside[0][:, None, None] & inside[1][None, :, None] & inside[2][None, None, :]).reshape(-1)
        ids = ((sets[0][:, None, None] * grid[1] + sets[1][None, :, None]) * grid[2] + sets[2][None, None, :])
        ids = ids.reshape(-1)[real]
        k_ids = (k_coords[keys, 0] * grid[1] + k_coords[keys, 1]) * grid[2] + k_coords[keys, 2]
        order = np.argsort(k_ids)
        where = np.searchsorted(k_ids[order], ids)
        if where.max() >= k_ids.size or not np.array_equal(k_ids[order][where], ids):
            raise AssertionError("an extended box holds a row this rank does not have")  # a winsp bug
        box_keys = np.zeros(real.size, np.int64)  # padding reads row 0: never attended by a block query
        box_keys[real] = keys[order][where]
        rel = q_coords[own] - np.asarray([a for a, _, _, _ in box])
        in_box = (rel[:, 0] * shape[1] + rel[:, 1]) * shape[2] + rel[:, 2]
        by_key.setdefault((shape, int(text_lengths[s])), []).append((box_keys, own, in_box,
                                                                    np.arange(txt_starts[s], txt_starts[s + 1])))
    groups, row_slot, offset = [], np.zeros(row_sample.size, np.int64), 0
    for (shape, text), members in by_key.items():
        volume = math.prod(shape)
        key = np.stack([m[0] for m in members])
        own_rows = np.concatenate([m[1] for m in members])
        own_pos = np.concatenate([i * volume + m[2] for i, m in enumerate(members)])
        row_slot[own_rows] = offset + np.arange(own_rows.size)
        offset += own_rows.size
        t = torch.from_numpy(np.stack([m[3] for m in members])).to(device) if text else None
        query = np.minimum(key, row_sample.size - 1)
        groups.append((torch.from_numpy(key).to(device), torch.from_numpy(query).to(device), t, shape,
                       torch.from_numpy(own_pos).to(device)))
    pick = lambda values: tuple(values[a] for a in na_axes)  # noqa: E731
    return NattenBoxes(tuple(groups), torch.from_numpy(row_slot).to(device), pick(geometry.kernel),
                       pick(geometry.dilation), pick(geometry.causal), na_axes, pick(geometry.stride)), None


def _to_natten(x: Tensor, index: Tensor, *, boxes: int, shape: tuple, na_shape: tuple, heads: int,
               perm: tuple) -> Tensor:
    """Rows ``index [boxes, volume]`` of ``x [L, heads, D]`` as NATTEN's ``[boxes * folded, *na_shape, heads, D]``."""
    x = x.index_select(0, index.reshape(-1)).view(boxes, *shape, heads, -1).permute(perm)
    return x.reshape(-1, *na_shape, heads, x.shape[-1]).contiguous()


def natten_video_queries(boxes: NattenBoxes, q: Tensor, k_all: Tensor, v_all: Tensor, txt: Optional[tuple],
                         scale: float, *, natten_backend: Optional[str] = None) -> Tensor:
    """Video queries' output [L, H, D] (local row order): ``natten.na{1,2,3}d`` over each extended box.

    ``natten_backend`` is passed to natten as ``backend`` (None: natten picks its fastest kernel).
    """
    import natten

    rows, heads, dim = q.shape
    if rows == 0:
        return q.new_zeros((0, heads, v_all.shape[-1]))
    fn = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[len(boxes.na_axes)]
    batch_axes = tuple(a for a in range(3) if a not in boxes.na_axes)
    perm = (0,) + tuple(1 + a for a in batch_axes + boxes.na_axes) + (4, 5)
    inverse = tuple(int(i) for i in np.argsort(perm))
    outs = []
    for key, query, text, shape, own in boxes.groups:
        b = key.shape[0]
        na_shape = tuple(shape[a] for a in boxes.na_axes)
        to_natten = functools.partial(_to_natten, boxes=b, shape=shape, na_shape=na_shape, heads=heads,
                                      perm=perm)
        folded = math.prod(shape[a] for a in batch_axes)
        kwargs = {}
        if text is not None:
            assert txt is not None, "boxes with text need the text keys and values"
            kt, vt = (x.index_select(0, text.reshape(-1)).view(b, 1, -1, heads, x.shape[-1])
                      .expand(b, folded, -1, -1, -1).reshape(b * folded, -1, heads, x.shape[-1]).to(q.dtype)
                      for x in (txt[0], txt[1]))
            kwargs = dict(additional_keys=kt.contiguous(), additional_values=vt.contiguous())
        out = fn(to_natten(q, query), to_natten(k_all, key), to_natten(v_all, key), kernel_size=boxes.kernel,
                 stride=boxes.stride or 1, dilation=boxes.dilation, is_causal=boxes.causal, scale=scale,
                 backend=natten_backend, **kwargs)
        out = out.reshape(b, *(shape[a] for a in batch_axes + boxes.na_axes), heads, -1).permute(inverse)
        outs.append(out.reshape(-1, heads, out.shape[-1]).index_select(0, own))
    return torch.cat(outs).index_select(0, boxes.row_slot)
