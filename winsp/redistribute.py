"""Plan A redistribution: move rows between two plans with one variable-split all-to-all (or a local permutation).

With ``owner_src`` / ``owner_dst`` the rank of every canonical token under each plan, the count matrix
``C[r, d]`` is how many rows rank d needs from rank r. Rank r sends row r of C (``input_split_sizes``) and receives
column r (``output_split_sizes``). Each peer segment is packed in the destination's local order, so the receiver puts
rows in place with one precomputed gather. Whether any row changes rank is read from the *global* matrix, so every
rank takes the same branch and no rank skips the collective alone. All indices are computed once per plan pair.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from .group import SPGroup
from .layout import inverse_permutation
from .planner import Plan

__all__ = [
    "Transition",
    "RankTransition",
    "plan_transition",
    "redistribute",
    "scatter_rows",
    "gather_rows",
    "count_layout_changes",
    "ensure_layout",
]


@dataclass(eq=False)
class RankTransition:
    """What one rank does in a transition: gather, exchange, gather.

    ``send_index`` picks source-local rows grouped by destination (each group in destination-local order);
    ``recv_index`` puts the received rows in destination-local order. Both are permutations, so the backward pass
    is the same three steps with inverted indices and swapped split sizes.
    """

    send_index: np.ndarray
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    recv_index: np.ndarray
    network_exchange_required: bool
    _device_cache: dict = field(default_factory=dict, repr=False)

    def device_indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(send, recv, inverse send, inverse recv) as int64 tensors on ``device``, built once per device."""
        key = str(device)
        cached = self._device_cache.get(key)
        if cached is None:
            arrays = (self.send_index, self.recv_index,
                      inverse_permutation(self.send_index), inverse_permutation(self.recv_index))
            cached = tuple(torch.from_numpy(a).to(device) for a in arrays)
            self._device_cache[key] = cached
        return cached


class Transition:
    """The redistribution from plan ``src`` to plan ``dst`` (same tokens, same world size)."""

    def __init__(self, src: Plan, dst: Plan) -> None:
        if src.world_size != dst.world_size:
            raise ValueError(f"cannot redistribute between plans for {src.world_size} and {dst.world_size} ranks")
        if src.layout.grids != dst.layout.grids:
            raise ValueError(
                f"cannot redistribute between different batches: grids {src.layout.grids} vs {dst.layout.grids}"
            )
        self.src, self.dst = src, dst
        p = src.world_size
        pairs = src.token_owner * p + dst.token_owner
        self.count_matrix: np.ndarray = np.bincount(pairs, minlength=p * p).reshape(p, p)
        off_diagonal = self.count_matrix.sum() - np.trace(self.count_matrix)
        self.network_exchange_required: bool = bool(off_diagonal > 0)
        self._per_rank: dict[int, RankTransition] = {}
        self._lock = threading.Lock()

    @property
    def rows_moved(self) -> int:
        """Rows that change rank (the off-diagonal sum of the count matrix)."""
        return int(self.count_matrix.sum() - np.trace(self.count_matrix))

    def for_rank(self, rank: int) -> RankTransition:
        """Send/receive indices and split sizes of ``rank`` (computed on first use, then cached)."""
        with self._lock:
            cached = self._per_rank.get(rank)
        if cached is not None:
            return cached
        src, dst, n = self.src, self.dst, self.src.layout.num_tokens
        src_ids = src.rank_token_ids(rank)
        # send: my rows ordered by (destination rank, destination-local row)
        send_index = np.argsort(dst.token_owner[src_ids] * n + dst.token_local_index[src_ids], kind="stable")
        # receive: rows arrive ordered by (source rank, my local row); put them back in my local order
        dst_ids = dst.rank_token_ids(rank)
        arrival = np.argsort(src.token_owner[dst_ids] * n + np.arange(dst_ids.size), kind="stable")
        recv_index = inverse_permutation(arrival)
        result = RankTransition(
            send_index=send_index.astype(np.int64),
            input_split_sizes=tuple(int(c) for c in self.count_matrix[rank, :]),
            output_split_sizes=tuple(int(c) for c in self.count_matrix[:, rank]),
            recv_index=recv_index.astype(np.int64),
            network_exchange_required=self.network_exchange_required,
        )
        with self._lock:
            self._per_rank[rank] = result
        return result

    def __repr__(self) -> str:
        return (f"Transition(rows_moved={self.rows_moved}, world_size={self.src.world_size}, "
                f"network_exchange_required={self.network_exchange_required})")


_TRANSITIONS: OrderedDict[tuple, Transition] = OrderedDict()
_TRANSITIONS_LOCK = threading.Lock()
_TRANSITIONS_MAX = 64


def plan_transition(src: Plan, dst: Plan) -> Transition:
    """The (cached) transition between two plans, keyed by the plans' cache keys."""
    if not src.key or not dst.key:
        return Transition(src, dst)
    key = (src.key, dst.key)
    with _TRANSITIONS_LOCK:
        hit = _TRANSITIONS.get(key)
        if hit is not None and hit.src is src and hit.dst is dst:
            _TRANSITIONS.move_to_end(key)
            return hit
    made = Transition(src, dst)
    with _TRANSITIONS_LOCK:
        _TRANSITIONS[key] = made
        while len(_TRANSITIONS) > _TRANSITIONS_MAX:
            _TRANSITIONS.popitem(last=False)
    return made


# ---- the data movement (differentiable) ----------------------------------------------------------------

def _move(x: torch.Tensor, first: torch.Tensor, in_splits, out_splits, then: torch.Tensor, group: SPGroup,
          exchange: bool) -> torch.Tensor:
    if not exchange:
        # Nothing changes rank anywhere: the recv gather is the identity, one local gather suffices.
        return x.index_select(0, first)
    packed = x.index_select(0, first)
    received = group.all_to_all_single(packed, out_splits, in_splits)
    return received.index_select(0, then)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rt: RankTransition, group: SPGroup):
        send, recv, inv_send, inv_recv = rt.device_indices(x.device)
        ctx.rt, ctx.group = rt, group
        return _move(x, send, rt.input_split_sizes, rt.output_split_sizes, recv, group, rt.network_exchange_required)

    @staticmethod
    def backward(ctx, grad):
        rt, group = ctx.rt, ctx.group
        send, recv, inv_send, inv_recv = rt.device_indices(grad.device)
        if not rt.network_exchange_required:
            return grad.index_select(0, inv_send), None, None
        back = _move(grad.contiguous(), inv_recv, rt.output_split_sizes, rt.input_split_sizes, inv_send, group, True)
        return back, None, None


def redistribute(x: torch.Tensor, transition: Transition, group: SPGroup) -> torch.Tensor:
    """Move this rank's rows (dim 0) from ``transition.src``'s layout to ``transition.dst``'s.

    One ``all_to_all_single`` on the SP group when any row changes rank anywhere, else one local gather.
    The backward pass is the reverse redistribution.
    """
    rt = transition.for_rank(group.rank)
    expected = transition.src.rank_token_counts[group.rank]
    if x.shape[0] != expected:
        raise ValueError(
            f"rank {group.rank}: redistribute got {x.shape[0]} rows but the source plan gives this rank {expected}"
        )
    return _Redistribute.apply(x, rt, group)


def ensure_layout(x: torch.Tensor, current: Plan, required: Plan, group: SPGroup) -> torch.Tensor:
    """Rows of ``current``'s layout -> rows of ``required``'s; nothing at all when the two are the same plan."""
    if current is required or (current.key and current.key == required.key):
        return x
    return redistribute(x, plan_transition(current, required), group)


# ---- entry and exit -------------------------------------------------------------------------------------

class _ScatterRows(torch.autograd.Function):
    """Forward: keep this rank's rows of a replicated canonical tensor. Backward: the full gradient on every rank."""

    @staticmethod
    def forward(ctx, x, plan: Plan, group: SPGroup):
        ctx.plan, ctx.group = plan, group
        return x.index_select(0, _device_array(plan, "ids", group.rank, x.device))

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.plan, ctx.group), None, None


class _GatherRows(torch.autograd.Function):
    """Forward: rebuild the canonical tensor on every rank. Backward: this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, plan: Plan, group: SPGroup):
        ctx.plan, ctx.group = plan, group
        return _gather(x.contiguous(), plan, group)

    @staticmethod
    def backward(ctx, grad):
        plan, group = ctx.plan, ctx.group
        return grad.index_select(0, _device_array(plan, "ids", group.rank, grad.device)), None, None


def _device_array(plan: Plan, what: str, rank: int, device: torch.device) -> torch.Tensor:
    cache = plan.__dict__.setdefault("_device_arrays", {})
    key = (what, rank, str(device))
    t = cache.get(key)
    if t is None:
        arr = plan.rank_token_ids(rank) if what == "ids" else plan.gather_order
        t = torch.from_numpy(arr).to(device)
        cache[key] = t
    return t


def _gather(x: torch.Tensor, plan: Plan, group: SPGroup) -> torch.Tensor:
    if group.is_single:
        everything = x
    else:
        everything = group.all_gather_rows(x, plan.rank_token_counts)
    return everything.index_select(0, _device_array(plan, "order", -1, x.device))


def scatter_rows(x: torch.Tensor, plan: Plan, group: SPGroup) -> torch.Tensor:
    """Entry distribution: this rank's rows (in plan-local order) of a canonical tensor held by every rank."""
    if x.shape[0] != plan.layout.num_tokens:
        raise ValueError(
            f"scatter_rows: the canonical tensor has {x.shape[0]} rows but the batch has {plan.layout.num_tokens} tokens"
        )
    return _ScatterRows.apply(x, plan, group)


def gather_rows(x: torch.Tensor, plan: Plan, group: SPGroup) -> torch.Tensor:
    """Final reconstruction: the canonical tensor, complete on every rank, from every rank's local rows."""
    expected = plan.rank_token_counts[group.rank]
    if x.shape[0] != expected:
        raise ValueError(f"rank {group.rank}: gather_rows got {x.shape[0]} rows, the plan gives this rank {expected}")
    return _GatherRows.apply(x, plan, group)


def count_layout_changes(fingerprints) -> int:
    """How many inter-layer transitions a layer schedule needs: one per pair of consecutive layers whose layouts differ."""
    items = list(fingerprints)
    return sum(1 for a, b in zip(items, items[1:]) if a != b)
