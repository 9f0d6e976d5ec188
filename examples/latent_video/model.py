"""A latent video diffusion transformer with alternating spatial and temporal blocks, in plain PyTorch (no winsp).

Its forward reshapes the tokens itself between the blocks: ``[B*T, S, C]`` (per-frame batches: a spatial block
attends inside each frame) and ``[B*S, T, C]`` (per-position batches: a temporal block attends along each position's
frames), with the sizes read from its input. A positional table for one frame is added after the patch embedding and
a frame table before the first temporal block; each block is modulated by the timestep embedding (adaLN), repeated
per frame or per position as the batches are. Written here as a test model for ``winsp.parallelize``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Attention", "Block", "LatentVideoDiT"]


class Attention(nn.Module):
    """Multi-head self-attention along dim 1 of ``[N, L, C]``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        n, length, c = x.shape
        q, k, v = self.qkv(x).reshape(n, length, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, length, c))


class Block(nn.Module):
    """A transformer block modulated per batch by a conditioning vector ``[N, D]`` (adaLN)."""

    def __init__(self, dim: int, heads: int, cond: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, elementwise_affine=False), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ada = nn.Linear(cond, 4 * dim)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        shift1, scale1, shift2, scale2 = self.ada(cond)[:, None].chunk(4, -1)
        x = x + self.attn(self.norm1(x) * (1 + scale1) + shift1)
        return x + self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class LatentVideoDiT(nn.Module):
    """Latents ``[B, T, H, W, C_in]`` and timesteps ``[B]`` -> ``[B, T, H, W, C_in]``."""

    def __init__(self, channels: int = 4, dim: int = 16, heads: int = 2, depth: int = 2, size: tuple = (3, 4),
                 max_frames: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(channels, dim)
        self.pos = nn.Parameter(torch.randn(1, size[0] * size[1], dim) * 0.5)  # one frame's positions
        self.frame_pos = nn.Parameter(torch.randn(1, max_frames, dim) * 0.5)  # per frame, up to max_frames
        self.time = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dim) for _ in range(2 * depth))  # spatial, temporal, ...
        self.out = nn.Linear(dim, channels)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        b, f, h, w, _ = x.shape
        x = self.embed(x).flatten(2, 3).flatten(0, 1) + self.pos  # [B*T, S, C]
        cond = self.time(t[:, None])
        per_frame, per_position = cond.repeat_interleave(f, 0), cond.repeat_interleave(h * w, 0)
        for i in range(0, len(self.blocks), 2):
            x = self.blocks[i](x, per_frame)
            x = x.unflatten(0, (b, x.shape[0] // b)).transpose(1, 2).flatten(0, 1)  # [B*S, T, C]
            if i == 0:
                x = x + self.frame_pos[:, :f]
            x = self.blocks[i + 1](x, per_position)
            x = x.unflatten(0, (b, x.shape[0] // b)).transpose(1, 2).flatten(0, 1)  # [B*T, S, C]
        return self.out(x).unflatten(0, (b, f)).unflatten(2, (h, w))
