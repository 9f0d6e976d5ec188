"""A small hourglass (U-net) transformer on video tokens, written in plain PyTorch as a third party would (no winsp).

Levels of two blocks (window attention, then shifted-window attention, as masked dense attention; a feed-forward
with element-wise dropout), 2 x 2 token merges on the way down, depth-to-space splits on the way up cropped to the
skip's grid, skips added across levels, and a global-attention middle level. The modules *register* in another order
than they run: ``down``, then ``up`` (up[1] runs before up[0]), then ``mid``; ``splits[1]`` runs before ``splits[0]``.
Tokens are channels-last ``[B, T, H, W, C]``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HourglassNet", "Hourglass", "Block", "WindowAttention", "Merge", "Split"]


def _window_ids(size: int, window: int, shift: int) -> torch.Tensor:
    """Window index of each position on one axis: cuts every ``window`` tokens, the first one at ``shift``."""
    c = torch.arange(size)
    return torch.where(c < shift, 0, (c - shift) // window + 1) if shift else c // window


class WindowAttention(nn.Module):
    """Multi-head attention inside (shifted) windows clipped at the borders; ``window=None`` attends globally."""

    def __init__(self, dim: int, heads: int, window: Optional[Sequence[int]] = None,
                 shift: Sequence[int] = (0, 0, 0)) -> None:
        super().__init__()
        self.heads, self.window, self.shift = heads, None if window is None else tuple(window), tuple(shift)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h, w, c = x.shape
        mask = None
        if self.window is not None:
            ids = [_window_ids(n, k, s) for n, k, s in zip((t, h, w), self.window, self.shift, strict=True)]
            win = ((ids[0][:, None, None] * h + ids[1][None, :, None]) * w + ids[2][None, None, :]).reshape(-1)
            mask = (win[:, None] == win[None, :]).to(x.device)
        q, k, v = self.qkv(x.reshape(b, -1, c)).reshape(b, -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, t, h, w, c))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a feed-forward with dropout."""

    def __init__(self, dim: int, heads: int, window=None, shift=(0, 0, 0), dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window, shift)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Level(nn.Module):
    """Two blocks on one grid: windows, then shifted windows."""

    def __init__(self, dim: int, heads: int, window, shift, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, heads, window, (0, 0, 0), dropout),
                                     Block(dim, heads, window, shift, dropout)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Merge(nn.Module):
    """2 x 2 tokens on (h, w) -> one (zero padding past odd edges, children's channels h offset slowest), norm,
    linear."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduce = nn.Linear(4 * dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 0, x.shape[3] % 2, 0, x.shape[2] % 2))
        x = torch.cat([x[:, :, i::2, j::2] for i in (0, 1) for j in (0, 1)], dim=-1)
        return self.reduce(self.norm(x))


class Split(nn.Module):
    """One token -> 2 x 2 (a linear to 4 C', depth-to-space), cropped to the skip's grid."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.expand = nn.Linear(dim, 4 * out)

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        b, t, h, w, _ = x.shape
        x = self.expand(x).reshape(b, t, h, w, 2, 2, -1).permute(0, 1, 2, 4, 3, 5, 6).reshape(b, t, 2 * h, 2 * w, -1)
        return x[:, :, :like.shape[2], :like.shape[3]]


class Hourglass(nn.Module):
    """Two levels down, a global middle, two levels up; skips from each down level to its up level."""

    def __init__(self, dims=(8, 12, 16), heads=(2, 3, 2), window=(2, 3, 3), shift=(1, 1, 1),
                 dropout: float = 0.1) -> None:
        super().__init__()
        levels = list(zip(dims[:2], heads[:2], strict=True))
        self.down = nn.ModuleList([Level(d, n, window, shift, dropout) for d, n in levels])
        self.up = nn.ModuleList([Level(d, n, window, shift, dropout) for d, n in levels])
        self.merges = nn.ModuleList([Merge(dims[0], dims[1]), Merge(dims[1], dims[2])])
        self.splits = nn.ModuleList([Split(dims[1], dims[0]), Split(dims[2], dims[1])])
        self.mid = Block(dims[2], heads[2], None, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for level, merge in zip(self.down, self.merges, strict=True):
            x = level(x)
            skips.append(x)
            x = merge(x)
        x = self.mid(x)
        for level, split, skip in reversed(list(zip(self.up, self.splits, skips, strict=True))):
            x = level(split(x, skip) + skip)
        return x


class HourglassNet(nn.Module):
    """Embedding, the hourglass body, a head: ``[B, T, H, W, 3] -> [B, T, H, W, 3]``."""

    def __init__(self, **body) -> None:
        super().__init__()
        self.body = Hourglass(**body)
        dim = self.body.down[0].blocks[0].norm1.normalized_shape[0]
        self.embed, self.head = nn.Linear(3, dim), nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))
