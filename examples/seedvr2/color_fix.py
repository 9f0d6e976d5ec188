"""Wavelet colour fix: keep the restored frames' detail, take the colours (low frequencies) of the input.

A one-step diffusion restorer can drift in overall colour and brightness. The fix splits both images with an
"a trous" wavelet pyramid (a 3x3 binomial blur applied at dilations 1, 2, 4, 8, 16 with edge replication) and
recombines the restored image's high-frequency bands with the input's coarsest low-pass band:

    fixed = restored - lowpass(restored) + lowpass(input)

(the sum of all high-frequency bands of an image telescopes to ``image - lowpass(image)``). The same five-level
pyramid is what SeedVR2's inference applies to its outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["wavelet_lowpass", "wavelet_color_fix", "WAVELET_LEVELS"]

WAVELET_LEVELS = 5
_BINOMIAL_3 = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)


def _blur(images: torch.Tensor, dilation: int) -> torch.Tensor:
    """3x3 binomial blur of ``[n, c, h, w]`` with taps ``dilation`` apart, borders extended by replication."""
    channels = images.shape[1]
    kernel = torch.outer(_BINOMIAL_3, _BINOMIAL_3).to(images.dtype).to(images.device)
    kernel = kernel.expand(channels, 1, 3, 3)
    padded = F.pad(images, (dilation,) * 4, mode="replicate")
    return F.conv2d(padded, kernel, groups=channels, dilation=dilation)


def wavelet_lowpass(images: torch.Tensor, levels: int = WAVELET_LEVELS) -> torch.Tensor:
    """The coarsest low-pass band of ``[..., h, w]`` images after ``levels`` blurs at dilations 1, 2, 4, ..."""
    if images.dim() < 2:
        raise ValueError(f"images must have at least 2 dims (h, w), got shape {list(images.shape)}")
    lead, (h, w) = images.shape[:-2], images.shape[-2:]
    low = images.reshape(-1, 1, h, w)
    for level in range(levels):
        low = _blur(low, 2**level)
    return low.reshape(lead + (h, w))


def wavelet_color_fix(restored: torch.Tensor, reference: torch.Tensor, levels: int = WAVELET_LEVELS) -> torch.Tensor:
    """Give ``restored`` the low frequencies (colour, brightness) of ``reference``; both ``[..., h, w]``, same shape.

    Works in whatever value range the inputs share (the pipeline uses [-1, 1]); computed in float32 at least.
    """
    if restored.shape != reference.shape:
        raise ValueError(
            f"colour fix needs matching shapes, got restored {list(restored.shape)} and reference {list(reference.shape)}"
        )
    dtype = torch.promote_types(restored.dtype, torch.float32)
    restored32, reference32 = restored.to(dtype), reference.to(dtype)
    fixed = restored32 - wavelet_lowpass(restored32, levels) + wavelet_lowpass(reference32, levels)
    return fixed.to(restored.dtype)
