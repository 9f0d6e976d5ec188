"""Collectives for spatially sharded tensors: each rank holds one contiguous band along one dimension.

Convolutional models (a video VAE, a U-Net) can be split by rows: every rank keeps a band of the height axis,
convolutions fetch the few rows they need from the neighbouring bands (a *halo*), normalisation layers add up
their statistics across the bands, and a layer that needs the whole extent (an attention over all pixels of a
frame) gathers it. This module provides those three mechanisms, knowing nothing about any model, and talks to
other ranks only through :class:`winsp.comm.group.SPGroup` (a single-rank group makes every function a local no-op).

Bands are described by ``sizes``: the number of rows every rank holds, in rank order, identical on all ranks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from winsp.comm.group import SPGroup

__all__ = [
    "band_sizes",
    "band_offsets",
    "take_band",
    "halo_exchange",
    "gather_bands",
    "distributed_mean_var",
    "distributed_group_norm",
]


def band_sizes(total: int, parts: int) -> list[int]:
    """Split ``total`` rows into ``parts`` contiguous bands whose sizes differ by at most one (larger bands first)."""
    if not isinstance(total, int) or total < 0:
        raise ValueError(f"band_sizes: total must be a non-negative integer, got {total!r}")
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"band_sizes: parts must be a positive integer, got {parts!r}")
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def band_offsets(sizes: Sequence[int]) -> list[int]:
    """Start row of every band (exclusive prefix sum of ``sizes``)."""
    offsets, start = [], 0
    for s in sizes:
        offsets.append(start)
        start += int(s)
    return offsets


def take_band(x: torch.Tensor, dim: int, sizes: Sequence[int], rank: int) -> torch.Tensor:
    """The rows of ``x`` (the full extent along ``dim``) that band ``rank`` holds, as a view."""
    if x.shape[dim] != sum(sizes):
        raise ValueError(f"take_band: dim {dim} has {x.shape[dim]} rows but the bands add up to {sum(sizes)}")
    if not 0 <= rank < len(sizes):
        raise ValueError(f"take_band: rank {rank} outside the {len(sizes)} bands")
    return x.narrow(dim, band_offsets(sizes)[rank], int(sizes[rank]))


def _check_sizes(x: torch.Tensor, dim: int, sizes: Sequence[int], group: SPGroup, what: str) -> None:
    if len(sizes) != group.size:
        raise ValueError(f"{what}: {len(sizes)} band sizes given for a group of {group.size} ranks")
    if x.shape[dim] != sizes[group.rank]:
        raise ValueError(
            f"{what}: rank {group.rank} holds {x.shape[dim]} rows along dim {dim} but its band size is "
            f"{sizes[group.rank]}"
        )


def halo_exchange(
    x: torch.Tensor, dim: int, before: int, after: int, group: SPGroup, sizes: Sequence[int]
) -> torch.Tensor:
    """Extend this rank's band along ``dim`` with ``before`` rows of the previous band and ``after`` rows of the next.

    Where there is no neighbour (the first band's top, the last band's bottom) the extension is zeros, so the
    result is exactly what a zero-padded convolution over the full extent would see for these rows. One
    all-to-all moves every halo at once. Every band that must lend rows has to hold at least that many:
    a band thinner than the halo raises ``ValueError`` naming the rank (bands are never stitched across two
    neighbours).
    """
    if before < 0 or after < 0:
        raise ValueError(f"halo_exchange: halo sizes must be >= 0, got before={before}, after={after}")
    dim = dim % x.dim()
    _check_sizes(x, dim, sizes, group, "halo_exchange")
    n, rank = group.size, group.rank
    for r, s in enumerate(sizes):
        if r < n - 1 and s < before:
            raise ValueError(
                f"halo_exchange: rank {r} holds {s} rows along dim {dim}, fewer than the {before}-row halo "
                f"that rank {r + 1} needs from it; use fewer ranks or a taller input"
            )
        if r > 0 and s < after:
            raise ValueError(
                f"halo_exchange: rank {r} holds {s} rows along dim {dim}, fewer than the {after}-row halo "
                f"that rank {r - 1} needs from it; use fewer ranks or a taller input"
            )
    if before == 0 and after == 0:
        return x
    local = x.shape[dim]
    has_prev, has_next = rank > 0, rank < n - 1
    send_splits = [0] * n
    recv_splits = [0] * n
    pieces = []
    if has_prev and after:
        send_splits[rank - 1] = after  # my first rows are the previous band's bottom halo
        pieces.append(x.narrow(dim, 0, after))
    if has_next and before:
        send_splits[rank + 1] = before  # my last rows are the next band's top halo
        pieces.append(x.narrow(dim, local - before, before))
    if has_prev:
        recv_splits[rank - 1] = before
    if has_next:
        recv_splits[rank + 1] = after
    # Only the halo rows travel (rows first, as the all-to-all splits dim 0); the band itself is copied once, by
    # the concatenation, which keeps the input's layout (a convolution then reads it without another copy).
    if n > 1 and (any(send_splits) or any(recv_splits)):
        send = torch.cat([p.movedim(dim, 0) for p in pieces], 0) if pieces else x.narrow(dim, 0, 0).movedim(dim, 0)
        recv = group.all_to_all_single(send, recv_splits, send_splits).movedim(0, dim)
    else:
        recv = x.narrow(dim, 0, 0)
    zeros_shape = list(x.shape)
    parts = []
    if before:
        zeros_shape[dim] = before
        parts.append(recv.narrow(dim, 0, before) if has_prev else x.new_zeros(zeros_shape))
    parts.append(x)
    if after:
        zeros_shape[dim] = after
        parts.append(recv.narrow(dim, recv.shape[dim] - after, after) if has_next else x.new_zeros(zeros_shape))
    return torch.cat(parts, dim)


def gather_bands(x: torch.Tensor, dim: int, group: SPGroup, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's band along ``dim`` so that every rank holds the full extent."""
    dim = dim % x.dim()
    _check_sizes(x, dim, sizes, group, "gather_bands")
    if group.is_single:
        return x
    full = group.all_gather_rows(x.movedim(dim, 0).contiguous(), list(sizes))
    return full.movedim(0, dim)


def distributed_mean_var(
    x: torch.Tensor, dims: Sequence[int], group: SPGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) variance of ``x`` over ``dims`` as if the bands of all ranks were one tensor.

    Each rank reduces its band locally (``torch.var_mean``: no copy of ``x``, double accumulation on CPU), then
    one small all-gather gives every rank every band's (count, mean, variance) in float64, combined in rank order
    (the same arithmetic on every rank): counts and means give the global mean, then counts times (variance +
    squared offset from that mean) the global variance. Combining around the global mean avoids the
    cancellation of "E[x^2] - mean^2" when the mean dominates. The results
    keep the reduced dims (size 1) and are float64. A rank whose band is empty contributes nothing.
    """
    dims = sorted({d % x.dim() for d in dims})
    count = 1
    for d in dims:
        count *= x.shape[d]
    if count > 0:
        var, mean = torch.var_mean(x, dim=dims, correction=0, keepdim=True)
        mean, var = mean.to(torch.float64), var.to(torch.float64)
    else:
        shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
        mean = var = torch.zeros(shape, dtype=torch.float64, device=x.device)
    if group.is_single:
        return mean, var
    # One collective: every rank gets every band's (count, mean, variance) and combines them in rank order.
    stats = group.all_gather_rows(torch.stack([torch.full_like(mean, float(count)), mean, var]), [3] * group.size)
    stats = stats.view((group.size, 3) + tuple(mean.shape))
    counts, means, variances = stats.unbind(1)
    count_all = counts.sum(0)
    message = "distributed_mean_var: no rank holds any element to take statistics over"
    if count_all.device.type == "cpu":  # a host read is free there
        if bool((count_all <= 0).any()):
            raise ValueError(message)
    else:  # on a device: an assertion there, not a host read inside the forward
        torch._assert_async((count_all > 0).all(), message)
    global_mean = (counts * means).sum(0) / count_all
    spread = (counts * (variances + (means - global_mean) ** 2)).sum(0)
    return global_mean, spread / count_all


def distributed_group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group: SPGroup,
    *,
    independent_dims: Sequence[int] = (),
) -> torch.Tensor:
    """Group normalisation of ``x`` [N, C, *rest] whose ``rest`` dims may be sharded across ``group``.

    Statistics are taken per sample and per channel group over the channels of the group and every dim of
    ``rest`` except ``independent_dims`` (dims of ``x`` that keep separate statistics, e.g. a time axis for
    frame-wise normalisation), combined over all ranks (:func:`distributed_mean_var`). Equals
    ``torch.nn.functional.group_norm`` on the gathered tensor up to float32 rounding. The normalisation and
    the affine map are folded into one scale and shift, so the only full-size allocation is the output.
    """
    if x.dim() < 2:
        raise ValueError(f"distributed_group_norm expects [N, C, ...], got shape {tuple(x.shape)}")
    channels = x.shape[1]
    if num_groups < 1 or channels % num_groups:
        raise ValueError(f"distributed_group_norm: {channels} channels do not split into {num_groups} groups")
    independent = {d % x.dim() for d in independent_dims}
    if independent & {0, 1}:
        raise ValueError("distributed_group_norm: independent_dims must name dims after the channel dim")
    per_group = channels // num_groups
    grouped = x.reshape((x.shape[0], num_groups, per_group) + tuple(x.shape[2:]))
    # grouped dims: 0 sample, 1 group, 2 channel-in-group, 3.. = x dims 2..
    reduce = [2] + [d + 1 for d in range(2, x.dim()) if d not in independent]
    mean, var = distributed_mean_var(grouped, reduce, group)
    scale = torch.rsqrt(var + eps)
    channel_shape = (1, num_groups, per_group) + (1,) * (x.dim() - 2)
    if weight is not None:
        scale = scale * weight.to(torch.float64).reshape(channel_shape)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.to(torch.float64).reshape(channel_shape)
    out = torch.addcmul(shift.to(x.dtype), grouped, scale.to(x.dtype))
    return out.reshape(x.shape)
