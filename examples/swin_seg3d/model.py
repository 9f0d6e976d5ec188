"""A 3D segmentation network, in plain PyTorch (no winsp): a Swin encoder on volumes and a CNN decoder.

The encoder embeds 2 x 2 x 2 patches (a strided convolution), then runs stages that take and return channels-first
tensors ``[B, C, D, H, W]``: each permutes to channels-last, runs its Swin blocks (window attention, every other
block on windows shifted by rolling the volume and masking the strip that wrapped around) and ends with a patch merge
(2 x 2 x 2 tokens -> one of twice the channels). The encoder returns the patch embedding and every stage's output;
the decoder upsamples from the deepest one, concatenating each on the way up (skip connections), to a label map of
the input's size. Written here as a test model for ``winsp.parallelize``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["WindowAttention3d", "SwinBlock3d", "PatchMerging3d", "SwinStage3d", "SwinEncoder3d", "SegNet3d"]


class WindowAttention3d(nn.Module):
    """Attention inside ``window`` windows of ``[B, D, H, W, C]`` (sizes multiples of the window), rolled back by
    ``shift`` first with the wrapped strip masked (Swin's shifted windows)."""

    def __init__(self, dim: int, heads: int, window: tuple, shift: tuple) -> None:
        super().__init__()
        self.heads, self.window, self.shift = heads, tuple(window), tuple(shift)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def _windows(self, x: Tensor) -> Tensor:
        b, d, h, w, c = x.shape
        (a, e, f), n = self.window, x.shape[-1]
        x = x.reshape(b, d // a, a, h // e, e, w // f, f, n).permute(0, 1, 3, 5, 2, 4, 6, 7)
        return x.reshape(-1, a * e * f, n)

    def _mask(self, d: int, h: int, w: int, device) -> Tensor:
        ids, count = torch.zeros(1, d, h, w, 1, device=device), 0
        cuts = [(slice(0, -a), slice(-a, -s), slice(-s, None)) if s else (slice(None),)
                for a, s in zip(self.window, self.shift, strict=True)]
        for i in cuts[0]:
            for j in cuts[1]:
                for k in cuts[2]:
                    ids[:, i, j, k], count = count, count + 1
        groups = self._windows(ids)[..., 0]
        return groups[:, :, None] == groups[:, None, :]  # [windows, N, N]: True where two tokens may attend

    def forward(self, x: Tensor) -> Tensor:
        b, d, h, w, c = x.shape
        rolled = any(self.shift)
        if rolled:
            x = torch.roll(x, tuple(-s for s in self.shift), (1, 2, 3))
        win = self._windows(x)
        q, k, v = self.qkv(win).reshape(win.shape[0], win.shape[1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = self._mask(d, h, w, x.device).repeat(b, 1, 1)[:, None] if rolled else None
        out = self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2))
        (a, e, f) = self.window
        out = out.reshape(b, d // a, h // e, w // f, a, e, f, c).permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, d, h, w, c)
        return torch.roll(out, self.shift, (1, 2, 3)) if rolled else out


class SwinBlock3d(nn.Module):
    def __init__(self, dim: int, heads: int, window: tuple, shift: tuple) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), WindowAttention3d(dim, heads, window, shift)
        self.norm2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                                nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:  # [B, D, H, W, C]
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging3d(nn.Module):
    """2 x 2 x 2 tokens -> one: their channels side by side (raster order), norm, a linear to twice the channels."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.reduction = nn.LayerNorm(8 * dim), nn.Linear(8 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [B, D, H, W, C] -> [B, D/2, H/2, W/2, 2C]
        x = torch.cat([x[:, i::2, j::2, k::2] for i in (0, 1) for j in (0, 1) for k in (0, 1)], -1)
        return self.reduction(self.norm(x))


class SwinStage3d(nn.Module):
    """Swin blocks (plain, then shifted windows where the grid is larger than the window), then a patch merge;
    channels-first in and out."""

    def __init__(self, dim: int, depth: int, heads: int, window: tuple, shifted: bool) -> None:
        super().__init__()
        shift = tuple(a // 2 for a in window) if shifted else (0, 0, 0)
        self.blocks = nn.ModuleList(SwinBlock3d(dim, heads, window, shift if i % 2 else (0, 0, 0))
                                    for i in range(depth))
        self.merge = PatchMerging3d(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 4, 1)
        for block in self.blocks:
            x = block(x)
        return self.merge(x).permute(0, 4, 1, 2, 3)


class SwinEncoder3d(nn.Module):
    def __init__(self, channels: int, dim: int, depths: tuple, heads: tuple, windows: tuple, shifted: tuple) -> None:
        super().__init__()
        self.patch = nn.Conv3d(channels, dim, 2, stride=2)
        self.stages = nn.ModuleList(SwinStage3d(dim * 2 ** i, depth, head, window, shift) for i, (depth, head, window,
                                    shift) in enumerate(zip(depths, heads, windows, shifted, strict=True)))

    def forward(self, x: Tensor) -> list[Tensor]:
        x = self.patch(x)
        features = [x]
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features


class SegNet3d(nn.Module):
    """Volumes ``[B, C_in, D, H, W]`` -> label logits ``[B, classes, D, H, W]``."""

    def __init__(self, channels: int = 1, classes: int = 3, dim: int = 8, depths: tuple = (2, 2), heads: tuple = (2, 2),
                 windows: tuple = ((2, 4, 4), (2, 4, 4)), shifted: tuple = (True, False)) -> None:
        super().__init__()
        self.encoder = SwinEncoder3d(channels, dim, depths, heads, windows, shifted)
        widths = [dim * 2 ** i for i in range(len(depths) + 1)]
        self.up = nn.ModuleList(nn.ConvTranspose3d(widths[i + 1], widths[i], 2, stride=2) for i in range(len(depths)))
        self.fuse = nn.ModuleList(nn.Conv3d(2 * widths[i], widths[i], 3, padding=1) for i in range(len(depths)))
        self.head = nn.ConvTranspose3d(dim, classes, 2, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        features = self.encoder(x)
        y = features[-1]
        for i in reversed(range(len(self.up))):
            y = F.gelu(self.fuse[i](torch.cat([self.up[i](y), features[i]], 1)))
        return self.head(y)
