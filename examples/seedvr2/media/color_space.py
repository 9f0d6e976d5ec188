"""sRGB <-> CIE L*a*b* (D65), for the LAB colour fix.

sRGB values in [0, 1] are linearised with the sRGB transfer curve, taken to CIE XYZ with the sRGB (D65) primaries,
and to L*a*b* relative to the D65 white. The white is the image of sRGB (1, 1, 1) under the same matrix, so every
neutral grey (R = G = B) maps to a* = b* = 0 exactly, and back. Linear values outside [0, 1] (colours outside the
sRGB gamut, which a colour transfer can produce) go through the transfer curve mirrored at 0, so the round trip stays
exact for them too. Channels are the third dimension from the end: ``[..., 3, h, w]``.
"""

from __future__ import annotations

import torch

__all__ = ["srgb_to_lab", "lab_to_srgb", "SRGB_TO_XYZ"]

#: linear sRGB -> CIE XYZ (D65), IEC 61966-2-1
SRGB_TO_XYZ = torch.tensor(
    [[0.4124564, 0.3575761, 0.1804375],
     [0.2126729, 0.7151522, 0.0721750],
     [0.0193339, 0.1191920, 0.9503041]], dtype=torch.float64)
_WHITE = SRGB_TO_XYZ.sum(dim=1)  # XYZ of sRGB white, the D65 white point the L*a*b* values are relative to
_DELTA = 6.0 / 29.0


def _apply(matrix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``matrix @ x`` over the channel dim (-3) of ``[..., 3, h, w]``."""
    return torch.einsum("ij,...jhw->...ihw", matrix.to(x.dtype).to(x.device), x)


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() < 3 or x.shape[-3] != 3:
        raise ValueError(f"{name} must be [..., 3, h, w] (channels third from the end), got {list(x.shape)}")


def _linearise(c: torch.Tensor) -> torch.Tensor:
    a = c.abs()
    return torch.sign(c) * torch.where(a <= 0.04045, a / 12.92, ((a + 0.055) / 1.055) ** 2.4)


def _gamma(c: torch.Tensor) -> torch.Tensor:
    a = c.abs()
    return torch.sign(c) * torch.where(a <= 0.0031308, a * 12.92, 1.055 * a ** (1.0 / 2.4) - 0.055)


def _f(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t > _DELTA**3, t.clamp(min=_DELTA**3) ** (1.0 / 3.0), t / (3 * _DELTA**2) + 4.0 / 29.0)


def _f_inverse(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t > _DELTA, t**3, 3 * _DELTA**2 * (t - 4.0 / 29.0))


def srgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """sRGB ``[..., 3, h, w]`` (nominally in [0, 1]) -> L*a*b* ``[..., 3, h, w]`` (L* in [0, 100]); float32 at least."""
    _check(rgb, "rgb")
    x = rgb.to(torch.promote_types(rgb.dtype, torch.float32))
    xyz = _apply(SRGB_TO_XYZ, _linearise(x)) / _WHITE.to(x.dtype).to(x.device)[:, None, None]
    fx, fy, fz = _f(xyz).unbind(dim=-3)
    return torch.stack([116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)], dim=-3)


def lab_to_srgb(lab: torch.Tensor) -> torch.Tensor:
    """L*a*b* ``[..., 3, h, w]`` -> sRGB ``[..., 3, h, w]`` (unclipped: out-of-gamut colours leave [0, 1])."""
    _check(lab, "lab")
    x = lab.to(torch.promote_types(lab.dtype, torch.float32))
    L, a, b = x.unbind(dim=-3)
    fy = (L + 16.0) / 116.0
    f = torch.stack([fy + a / 500.0, fy, fy - b / 200.0], dim=-3)
    xyz = _f_inverse(f) * _WHITE.to(x.dtype).to(x.device)[:, None, None]
    return _gamma(_apply(torch.linalg.inv(SRGB_TO_XYZ), xyz))
