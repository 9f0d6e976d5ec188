"""What a backend is, and the packing helpers the backends share.

A runner takes ``(q, k, v)`` of the local video rows, ``(q, k, v)`` of the packed replicated text, the segments, their
index tensors on the inputs' device, the softmax scale and the call's :class:`~winsp.attention.score_mods.ScoreMods` (or
None), and returns ``(vid_out, window-major txt_out)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from winsp.attention.score_mods import ScoreMods, attention_with_mods, modified_scores
from winsp.attention.segments import WindowIndexTensors, WindowSegments

__all__ = ["Backend", "Runner", "pack", "unpack", "sdpa_segments", "attend_groups"]

QKV = tuple[Tensor, Tensor, Tensor]
Runner = Callable[[QKV, QKV, WindowSegments, WindowIndexTensors, float, Optional[ScoreMods]], tuple[Tensor, Tensor]]


def _never(device: torch.device, mods: bool) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Backend:
    """A named attention backend.

    ``unavailable_reason(device, segments, dtype)`` says why it cannot run (None when it can; ``segments`` or
    ``dtype`` None skip those checks). ``load()`` returns its runner, importing any kernel it needs; ``prepare(segments,
    index)`` returns the runner bound to one rank's segments (a backend with per-layout state, such as FlexAttention's
    block mask, builds it there, once per request shape). ``takes_score_mods`` says whether it can apply a
    ``score_mod`` / ``mask_mod``; ``auto_rule(device, modded)`` says why ``"auto"`` passes it over (None: it may pick
    it).
    """

    name: str
    unavailable_reason: Callable[[torch.device, Optional[WindowSegments], Optional[torch.dtype]], Optional[str]]
    load: Callable[[], Runner]
    takes_score_mods: bool = True
    auto_rule: Callable[[torch.device, bool], Optional[str]] = field(default=_never)
    prepare: Optional[Callable[[WindowSegments, WindowIndexTensors], Runner]] = None

    def bind(self, segments: WindowSegments, index: WindowIndexTensors) -> Runner:
        """The runner for these segments (see ``prepare``)."""
        return self.prepare(segments, index) if self.prepare is not None else self.load()


def pack(vid: Tensor, txt: Tensor, index: Tensor, segments: WindowSegments) -> Tensor:
    """The packed ``[window video, window text]`` sequence, in pack order."""
    if segments.packing_is_identity:
        return vid
    return torch.cat([vid, txt]).index_select(0, index)


def unpack(packed_out: Tensor, index: Tensor, segments: WindowSegments) -> tuple[Tensor, Tensor]:
    """``(vid_out, window-major txt_out)`` from the packed output."""
    out = packed_out if segments.packing_is_identity else packed_out.index_select(0, index)
    return out[: segments.total_vid], out[segments.total_vid:]


def sdpa_segments(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Attention over ``[G, S, heads, head_dim]`` segments; returns the same layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


def attend_groups(q: Tensor, k: Tensor, v: Tensor, rows: Optional[tuple[Tensor, Tensor]], segments: WindowSegments,
                  scale: float, mods: Optional[ScoreMods]) -> Tensor:
    """Attention over ``[G, S, heads, head_dim]`` windows of one length whose concat rows and video rows
    (:attr:`~winsp.attention.segments.WindowSegments.pack_vid_row`) are ``rows`` (two ``[G, S]`` tensors; None without
    mods).

    Plain SDPA without mods; with only a ``mask_mod``, SDPA with a boolean mask; with a ``score_mod``, explicit
    scores (the score must be materialised to be modified).
    """
    if not mods:
        return sdpa_segments(q, k, v, scale)
    assert rows is not None, "score mods are evaluated at the packed rows, which the caller passes with them"
    concat_rows, vid_rows = rows
    if mods.score_mod is None:
        groups, length = concat_rows.shape
        zeros = q.new_zeros((groups, q.shape[2], length, length), dtype=torch.float32)
        allowed = modified_scores(zeros, concat_rows, vid_rows, segments.total_vid, mods) == 0
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=allowed, scale=scale)
        return out.transpose(1, 2)
    return attention_with_mods(q, k, v, concat_rows, vid_rows, segments.total_vid, scale, mods)
