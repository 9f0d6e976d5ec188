"""The prepared per-rank data of a stage: the sharded grid change into it, and its padding rows.

A :class:`GridStep` is one rank's part of a grid change (merge or split, :mod:`winsp.planning.stages`): every output row
is built on the rank that owns it in the next stage's first layout, from rows that either are already there or arrive in
one variable-split all-to-all. Only rows whose output lives on another rank move; nothing is all-gathered.
:class:`StageRows` tells padding rows from model rows in one layout. Both are built once per request shape (in the
runtime's store) and applied with tensor ops only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from torch import Tensor

from winsp.planning.plan import Plan
from winsp.planning.stages import logical_ids

if TYPE_CHECKING:  # a type only: planning sits below communication
    from winsp.comm.group import SPGroup

__all__ = ["GridStep", "StageRows"]


@dataclass(frozen=True, eq=False)
class GridStep:
    """One rank's part of a grid change: gather, exchange, then build each local output row (all prepared)."""

    send_index: Tensor
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    build_index: Tensor  # [L_dst, K] rows of [received; one zero row]
    chunk: Optional[Tensor]  # [L_dst] for a split, None for a merge
    network_exchange_required: bool
    num_src_rows: int
    rows_moved: int  # rows that change rank over the whole group (for reports)
    parts: int  # children a split makes of one row's channels (1 for a merge)

    @staticmethod
    def build(src: Plan, dst: Plan, sources: np.ndarray, chunk: Optional[np.ndarray], parts: int, rank: int,
              device: torch.device) -> "GridStep":
        """The step of ``rank`` moving rows of ``src``'s layout into ``dst``'s, output rows from ``sources``."""
        p, n_src = src.world_size, src.layout.num_tokens
        dst_owner = dst.token_owner
        rows, cols = np.nonzero(sources >= 0)
        pair = np.unique(dst_owner[rows] * n_src + sources[rows, cols])  # needed (destination rank, source row)
        need_rank, need_src = pair // n_src, pair % n_src
        src_rank, src_local = src.token_owner[need_src], src.token_local_index[need_src]
        counts = np.bincount(src_rank * p + need_rank, minlength=p * p).reshape(p, p)
        mine = src_rank == rank
        send = np.lexsort((src_local[mine], need_rank[mine]))
        incoming = need_rank == rank
        arrival = np.lexsort((src_local[incoming], src_rank[incoming]))
        buffer_ids = need_src[incoming][arrival]
        position = np.full(n_src, buffer_ids.size, dtype=np.int64)  # default: the zero row after the buffer
        position[buffer_ids] = np.arange(buffer_ids.size, dtype=np.int64)
        local = sources[dst.rank_token_ids(rank)]
        build_index = np.where(local >= 0, position[np.maximum(local, 0)], buffer_ids.size)
        moved = int(counts.sum() - np.trace(counts))

        def t(a: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        return GridStep(
            send_index=t(src_local[mine][send]),
            input_split_sizes=tuple(int(c) for c in counts[rank, :]),
            output_split_sizes=tuple(int(c) for c in counts[:, rank]),
            build_index=t(build_index.reshape(local.shape)),
            chunk=None if chunk is None else t(chunk[dst.rank_token_ids(rank)]),
            network_exchange_required=moved > 0,
            num_src_rows=src.rank_token_counts[rank],
            rows_moved=moved,
            parts=parts,
        )

    def __call__(self, x: Tensor, group: SPGroup) -> Tensor:
        if x.shape[0] != self.num_src_rows:
            raise ValueError(f"rank {group.rank}: to_grid got {x.shape[0]} rows, the current layout gives this rank "
                             f"{self.num_src_rows}")
        if x.dim() < 2 or x.shape[1] % self.parts:
            raise ValueError(f"to_grid: rows must be [L, C, ...] with C divisible by {self.parts} (the children a "
                             f"split makes), got shape {tuple(x.shape)}")
        packed = x.index_select(0, self.send_index)
        if self.network_exchange_required:
            packed = group.all_to_all_single(packed, self.output_split_sizes, self.input_split_sizes)
        rest = tuple(x.shape[2:])
        buffer = torch.cat([packed, packed.new_zeros((1,) + tuple(x.shape[1:]))])
        rows, k = self.build_index.shape
        out = buffer.index_select(0, self.build_index.reshape(-1))
        if self.chunk is None:  # merge: the children's channels side by side, in the stage's order
            return out.reshape((rows, k * x.shape[1]) + rest)
        parts = out.reshape((rows, self.parts, x.shape[1] // self.parts) + rest)
        return parts[torch.arange(rows, device=x.device), self.chunk]



@dataclass(frozen=True, eq=False)
class StageRows:
    """Per-row padding data of one layout on one rank (prepared once)."""

    valid: Tensor  # [L] bool: the row is inside the model grid
    scatter_index: Tensor  # [L] model-canonical id of each local row (N_model for padding: a zero row)
    laid_grid: Tensor  # [L, 3] the laid-out grid of each row's sample
    crop_index: Tensor  # [N_model] laid-canonical id of each model-canonical row
    padded: bool

    @staticmethod
    def build(plan: Plan, rank: int, row_sample: np.ndarray, token_ids: np.ndarray, model, laid,
              device: torch.device) -> "StageRows":
        """``rank``'s rows of ``plan`` (local ``token_ids`` and ``row_sample``) on a stage with these grids."""
        keep = logical_ids(model, laid)
        logical = keep[token_ids]
        grid = np.asarray(laid, dtype=np.int64)[row_sample].reshape(-1, 3)
        total = sum(t * h * w for t, h, w in model)
        return StageRows(
            valid=torch.from_numpy(logical >= 0).to(device),
            scatter_index=torch.from_numpy(np.where(logical >= 0, logical, total)).to(device),
            laid_grid=torch.from_numpy(np.ascontiguousarray(grid)).to(device),
            crop_index=torch.from_numpy(np.nonzero(keep >= 0)[0][np.argsort(keep[keep >= 0])]).to(device),
            padded=bool((keep < 0).any()),
        )
