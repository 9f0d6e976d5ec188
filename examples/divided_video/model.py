"""A divided space-time video transformer, written here in plain PyTorch as a model to adopt (not a copy of any).

Each frame is cut into patches; the encoder takes ``[B, 1 + S*T, C]``: a class token, then the ``S`` patches of ``T``
frames *frames fastest* (the token of position ``s`` in frame ``t`` is ``1 + s*T + t``), plus the number of frames.
Every block runs two attentions:

- temporal: each patch position attends over the frames (``[B*S, T, C]``); the class token takes no part;
- spatial: each frame attends over its patches with its own copy of the class token in front (``[B*T, 1 + S, C]``);
  the class token's output is the mean of the frames' copies;

then an MLP on every token. The block does the reshapes itself, between its two attentions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "DividedBlock", "Encoder", "DividedVideoTransformer"]


class Attention(nn.Module):
    """Multi-head self-attention inside each sequence of ``[N, n, C]``; ``attn_drop`` is the probability dropout."""

    def __init__(self, dim: int, heads: int, attn_drop: float = 0.0) -> None:
        super().__init__()
        self.heads, self.attn_drop = heads, attn_drop
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj(out.transpose(1, 2).flatten(2))


class DividedBlock(nn.Module):
    """Temporal attention (patches only), spatial attention (with the class token), MLP; ``drop`` is the MLP's
    dropout."""

    def __init__(self, dim: int, heads: int, drop: float = 0.0, attn_drop: float = 0.0) -> None:
        super().__init__()
        self.norm_t, self.attn_t, self.fc_t = nn.LayerNorm(dim), Attention(dim, heads, attn_drop), nn.Linear(dim, dim)
        self.norm_s, self.attn_s = nn.LayerNorm(dim), Attention(dim, heads, attn_drop)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim), nn.Dropout(drop))

    def forward(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        (b, n, c), t = x.shape, frames
        s = (n - 1) // t
        cls, tok = x[:, :1], x[:, 1:]
        tok = tok + self.fc_t(self.attn_t(self.norm_t(tok.reshape(b * s, t, c)))).reshape(b, n - 1, c)
        per_frame = tok.reshape(b, s, t, c).transpose(1, 2).reshape(b * t, s, c)
        out = self.attn_s(self.norm_s(torch.cat([cls.repeat_interleave(t, 0), per_frame], 1)))
        cls = cls + out[:, :1].reshape(b, t, c).mean(1, keepdim=True)
        tok = tok + out[:, 1:].reshape(b, t, s, c).transpose(1, 2).reshape(b, n - 1, c)
        x = torch.cat([cls, tok], 1)
        return x + self.mlp(self.norm_mlp(x))


class Encoder(nn.Module):
    def __init__(self, dim: int, heads: int, depth: int, drop: float = 0.0, attn_drop: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DividedBlock(dim, heads, drop, attn_drop) for _ in range(depth)])

    def forward(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, frames)
        return x


class DividedVideoTransformer(nn.Module):
    """``video [B, T, 3, H, W] -> (class logits [B, classes], patch tokens [B, S*T, C])``."""

    def __init__(self, size: tuple[int, int] = (4, 6), frames: int = 3, patch: int = 2, dim: int = 16,
                 heads: int = 2, depth: int = 2, classes: int = 5, drop: float = 0.0, attn_drop: float = 0.0) -> None:
        super().__init__()
        positions = (size[0] // patch) * (size[1] // patch)
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 1 + positions, dim))
        self.time = nn.Parameter(torch.randn(1, frames, dim))
        self.encoder = Encoder(dim, heads, depth, drop, attn_drop)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = video.shape[:2]
        x = self.embed(video.flatten(0, 1)).flatten(2).transpose(1, 2) + self.pos[:, 1:]  # [B*T, S, C]
        x = (x.unflatten(0, (b, t)) + self.time[:, :t, None]).transpose(1, 2).flatten(1, 2)  # frames fastest
        x = torch.cat([(self.cls + self.pos[:, :1]).expand(b, -1, -1), x], 1)
        x = self.norm(self.encoder(x, t))
        return self.head(x[:, 0]), x[:, 1:]
