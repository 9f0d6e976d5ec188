"""The colour fixes (examples/seedvr2/media/color_fix.py) and the sRGB <-> CIE L*a*b* conversion (color_space.py).

The wavelet fix itself is tested in tests/test_media.py; here: AdaIN against the formula in float64, the LAB
conversion against published values and its own inverse, and the LAB transfer's promises (a neutral grey stays
neutral, hues are not turned).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from examples.seedvr2.media.color_fix import (
    COLOR_FIXES,
    adain_color_fix,
    apply_color_fix,
    lab_color_fix,
    wavelet_color_fix,
)
from examples.seedvr2.media.color_space import lab_to_srgb, srgb_to_lab


def _rand(*shape, seed=0, low=0.0, high=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=dtype) * (high - low) + low)


# ---- sRGB <-> L*a*b* ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rgb, lab", [
    ((1.0, 1.0, 1.0), (100.0, 0.0, 0.0)),
    ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
    ((1.0, 0.0, 0.0), (53.2408, 80.0925, 67.2032)),  # sRGB primaries in CIE L*a*b* (D65), as published
    ((0.0, 1.0, 0.0), (87.7347, -86.1827, 83.1793)),
    ((0.0, 0.0, 1.0), (32.2970, 79.1875, -107.8602)),
])
def test_lab_of_known_colours(rgb, lab):
    got = srgb_to_lab(torch.tensor(rgb, dtype=torch.float64)[:, None, None])[:, 0, 0]
    np.testing.assert_allclose(got.numpy(), lab, atol=0.02)


def test_every_neutral_grey_has_no_chroma():
    grey = torch.arange(256, dtype=torch.float64).div(255).expand(3, 1, 256)
    lab = srgb_to_lab(grey)
    assert lab[1:].abs().max() < 1e-9
    assert torch.all(lab[0, 0, 1:] > lab[0, 0, :-1])  # lightness rises with the grey level


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_srgb_lab_round_trip(dtype, tol):
    rgb = _rand(2, 3, 17, 19, seed=3, dtype=dtype)
    back = lab_to_srgb(srgb_to_lab(rgb))
    assert back.dtype == dtype and (back - rgb).abs().max() < tol
    outside = _rand(3, 8, 8, seed=4, low=-0.3, high=1.3, dtype=torch.float64)  # out of gamut: mirrored curve
    assert (lab_to_srgb(srgb_to_lab(outside)) - outside).abs().max() < 1e-10


def test_lab_needs_three_channels():
    with pytest.raises(ValueError, match=r"\[\.\.\., 3, h, w\]"):
        srgb_to_lab(torch.zeros(4, 8, 8))


# ---- AdaIN ----------------------------------------------------------------------------------------------------------


def test_adain_is_the_per_channel_mean_std_transfer():
    restored = _rand(4, 3, 12, 10, seed=1, low=-1, high=1, dtype=torch.float32)
    reference = _rand(4, 3, 12, 10, seed=2, low=-0.5, high=0.9, dtype=torch.float32)
    got = adain_color_fix(restored, reference)
    x, r = restored.double().numpy(), reference.double().numpy()
    eps = 4e-5  # the reference's 1e-5 of [0, 1] units, in [-1, 1] units
    mx, sx = x.mean(axis=(2, 3), keepdims=True), np.sqrt(x.var(axis=(2, 3), ddof=1, keepdims=True) + eps)
    mr, sr = r.mean(axis=(2, 3), keepdims=True), np.sqrt(r.var(axis=(2, 3), ddof=1, keepdims=True) + eps)
    np.testing.assert_allclose(got.double().numpy(), (x - mx) / sx * sr + mr, atol=1e-5)
    # so each frame's channel takes the input's statistics (up to the eps)
    torch.testing.assert_close(got.mean(dim=(2, 3)), reference.mean(dim=(2, 3)), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.std(dim=(2, 3)), reference.std(dim=(2, 3)), atol=1e-4, rtol=1e-3)


def test_adain_in_unit_range_matches_the_reference_units():
    """AdaIN of [-1, 1] frames with the default eps is AdaIN of the same frames in [0, 1] with eps 1e-5, mapped back."""
    restored, reference = _rand(2, 3, 6, 6, seed=5, low=-1, high=1), _rand(2, 3, 6, 6, seed=6, low=-1, high=1)
    unit = adain_color_fix((restored + 1) / 2, (reference + 1) / 2, eps=1e-5) * 2 - 1
    torch.testing.assert_close(adain_color_fix(restored, reference), unit, atol=1e-12, rtol=0)


def test_adain_with_itself_is_identity():
    x = _rand(2, 3, 9, 9, seed=7, low=-1, high=1)
    torch.testing.assert_close(adain_color_fix(x, x), x, atol=1e-12, rtol=0)


# ---- LAB transfer ---------------------------------------------------------------------------------------------------


def _to_pipeline(rgb01: torch.Tensor) -> torch.Tensor:
    return rgb01 * 2 - 1


def _lab_of(pipeline_frames: torch.Tensor) -> torch.Tensor:
    return srgb_to_lab((pipeline_frames + 1) / 2)


def test_lab_fix_keeps_a_neutral_grey_neutral():
    """A grey restored frame (textured) towards a grey input (another level and contrast) stays grey: R = G = B."""
    texture = _rand(2, 1, 16, 16, seed=8, low=0.3, high=0.6).expand(2, 3, 16, 16)
    reference = _rand(2, 1, 16, 16, seed=9, low=0.1, high=0.9).expand(2, 3, 16, 16)
    fixed = lab_color_fix(_to_pipeline(texture), _to_pipeline(reference))
    assert (fixed - fixed[:, :1]).abs().max() < 1e-9  # every pixel neutral
    lab, lab_ref = _lab_of(fixed), _lab_of(_to_pipeline(reference))
    assert lab[:, 1:].abs().max() < 1e-7
    torch.testing.assert_close(lab[:, 0].mean(dim=(1, 2)), lab_ref[:, 0].mean(dim=(1, 2)), atol=1e-6, rtol=0)
    torch.testing.assert_close(lab[:, 0].std(dim=(1, 2)), lab_ref[:, 0].std(dim=(1, 2)), atol=1e-3, rtol=1e-3)


def _lab_transform(rgb01, light=(0.85, 4.0), chroma_scale=0.6, chroma_shift=(4.0, -3.0)):
    lab = srgb_to_lab(rgb01)
    L = lab[:, :1] * light[0] + light[1]
    ab = lab[:, 1:] * chroma_scale + torch.tensor(chroma_shift, dtype=lab.dtype)[:, None, None]
    return lab_to_srgb(torch.cat([L, ab], dim=1))


def test_lab_fix_undoes_a_lightness_and_chroma_drift():
    """The restored frame = the input with lightness, saturation and tint drifted in L*a*b*: the fix gives the input
    back (every pixel's colour, so every hue)."""
    reference = _rand(3, 3, 12, 12, seed=10, low=0.25, high=0.75)
    drifted = _lab_transform(reference)
    assert drifted.min() >= 0 and drifted.max() <= 1  # stays in the sRGB gamut, so nothing is clipped
    exact = lab_color_fix(_to_pipeline(drifted), _to_pipeline(reference), eps=1e-12)
    torch.testing.assert_close(exact, _to_pipeline(reference), atol=1e-9, rtol=0)
    fixed = lab_color_fix(_to_pipeline(drifted), _to_pipeline(reference))  # the default eps changes little
    torch.testing.assert_close(fixed, _to_pipeline(reference), atol=5e-4, rtol=0)


def _hue_angles(lab: torch.Tensor) -> torch.Tensor:
    """Hue angle of every pixel's chroma relative to its frame's mean chroma."""
    ab = lab[:, 1:] - lab[:, 1:].mean(dim=(2, 3), keepdim=True)
    return torch.atan2(ab[:, 1], ab[:, 0])


def _per_axis_lab_transfer(restored, reference):
    """The naive LAB transfer (every L*a*b* channel by its own mean and std): what this fix avoids."""
    lab, lab_ref = _lab_of(restored), _lab_of(reference)
    m, s = lab.mean(dim=(2, 3), keepdim=True), lab.std(dim=(2, 3), keepdim=True)
    mr, sr = lab_ref.mean(dim=(2, 3), keepdim=True), lab_ref.std(dim=(2, 3), keepdim=True)
    return (lab - m) / s * sr + mr


def test_lab_fix_does_not_turn_hues():
    """Towards an input whose colours spread along one axis (reds and greens, little blue-yellow), the restored
    frame's hues around its mean colour keep their angles; matching a* and b* separately would turn them."""
    restored = _rand(2, 3, 16, 16, seed=11, low=0.3, high=0.7)
    reference_lab = torch.cat([_rand(2, 1, 16, 16, seed=12, low=40, high=70),
                               _rand(2, 1, 16, 16, seed=13, low=-30, high=30),  # a*: wide
                               _rand(2, 1, 16, 16, seed=14, low=-3, high=3)], dim=1)  # b*: narrow
    reference = lab_to_srgb(reference_lab)
    assert reference.min() >= 0 and reference.max() <= 1
    fixed = lab_color_fix(_to_pipeline(restored), _to_pipeline(reference))
    assert fixed.min() >= -1 and fixed.max() <= 1  # in gamut: the comparison below is not blurred by clipping
    lab_r = _lab_of(_to_pipeline(restored))
    chroma = (lab_r[:, 1:] - lab_r[:, 1:].mean(dim=(2, 3), keepdim=True)).norm(dim=1)
    vivid = chroma > 2.0  # pixels with a well-defined hue around the mean
    turn = (_hue_angles(_lab_of(fixed)) - _hue_angles(lab_r) + math.pi) % (2 * math.pi) - math.pi
    assert turn[vivid].abs().max() < 1e-4
    naive = (_hue_angles(_per_axis_lab_transfer(_to_pipeline(restored), _to_pipeline(reference)))
             - _hue_angles(lab_r) + math.pi) % (2 * math.pi) - math.pi
    assert naive[vivid].abs().max() > 0.3  # the test can fail: per-axis matching turns hues by > 17 degrees
    # and the chroma cloud takes the input's centre and spread
    lab_f, lab_ref = _lab_of(fixed), _lab_of(_to_pipeline(reference))
    torch.testing.assert_close(lab_f.mean(dim=(2, 3)), lab_ref.mean(dim=(2, 3)), atol=1e-5, rtol=0)


def test_lab_fix_with_itself_is_identity():
    x = _to_pipeline(_rand(2, 3, 8, 8, seed=15))
    torch.testing.assert_close(lab_color_fix(x, x), x, atol=1e-9, rtol=0)


def test_lab_fix_keeps_the_dtype_and_needs_rgb():
    x = _to_pipeline(_rand(1, 3, 8, 8, seed=16, dtype=torch.float32))
    assert lab_color_fix(x, x).dtype == torch.float32
    with pytest.raises(ValueError, match="RGB"):
        lab_color_fix(torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match="matching shapes"):
        lab_color_fix(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 9))


# ---- the dispatcher -------------------------------------------------------------------------------------------------


def test_apply_color_fix_dispatches_every_choice():
    restored = _to_pipeline(_rand(2, 3, 40, 40, seed=17))
    reference = _to_pipeline(_rand(2, 3, 40, 40, seed=18))
    assert COLOR_FIXES == ("wavelet", "adain", "lab", "none")
    assert apply_color_fix("none", restored, reference) is restored
    torch.testing.assert_close(apply_color_fix("wavelet", restored, reference), wavelet_color_fix(restored, reference))
    torch.testing.assert_close(apply_color_fix("adain", restored, reference), adain_color_fix(restored, reference))
    torch.testing.assert_close(apply_color_fix("lab", restored, reference), lab_color_fix(restored, reference))
    with pytest.raises(ValueError, match="unknown colour fix 'hsv'"):
        apply_color_fix("hsv", restored, reference)
