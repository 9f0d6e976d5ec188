"""``flex`` for neighborhood layers: one rank's queries against its key rows under a FlexAttention block mask.

The rank's local queries (in query-tile order, so a block of 128 queries is spatially compact) attend to its key
rows (local, then received halo rows, reordered tile-major) followed by all text rows. The mask_mod is exactly NATTEN's
neighbourhood, from the per-axis tables of :mod:`winsp.geometry.neighborhood`: along each axis a query at ``i`` reaches
the keys ``p`` with ``p = i (mod dilation)`` and ``lo[i] <= p <= hi[i]`` (its clamped or causal window), within its own
sample; every video query also reaches its sample's text rows. The block mask is built from the query tiles of
:class:`winsp.planning.halo.HaloExchange` (a tile's queries against the box its queries reach), not by evaluating the
mask densely, so it costs no ``queries x keys`` memory; it is built once per request shape and kept in the runtime's
store.

A call's ``score_mod`` / ``mask_mod`` apply to video x video pairs at *local* query rows and *key* rows, as in the
tiled path (text pairs are evaluated at the query's own row, then left unmodified). The kernel is the window flex
backend's: compiled on CUDA, eager (every score materialised, forward only) on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from winsp.attention.backends.flex import _import, _kernel, apply_mods
from winsp.attention.score_mods import ScoreMods
from winsp.geometry.neighborhood import Neighborhood, axis_neighbours
from winsp.planning.halo import HaloTensors, query_tile_length

__all__ = ["FlexNeighborhood", "build_flex_neighborhood", "flex_video_queries", "FLEX_BLOCK"]

#: FlexAttention's sparse block size (its default): the block mask is ``[query blocks, key blocks]`` of this many rows.
FLEX_BLOCK = 128


@dataclass(frozen=True, eq=False)
class FlexNeighborhood:
    """One rank's FlexAttention data for one neighborhood layer and request shape (see :func:`build_flex_neighborhood`).

    ``q_order`` / ``k_order``: local rows / key rows in the kernel's order (``row_slot`` maps back);
    ``block_mask``: the mask over ``[queries, video keys + text keys]``; ``num_video_keys``: where text keys start.
    """

    q_order: Tensor
    q_order_padded: Tensor
    k_order: Tensor
    k_order_padded: Tensor
    row_slot: Tensor
    block_mask: object
    num_video_keys: int
    num_text: int


def _pad(values: np.ndarray, length: int, fill) -> np.ndarray:
    out = np.full((length,) + values.shape[1:], fill, dtype=values.dtype)
    out[: values.shape[0]] = values
    return out


def _axis_windows(grids, geometry: Neighborhood, coords: np.ndarray, sample: np.ndarray):
    """Per query: its window ``[lo, hi]`` per axis (in positions) from the per-axis neighbour tables ([L, 3] each)."""
    lo = np.zeros_like(coords)
    hi = np.zeros_like(coords)
    for s, grid in enumerate(grids):
        rows = np.nonzero(sample == s)[0]
        for a, axis in enumerate(geometry.axes(grid)):
            keys, valid = axis_neighbours(*axis)
            pos = coords[rows, a]
            lo[rows, a] = np.where(valid[pos], keys[pos], np.iinfo(np.int64).max).min(axis=1)
            hi[rows, a] = keys[pos].max(axis=1)  # invalid causal slots hold the query itself, the window's top
    return lo, hi


def _key_order(coords: np.ndarray, sample: np.ndarray, geometry: Neighborhood) -> np.ndarray:
    """Key rows sorted tile-major (sample, then the query tiles' lengths per axis, then row-major)."""
    tile = np.asarray([query_tile_length(k, d, s) for k, d, s in
                       zip(geometry.kernel, geometry.dilation, geometry.stride, strict=True)])
    t = coords // tile
    return np.lexsort((coords[:, 2], coords[:, 1], coords[:, 0], t[:, 2], t[:, 1], t[:, 0], sample))


def _block_lists(halo: HaloTensors, q_pos_of_row: np.ndarray, k_pos_of_row: np.ndarray, q_sample: np.ndarray,
                 text_sample: np.ndarray, num_video_keys: int, q_len: int, kv_len: int):
    """``kv_num_blocks`` [1, 1, QB] and ``kv_indices`` [1, 1, QB, KB]: every key block a query block may reach.

    A tile's queries reach at most the tile's key box, so (query blocks of a tile) x (key blocks of its box) covers
    every allowed pair; text blocks are added per sample. The mask_mod decides inside a block.
    """
    qb, kb = -(-q_len // FLEX_BLOCK), -(-kv_len // FLEX_BLOCK)
    reach = np.zeros((qb, kb), dtype=np.float32)
    for query_rows, key_rows, _, _ in halo.tiles:
        query, key = query_rows.cpu().numpy(), key_rows.cpu().numpy()
        g = query.shape[0]
        q_hit = np.zeros((g, qb), dtype=np.float32)
        k_hit = np.zeros((g, kb), dtype=np.float32)
        q_hit[np.arange(g)[:, None], q_pos_of_row[query] // FLEX_BLOCK] = 1
        k_hit[np.arange(g)[:, None], k_pos_of_row[key] // FLEX_BLOCK] = 1
        reach += q_hit.T @ k_hit
    if text_sample.size:
        samples = int(max(q_sample.max(initial=-1), text_sample.max())) + 1
        q_s = np.zeros((qb, samples), dtype=np.float32)
        t_s = np.zeros((samples, kb), dtype=np.float32)
        q_s[np.arange(q_len) // FLEX_BLOCK, q_sample] = 1
        t_s[text_sample, (num_video_keys + np.arange(text_sample.size)) // FLEX_BLOCK] = 1
        reach += q_s @ t_s
    allowed = reach > 0
    counts = allowed.sum(axis=1).astype(np.int32)
    order = np.argsort(~allowed, axis=1, kind="stable").astype(np.int32)  # allowed blocks first, ascending
    return counts[None, None], order[None, None]


def build_flex_neighborhood(halo: HaloTensors, geometry: Neighborhood, grids, text_sample: Tensor,
                            device: torch.device) -> FlexNeighborhood:
    """The block mask and orders of one rank's neighborhood layer (built once per request shape, on ``device``).

    ``halo`` and ``text_sample`` [L_txt] (each text row's sample) are host tensors: this is planning, which reads
    them with numpy and moves its results to ``device``; ``grids`` are the plan's (laid) grids.
    """
    if _import() is None:
        raise ValueError("the flex neighborhood backend needs torch.nn.attention.flex_attention (torch >= 2.5)")
    from torch.nn.attention.flex_attention import BlockMask

    q_order = torch.cat([query.reshape(-1) for query, *_ in halo.tiles]).cpu().numpy() if halo.tiles else \
        np.zeros(0, np.int64)
    key_coords, key_sample = halo.key_coords.cpu().numpy(), halo.key_sample.cpu().numpy()
    k_order = _key_order(key_coords, key_sample, geometry)
    txt = text_sample.cpu().numpy().astype(np.int64)
    nq, nk, nt = q_order.size, k_order.size, txt.size
    q_len, kv_len = nq, nk + nt
    q_pad, kv_pad = -(-max(q_len, 1) // FLEX_BLOCK) * FLEX_BLOCK, -(-max(kv_len, 1) // FLEX_BLOCK) * FLEX_BLOCK

    q_coords = halo.query_coords.cpu().numpy()[q_order]
    q_sample = halo.row_sample.cpu().numpy()[q_order]
    lo, hi = _axis_windows(grids, geometry, q_coords, q_sample)
    dil = np.asarray(geometry.dilation)
    residue = q_coords % dil
    kv_coords = np.concatenate([key_coords[k_order], np.zeros((nt, 3), np.int64)])
    kv_sample = np.concatenate([key_sample[k_order], txt])

    def t(a, length, fill):  # padded to whole blocks, so an index the kernel reads past the end stays in range
        return torch.from_numpy(np.ascontiguousarray(_pad(a, length, fill))).to(device)

    qs, q_lo, q_hi, q_res = t(q_sample, q_pad, -2), t(lo, q_pad, 0), t(hi, q_pad, -1), t(residue, q_pad, 0)
    ks, kc = t(kv_sample, kv_pad, -1), t(kv_coords, kv_pad, 0)
    axes = [(q_lo[:, a].contiguous(), q_hi[:, a].contiguous(), q_res[:, a].contiguous(), kc[:, a].contiguous(),
             int(dil[a])) for a in range(3)]
    num_video_keys = int(nk)

    def neighbourhood(b, h, q_idx, kv_idx):
        ok = (qs[q_idx] == ks[kv_idx])
        inside = kv_idx < num_video_keys
        for a_lo, a_hi, a_res, a_key, d in axes:
            pos = a_key[kv_idx]
            inside = inside & (pos >= a_lo[q_idx]) & (pos <= a_hi[q_idx]) & (pos % d == a_res[q_idx])
        return ok & (inside | (kv_idx >= num_video_keys))

    k_pos_of_row = np.empty(nk, np.int64)
    k_pos_of_row[k_order] = np.arange(nk)
    q_pos_of_row = np.empty(nq, np.int64)
    q_pos_of_row[q_order] = np.arange(nq)
    counts, indices = _block_lists(halo, q_pos_of_row, k_pos_of_row, q_sample, txt, nk, max(q_len, 1),
                                   max(kv_len, 1))
    block_mask = BlockMask.from_kv_blocks(torch.from_numpy(counts).to(device), torch.from_numpy(indices).to(device),
                                          BLOCK_SIZE=FLEX_BLOCK, mask_mod=neighbourhood,
                                          seq_lengths=(max(q_len, 1), max(kv_len, 1)))
    q_order_t = torch.from_numpy(q_order).to(device)
    k_order_t = torch.from_numpy(k_order).to(device)
    return FlexNeighborhood(
        q_order=q_order_t, q_order_padded=torch.from_numpy(_pad(q_order, q_pad, 0)).to(device),
        k_order=k_order_t, k_order_padded=torch.from_numpy(_pad(k_order, kv_pad, 0)).to(device),
        row_slot=halo.row_slot.to(device), block_mask=block_mask, num_video_keys=num_video_keys, num_text=int(nt))


def _flex_score_mod(data: FlexNeighborhood, mods: Optional[ScoreMods]):
    """The call's mods in FlexAttention's form at local query rows and key rows (text keys: left unmodified)."""
    if not mods:
        return None
    q_rows, k_rows, nk = data.q_order_padded, data.k_order_padded, data.num_video_keys

    def score_mod(score, b, h, q_idx, kv_idx):
        video = kv_idx < nk
        q_row = q_rows[q_idx]
        k_row = torch.where(video, k_rows[kv_idx], q_row)
        return apply_mods(score, h, q_row, k_row, video, mods)

    return score_mod


def flex_video_queries(data: FlexNeighborhood, q: Tensor, k_all: Tensor, v_all: Tensor,
                       txt: Optional[tuple], scale: float, mods: Optional[ScoreMods]) -> Tensor:
    """Video queries' output [L, H, D] (local row order) with FlexAttention under ``data``'s block mask."""
    rows, heads, _ = q.shape
    if rows == 0:
        return q.new_zeros((0, heads, v_all.shape[-1]))
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k_all, v_all, *(txt[:2] if txt is not None else ()))):
        raise ValueError("neighborhood_backend='flex' on CPU is inference-only (torch has no CPU backward for "
                         "FlexAttention); use neighborhood_backend='tiled' (or 'auto') to train on CPU")
    kv = [x.index_select(0, data.k_order) for x in (k_all, v_all)]
    if data.num_text:
        if txt is None or txt[0].shape[0] != data.num_text:
            raise ValueError(f"the flex neighborhood mask was built for {data.num_text} text rows, the call has "
                             f"{0 if txt is None else txt[0].shape[0]}")
        kv = [torch.cat([kv[0], txt[0].to(kv[0].dtype)]), torch.cat([kv[1], txt[1].to(kv[1].dtype)])]
    qf = q.index_select(0, data.q_order).transpose(0, 1).unsqueeze(0).contiguous()
    kf, vf = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in kv)
    out = _kernel(q.device)(qf, kf, vf, score_mod=_flex_score_mod(data, mods), block_mask=data.block_mask,
                            scale=scale)
    return out.squeeze(0).transpose(0, 1).index_select(0, data.row_slot)
