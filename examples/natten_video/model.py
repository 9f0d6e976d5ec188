"""A small neighborhood-attention video transformer, written with ``natten``'s functional API (no winsp in it).

Channels-last video ``[B, T, H, W, C_in]`` -> a linear patch embedding -> blocks of pre-norm neighborhood attention
(``natten.na3d`` with per-block kernel, dilation and causal time) and an MLP, with residuals -> a norm and a linear
head -> ``[B, T, H, W, C_out]``. The shape of the hierarchical diffusion transformers' high-resolution levels, small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import natten
import torch
from torch import Tensor, nn

__all__ = ["NATVideoConfig", "NeighborhoodAttention3d", "NATBlock", "NATVideo"]


@dataclass(frozen=True)
class NATVideoConfig:
    in_channels: int = 4
    out_channels: int = 4
    dim: int = 32
    heads: int = 4
    # one (kernel, dilation, causal) per block: plain, dilated, causal in time
    blocks: tuple = field(default=(((3, 3, 3), (1, 1, 1), (False, False, False)),
                                   ((3, 3, 3), (1, 2, 2), (False, False, False)),
                                   ((2, 3, 5), (1, 1, 1), (True, False, False))))


class NeighborhoodAttention3d(nn.Module):
    """Multi-head 3D neighborhood attention on ``[B, T, H, W, C]`` via ``natten.na3d``."""

    def __init__(self, dim: int, heads: int, kernel_size, dilation, is_causal) -> None:
        super().__init__()
        self.heads = heads
        self.kernel_size, self.dilation, self.is_causal = tuple(kernel_size), tuple(dilation), tuple(is_causal)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(-3)  # [B, T, H, W, heads, head_dim]
        out = natten.na3d(q, k, v, kernel_size=self.kernel_size, dilation=self.dilation, is_causal=self.is_causal)
        return self.proj(out.flatten(-2))


class NATBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kernel_size, dilation, is_causal) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = NeighborhoodAttention3d(dim, heads, kernel_size, dilation, is_causal)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class NATVideo(nn.Module):
    def __init__(self, config: NATVideoConfig = NATVideoConfig()) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Linear(config.in_channels, config.dim)
        self.blocks = nn.Sequential(*(NATBlock(config.dim, config.heads, *b) for b in config.blocks))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.out_channels)

    def forward(self, video: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.embed(video))))


def random_model(config: NATVideoConfig = NATVideoConfig(), seed: int = 0) -> NATVideo:
    """A model with weights drawn from ``seed`` (norm affines moved off 1 / 0 so they take part in checks)."""
    torch.manual_seed(seed)
    model = NATVideo(config)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model
