"""Neighborhood attention on local rows: exchange the halos, then attend to each query's gathered neighbourhood.

The exact path (every device, every dtype, with backward) is tiled masked SDPA:
:class:`winsp.planning.halo.HaloExchange` cuts the rank's block into query tiles of ``kernel * dilation`` per axis, once
per request shape; each tile attends densely to the box of rows its queries reach (local and received halo rows) plus
its sample's text keys, under a boolean mask that keeps each query's neighbourhood, in chunks of tiles within a memory
budget. Dense tiles trade some masked work for GEMM speed (about (2k - 1) / k per axis of extra pairs). Only k and v
travel (one variable-split all-to-all of both); its backward is the reverse exchange, so halo gradients return to the
rows' owners. In inference the exchange runs in the background while the *interior* tiles (those that reach local rows
only) are computed.

Text rows follow window attention's rule taken to a window that covers the grid: every video query attends to its
sample's text keys besides its neighbourhood, and a text query attends to *all* of its sample's video rows and text
rows. The latter is computed exactly across ranks: each rank's partial softmax over its own rows, shifted by the
global maximum (one all-gather of per-rank maxima) and summed with one all-reduce; the same on every rank.

``score_mod(score, head, q_row, k_row)`` / ``mask_mod(head, q_row, k_row)`` apply to video x video pairs as in
window attention, per query tile: ``score`` ``[G, H, Q, K]``, ``head`` ``[1, H, 1, 1]``, ``q_row`` ``[G, 1, Q, 1]``
(local rows) and ``k_row`` ``[G, 1, 1, K]``: *key rows* (local rows, then halo rows). They are evaluated on every
pair of a tile, neighbours or not (the others are masked afterwards), so they must accept any key row. Key rows'
grid coordinates are
``halo_tensors(request, layer).key_coords``; :func:`neighborhood_rpb_score_mod` builds NATTEN's relative position
bias from them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from winsp.attention.score_mods import ScoreMods
from winsp.comm.group import PendingRows, SPGroup
from winsp.geometry.neighborhood import Neighborhood
from winsp.planning.halo import HaloExchange, HaloTensors

__all__ = ["exchange_halos", "start_halo_exchange", "finish_halo_exchange", "neighborhood_attention", "halo_tensors",
           "neighborhood_rpb_score_mod", "GATHER_BUDGET"]

#: Elements (gathered q / k / v and scores) one chunk of query tiles may hold.
GATHER_BUDGET = 1 << 24


def start_halo_exchange(k: Tensor, v: Tensor, halo: HaloTensors, group: SPGroup) -> Optional[PendingRows]:
    """Send this rank's edge rows of k and v to the neighbours that reach them (one variable-split all-to-all of
    both, packed); None when the plan exchanges nothing. :func:`finish_halo_exchange` returns the key rows."""
    if not halo.exchange:
        return None
    idx = halo.send_index  # pick the edge rows first, then pack: the copy is the halo's size, not the block's
    packed = torch.cat([k.index_select(0, idx), v.index_select(0, idx).to(k.dtype)], dim=-1)
    return group.start_all_to_all_single(packed, halo.output_split_sizes, halo.input_split_sizes)


def finish_halo_exchange(k: Tensor, v: Tensor, pending: Optional[PendingRows]) -> tuple[Tensor, Tensor]:
    """Key rows ``[L + halo, H, D]`` of k and v: the local rows, then the rows received from the neighbours."""
    if pending is None:
        return k, v
    recv, dk = pending.wait(), k.shape[-1]
    return torch.cat([k, recv[..., :dk]]), torch.cat([v, recv[..., dk:].to(v.dtype)])


def exchange_halos(k: Tensor, v: Tensor, halo: HaloTensors, group: SPGroup) -> tuple[Tensor, Tensor]:
    """Key rows ``[L + halo, H, D]`` of k and v: the local rows, then the rows received from the neighbours."""
    return finish_halo_exchange(k, v, start_halo_exchange(k, v, halo, group))


def _fused_kv(k: Tensor, v: Tensor) -> Optional[Tensor]:
    """The ``[L, 2, H, D]`` view of k and v when they are two slices of one buffer (a fused qkv projection's output,
    ``qkv.view(L, 3, H, D).unbind(1)``), so that one gather fetches both; None otherwise, and whenever autograd
    records or torch.compile traces (the view is an inference shortcut)."""
    if (k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device or k.stride() != v.stride()
            or torch.compiler.is_compiling() or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))):
        return None
    step = v.storage_offset() - k.storage_offset()
    if step <= 0 or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    return k.as_strided((k.shape[0], 2) + tuple(k.shape[1:]), (k.stride(0), step) + tuple(k.stride()[1:]),
                        k.storage_offset())


def _gather_keys(keys, index: Tensor, g: int, mk: int, heads: int) -> tuple[Tensor, Tensor]:
    """``[G, K, H, D]`` key and value rows of ``index`` from ``keys``: ``(k, v)`` or one ``[N, 2, H, D]`` tensor."""
    if isinstance(keys, Tensor):
        both = keys.index_select(0, index.reshape(-1)).view(g, mk, 2, heads, -1)
        return both[:, :, 0], both[:, :, 1]
    k, v = keys
    return (k.index_select(0, index.reshape(-1)).view(g, mk, heads, -1),
            v.index_select(0, index.reshape(-1)).view(g, mk, heads, -1))


def _attend_tiles(q: Tensor, keys, groups, txt: Optional[tuple[Tensor, Tensor, Tensor]], scale: float,
                  mods: Optional[ScoreMods], out: Tensor, gather: Optional[tuple[Tensor, ...]] = None) -> None:
    """Each group of query tiles against the key rows it reaches (and its sample's text), masked, in chunks; each
    query's output is written into its local row of ``out`` ``[L, H, D]``. ``gather``: per group, where its key rows
    sit in ``keys`` when that is not the key-row numbering itself (a compact buffer of the edge tiles' rows)."""
    _, heads, dim = q.shape
    for group, (query, key, tile_mask, tile_sample) in enumerate(groups):
        where = key if gather is None else gather[group]
        tiles, mq = query.shape
        mk = key.shape[1]
        chunk = max(1, GATHER_BUDGET // max(1, (mq + mk) * heads * dim + mq * mk * heads))
        for start in range(0, tiles, chunk):
            stop = min(tiles, start + chunk)
            g = stop - start
            qi, ki = query[start:stop], key[start:stop]
            qg = q.index_select(0, qi.reshape(-1)).view(g, mq, heads, -1).transpose(1, 2)
            kg, vg = _gather_keys(keys, where[start:stop], g, mk, heads)
            mask = tile_mask[start:stop]
            if txt is not None:
                k_txt, v_txt, (txt_index, txt_valid) = txt
                sample = tile_sample[start:stop]
                ti = txt_index.index_select(0, sample)
                kg = torch.cat([kg, k_txt.index_select(0, ti.reshape(-1)).view(g, -1, heads, kg.shape[-1])], dim=1)
                vg = torch.cat([vg, v_txt.index_select(0, ti.reshape(-1)).view(g, -1, heads, vg.shape[-1])], dim=1)
                mask = torch.cat([mask, txt_valid.index_select(0, sample)[:, None, :].expand(g, mq, -1)], dim=-1)
            kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
            mask = mask[:, None]
            if mods is None:
                tile_out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
            else:
                tile_out = _modded_tiles(qg, kg, vg, mask, qi, ki, scale, mods)
            out.index_put_((qi,), tile_out.transpose(1, 2))  # [G, Q, H, D] into the tiles' local rows


def _video_queries(q: Tensor, k_all: Tensor, v_all: Tensor, txt: Optional[tuple[Tensor, Tensor, Tensor]],
                   halo: HaloTensors, scale: float, mods: Optional[ScoreMods]) -> Tensor:
    """The tiled kernel on complete key rows (local, then halo): every query tile, in the backends' signature."""
    out = q.new_empty((q.shape[0], q.shape[1], v_all.shape[-1]))
    _attend_tiles(q, (k_all, v_all), halo.tiles, txt, scale, mods, out)
    return out


class _AfterExchange(torch.autograd.Function):
    """``out`` itself, recorded as depending on the exchanged key rows, so that every rank's backward runs the
    reverse exchange, even a rank none of whose tiles reached a halo row (the collective needs every rank)."""

    @staticmethod
    def forward(ctx, out: Tensor, k_all: Tensor, v_all: Tensor) -> Tensor:
        ctx.key_shapes = tuple((t.shape, t.dtype, t.device) for t in (k_all, v_all))
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad,) + tuple(torch.zeros(shape, dtype=dtype, device=device)
                               for shape, dtype, device in ctx.key_shapes)


def _tiled_inference(q: Tensor, k: Tensor, v: Tensor, txt, halo: HaloTensors, group: SPGroup, scale: float,
                     mods: Optional[ScoreMods], out: Tensor) -> bool:
    """The tiled path without autograd, k and v alike. The edge tiles read one ``[E + halo, 2, H, D]`` key buffer:
    the E local rows they reach, then the halo, received straight into its tail while the interior tiles run (no
    copy of the received rows, none of the local rows no edge tile reads); k and v are gathered together (one gather
    of a fused qkv's k and v). False (nothing done) where it does not apply."""
    if (k.shape != v.shape or k.dtype != v.dtype or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))):
        return False
    fused = _fused_kv(k, v)
    local = fused if fused is not None else (k, v)
    edge = halo.tiles[halo.interior_groups:]
    if not halo.exchange:
        _attend_tiles(q, local, halo.tiles, txt, scale, mods, out)
        return True
    rows = halo.edge_rows.shape[0]
    buffer = k.new_empty((rows + sum(halo.output_split_sizes), 2) + tuple(k.shape[1:]))
    idx = halo.send_index
    send = (fused.index_select(0, idx) if fused is not None
            else torch.stack([k.index_select(0, idx), v.index_select(0, idx)], dim=1))
    pending = group.start_all_to_all_single(send, halo.output_split_sizes, halo.input_split_sizes,
                                            out=buffer[rows:])
    _attend_tiles(q, local, halo.tiles[:halo.interior_groups], txt, scale, mods, out)
    if fused is not None:
        torch.index_select(fused, 0, halo.edge_rows, out=buffer[:rows])
    else:
        torch.index_select(k, 0, halo.edge_rows, out=buffer[:rows, 0])
        torch.index_select(v, 0, halo.edge_rows, out=buffer[:rows, 1])
    pending.wait()
    _attend_tiles(q, buffer, edge, txt, scale, mods, out, gather=halo.edge_keys)
    return True


def _exchanged_video_queries(q: Tensor, k: Tensor, v: Tensor, txt, halo: HaloTensors, group: SPGroup,
                             scale: float, mods: Optional[ScoreMods], video_attention) -> Tensor:
    """The video queries' output with the halo exchange around it: the tiled path (``video_attention`` None) runs
    its interior tiles (local keys only) while the exchange is in flight; another backend attends once it is done."""
    if video_attention is None:
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
        if _tiled_inference(q, k, v, txt, halo, group, scale, mods, out):
            return out
    pending = start_halo_exchange(k, v, halo, group)
    if video_attention is None:
        _attend_tiles(q, (k, v), halo.tiles[:halo.interior_groups], txt, scale, mods, out)
        k_all, v_all = finish_halo_exchange(k, v, pending)
        _attend_tiles(q, (k_all, v_all), halo.tiles[halo.interior_groups:], txt, scale, mods, out)
    else:
        k_all, v_all = finish_halo_exchange(k, v, pending)
        out = video_attention(q, k_all, v_all, txt, halo, scale, mods)
    if pending is not None and torch.is_grad_enabled() and (k_all.requires_grad or v_all.requires_grad):
        out = _AfterExchange.apply(out, k_all, v_all)
    return out


def _modded_tiles(qg: Tensor, kg: Tensor, vg: Tensor, mask: Tensor, qi: Tensor, ki: Tensor, scale: float,
                  mods: ScoreMods) -> Tensor:
    """Explicit tile attention with ``mods`` on the video x video columns (the first ``ki.shape[1]``)."""
    compute = torch.float32 if qg.dtype in (torch.float16, torch.bfloat16) else qg.dtype
    g, heads, mq, _ = qg.shape
    mk = ki.shape[1]
    scores = torch.einsum("ghqd,ghkd->ghqk", qg.to(compute), kg.to(compute)) * scale
    vid = scores[..., :mk]
    head = torch.arange(heads, device=qg.device).view(1, -1, 1, 1)
    q_row, k_row = qi.view(g, 1, mq, 1), ki.view(g, 1, 1, mk)
    if mods.score_mod is not None:
        vid = mods.score_mod(vid, head, q_row, k_row)
    if mods.mask_mod is not None:
        vid = vid.masked_fill(~mods.mask_mod(head, q_row, k_row), float("-inf"))
    scores = torch.cat([vid, scores[..., mk:]], dim=-1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("ghqk,ghkd->ghqd", probs, vg.to(compute)).to(qg.dtype)


def _padded_text_index(lengths: list[int], device) -> tuple[Tensor, Tensor]:
    """Per sample (text lengths as Python ints), its text rows padded to the longest (``[B, T_max]`` index and
    validity)."""
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(max([1] + lengths), device=device)
    valid = pos[None, :] < counts[:, None]
    index = torch.where(valid, starts[:, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    return index, valid


def _text_index(txt_sample: Tensor, samples: int) -> tuple[Tensor, Tensor]:
    """:func:`_padded_text_index` of the text rows' samples ``txt_sample`` (for callers without the lengths)."""
    return _padded_text_index(torch.bincount(txt_sample, minlength=samples).tolist(), txt_sample.device)


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
                           text_output: bool = True, video_attention=None,
                           txt_index: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Optional[Tensor]]:
    """One neighborhood layer on local rows ``[L, H, D]``: halo exchange, then attention (and text queries' output).

    ``txt_sample`` [L_txt] is each text row's sample. ``video_attention``: the video queries' kernel
    ``(q, k_all, v_all, txt, halo, scale, mods) -> [L, H, D]`` (:mod:`winsp.attention.halo.backends`; None: the tiled
    path). ``txt_index``: each sample's text rows padded to the longest (``[B, T_max]`` index and validity), when the
    caller has it (the runtime keeps it per request: no data-dependent size under torch.compile); else computed here.
    Returns (video output, text output or None).
    """
    if q.shape[0] != halo.num_rows:
        raise ValueError(f"rank {group.rank}: neighborhood attention got {q.shape[0]} rows, the plan gives this rank "
                         f"{halo.num_rows}")
    if (q_txt is not None or k_txt is not None) and (k_txt is None or v_txt is None or txt_sample is None):
        raise ValueError("neighborhood attention with text needs k_txt, v_txt and txt_sample (each text row's sample)")
    txt = None
    if k_txt is not None and k_txt.shape[0] > 0:
        assert txt_sample is not None  # checked above
        txt = (k_txt, v_txt, _text_index(txt_sample, halo.num_samples) if txt_index is None else txt_index)
    vid = _exchanged_video_queries(q, k, v, txt, halo, group, scale, mods, video_attention)
    if q_txt is None or not text_output:
        return vid, None
    assert k_txt is not None and v_txt is not None and txt_sample is not None  # checked above
    return vid, _text_queries(q_txt, k_txt, v_txt, txt_sample, k, v, halo, group, scale)


def halo_tensors(request, layer: int, device: torch.device | str | None = None) -> HaloTensors:
    """This rank's prepared halo data for neighborhood layer ``layer`` of ``request`` (built once, in the store), on
    ``device`` (default: the request's; ``"cpu"`` for planning that reads it on the host, without a device copy).

    ``query_coords`` / ``key_coords`` are the grid (t, h, w) of local rows and of key rows (local, then halo),
    ``row_sample`` / ``key_sample`` their samples: what a score_mod on a neighborhood layer indexes.
    """
    from winsp.geometry.neighborhood import is_neighborhood

    layer = request._check_layer(layer)
    geometry = request.runtime.schedule[layer]
    if not is_neighborhood(geometry):
        raise ValueError(f"layer {layer} attends in {geometry!r}, not a winsp.Neighborhood: it has no halos")
    plan = request.plan(layer)
    runtime = request.runtime
    device = request.device if device is None else torch.device(device)
    plan_key = ("halo-plan", plan.key or id(plan), geometry.fingerprint, runtime.rank)
    key = ("halo", plan.key or id(plan), geometry.fingerprint, runtime.rank, str(device))
    return runtime.store.get(key, lambda: runtime.store.get(
        plan_key, lambda: HaloExchange(plan, runtime.rank, geometry)).to(device))


def neighborhood_rpb_score_mod(table: Tensor, halo: HaloTensors, geometry: Neighborhood):
    """A score_mod adding NATTEN-style relative position bias ``table[head, dt + kt - 1, dh + kh - 1, dw + kw - 1]``.

    ``table`` is ``[heads, 2 kt - 1, 2 kh - 1, 2 kw - 1]``; ``d`` is (key - query) / dilation per axis, which a
    neighbourhood keeps within ``(-k, k)``. ``table`` receives its gradient through the score_mod.
    """
    kern, dil = geometry.kernel, geometry.dilation
    expected = [2 * k - 1 for k in kern]
    if table.dim() != 4 or list(table.shape[1:]) != expected:
        raise ValueError(f"relative position bias table must be [heads, {', '.join(map(str, expected))}] for kernel "
                         f"{geometry.kernel}, got {list(table.shape)}")
    # one 1D column per axis: scalar ops only, which compiled FlexAttention lowers (a [3] intermediate it does not)
    q_axes = [halo.query_coords[:, a].contiguous() for a in range(3)]
    k_axes = [halo.key_coords[:, a].contiguous() for a in range(3)]

    def score_mod(score, head, q_row, k_row):
        rel = [(torch.div(k_axes[a][k_row] - q_axes[a][q_row], dil[a], rounding_mode="floor") + kern[a] - 1)
               .clamp(0, 2 * kern[a] - 2) for a in range(3)]  # pairs outside the neighbourhood are masked anyway
        return score + table[head, rel[0], rel[1], rel[2]]

    return score_mod


def _text_samples(request, device: torch.device | str | None = None) -> Tensor:
    device = request.device if device is None else torch.device(device)
    key = ("halo-text", request.text_lengths, str(device))
    lengths = torch.tensor(request.text_lengths, dtype=torch.int64)
    return request.runtime.store.get(key, lambda: torch.repeat_interleave(
        torch.arange(len(lengths)), lengths).to(device))


def _text_index_of(request) -> tuple[Tensor, Tensor]:
    """:func:`_padded_text_index` of the request's text lengths (Python ints: no data-dependent size under
    torch.compile), kept in the store."""
    return request.runtime.store.get(("halo-text-index", request.text_lengths, str(request.device)),
                                     lambda: _padded_text_index(list(request.text_lengths), request.device))


def neighborhood_layer(request, layer: int, qkv: tuple, qkv_txt: tuple, mods: Optional[ScoreMods],
                       softmax_scale: Optional[float], text_output: bool) -> tuple[Tensor, Optional[Tensor]]:
    """:meth:`winsp.WindowRequest.attention` of a :class:`~winsp.Neighborhood` layer (the runtime's one hook)."""
    from winsp.attention.halo.backends import neighborhood_runner
    from winsp.attention.windows import _scale

    halo = halo_tensors(request, layer)
    q, k, v = qkv
    q_txt, k_txt, v_txt = qkv_txt
    return neighborhood_attention(q, k, v, halo, request.group, q_txt=q_txt, k_txt=k_txt, v_txt=v_txt,
                                  txt_sample=_text_samples(request) if k_txt is not None else None,
                                  scale=_scale(qkv[0], softmax_scale), mods=mods, text_output=text_output,
                                  video_attention=neighborhood_runner(request, layer, qkv[0], mods),
                                  txt_index=_text_index_of(request) if k_txt is not None else None)
