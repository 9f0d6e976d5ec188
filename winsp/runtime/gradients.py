"""Making gradients whole after a window-parallel backward.

winsp's gradient convention, in one sentence: **every rank computes the same loss from replicated values, each rank's
copy of a replicated value is its own contribution, so after ``loss.backward()`` :func:`sync_gradients` averages
gradients over the SP group (as DDP does).**

Why it holds wherever the steps sit: the SP ranks together compute P copies of the same loss, and every collective's
backward is the exact adjoint of its forward (``scatter``: this rank's rows of its own copy; ``gather``: a
reduce-scatter; the text reduction: an all-reduce; a re-deal: the reverse all-to-all). So the gradients summed over
the group are those of P times the loss, and their mean is the one-rank gradient, for parameters before ``scatter``,
inside windows, between two sharded regions (gather -> replicated op -> scatter), after the final ``gather`` (a head,
a final norm), and for losses on any replicated output (video or text), with no scaling by the SP degree anywhere.
With data parallelism on top (an SP x DP world) the mean over SP then over DP is the mean over the world: DDP over the
whole world alone does both.

:func:`sync_gradients` needs few collectives: gradients are flattened by (device, dtype) into buckets, and each
bucket is summed with one all-reduce and divided by the group size.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from winsp.comm.group import SPGroup, world_rank_and_size

__all__ = ["sync_gradients", "attached_runtime"]

_DEFAULT_BUCKET_BYTES = 32 * 2**20


def attached_runtime(module: nn.Module):
    """The :class:`~winsp.runtime.runtime.WindowRuntime` attached to ``module`` (``_winsp_runtime``, as
    :meth:`winsp.WindowParallel.build_runtime` and :func:`winsp.parallelize` set it), else one attached to its
    submodules (a model with several parallel regions carries one runtime per region), else None.

    Raises ValueError when submodules carry runtimes on different SP groups (which group to average over would be
    ambiguous); runtimes on the same ranks are one group, whichever of them is returned.
    """
    own = getattr(module, "_winsp_runtime", None)
    if own is not None:
        return own
    found = {id(r): r for m in module.modules() if (r := getattr(m, "_winsp_runtime", None)) is not None}
    by_group: dict[tuple[int, ...], Any] = {}
    for runtime in found.values():
        by_group.setdefault(_group_ranks(runtime.group), runtime)
    if len(by_group) > 1:
        raise ValueError(
            f"{type(module).__name__} holds winsp runtimes on {len(by_group)} different SP groups (ranks "
            f"{sorted(by_group)}); pass the group explicitly: sync_gradients(params, runtime)"
        )
    return next(iter(by_group.values()), None)


def _group_ranks(group: SPGroup) -> tuple[int, ...]:
    """The global ranks of an SP group (one rank: this process's), to tell groups apart."""
    if group.is_single or group.group is None:
        return (world_rank_and_size()[0],)
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group.group))


def _as_group(params, group) -> SPGroup:
    from winsp.runtime.runtime import WindowRuntime

    if group is None or isinstance(group, nn.Module):
        source = group if group is not None else params
        runtime = attached_runtime(source) if isinstance(source, nn.Module) else None
        if runtime is not None:
            return runtime.group
        if isinstance(group, nn.Module):
            raise ValueError(
                f"sync_gradients: {type(group).__name__} has no winsp runtime attached; call "
                f"model.build_runtime(config) first, or pass the runtime or SP group"
            )
        _, world = world_rank_and_size()
        if world > 1:
            raise ValueError(
                f"sync_gradients: no SP group given and no winsp runtime attached to what was passed, inside a world "
                f"of {world} ranks; pass the model (after build_runtime) or its runtime: sync_gradients(model), "
                f"sync_gradients([vid, txt], model)"
            )
        return SPGroup(None)
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
    """Average the gradients of ``params`` over the SP group, in place; returns the number of gradient buckets.

    Args:
        params: a module (its parameters) or tensors (parameters, or inputs that required grad).
        group: None (the runtime attached to ``params`` when it is a module: ``sync_gradients(model)``), a module
            whose runtime to use (``sync_gradients([vid, txt], model)``), a
            :class:`~winsp.runtime.runtime.WindowRuntime`, an :class:`~winsp.comm.group.SPGroup` or a
            ``torch.distributed`` process group. One rank: nothing to do.
        bucket_bytes: the most bytes one all-reduce carries (one tensor larger than that goes alone).

    Afterwards every rank holds the one-rank gradient of the loss every rank computed (the module docstring says
    why). Tensors without a gradient on any rank are skipped; one that has a gradient on some ranks only gets zeros on
    the others first (one extra small all-reduce decides). Every rank must pass the same tensors in the same order.
    """
    sp = _as_group(params, group)
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
    # rank's contribution is zero. One small all-reduce of "has a gradient" flags keeps every rank's buckets identical.
    present = torch.tensor([t.grad is not None for t in tensors], dtype=torch.int32, device=tensors[0].device)
    sp.all_reduce_sum_(present)
    for t, count in zip(tensors, present.tolist(), strict=True):
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
            sp.all_reduce_sum_(flat)  # SUM then divide: gloo has no AVG
            flat.div_(sp.size)
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
