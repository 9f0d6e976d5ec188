"""Thin ``nn.Module`` wrappers over the runtime steps, for composing window parallelism into a DiT.

Each module takes the current :class:`~winsp.runtime.WindowRequest` as an argument, so one module instance serves every
request and holds no per-request state.
"""

from __future__ import annotations

import torch
from torch import nn

from .runtime import WindowRequest

__all__ = ["ScatterWindows", "EnsureLayout", "ReplicatedTextWindowAttention", "GatherWindows"]


class ScatterWindows(nn.Module):
    """Canonical rows -> this rank's rows of the first layer's layout."""

    def forward(self, x: torch.Tensor, request: WindowRequest) -> torch.Tensor:
        return request.scatter(x)


class EnsureLayout(nn.Module):
    """Bring local rows into layer ``layer``'s layout (a no-op when it is already current)."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, request: WindowRequest) -> torch.Tensor:
        return request.to_layer(x, self.layer)

    def extra_repr(self) -> str:
        return f"layer={self.layer}"


class ReplicatedTextWindowAttention(nn.Module):
    """Window attention over [window video, replicated text] followed by the global text mean."""

    def __init__(self, *, softmax_scale: float | None = None) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, request: WindowRequest, q_vid, k_vid, v_vid, q_txt=None, k_txt=None, v_txt=None):
        return request.attention(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, softmax_scale=self.softmax_scale)


class GatherWindows(nn.Module):
    """This rank's rows -> the canonical tensor, complete on every rank."""

    def forward(self, x: torch.Tensor, request: WindowRequest) -> torch.Tensor:
        return request.gather(x)
