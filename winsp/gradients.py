"""Making gradients whole after a window-parallel backward.

winsp's gradient convention: after ``loss.backward()`` every gradient on every rank is a *partial sum* over the SP
group, whatever the tensor feeds (video rows, replicated text, weights shared between the streams, a timestep
embedding that modulates both). One SUM over the group then gives every rank the one-rank gradient of the same loss.
That is what :func:`sync_gradients` does, with few collectives: gradients are flattened by (device, dtype) into
buckets and each bucket is summed with one all-reduce.

It needs every rank to compute the same scalar loss from the gathered (canonical) video output, which is the usual
case. A loss term on a *replicated* output (the text stream, identical on every rank) must be counted once over the
group: divide it by the SP degree (or add it on one rank only).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .group import SPGroup

__all__ = ["sync_gradients"]

_DEFAULT_BUCKET_BYTES = 32 * 2**20


def _as_group(group) -> SPGroup:
    from .runtime import WindowRuntime

    if isinstance(group, WindowRuntime):
        return group.group
    if isinstance(group, SPGroup):
        return group
    return SPGroup(group)


def sync_gradients(
    params: nn.Module | Iterable[torch.Tensor],
    group=None,
    *,
    bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
) -> int:
    """Sum the gradients of ``params`` over the SP group, in place; returns the number of gradient buckets summed.

    Args:
        params: a module (its parameters) or tensors (parameters, or inputs that required grad).
        group: a :class:`~winsp.runtime.WindowRuntime`, an :class:`~winsp.group.SPGroup`, a ``torch.distributed``
            process group, or None (one rank: nothing to do).
        bucket_bytes: the most bytes one all-reduce carries (one tensor larger than that goes alone).

    Tensors without a gradient on any rank are skipped; one that has a gradient on some ranks only gets zeros on the
    others first (one extra small all-reduce decides). Every rank must pass the same tensors in the same order.
    """
    sp = _as_group(group)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    tensors = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"sync_gradients: item {i} is a {type(t).__name__}, not a tensor")
    for t in tensors:
        if t.grad is not None and t.grad.is_sparse:
            raise ValueError("sync_gradients: sparse gradients are not supported; use dense embeddings")
    if sp.is_single or not tensors:
        return 0
    # A tensor can get a gradient on some ranks only (a rank without windows never touches some text weights): that
    # rank's share is zero. One small all-reduce of "has a gradient" flags keeps every rank's buckets identical.
    present = torch.tensor([t.grad is not None for t in tensors], dtype=torch.int32, device=tensors[0].device)
    sp.all_reduce_sum_(present)
    for t, count in zip(tensors, present.tolist()):
        if count and t.grad is None:
            t.grad = torch.zeros_like(t)
    grads = [t.grad for t in tensors if t.grad is not None]
    if not grads:
        return 0
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    calls = 0
    for key in sorted(by_kind, key=lambda k: (str(k[0]), str(k[1]))):
        for bucket in _buckets(by_kind[key], bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            sp.all_reduce_sum_(flat)
            calls += 1
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
    return calls


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``grads`` of at most ``bucket_bytes`` each (a larger single tensor forms its own run)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    return buckets
