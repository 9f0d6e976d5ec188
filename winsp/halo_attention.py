"""Neighborhood attention on local rows: exchange the halos, then attend to each query's gathered neighbourhood.

The exact path (every device, every dtype, with backward): the key index of :class:`winsp.halo.HaloExchange` is
computed once per request shape; a layer then gathers each query's ``prod(kernel)`` key rows from the local rows
and the received halo rows, adds the sample's text keys, and runs a masked softmax, in query chunks so that the
gathered keys stay within a memory budget. Only k and v travel (one variable-split all-to-all of both); its backward
is the reverse exchange, so halo gradients return to the rows' owners.

Text rows follow window attention's rule taken to a window that covers the grid: every video query attends to its
sample's text keys besides its neighbourhood, and a text query attends to *all* of its sample's video rows and text
rows. The latter is computed exactly across ranks: each rank's partial softmax over its own rows, shifted by the
global maximum (one all-gather of per-rank maxima) and summed with one all-reduce; the same on every rank.

``score_mod(score, head, q_row, k_row)`` / ``mask_mod(head, q_row, k_row)`` apply to video x video pairs as in
window attention, with ``score`` ``[C, H, K]``, ``head`` ``[1, H, 1]``, ``q_row`` ``[C, 1, 1]`` (local rows) and
``k_row`` ``[C, 1, K]``: *key rows* (local rows, then halo rows), whose grid coordinates are
``halo_tensors(request, layer).key_coords``; :func:`neighborhood_rpb_score_mod` builds NATTEN's relative position
bias from them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .group import SPGroup
from .halo import HaloExchange, HaloTensors
from .neighborhood import Neighborhood
from .score_mods import ScoreMods

__all__ = ["exchange_halos", "neighborhood_attention", "halo_tensors", "neighborhood_rpb_score_mod",
           "GATHER_BUDGET"]

#: Elements of gathered keys (chunk rows x kernel x heads x head_dim) one query chunk may hold.
GATHER_BUDGET = 1 << 24


def exchange_halos(k: Tensor, v: Tensor, halo: HaloTensors, group: SPGroup) -> tuple[Tensor, Tensor]:
    """Key rows ``[L + halo, H, D]`` of k and v: the local rows, then the rows received from the neighbours."""
    if not halo.exchange:
        return k, v
    dk = k.shape[-1]
    packed = torch.cat([k, v.to(k.dtype)], dim=-1).index_select(0, halo.send_index)
    recv = group.all_to_all_single(packed, halo.output_split_sizes, halo.input_split_sizes)
    return torch.cat([k, recv[..., :dk]]), torch.cat([v, recv[..., dk:].to(v.dtype)])


def _video_queries(q: Tensor, k_all: Tensor, v_all: Tensor, txt: Optional[tuple[Tensor, Tensor, Tensor]],
                   halo: HaloTensors, scale: float, mods: Optional[ScoreMods]) -> Tensor:
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    rows, heads, dim = q.shape
    kernel = halo.kernel
    chunk = max(1, GATHER_BUDGET // max(1, kernel * heads * dim))
    head = torch.arange(heads, device=q.device).view(1, -1, 1)
    outs = []
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        index = halo.key_index[start:stop]
        qc = q[start:stop].to(compute)
        kg, vg = k_all.index_select(0, index.reshape(-1)), v_all.index_select(0, index.reshape(-1))
        kg, vg = kg.view(stop - start, kernel, heads, -1).to(compute), vg.view(stop - start, kernel, heads, -1)
        scores = torch.einsum("chd,ckhd->chk", qc, kg) * scale
        if mods is not None:
            q_row = torch.arange(start, stop, device=q.device).view(-1, 1, 1)
            k_row = index.view(stop - start, 1, kernel)
            if mods.score_mod is not None:
                scores = mods.score_mod(scores, head, q_row, k_row)
            if mods.mask_mod is not None:
                scores = scores.masked_fill(~mods.mask_mod(head, q_row, k_row), float("-inf"))
        scores = scores.masked_fill(~halo.key_valid[start:stop].view(stop - start, 1, kernel), float("-inf"))
        if txt is not None:
            k_txt, v_txt, txt_sample = txt
            txt_scores = torch.einsum("chd,thd->cht", qc, k_txt.to(compute)) * scale
            other = txt_sample.view(1, 1, -1) != halo.row_sample[start:stop].view(-1, 1, 1)
            scores = torch.cat([scores, txt_scores.masked_fill(other, float("-inf"))], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("chk,ckhd->chd", probs[..., :kernel], vg.to(compute))
        if txt is not None:
            out = out + torch.einsum("cht,thd->chd", probs[..., kernel:], txt[1].to(compute))
        outs.append(out.to(q.dtype))
    return torch.cat(outs) if outs else q.new_zeros((0, heads, v_all.shape[-1]))


def _text_queries(q_txt: Tensor, k_txt: Tensor, v_txt: Tensor, txt_sample: Tensor, k: Tensor, v: Tensor,
                  halo: HaloTensors, group: SPGroup, scale: float) -> Tensor:
    """Each text query over all of its sample's video rows (on every rank) and its sample's text rows."""
    compute = torch.float32 if q_txt.dtype in (torch.float16, torch.bfloat16) else q_txt.dtype
    qt = q_txt.to(compute)
    vid = torch.einsum("thd,lhd->thl", qt, k.to(compute)) * scale
    vid = vid.masked_fill(txt_sample.view(-1, 1, 1) != halo.row_sample.view(1, 1, -1), float("-inf"))
    txt = torch.einsum("thd,shd->ths", qt, k_txt.to(compute)) * scale
    txt = txt.masked_fill(txt_sample.view(-1, 1, 1) != txt_sample.view(1, 1, -1), float("-inf"))
    with torch.no_grad():  # the shift: any common constant gives the same result, so it carries no gradient
        local_max = vid.amax(dim=-1) if vid.shape[-1] else torch.full_like(txt[..., 0], float("-inf"))
        if not group.is_single:
            local_max = group.all_gather_rows(local_max.contiguous(), [local_max.shape[0]] * group.size)
            local_max = local_max.view(group.size, *txt.shape[:2]).amax(dim=0)
        shift = torch.maximum(local_max, txt.amax(dim=-1)).unsqueeze(-1)
    e_vid, e_txt = torch.exp(vid - shift), torch.exp(txt - shift)
    partial = torch.cat([torch.einsum("thl,lhd->thd", e_vid, v.to(compute)), e_vid.sum(-1, keepdim=True)], dim=-1)
    if not group.is_single:
        partial = group.all_reduce_sum(partial)
    num = partial[..., :-1] + torch.einsum("ths,shd->thd", e_txt, v_txt.to(compute))
    den = partial[..., -1:] + e_txt.sum(-1, keepdim=True)
    return (num / den).to(q_txt.dtype)


def neighborhood_attention(q: Tensor, k: Tensor, v: Tensor, halo: HaloTensors, group: SPGroup, *,
                           q_txt: Optional[Tensor] = None, k_txt: Optional[Tensor] = None,
                           v_txt: Optional[Tensor] = None, txt_sample: Optional[Tensor] = None,
                           scale: float, mods: Optional[ScoreMods] = None,
                           text_output: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """One neighborhood layer on local rows ``[L, H, D]``: halo exchange, then attention (and text queries' output).

    ``txt_sample`` [L_txt] is each text row's sample. Returns (video output, text output or None).
    """
    if q.shape[0] != halo.num_rows:
        raise ValueError(f"rank {group.rank}: neighborhood attention got {q.shape[0]} rows, the plan gives this rank "
                         f"{halo.num_rows}")
    k_all, v_all = exchange_halos(k, v, halo, group)
    has_text = k_txt is not None and k_txt.shape[0] > 0
    vid = _video_queries(q, k_all, v_all, (k_txt, v_txt, txt_sample) if has_text else None, halo, scale, mods)
    if q_txt is None or not text_output:
        return vid, None
    return vid, _text_queries(q_txt, k_txt, v_txt, txt_sample, k, v, halo, group, scale)


def halo_tensors(request, layer: int) -> HaloTensors:
    """This rank's prepared halo data for neighborhood layer ``layer`` of ``request`` (built once, in the store).

    ``query_coords`` / ``key_coords`` are the grid (t, h, w) of local rows and of key rows (local, then halo),
    ``row_sample`` / ``key_sample`` their samples: what a score_mod on a neighborhood layer indexes.
    """
    from .neighborhood import is_neighborhood

    layer = request._check_layer(layer)
    geometry = request.runtime.schedule[layer]
    if not is_neighborhood(geometry):
        raise ValueError(f"layer {layer} attends in {geometry!r}, not a winsp.Neighborhood: it has no halos")
    plan = request.plan(layer)
    runtime = request.runtime
    key = ("halo", plan.key or id(plan), geometry.fingerprint, runtime.rank, str(request.device))
    return runtime.store.get(key, lambda: HaloExchange(plan, runtime.rank, geometry).to(request.device))


def neighborhood_rpb_score_mod(table: Tensor, halo: HaloTensors, geometry: Neighborhood):
    """A score_mod adding NATTEN-style relative position bias ``table[head, dt + kt - 1, dh + kh - 1, dw + kw - 1]``.

    ``table`` is ``[heads, 2 kt - 1, 2 kh - 1, 2 kw - 1]``; ``d`` is (key - query) / dilation per axis, which a
    neighbourhood keeps within ``(-k, k)``. ``table`` receives its gradient through the score_mod.
    """
    kern = torch.tensor(geometry.kernel, device=halo.key_coords.device)
    dil = torch.tensor(geometry.dilation, device=halo.key_coords.device)
    expected = (2 * kern - 1).tolist()
    if table.dim() != 4 or list(table.shape[1:]) != expected:
        raise ValueError(f"relative position bias table must be [heads, {', '.join(map(str, expected))}] for kernel "
                         f"{geometry.kernel}, got {list(table.shape)}")
    q_coords, k_coords = halo.query_coords, halo.key_coords

    def score_mod(score, head, q_row, k_row):
        rel = torch.div(k_coords[k_row] - q_coords[q_row], dil, rounding_mode="floor") + kern - 1
        return score + table[head, rel[..., 0], rel[..., 1], rel[..., 2]]

    return score_mod


def _text_samples(request) -> Tensor:
    key = ("halo-text", request.text_lengths, str(request.device))
    lengths = torch.tensor(request.text_lengths, dtype=torch.int64)
    return request.runtime.store.get(key, lambda: torch.repeat_interleave(
        torch.arange(len(lengths)), lengths).to(request.device))


def neighborhood_layer(request, layer: int, qkv: tuple, qkv_txt: tuple, mods: Optional[ScoreMods],
                       softmax_scale: Optional[float], text_output: bool) -> tuple[Tensor, Optional[Tensor]]:
    """:meth:`winsp.WindowRequest.attention` of a :class:`~winsp.Neighborhood` layer (the runtime's one hook)."""
    from .attention import _scale

    halo = halo_tensors(request, layer)
    q_txt, k_txt, v_txt = qkv_txt
    return neighborhood_attention(*qkv, halo, request.group, q_txt=q_txt, k_txt=k_txt, v_txt=v_txt,
                                  txt_sample=_text_samples(request) if k_txt is not None else None,
                                  scale=_scale(qkv[0], softmax_scale), mods=mods, text_output=text_output)
