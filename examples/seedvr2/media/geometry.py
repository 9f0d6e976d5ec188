"""The geometry that turns an input into the model's working size and back to exactly the requested size.

Geometry ("exactly the requested size"). The user asks for an output size ``(H, W)`` (``--resolution WxH``, or
``--scale S`` = the input size times ``S``, rounded). The model needs sides that are multiples of 16, so:

1. the input is resized (bicubic, antialiased, as the reference) with its aspect ratio kept so that it *covers*
   ``H x W`` (when the aspect ratios agree this is the reference's "area" resize to ``H * W`` pixels), and the excess
   is centre-cropped away, giving exactly ``H x W``;
2. that frame is centre-cropped to the largest multiple of 16 on each side (the reference's divisible crop): the
   *working size* at which the VAE and DiT run;
3. the restored result is resized back to exactly ``H x W``. When ``H`` and ``W`` are already multiples of 16 (the
   common case: 720p, 1080p width, ...) steps 2 and 3 do nothing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .reading import DIVISOR, MAX_SIDE, MIN_SIDE, MediaError

__all__ = [
    "Geometry",
    "check_scale",
    "parse_resolution",
    "plan_geometry",
    "resize_frames",
    "center_crop",
    "frames_to_model",
    "model_to_frames",
]

@dataclass(frozen=True)
class Geometry:
    """How an ``input`` (h, w) becomes the ``work`` size the model sees and the exact ``output`` size written."""

    input: tuple[int, int]
    resized: tuple[int, int]  # after the aspect-keeping resize that covers the output size
    output: tuple[int, int]  # exactly what the user asked for
    work: tuple[int, int]  # output centre-cropped to multiples of 16


def parse_resolution(text: str) -> tuple[int, int]:
    """``"WxH"`` -> ``(H, W)``: two whole numbers joined by an ``x``; :class:`MediaError` for anything else (a ``*``
    or ``:`` between them, a sign, a fraction), so that a mistyped size is never read as another one."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if match is None:
        raise MediaError(f"--resolution must look like WIDTHxHEIGHT (e.g. 1280x720), got {text!r}")
    return int(match.group(2)), int(match.group(1))


def check_scale(scale) -> float:
    """``scale`` if it is a positive finite number (what ``--scale`` may be before any input is seen), else
    :class:`MediaError`. Whether the output it gives is allowed depends on the input (:func:`plan_geometry`)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise MediaError(f"--scale must be a positive finite number, got {scale!r}")
    if scale > MAX_SIDE:  # any input side of 1 pixel or more would give an output side over the maximum
        raise MediaError(f"--scale must be at most {MAX_SIDE} (the largest output side), got {scale!r}")
    return float(scale)


def plan_geometry(
    input_hw: tuple[int, int], resolution: tuple[int, int] | None = None, scale: float | None = None
) -> Geometry:
    """Plan the resize/crop for an input of ``input_hw``; ``resolution`` is ``(H, W)``; neither means scale 1.

    Raises :class:`MediaError` for a scale that is not a positive finite number, or an output side under 16 or
    over 16384 pixels.
    """
    if resolution is not None and scale is not None:
        raise MediaError("give either --resolution or --scale, not both")
    in_h, in_w = (int(v) for v in input_hw)
    if resolution is None:
        scale = 1.0 if scale is None else check_scale(scale)
        out_h, out_w = round(in_h * scale), round(in_w * scale)
    else:
        out_h, out_w = (int(v) for v in resolution)
    for name, side in (("height", out_h), ("width", out_w)):
        if side < MIN_SIDE:
            hint = ""
            if resolution is None:  # the size follows the input: say how much to scale it up
                needed = MIN_SIDE / min(in_h, in_w)
                hint = (f"; the input is {in_w}x{in_h}: use --scale {math.ceil(needed * 100) / 100:g} or more to "
                        f"upscale it (or --resolution WxH)")
            raise MediaError(f"output {name} {side} is under the minimum of {MIN_SIDE} pixels{hint}")
        if side > MAX_SIDE:
            hint = ""
            if resolution is None:
                allowed = math.floor(MAX_SIDE / max(in_h, in_w) * 100) / 100
                hint = f"; the input is {in_w}x{in_h}: use --scale {allowed:g} or less (or --resolution WxH)"
            raise MediaError(f"output {name} {side} is over the maximum of {MAX_SIDE} pixels{hint}")
    cover = max(out_h / in_h, out_w / in_w)
    resized = (max(out_h, round(in_h * cover)), max(out_w, round(in_w * cover)))
    work = (out_h - out_h % DIVISOR, out_w - out_w % DIVISOR)
    return Geometry(input=(in_h, in_w), resized=resized, output=(out_h, out_w), work=work)


def resize_frames(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic, antialiased resize of ``[..., h, w]`` float frames to ``size`` (the reference's area resize filter)."""
    size = (int(size[0]), int(size[1]))
    if tuple(video.shape[-2:]) == size:
        return video
    lead = video.shape[:-2]
    flat = video.reshape((-1, 1) + tuple(video.shape[-2:]))
    out = F.interpolate(flat, size=size, mode="bicubic", align_corners=False, antialias=True)
    return out.reshape(lead + size)


def center_crop(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Crop ``[..., h, w]`` to ``size`` around the centre (offsets rounded as torchvision's centre crop rounds)."""
    h, w = video.shape[-2:]
    ch, cw = int(size[0]), int(size[1])
    if ch > h or cw > w:
        raise ValueError(f"cannot centre-crop {h}x{w} to a larger {ch}x{cw}")
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return video[..., top : top + ch, left : left + cw]


def frames_to_model(frames: np.ndarray | torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """``uint8 [t, h, w, 3]`` -> float32 ``[3, t, H', W']`` in [-1, 1] at the working size (resize, clamp, crops)."""
    video = torch.as_tensor(np.asarray(frames)).permute(3, 0, 1, 2).float().div(255.0)  # [3, t, h, w] in [0, 1]
    video = resize_frames(video, geometry.resized).clamp(0.0, 1.0)
    video = center_crop(center_crop(video, geometry.output), geometry.work)
    return video.mul(2.0).sub(1.0)


def model_to_frames(video: torch.Tensor, geometry: Geometry) -> np.ndarray:
    """Float ``[3, t, H', W']`` in [-1, 1] at the working size -> ``uint8 [t, H, W, 3]`` at the output size."""
    video = resize_frames(video.float(), geometry.output)
    video = video.clamp(-1.0, 1.0).mul(0.5).add(0.5).mul(255.0).round()
    return video.to(torch.uint8).permute(1, 2, 3, 0).contiguous().numpy()
