"""Attention of split windows: head-parallel inside the few ranks that hold a window's rows.

A split window's rows live on several ranks (its *holders*, each with a contiguous run of its rows). Its heads are
shared out among the holders in proportion to their rows (holder ``i`` with rows ``[a, b)`` of ``W`` computes heads
``[round(H a / W), round(H b / W))``), so its attention work follows its rows. Per layer:

1. one all-to-all (over the SP group, zero-sized for every pair of ranks that shares no window): each holder sends
   q, k, v of its rows, for every other holder's heads, to that holder;
2. each holder runs the whole window's attention over ``[window video, sample text]`` for its heads: every query
   (video and text) sees every key, so there is no partial softmax to merge, and the window's text queries are
   computed once per head, i.e. exactly once;
3. one all-to-all sends each holder's output rows back for the other holders' heads.

The window's text output (a ``[T, heads]`` slice per holder) goes into the layer's single text all-reduce like any
whole window's copy (:func:`winsp.comm.text.sum_window_text`), and the window counts once in its sample's divisor. Per
holder this moves ``4 w (W - w) / W`` rows' worth (``w`` its rows): what Ulysses moves inside that group, or less.

Index data is numpy on the CPU (:class:`SplitAttention`, per plan, rank and head count); the runtime's store keeps
the device copies (:class:`SplitAttentionTensors`). A ``score_mod`` / ``mask_mod`` indexes per-local-row tensors,
which a window gathered from several ranks does not have: :func:`refuse_score_mods` raises for split layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from winsp.comm.group import SPGroup
from winsp.geometry.layout import inverse_permutation
from winsp.planning.plan import Plan

__all__ = ["SplitAttention", "SplitAttentionTensors", "head_bounds", "split_attention", "refuse_score_mods",
           "split_local_rows", "join_local_rows"]


def head_bounds(first: int, end: int, rows: int, heads: int) -> tuple[int, int]:
    """The heads ``[h0, h1)`` of the holder of rows ``[first, end)`` of a ``rows``-row window (rounded shares)."""
    return (2 * heads * first + rows) // (2 * rows), (2 * heads * end + rows) // (2 * rows)


def refuse_score_mods(plan: Plan, score_mod, mask_mod) -> None:
    """ValueError when a ``score_mod`` / ``mask_mod`` meets a layout with split windows."""
    if plan.has_split_windows and (score_mod is not None or mask_mod is not None):
        raise ValueError(
            f"this layout splits {len(plan.window_holders)} window(s) across ranks, and score_mod / mask_mod index "
            "per-local-row tensors that a split window does not have on one rank; make the request with "
            "score_mods=True, or build the runtime with split_windows=False (the default planner then keeps whole "
            "windows) or planner='lpt' / 'locality'"
        )


@dataclass(frozen=True, eq=False)
class SplitAttention:
    """What one rank does for the split windows of one plan, at one head count (CPU index arrays).

    Local rows are split into the rows of whole windows (``whole_rows``, what :func:`winsp.attention.windows.attend`
    sees) and the rows of split pieces (``split_rows``, piece order); ``restore`` puts ``cat([whole, split])`` back in
    local order. ``in_send`` picks ``(qkv, split row, head)`` rows of the stacked ``[3 * L_split * H, d]`` inputs per
    peer; ``in_gather`` turns the received rows into ``[3, W, h]`` blocks, one per window this rank computes heads of
    (``windows``: ``(rows W, text start, text length, first head, head count)``). ``out_send`` / ``out_gather`` do the
    same for the outputs; ``text_index`` places each block's ``[T, h]`` text output in the ``[N_txt * H]`` rows of the
    text accumulator.
    """

    heads: int
    whole_rows: np.ndarray
    split_rows: np.ndarray
    restore: np.ndarray
    in_send: np.ndarray
    in_send_sizes: tuple[int, ...]
    in_recv_sizes: tuple[int, ...]
    in_gather: np.ndarray
    windows: tuple[tuple[int, int, int, int, int], ...]
    out_send: np.ndarray
    out_send_sizes: tuple[int, ...]
    out_recv_sizes: tuple[int, ...]
    out_gather: np.ndarray
    text_index: np.ndarray

    @classmethod
    def build(cls, plan: Plan, rank: int, heads: int, text_lengths: tuple[int, ...]) -> "SplitAttention":
        if heads < 1:
            raise ValueError(f"split attention needs at least one head, got {heads}")
        lay, p = plan.layout, plan.world_size
        holders = plan.window_holders
        txt_start = np.concatenate([[0], np.cumsum(text_lengths)]).astype(np.int64)
        # local rows: whole windows' and split pieces' (piece order)
        whole_rows: list[np.ndarray] = []
        split_rows: list[np.ndarray] = []
        mine: dict[int, tuple[int, int, int]] = {}  # window -> (first row, end row, offset among my split rows)
        row = 0
        for w, a, b in plan.rank_pieces[rank]:
            rows = np.arange(row, row + b - a, dtype=np.int64)
            if w in holders:
                mine[w] = (a, b, sum(len(r) for r in split_rows))  # my rows of w start at this split-row offset
                split_rows.append(rows)
            else:
                whole_rows.append(rows)
            row += b - a
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
        whole, split = cat(whole_rows), cat(split_rows)
        n_split = split.size

        def bounds(w: int, a: int, b: int) -> tuple[int, int]:
            return head_bounds(a, b, int(lay.token_counts[w]), heads)

        # windows shared with each peer, in window order
        shared = [sorted(w for w in mine if any(r == q for r, _, _ in holders[w])) for q in range(p)]

        # ---- in: send my rows of w, heads of peer q; receive peer q's rows of w, my heads
        send: list[np.ndarray] = []
        send_sizes: list[int] = []
        recv_sizes: list[int] = []
        recv_offset: dict[tuple[int, int], int] = {}
        received = 0
        for q in range(p):
            sent = 0
            for w in shared[q]:
                a, b, off = mine[w]
                _, qa, qb = next(h for h in holders[w] if h[0] == q)
                h0, h1 = bounds(w, qa, qb)
                part, row_of, head_of = np.meshgrid(np.arange(3), np.arange(off, off + b - a), np.arange(h0, h1),
                                                    indexing="ij")
                send.append(((part * n_split + row_of) * heads + head_of).reshape(-1))
                sent += send[-1].size
                m0, m1 = bounds(w, a, b)
                recv_offset[(q, w)] = received
                received += 3 * (qb - qa) * (m1 - m0)
            send_sizes.append(sent)
            recv_sizes.append(received - sum(recv_sizes))
        windows, gather, text_index, block_offset = [], [], [], {}
        out_rows = 0
        for w, (a, b, _) in mine.items():
            m0, m1 = bounds(w, a, b)
            count = int(lay.token_counts[w])
            if m1 == m0:
                continue
            h_mine = m1 - m0
            parts = []
            for t in range(3):
                for q, qa, qb in holders[w]:
                    base = recv_offset[(q, w)] + t * (qb - qa) * h_mine
                    parts.append(base + np.arange((qb - qa) * h_mine, dtype=np.int64))
            gather.append(np.concatenate(parts))
            sample = int(lay.window_sample[w])
            t_len, t0 = int(text_lengths[sample]), int(txt_start[sample])
            windows.append((count, t0, t_len, m0, h_mine))
            rr, hh = np.meshgrid(np.arange(t0, t0 + t_len), np.arange(m0, m1), indexing="ij")
            text_index.append((rr * heads + hh).reshape(-1))
            block_offset[w] = out_rows
            out_rows += count * h_mine

        # ---- out: send peer q its rows of w for my heads; receive my rows of w for peer q's heads
        out_send: list[np.ndarray] = []
        out_send_sizes: list[int] = []
        out_recv_sizes: list[int] = []
        out_offset: dict[tuple[int, int], tuple[int, int, int]] = {}
        received = 0
        for q in range(p):
            sent = 0
            for w in shared[q]:
                a, b, _ = mine[w]
                _, qa, qb = next(h for h in holders[w] if h[0] == q)
                m0, m1 = bounds(w, a, b)
                if m1 > m0:
                    out_row, out_head = np.meshgrid(np.arange(qa, qb), np.arange(m1 - m0), indexing="ij")
                    out_send.append((block_offset[w] + out_row * (m1 - m0) + out_head).reshape(-1))
                    sent += out_send[-1].size
                h0, h1 = bounds(w, qa, qb)
                out_offset[(q, w)] = (received, h0, h1)
                received += (b - a) * (h1 - h0)
            out_send_sizes.append(sent)
            out_recv_sizes.append(received - sum(out_recv_sizes))
        out_gather = []
        for w, (a, b, _) in mine.items():
            owner_of_head = np.empty(heads, dtype=np.int64)
            start_of_head = np.empty(heads, dtype=np.int64)
            width_of_head = np.empty(heads, dtype=np.int64)
            for q, _, _ in holders[w]:
                base, h0, h1 = out_offset[(q, w)]
                owner_of_head[h0:h1] = base - h0
                start_of_head[h0:h1] = h0
                width_of_head[h0:h1] = h1 - h0
            r = np.arange(b - a)[:, None]
            hh = np.arange(heads)[None, :]
            out_gather.append((owner_of_head[None, :] + start_of_head[None, :] + r * width_of_head[None, :]
                               + (hh - start_of_head[None, :])).reshape(-1))
        return cls(
            heads=heads, whole_rows=whole, split_rows=split,
            restore=inverse_permutation(np.concatenate([whole, split])) if row else np.zeros(0, np.int64),
            in_send=cat(send), in_send_sizes=tuple(send_sizes), in_recv_sizes=tuple(recv_sizes),
            in_gather=cat(gather), windows=tuple(windows),
            out_send=cat(out_send), out_send_sizes=tuple(out_send_sizes), out_recv_sizes=tuple(out_recv_sizes),
            out_gather=cat(out_gather), text_index=cat(text_index),
        )

    @property
    def row_order(self) -> str:
        """``"whole_first"`` / ``"split_first"`` where local rows are one run of whole windows' rows and one of split
        pieces' (in that order), so both are slices and need no gather; else ``"gather"``."""
        nw, ns = self.whole_rows.size, self.split_rows.size
        if np.array_equal(self.whole_rows, np.arange(nw)) and np.array_equal(self.split_rows, np.arange(nw, nw + ns)):
            return "whole_first"
        if np.array_equal(self.split_rows, np.arange(ns)) and np.array_equal(self.whole_rows, np.arange(ns, ns + nw)):
            return "split_first"
        return "gather"

    def to(self, device: torch.device | str) -> "SplitAttentionTensors":
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
        return SplitAttentionTensors(
            heads=self.heads, whole_rows=t(self.whole_rows), split_rows=t(self.split_rows), restore=t(self.restore),
            in_send=t(self.in_send), in_send_sizes=self.in_send_sizes, in_recv_sizes=self.in_recv_sizes,
            in_gather=t(self.in_gather), windows=self.windows, out_send=t(self.out_send),
            out_send_sizes=self.out_send_sizes, out_recv_sizes=self.out_recv_sizes, out_gather=t(self.out_gather),
            text_index=t(self.text_index), num_split_rows=int(self.split_rows.size),
            num_whole_rows=int(self.whole_rows.size), row_order=self.row_order,
        )


@dataclass(frozen=True, eq=False)
class SplitAttentionTensors:
    """A :class:`SplitAttention` on one device (index tensors; sizes and window shapes stay Python ints)."""

    heads: int
    whole_rows: Tensor
    split_rows: Tensor
    restore: Tensor
    in_send: Tensor
    in_send_sizes: tuple[int, ...]
    in_recv_sizes: tuple[int, ...]
    in_gather: Tensor
    windows: tuple[tuple[int, int, int, int, int], ...]
    out_send: Tensor
    out_send_sizes: tuple[int, ...]
    out_recv_sizes: tuple[int, ...]
    out_gather: Tensor
    text_index: Tensor
    num_split_rows: int
    num_whole_rows: int = 0
    row_order: str = "gather"


def split_local_rows(x: Tensor, split: SplitAttentionTensors) -> tuple[Tensor, Tensor]:
    """``x``'s rows of whole windows and of split pieces: two slices where local rows allow it, else two gathers."""
    if split.row_order == "whole_first":
        return x[:split.num_whole_rows], x[split.num_whole_rows:]
    if split.row_order == "split_first":
        return x[split.num_split_rows:], x[:split.num_split_rows]
    return x.index_select(0, split.whole_rows), x.index_select(0, split.split_rows)


def join_local_rows(whole: Tensor, pieces: Tensor, split: SplitAttentionTensors) -> Tensor:
    """The inverse of :func:`split_local_rows`: whole windows' and split pieces' rows back in local order."""
    if split.row_order == "whole_first":
        return torch.cat([whole, pieces])
    if split.row_order == "split_first":
        return torch.cat([pieces, whole])
    return torch.cat([whole, pieces]).index_select(0, split.restore)


def split_attention(q: Tensor, k: Tensor, v: Tensor, q_txt: Tensor, k_txt: Tensor, v_txt: Tensor,
                    split: SplitAttentionTensors, group: SPGroup, scale: float) -> tuple[Tensor, Tensor]:
    """This rank's split pieces' video outputs ``[L_split, H, d]`` and its text contributions ``[R, d]``.

    ``q``/``k``/``v`` are the split rows ``[L_split, H, d]`` (in :attr:`SplitAttention.split_rows` order); the text
    tensors are the replicated ``[N_txt, H, d]`` (zero rows without text). The text contributions belong at rows
    ``split.text_index`` of the ``[N_txt * H, d]`` view of the text accumulator. Every rank of the group must call
    this for the layout (the two all-to-alls are collective), even with no split piece.
    """
    d = q.shape[-1]
    stacked = torch.stack([q, k, v]).reshape(-1, d)
    received = group.all_to_all_single(stacked.index_select(0, split.in_send), split.in_recv_sizes,
                                       split.in_send_sizes)
    blocks = received.index_select(0, split.in_gather)
    outs, texts = [], []
    start = 0
    for rows, t0, t_len, h0, h in split.windows:
        block = blocks[start:start + 3 * rows * h].view(3, rows, h, d)
        start += 3 * rows * h
        qkv = [torch.cat([block[i], txt[t0:t0 + t_len, h0:h0 + h]]).transpose(0, 1)
               for i, txt in enumerate((q_txt, k_txt, v_txt))]
        # 4-D: CPU SDPA takes its fused (flash) kernel only for [batch, heads, rows, d]; 3-D falls back to the math path
        q4, k4, v4 = (t[None] for t in qkv)
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale)[0].transpose(0, 1)  # [rows+T, h, d]
        outs.append(out[:rows].reshape(-1, d))
        texts.append(out[rows:].reshape(-1, d))
    # every rank's graph reaches both exchanges (the backward runs them as collectives too), even without a block
    send = torch.cat(outs + [received[:0]]).index_select(0, split.out_send)
    back = group.all_to_all_single(send, split.out_recv_sizes, split.out_send_sizes)
    video = back.index_select(0, split.out_gather).view(-1, split.heads, d)
    text = torch.cat(texts + [blocks[:0]])
    return video, text
