"""Plan A redistribution: move rows between two plans with one variable-split all-to-all (or a local permutation).

"Plan A" is the design's name for re-sharding the whole activation at every layout change (each rank then holds
whole windows of the next layout), as opposed to "Plan B", exchanging only halos around fixed blocks, which
neighborhood layers use (:mod:`winsp.planning.halo`). ``runtime.execution_path`` reports it by that name.

With ``owner_src`` / ``owner_dst`` the rank of every canonical token under each plan, the count matrix
``C[r, d]`` is how many rows rank d needs from rank r. Rank r sends row r of C (``input_split_sizes``) and receives
column r (``output_split_sizes``). Each peer segment is packed in the destination's local order, so the receiver puts
rows in place with one precomputed gather. Whether any row changes rank is read from the *global* matrix, so every
rank takes the same branch and no rank skips the collective alone.

Index data is numpy, computed on the CPU (:class:`Transition`, :class:`RankTransition`); the data movement takes the
device copies (:class:`RankTransitionTensors`), which the runtime's store builds once per request shape. Everything
that moves rows is made of ``index_select`` and the traceable all-to-all of :class:`~winsp.comm.group.SPGroup`, so it is
differentiable (the backward of a redistribution is the reverse one) and compiles without graph breaks.

Entry and exit follow winsp's gradient convention (every rank's copy of a replicated value is its own contribution;
:func:`winsp.sync_gradients` averages over the group afterwards): :func:`scatter_rows` takes this rank's rows of its
own copy of a canonical tensor, so the gradient it passes back covers only those rows and needs no collective;
:func:`gather_rows` rebuilds the canonical tensor on every rank with one all-gather, whose backward is a
reduce-scatter (this rank's rows receive the sum over ranks of the gradients of every rank's copy of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from winsp.comm.group import SPGroup
from winsp.geometry.layout import inverse_permutation
from winsp.planning.plan import Plan

__all__ = [
    "Transition",
    "RankTransition",
    "RankTransitionTensors",
    "redistribute_rows",
    "ensure_layout",
    "scatter_rows",
    "gather_rows",
]


@dataclass(frozen=True, eq=False)
class RankTransitionTensors:
    """A :class:`RankTransition` on one device: the two gathers as int64 tensors, the split sizes as Python ints."""

    send_index: torch.Tensor
    recv_index: torch.Tensor
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    network_exchange_required: bool
    num_src_rows: int
    keeps_rows: bool = False  # no row changes rank anywhere and this rank's local order stays: nothing to do


@dataclass(frozen=True, eq=False)
class RankTransition:
    """What one rank does in a transition: gather, exchange, gather.

    ``send_index`` picks source-local rows grouped by destination (each group in destination-local order);
    ``recv_index`` puts the received rows in destination-local order.
    """

    send_index: np.ndarray
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    recv_index: np.ndarray
    network_exchange_required: bool

    def to(self, device: torch.device | str) -> RankTransitionTensors:
        """The device copy the data movement takes."""
        return RankTransitionTensors(
            send_index=torch.from_numpy(self.send_index).to(device),
            recv_index=torch.from_numpy(self.recv_index).to(device),
            input_split_sizes=self.input_split_sizes,
            output_split_sizes=self.output_split_sizes,
            network_exchange_required=self.network_exchange_required,
            num_src_rows=int(self.send_index.size),
            keeps_rows=not self.network_exchange_required and np.array_equal(
                self.send_index, np.arange(self.send_index.size)),
        )


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
        self.network_exchange_required: bool = self.rows_moved > 0

    @property
    def rows_moved(self) -> int:
        """Rows that change rank (the off-diagonal sum of the count matrix)."""
        return int(self.count_matrix.sum() - np.trace(self.count_matrix))

    def for_rank(self, rank: int) -> RankTransition:
        """Send/receive indices and split sizes of ``rank`` (computed on every call; the runtime's store keeps them)."""
        src, dst, n = self.src, self.dst, self.src.layout.num_tokens
        src_ids = src.rank_token_ids(rank)
        # send: my rows ordered by (destination rank, destination-local row)
        send_index = np.argsort(dst.token_owner[src_ids] * n + dst.token_local_index[src_ids], kind="stable")
        # receive: rows arrive ordered by (source rank, my local row); put them back in my local order
        dst_ids = dst.rank_token_ids(rank)
        arrival = np.argsort(src.token_owner[dst_ids] * n + np.arange(dst_ids.size), kind="stable")
        return RankTransition(
            send_index=send_index.astype(np.int64),
            input_split_sizes=tuple(int(c) for c in self.count_matrix[rank, :]),
            output_split_sizes=tuple(int(c) for c in self.count_matrix[:, rank]),
            recv_index=inverse_permutation(arrival).astype(np.int64),
            network_exchange_required=self.network_exchange_required,
        )

    def __repr__(self) -> str:
        return (f"Transition(rows_moved={self.rows_moved}, world_size={self.src.world_size}, "
                f"network_exchange_required={self.network_exchange_required})")


def redistribute_rows(x: torch.Tensor, step: RankTransitionTensors, group: SPGroup) -> torch.Tensor:
    """Move this rank's rows (dim 0) along one prepared transition step.

    One all-to-all on the SP group when any row changes rank anywhere, else one local gather.
    """
    if x.shape[0] != step.num_src_rows:
        raise ValueError(
            f"rank {group.rank}: redistribute got {x.shape[0]} rows but the source plan gives this rank "
            f"{step.num_src_rows}"
        )
    if step.keeps_rows:
        return x  # two layouts that place the same rows in the same order (e.g. a shift that moves no window edge)
    packed = x.index_select(0, step.send_index)
    if not step.network_exchange_required:
        return packed  # nothing changes rank anywhere: the receive gather is the identity
    received = group.all_to_all_single(packed, step.output_split_sizes, step.input_split_sizes)
    return received.index_select(0, step.recv_index)


def ensure_layout(x: torch.Tensor, current: Plan, required: Plan, group: SPGroup) -> torch.Tensor:
    """Rows of ``current``'s layout -> rows of ``required``'s; nothing at all when the two are the same plan.

    The functional form: it builds the transition's indices on every call. A runtime request prepares them once.
    """
    if current is required or (current.key and current.key == required.key):
        return x
    return redistribute_rows(x, Transition(current, required).for_rank(group.rank).to(x.device), group)


def scatter_rows(x: torch.Tensor, ids: torch.Tensor | Plan, group: SPGroup) -> torch.Tensor:
    """Entry: this rank's rows, in local order, of a canonical tensor every rank holds.

    ``ids`` are this rank's canonical token ids (a request's ``token_ids``), or a :class:`Plan` to take them from.
    """
    if isinstance(ids, Plan):
        if x.shape[0] != ids.layout.num_tokens:
            raise ValueError(
                f"scatter_rows: the canonical tensor has {x.shape[0]} rows but the batch has "
                f"{ids.layout.num_tokens} tokens"
            )
        ids = torch.from_numpy(ids.rank_token_ids(group.rank)).to(x.device)
    return x.index_select(0, ids)


def gather_rows(
    x: torch.Tensor, plan: Plan, group: SPGroup, order: torch.Tensor | None = None
) -> torch.Tensor:
    """Exit: the canonical tensor, complete on every rank, from every rank's local rows of ``plan``.

    ``order`` is ``plan.gather_order`` on ``x``'s device (built here when not given). Backward: a reduce-scatter (one
    all-to-all), so the gradient of this rank's rows is the sum over ranks of the gradient of every rank's copy.
    """
    sizes = plan.rank_token_counts
    rank = group.rank
    if x.shape[0] != sizes[rank]:
        raise ValueError(f"rank {rank}: gather_rows got {x.shape[0]} rows, the plan gives this rank {sizes[rank]}")
    if order is None:
        order = torch.from_numpy(plan.gather_order).to(x.device)
    return group.all_gather_rows(x, sizes).index_select(0, order)
