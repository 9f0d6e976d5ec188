"""Leaf layers of the causal video VAE: causal 3D convolution and frame-wise group normalisation.

Both see activations laid out [batch, channels, time, height, width]. Time is causal: an output frame depends
only on the same and earlier input frames, the clip start being padded by repeating the first frame. Space is
ordinary: zero padding, and normalisation statistics taken over one frame at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .context import RunContext

__all__ = ["CausalConv3d", "band_conv3d", "frame_group_norm", "pad_frame_edges"]


def _triple(value: int | tuple[int, int, int]) -> tuple[int, int, int]:
    if isinstance(value, int):
        return (value, value, value)
    if len(value) != 3:
        raise ValueError(f"expected an int or 3 ints, got {value!r}")
    return tuple(int(v) for v in value)  # type: ignore[return-value]


class CausalConv3d(nn.Conv3d):
    """A 3D convolution that is causal in time and zero-padded in space.

    The temporal kernel looks back ``kernel_t - 1`` frames. At the start of a clip those frames are copies of
    the first frame; inside a chunked clip they are the frames the previous chunk left in ``ctx.cache``.
    ``spatial_padding`` is the zero padding of height and width (the weight layout is ``nn.Conv3d``'s).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        *,
        stride: int | tuple[int, int, int] = 1,
        spatial_padding: int = 0,
        bias: bool = True,
    ) -> None:
        kernel = _triple(kernel_size)
        super().__init__(
            in_channels, out_channels, kernel, stride=_triple(stride),
            padding=(0, spatial_padding, spatial_padding), bias=bias,
        )
        self.time_lookback = kernel[0] - 1

    def _extend_time(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        cache = ctx.cache
        if cache is not None and not cache.first:
            tail = cache.take(self, x)
            if tail is not None:
                x = torch.cat([tail.to(x.dtype), x], dim=2)
        elif self.time_lookback:
            head = x[:, :, :1].expand(-1, -1, self.time_lookback, -1, -1)
            x = torch.cat([head, x], dim=2)
        if cache is not None:
            kernel_t, stride_t = self.kernel_size[0], self.stride[0]
            outputs = (x.shape[2] - kernel_t) // stride_t + 1
            if outputs < 1:
                raise ValueError(
                    f"temporal chunk too short: {x.shape[2]} frames (with carried context) cannot feed a "
                    f"{kernel_t}-frame kernel; use a larger chunk size"
                )
            next_start = outputs * stride_t  # first frame the next chunk's first output window reads
            cache.keep(self, x, next_start)
        return x

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:  # type: ignore[override]
        x = self._extend_time(x, ctx)
        pad_h, pad_w = self.padding[1], self.padding[2]
        if ctx.bands is None:
            return F.conv3d(x, self.weight, self.bias, self.stride, self.padding)
        frame_rows = x.shape[3] * ctx.bands.parts  # about the whole frame's rows, halos not counted
        if pad_h:
            if self.stride[1] != 1:
                raise NotImplementedError("height-sharded convolution with both stride and padding in height")
            x = ctx.bands.pad_rows(x, pad_h, pad_h)
        return band_conv3d(x, self.weight, self.bias, self.stride, (0, 0, pad_w), frame_rows=frame_rows)


#: PyTorch's CPU rule for a 5-D float32 convolution (batch 1, ungrouped 3D kernels): oneDNN when
#: batch x channels x frames x rows exceeds this, its slower vol2col kernel otherwise (frame width not counted)
_ONEDNN_MIN_NCTH = 20480


def band_conv3d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, *, frame_rows: int
) -> torch.Tensor:
    """``F.conv3d`` of one band of rows (halos attached) of a frame of ``frame_rows`` rows, with the CPU kernel
    the whole frame gets.

    PyTorch picks the CPU kernel by rows, not pixels: a band of a wide frame falls under the oneDNN threshold
    that the whole frame clears, and its vol2col kernel is 3-6x slower per pixel. So where the whole frame
    would use oneDNN, the band does too (the same kernel, so also the same arithmetic as the whole frame).
    """
    nct = x.shape[0] * x.shape[1] * x.shape[2]
    if (nct * x.shape[3] <= _ONEDNN_MIN_NCTH < nct * frame_rows and x.device.type == "cpu" and x.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return torch.mkldnn_convolution(x.contiguous(), weight.contiguous(), bias, list(padding), list(stride),
                                        [1, 1, 1], 1)
    return F.conv3d(x, weight, bias, stride, padding)


def pad_frame_edges(x: torch.Tensor, ctx: RunContext, *, bottom: int, right: int) -> torch.Tensor:
    """Zero-pad the bottom and right edges of every frame (height may be sharded: only the last band pads)."""
    if ctx.bands is None:
        return F.pad(x, (0, right, 0, bottom))
    x = F.pad(x, (0, right))
    return ctx.bands.pad_rows(x, 0, bottom)


def frame_group_norm(x: torch.Tensor, norm: nn.GroupNorm, ctx: RunContext) -> torch.Tensor:
    """``norm`` applied to every frame of ``x`` [b, c, t, h, w] on its own (statistics over c/groups, h, w)."""
    if ctx.bands is not None:
        return ctx.bands.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
    b, c, t, h, w = x.shape
    groups = norm.num_groups
    grouped = x.reshape(b, groups, c // groups, t, h, w)
    var, mean = torch.var_mean(grouped, dim=(2, 4, 5), correction=0, keepdim=True)
    scale = torch.rsqrt(var + norm.eps) * norm.weight.reshape(1, groups, c // groups, 1, 1, 1)
    shift = norm.bias.reshape(1, groups, c // groups, 1, 1, 1) - mean * scale
    return torch.addcmul(shift, grouped, scale).reshape(b, c, t, h, w)
