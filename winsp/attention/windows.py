"""Attention inside each local window: ``[window video rows, then its sample's text rows]``.

After the runtime has placed this rank's video rows window by window, every window is an independent attention
segment made of its own video rows followed by the text of the sample it belongs to. Each window yields its video
outputs and its own copy of its sample's text outputs; averaging those copies over all windows is the runtime's job
(:mod:`winsp.comm.text`), not this module's.

:func:`window_attention` is the functional entry point (it picks a backend from :mod:`winsp.attention.backends` and
builds the index tensors of :class:`~winsp.attention.segments.WindowSegments` on every call); :func:`attend` is what the
runtime calls with both prepared once per request; :func:`reference_window_attention` is the per-window loop the tests
use as oracle.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from winsp.attention.backends import (
    BACKENDS,
    Runner,
    available_backends,
    bind_backend,
    check_backend_name,
    select_backend,
)
from winsp.attention.score_mods import ScoreMods, attention_with_mods, check_score_mods
from winsp.attention.segments import WindowIndexTensors, WindowSegments

__all__ = [
    "BACKENDS",
    "WindowSegments",
    "WindowIndexTensors",
    "WindowAttention",
    "window_attention",
    "attend",
    "reference_window_attention",
    "available_backends",
    "select_backend",
]


# --------------------------------------------------------------------------- input checks
def _check_inputs(
    q_vid: Tensor,
    k_vid: Tensor,
    v_vid: Tensor,
    q_txt: Tensor | None,
    k_txt: Tensor | None,
    v_txt: Tensor | None,
    segments: WindowSegments,
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate shapes against ``segments``; returns the text tensors (empty ones when text is None)."""
    if not isinstance(segments, WindowSegments):
        raise TypeError(f"segments must be a WindowSegments, got {type(segments).__name__}")
    for name, tensor in (("q_vid", q_vid), ("k_vid", k_vid), ("v_vid", v_vid)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be [rows, heads, head_dim], got shape {tuple(tensor.shape)}")
        if tensor.shape != q_vid.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but q_vid has {tuple(q_vid.shape)}")
        if tensor.dtype != q_vid.dtype or tensor.device != q_vid.device:
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device} but q_vid is {q_vid.dtype} on {q_vid.device}"
            )
    if q_vid.shape[0] != segments.total_vid:
        raise ValueError(
            f"q_vid has {q_vid.shape[0]} rows but the segments describe {segments.total_vid} video rows"
        )
    text = (q_txt, k_txt, v_txt)
    if all(t is None for t in text):
        if segments.total_txt > 0:
            raise ValueError(
                f"no text tensors were given but the segments describe {segments.total_txt} window-text rows"
            )
        empty = q_vid.new_empty((0, *q_vid.shape[1:]))
        return empty, empty, empty
    if any(t is None for t in text):
        raise ValueError("q_txt, k_txt and v_txt must be all tensors or all None")
    assert q_txt is not None and k_txt is not None and v_txt is not None
    _, heads, head_dim = q_vid.shape
    txt_rows = q_txt.shape[0] if isinstance(q_txt, Tensor) and q_txt.dim() > 0 else None
    for name, tensor in (("q_txt", q_txt), ("k_txt", k_txt), ("v_txt", v_txt)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (heads, head_dim):
            raise ValueError(
                f"{name} must be [rows, {heads}, {head_dim}] like the video, got shape {tuple(tensor.shape)}"
            )
        if tensor.shape[0] != txt_rows:
            raise ValueError(f"{name} has {tensor.shape[0]} rows but q_txt has {txt_rows}")
        if tensor.dtype != q_vid.dtype or tensor.device != q_vid.device:
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device} but q_vid is {q_vid.dtype} on {q_vid.device}"
            )
    if q_txt.shape[0] < segments.txt_extent:
        raise ValueError(
            f"q_txt has {q_txt.shape[0]} rows but the segments read text up to row {segments.txt_extent}"
        )
    return q_txt, k_txt, v_txt


def _empty_outputs(*qkv: Tensor) -> tuple[Tensor, Tensor]:
    """Zero-row outputs for a rank whose windows are all empty (so there is no window text either).

    They still depend on every input (video and text q, k, v), so this rank's autograd graph has the same shape as
    its peers': the backward reaches the same nodes, runs the same collectives (the text reduction's all-reduce of an
    earlier layer is only reached through this layer's text inputs) and gives zero gradients upstream.
    """
    vid_out = sum(t[:0] for t in qkv[1:]) + qkv[0][:0]
    return vid_out, vid_out.clone()


def _scale(q: Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def attend(
    q_vid: Tensor,
    k_vid: Tensor,
    v_vid: Tensor,
    q_txt: Tensor | None,
    k_txt: Tensor | None,
    v_txt: Tensor | None,
    segments: WindowSegments,
    index: WindowIndexTensors,
    runner: Runner,
    *,
    softmax_scale: float | None = None,
    mods: ScoreMods | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`window_attention` with the backend's runner and the segments' device indices already prepared."""
    txt = _check_inputs(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments)
    return _run((q_vid, k_vid, v_vid), txt, segments, index, runner, softmax_scale, mods)


def _run(qkv_vid, qkv_txt, segments: WindowSegments, index: WindowIndexTensors, runner: Runner,
         softmax_scale: float | None, mods: ScoreMods | None) -> tuple[Tensor, Tensor]:
    """Run checked inputs (text as tensors, possibly empty) through ``runner``; an empty rank gets empty outputs."""
    if segments.total_seq == 0:
        return _empty_outputs(*qkv_vid, *qkv_txt)
    return runner(qkv_vid, qkv_txt, segments, index, _scale(qkv_vid[0], softmax_scale), mods)


def window_attention(
    q_vid: Tensor,
    k_vid: Tensor,
    v_vid: Tensor,
    q_txt: Tensor | None,
    k_txt: Tensor | None,
    v_txt: Tensor | None,
    segments: WindowSegments,
    *,
    backend: str = "auto",
    softmax_scale: float | None = None,
    score_mod=None,
    mask_mod=None,
) -> tuple[Tensor, Tensor]:
    """Attention inside every local window over ``[window video rows, window's sample text rows]``.

    ``q_vid``/``k_vid``/``v_vid`` are ``[Lv, heads, head_dim]`` (this rank's rows, window by window);
    ``q_txt``/``k_txt``/``v_txt`` are ``[Lt, heads, head_dim]``, the packed replicated text of all samples
    (or None / zero rows without text). Returns ``(vid_out [Lv, heads, head_dim], txt_out
    [sum(txt_lengths), heads, head_dim])`` with ``txt_out`` window-major: window 0's copy of its sample's
    text outputs, then window 1's, ... The output dtype is the input dtype. ``softmax_scale`` defaults to
    ``head_dim ** -0.5``. ``score_mod`` / ``mask_mod`` modify the video x video scores (see
    :mod:`winsp.attention.score_mods`; rows are indices into ``q_vid``). The backend is resolved and the indices are
    built on every call; a runtime request does both once (see :func:`attend`).
    """
    txt = _check_inputs(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments)
    mods = check_score_mods(score_mod, mask_mod)
    name = select_backend(q_vid.device, segments, backend, dtype=q_vid.dtype, modded=bool(mods))
    index = segments.index_tensors(q_vid.device)
    return _run((q_vid, k_vid, v_vid), txt, segments, index, bind_backend(name, segments, index), softmax_scale,
                mods)


def reference_window_attention(
    q_vid: Tensor,
    k_vid: Tensor,
    v_vid: Tensor,
    q_txt: Tensor | None,
    k_txt: Tensor | None,
    v_txt: Tensor | None,
    segments: WindowSegments,
    *,
    softmax_scale: float | None = None,
    score_mod=None,
    mask_mod=None,
) -> tuple[Tensor, Tensor]:
    """The oracle: one ``scaled_dot_product_attention`` call per window, with plain slicing and no index (with mods:
    one dense score matrix per window, modified pair by pair through the same row indices).

    Same contract as :func:`window_attention`; slow, and meant for tests.
    """
    q_txt, k_txt, v_txt = _check_inputs(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments)
    scale = _scale(q_vid, softmax_scale)
    mods = check_score_mods(score_mod, mask_mod)
    num_vid = q_vid.shape[0]
    vid_outs, txt_outs = [], []
    vid_row = 0
    for vid_len, txt_len, txt_start in zip(segments.vid_counts, segments.txt_lengths, segments.txt_starts, strict=True):
        if vid_len + txt_len == 0:
            continue
        vid_rows = slice(vid_row, vid_row + vid_len)
        txt_rows = slice(txt_start, txt_start + txt_len)
        # [S, heads, d] -> [heads, S, d] for SDPA, and back
        q, k, v = (
            torch.cat([vid[vid_rows], txt[txt_rows]]).transpose(0, 1)
            for vid, txt in ((q_vid, q_txt), (k_vid, k_txt), (v_vid, v_txt))
        )
        if mods:
            vid = torch.arange(vid_rows.start, vid_rows.stop)
            rows = torch.cat([vid, num_vid + torch.arange(txt_rows.start, txt_rows.stop)]).to(q_vid.device)
            at = torch.cat([vid, torch.full((txt_len,), vid_rows.start if vid_len else 0)]).to(q_vid.device)
            q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
            out = attention_with_mods(q4, k4, v4, rows[None], at[None], num_vid, scale, mods)[0]
        else:
            out = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
        vid_outs.append(out[:vid_len])
        txt_outs.append(out[vid_len:])
        vid_row += vid_len
    if not vid_outs:
        return _empty_outputs(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt)
    return torch.cat(vid_outs), torch.cat(txt_outs)


class WindowAttention(nn.Module):
    """Thin module over :func:`window_attention` holding the backend choice and the softmax scale."""

    def __init__(self, *, backend: str = "auto", softmax_scale: float | None = None) -> None:
        super().__init__()
        self.backend = check_backend_name(backend)
        self.softmax_scale = softmax_scale

    def forward(
        self,
        q_vid: Tensor,
        k_vid: Tensor,
        v_vid: Tensor,
        q_txt: Tensor | None,
        k_txt: Tensor | None,
        v_txt: Tensor | None,
        segments: WindowSegments,
        *,
        score_mod=None,
        mask_mod=None,
    ) -> tuple[Tensor, Tensor]:
        return window_attention(
            q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments,
            backend=self.backend, softmax_scale=self.softmax_scale, score_mod=score_mod, mask_mod=mask_mod,
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, softmax_scale={self.softmax_scale}"
