"""Colour fixes: keep the restored frames' detail, take the colours of the input (``--color-fix``).

A one-step diffusion restorer can drift in overall colour and brightness. Each fix works frame by frame on
``[..., 3, h, w]`` frames (the pipeline's ``(t, 3, h, w)``), in the pipeline's [-1, 1] range:

* ``wavelet`` (SeedVR2's own): the restored frame's high frequencies plus the input's low frequencies;
* ``adain``: adaptive instance normalisation, every channel of every frame shifted and scaled to the input's mean
  and standard deviation (the reference's definition: unbiased variance plus 1e-5, in [0, 1] units);
* ``lab``: the same statistics transfer in CIE L*a*b* (:mod:`.color_space`): lightness matched by mean and standard
  deviation, and the chroma plane by its mean and one common spread, so that colours are moved and scaled but their
  hues are never turned (scaling a* and b* separately would turn them);
* ``none``.

The wavelet fix splits both images with an "a trous" wavelet pyramid (a 3x3 binomial blur applied at dilations
1, 2, 4, 8, 16 with edge replication) and recombines the restored image's high-frequency bands with the input's coarsest
low-pass band:

    fixed = restored - lowpass(restored) + lowpass(input)

(the sum of all high-frequency bands of an image telescopes to ``image - lowpass(image)``). The same five-level
pyramid is what SeedVR2's inference applies to its outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .color_space import lab_to_srgb, srgb_to_lab

__all__ = ["wavelet_lowpass", "wavelet_color_fix", "adain_color_fix", "lab_color_fix", "apply_color_fix",
           "COLOR_FIXES", "WAVELET_LEVELS"]

WAVELET_LEVELS = 5
#: the ``--color-fix`` choices, ``none`` last
COLOR_FIXES = ("wavelet", "adain", "lab", "none")
#: added to a variance before its square root (the reference's AdaIN), in [0, 1] units
ADAIN_EPS = 1e-5
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
            f"colour fix needs matching shapes, got restored {list(restored.shape)} and reference "
            f"{list(reference.shape)}"
        )
    dtype = torch.promote_types(restored.dtype, torch.float32)
    restored32, reference32 = restored.to(dtype), reference.to(dtype)
    fixed = restored32 - wavelet_lowpass(restored32, levels) + wavelet_lowpass(reference32, levels)
    return fixed.to(restored.dtype)


def _check_pair(restored: torch.Tensor, reference: torch.Tensor) -> torch.dtype:
    if restored.shape != reference.shape:
        raise ValueError(
            f"colour fix needs matching shapes, got restored {list(restored.shape)} and reference "
            f"{list(reference.shape)}"
        )
    if restored.dim() < 2:
        raise ValueError(f"images must have at least 2 dims (h, w), got shape {list(restored.shape)}")
    return torch.promote_types(restored.dtype, torch.float32)


def _mean_std(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-image mean and sqrt(unbiased variance + eps) over the last two dims (kept, for broadcasting)."""
    flat = x.flatten(-2)
    var = flat.var(dim=-1, unbiased=flat.shape[-1] > 1) + eps
    return flat.mean(dim=-1)[..., None, None], var.sqrt()[..., None, None]


def adain_color_fix(restored: torch.Tensor, reference: torch.Tensor, eps: float = 4 * ADAIN_EPS) -> torch.Tensor:
    """AdaIN: every ``[h, w]`` plane of ``restored`` (a channel of a frame) takes the mean and standard deviation of
    the same plane of ``reference``: ``(x - mean_x) / std_x * std_ref + mean_ref``, with ``std = sqrt(var + eps)``.

    ``eps`` defaults to the reference's 1e-5 in [0, 1] units expressed in the pipeline's [-1, 1] units (x4).
    """
    dtype = _check_pair(restored, reference)
    x, ref = restored.to(dtype), reference.to(dtype)
    mean_x, std_x = _mean_std(x, eps)
    mean_ref, std_ref = _mean_std(ref, eps)
    return ((x - mean_x) / std_x * std_ref + mean_ref).to(restored.dtype)


def lab_color_fix(restored: torch.Tensor, reference: torch.Tensor, eps: float = 0.1) -> torch.Tensor:
    """LAB transfer of ``[..., 3, h, w]`` frames in [-1, 1]: in CIE L*a*b*, each frame's lightness takes the input
    frame's mean and standard deviation, and its chroma (a*, b*) the input's mean and RMS spread around it, one factor
    for both axes (a similarity of the chroma plane without rotation: hues relative to the mean colour are kept).

    ``eps`` (added to the variances, in L*a*b* units: AdaIN's 1e-5 of [0, 1] units at L*'s scale of 100) keeps a
    flat frame flat. Values are clipped to [-1, 1] first (the sRGB curve is defined there); the result may leave [-1, 1]
    where the transfer leaves the sRGB gamut and is clipped later like any output.
    """
    dtype = _check_pair(restored, reference)
    if restored.dim() < 3 or restored.shape[-3] != 3:
        raise ValueError(f"the LAB colour fix needs [..., 3, h, w] RGB frames, got {list(restored.shape)}")
    to_lab = lambda v: srgb_to_lab(v.to(dtype).clamp(-1.0, 1.0).add(1.0).mul(0.5))  # noqa: E731
    lab, lab_ref = to_lab(restored), to_lab(reference)
    L, chroma = lab[..., :1, :, :], lab[..., 1:, :, :]
    L_ref, chroma_ref = lab_ref[..., :1, :, :], lab_ref[..., 1:, :, :]
    mean_L, std_L = _mean_std(L, eps)
    mean_L_ref, std_L_ref = _mean_std(L_ref, eps)
    centre = chroma.mean(dim=(-2, -1), keepdim=True)
    centre_ref = chroma_ref.mean(dim=(-2, -1), keepdim=True)
    spread = (chroma - centre).square().sum(dim=-3, keepdim=True).mean(dim=(-2, -1), keepdim=True).add(eps).sqrt()
    spread_ref = (chroma_ref - centre_ref).square().sum(dim=-3, keepdim=True).mean(dim=(-2, -1), keepdim=True)
    spread_ref = spread_ref.add(eps).sqrt()
    fixed = torch.cat([(L - mean_L) / std_L * std_L_ref + mean_L_ref,
                       (chroma - centre) * (spread_ref / spread) + centre_ref], dim=-3)
    return lab_to_srgb(fixed).mul(2.0).sub(1.0).to(restored.dtype)


def apply_color_fix(method: str, restored: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The ``method`` colour fix (one of :data:`COLOR_FIXES`) of ``restored`` towards ``reference``: frames
    ``[..., 3, h, w]`` in [-1, 1], same shape. ``none`` returns ``restored`` unchanged."""
    if method == "none":
        return restored
    fixes = {"wavelet": wavelet_color_fix, "adain": adain_color_fix, "lab": lab_color_fix}
    if method not in fixes:
        raise ValueError(f"unknown colour fix {method!r}; choose one of {', '.join(COLOR_FIXES)}")
    return fixes[method](restored, reference)
