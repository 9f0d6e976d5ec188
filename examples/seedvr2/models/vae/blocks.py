"""Building blocks of the causal video VAE: residual block, down/up-samplers, bottleneck attention, stages.

Module and parameter names follow the released checkpoint's key layout (``resnets.0.norm1.weight``,
``downsamplers.0.conv.weight``, ``attentions.0.to_out.0.bias``, ...), so its state dict loads as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .context import RunContext
from .layers import CausalConv3d, frame_group_norm, pad_frame_edges

__all__ = [
    "ResnetBlock3D",
    "Downsample3D",
    "Upsample3D",
    "FrameAttention",
    "MidBlock3D",
    "DownEncoderBlock3D",
    "UpDecoderBlock3D",
]

NORM_EPS = 1e-6


class ResnetBlock3D(nn.Module):
    """Pre-norm residual block: (norm, SiLU, causal 3x3x3 conv) twice, plus a 1x1x1 projection if widths differ."""

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=NORM_EPS)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, spatial_padding=1)
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=NORM_EPS)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, spatial_padding=1)
        self.conv_shortcut = (
            CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None
        )

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        h = self.conv1(F.silu(frame_group_norm(x, self.norm1, ctx)), ctx)
        h = self.conv2(F.silu(frame_group_norm(h, self.norm2, ctx)), ctx)
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x, ctx)
        return skip + h


class Downsample3D(nn.Module):
    """Stride-2 3x3 convolution in space (bottom/right zero pad of one), optionally stride 2 over 3 frames in time."""

    def __init__(self, channels: int, *, temporal: bool) -> None:
        super().__init__()
        self.conv = CausalConv3d(
            channels, channels, (3 if temporal else 1, 3, 3), stride=(2 if temporal else 1, 2, 2)
        )

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        return self.conv(pad_frame_edges(x, ctx, bottom=1, right=1), ctx)


class Upsample3D(nn.Module):
    """Learned sub-pixel upsampling: a 1x1x1 conv to ``ratio`` times the channels, a shuffle into space (and
    time), then a causal 3x3x3 conv. Doubling time turns the clip's first frame into two; the copy is dropped so
    that t latent frames become 2t - 1 (causal: the first frame stays a frame of its own)."""

    def __init__(self, channels: int, *, temporal: bool) -> None:
        super().__init__()
        self.time_ratio = 2 if temporal else 1
        self.space_ratio = 2
        ratio = self.time_ratio * self.space_ratio ** 2
        self.upscale_conv = nn.Conv3d(channels, channels * ratio, kernel_size=1)
        with torch.no_grad():  # start as plain replication (every sub-position copies its source pixel)
            self.upscale_conv.weight.copy_(
                torch.eye(channels).repeat(ratio, 1).reshape(self.upscale_conv.weight.shape)
            )
            self.upscale_conv.bias.zero_()
        self.conv = CausalConv3d(channels, channels, 3, spatial_padding=1)

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        b, c, t, h, w = x.shape
        s, r = self.space_ratio, self.time_ratio
        y = self.upscale_conv(x)
        # channel index = ((row_offset * s + col_offset) * r + time_offset) * c + channel
        y = y.reshape(b, s, s, r, c, t, h, w).permute(0, 4, 5, 3, 6, 1, 7, 2)
        y = y.reshape(b, c, t * r, h * s, w * s)
        if r > 1 and (ctx.cache is None or ctx.cache.first):
            y = torch.cat([y[:, :, :1], y[:, :, r:]], dim=2)
        return self.conv(y, ctx)


class FrameAttention(nn.Module):
    """Single-head self-attention over all pixels of each frame, with a group-norm in front and a residual."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=NORM_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels), nn.Dropout(0.0)])

    @staticmethod
    def _tokens(x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        return x.permute(0, 2, 3, 4, 1).reshape(b * t, 1, h * w, c)

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        b, c, t, h, w = x.shape
        normed = frame_group_norm(x, self.group_norm, ctx)
        # Queries are this band's pixels; keys and values are the whole frame.
        whole = normed if ctx.bands is None else ctx.bands.gather_rows(normed)
        q = self.to_q(self._tokens(normed))
        kv_tokens = self._tokens(whole)
        out = F.scaled_dot_product_attention(q, self.to_k(kv_tokens), self.to_v(kv_tokens))
        out = self.to_out[1](self.to_out[0](out))
        out = out.reshape(b, t, h, w, c).permute(0, 4, 1, 2, 3)
        return x + out


class MidBlock3D(nn.Module):
    """Bottleneck: residual block, then (frame attention, residual block) once."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([FrameAttention(channels, groups)])
        self.resnets = nn.ModuleList([ResnetBlock3D(channels, channels, groups) for _ in range(2)])

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        x = self.resnets[0](x, ctx)
        for attention, resnet in zip(self.attentions, self.resnets[1:], strict=True):
            x = resnet(attention(x, ctx), ctx)
        return x


class DownEncoderBlock3D(nn.Module):
    """Encoder stage: ``num_layers`` residual blocks, then an optional 2x downsampler."""

    def __init__(
        self, in_channels: int, out_channels: int, *, num_layers: int, groups: int, downsample: bool,
        temporal_down: bool,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock3D(in_channels if i == 0 else out_channels, out_channels, groups) for i in range(num_layers)]
        )
        self.downsamplers = (
            nn.ModuleList([Downsample3D(out_channels, temporal=temporal_down)]) if downsample else None
        )

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, ctx)
        if self.downsamplers is not None:
            for down in self.downsamplers:
                x = down(x, ctx)
        return x


class UpDecoderBlock3D(nn.Module):
    """Decoder stage: ``num_layers`` residual blocks, then an optional 2x upsampler."""

    def __init__(
        self, in_channels: int, out_channels: int, *, num_layers: int, groups: int, upsample: bool,
        temporal_up: bool,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock3D(in_channels if i == 0 else out_channels, out_channels, groups) for i in range(num_layers)]
        )
        self.upsamplers = nn.ModuleList([Upsample3D(out_channels, temporal=temporal_up)]) if upsample else None

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, ctx)
        if self.upsamplers is not None:
            for up in self.upsamplers:
                x = up(x, ctx)
        return x
