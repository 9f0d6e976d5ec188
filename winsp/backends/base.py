"""What a backend is, and the packing helpers the backends share.

A runner takes ``(q, k, v)`` of the local video rows, ``(q, k, v)`` of the packed replicated text, the segments, their
index tensors on the inputs' device and the softmax scale, and returns ``(vid_out, window-major txt_out)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..segments import WindowIndexTensors, WindowSegments

__all__ = ["Backend", "Runner", "pack", "unpack", "sdpa_segments"]

QKV = tuple[Tensor, Tensor, Tensor]
Runner = Callable[[QKV, QKV, WindowSegments, WindowIndexTensors, float], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Backend:
    """A named attention backend.

    ``unavailable_reason(device, segments, dtype)`` says why it cannot run (None when it can; ``segments`` or
    ``dtype`` None skip those checks). ``load()`` returns its runner, importing any kernel it needs.
    """

    name: str
    unavailable_reason: Callable[[torch.device, Optional[WindowSegments], Optional[torch.dtype]], Optional[str]]
    load: Callable[[], Runner]


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
