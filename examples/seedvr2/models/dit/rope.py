"""3-axis rotary position embeddings of SeedVR2's NaDiTs, written out as plain tensor math.

Two kinds share the channel layout and the rotation and differ in frequencies and positions:

* ``"mmrope3d"`` (the 3B): described below; video and text are rotated.
* ``"rope3d"`` (the 7B's ``qk_rope``, over ``head_dim // 2`` channels): ``F = ((head_dim // 2) // 3) // 2``
  "pixel" frequencies ``f_j = pi * linspace(1, 128, F)[j]``; a video token at window-local coordinate d of a window
  n tokens long on that axis sits at ``linspace(-1, 1, n)[d]`` (so every window spans [-1, 1] whatever its size);
  text is not rotated.

``mmrope3d`` frequencies: one axis gets ``F = (rope_dim // 3) // 2`` frequencies
``f_j = 10000 ** (-2j / (rope_dim // 3))``
("language-model" spacing). A position p turns into angles ``p * f_j``, each used for one adjacent channel pair
(2j, 2j+1), so an axis covers 2F channels. The three axes (t, h, w) are laid out one after another, covering
``6F`` channels (126 of 128 for the 3B); the remaining channels of a head pass through unrotated.

Rotation of a pair (x0, x1) by angle a: ``(x0 cos a - x1 sin a, x1 cos a + x0 sin a)``, computed in float32.

Positions: a video token at window-local (dt, dh, dw) of a sample with ``n`` text tokens uses (n + dt, dh, dw);
text token i uses (i, i, i). Windows restart at 0, so the embedding is relative to the window, not the frame.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .layers import compute_dtype

__all__ = [
    "ROPE_KINDS", "rope_frequencies", "pixel_frequencies", "unit_positions", "rope_tables",
    "apply_rope", "RotaryEmbedding3d",
]

ROPE_KINDS = ("mmrope3d", "rope3d")


def rope_frequencies(rope_dim: int, theta: float = 10000.0, device=None) -> Tensor:
    """The per-axis "language" frequency vector ``[ (rope_dim // 3) // 2 ]`` in float32 (mmrope3d)."""
    axis_dim = rope_dim // 3
    exponents = torch.arange(0, axis_dim, 2, device=device)[: axis_dim // 2].float() / axis_dim
    return 1.0 / (theta ** exponents)


def pixel_frequencies(rope_dim: int, max_freq: float = 256.0, device=None) -> Tensor:
    """The per-axis "pixel" frequency vector ``pi * linspace(1, max_freq / 2, (rope_dim // 3) // 2)`` (rope3d)."""
    return torch.linspace(1.0, max_freq / 2, (rope_dim // 3) // 2, device=device) * math.pi


def unit_positions(coords: Tensor, extents: Tensor) -> Tensor:
    """``linspace(-1, 1, n)[d]`` for every coordinate ``d`` of an axis ``n`` long, elementwise, in float32.

    Computed as ``torch.linspace`` does (a float32 step ``2 / (n - 1)``; the first half counted up from -1, the
    second down from 1, each with one rounding), so the values equal the reference's tables; an axis of one sits at
    -1. The single rounding uses float64 (exact for these products), except where a device has no float64.
    """
    wide = torch.float32 if coords.device.type == "mps" else torch.float64
    step = (2.0 / (extents - 1).clamp_min(1).float()).to(wide)
    up = (-1.0 + step * coords.to(wide)).float()
    down = (1.0 - step * (extents - 1 - coords).to(wide)).float()
    pos = torch.where(coords < torch.div(extents, 2, rounding_mode="floor"), up, down)
    return torch.where(extents == 1, torch.full_like(pos, -1.0), pos)


def rope_tables(positions: Tensor, freqs: Tensor, width: int | None = None) -> tuple[Tensor, Tensor]:
    """``cos``/``sin`` tables ``[N, width]`` (float32) for ``positions [N, 3]`` (t, h, w) and ``freqs [F]``.

    Channels ``0 .. 6F`` hold the three axes' angles (each shared by a channel pair); ``width`` (default ``6F``,
    must be even) pads the tables with cos = 1, sin = 0 so that the remaining channels pass through unchanged.
    """
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise ValueError(f"positions must be [N, 3], got shape {tuple(positions.shape)}")
    span = 6 * freqs.shape[0]
    width = span if width is None else width
    if width < span or width % 2:
        raise ValueError(f"width must be even and at least the rotary span {span}, got {width}")
    freqs = freqs.float()
    angles = positions.float()[:, :, None] * freqs[None, None, :]  # [N, 3, F]
    angles = angles.repeat_interleave(2, dim=-1).reshape(positions.shape[0], span)  # a channel pair shares an angle
    cos, sin = angles.cos(), angles.sin()
    if width > span:
        pad = width - span
        cos = torch.cat([cos, cos.new_ones(cos.shape[0], pad)], dim=-1)
        sin = torch.cat([sin, sin.new_zeros(sin.shape[0], pad)], dim=-1)
    return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs of ``x [N, heads, head_dim]`` by the tables' angles (float32 math, ``x.dtype`` out).

    Tables narrower than ``head_dim`` rotate only their leading channels; full-width tables (see ``rope_tables``'
    ``width``) avoid the split and re-concatenation.
    """
    span = cos.shape[-1]
    if span == 0:
        return x
    x32 = x.to(compute_dtype(x.dtype))
    rot = x32 if span == x.shape[-1] else x32[..., :span]
    pairs = rot.unflatten(-1, (span // 2, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (x0, x1) -> (-x1, x0)
    out = rot * cos[:, None, :] + swapped * sin[:, None, :]
    if span < x.shape[-1]:
        out = torch.cat([out, x32[..., span:]], dim=-1)
    return out.to(x.dtype)


class RotaryEmbedding3d(nn.Module):
    """Holds one block's RoPE frequency buffer (checkpoint key ``...attn.rope.freqs``, ``[F]``) and its kind.

    ``kind`` (see the module docstring) picks the initial frequencies, the video positions and whether text is
    rotated (:attr:`rotates_text`). The buffer stays float32 when the model is cast to a lower precision: positions
    times frequencies must be exact for large positions, and the values are a fixed function of ``rope_dim`` anyway.
    """

    def __init__(self, rope_dim: int, kind: str = "mmrope3d") -> None:
        super().__init__()
        if kind not in ROPE_KINDS:
            raise ValueError(f"unsupported RoPE kind {kind!r}; supported: {list(ROPE_KINDS)}")
        self.rope_dim, self.kind = rope_dim, kind
        self.register_buffer("freqs", self.exact_frequencies(), persistent=True)
        # (buffer, its version, key): what frequency_key() last found, valid while the buffer is that tensor unchanged
        self._key_for: tuple | None = (self.freqs, self.freqs._version, ("exact", kind, rope_dim))

    def exact_frequencies(self) -> Tensor:
        """The float32 frequencies this kind and ``rope_dim`` define (what released checkpoints store), on the CPU."""
        return rope_frequencies(self.rope_dim) if self.kind == "mmrope3d" else pixel_frequencies(self.rope_dim)

    @property
    def span(self) -> int:
        return 6 * self.freqs.shape[0]

    @property
    def rotates_text(self) -> bool:
        """mmrope3d rotates text q/k too (text token i at (i, i, i)); rope3d leaves text unrotated."""
        return self.kind == "mmrope3d"

    def _apply(self, fn, recurse: bool = True):
        before = self.freqs
        known = self._key_for
        super()._apply(fn, recurse)
        after = self.freqs
        if after is not None and before is not None and after.dtype != before.dtype and before.dtype == torch.float32:
            self.freqs = before.to(device=after.device)  # keep float32, follow the device change only
        if known is not None and known[0] is before and known[1] == before._version and self.freqs is not None:
            self._key_for = (self.freqs, self.freqs._version, known[2])  # a move or cast keeps the values
        return self

    def frequency_key(self) -> tuple:
        """A host value naming this buffer's values: two buffers with equal keys hold equal frequencies.

        Known without reading the buffer while it is the tensor built at construction (or a move of it) and not
        changed in place; after a load or an in-place change it is read once (planning: a host read of a small buffer,
        never in the forward's compute), so a model on a device or on fake tensors groups its blocks without a sync.
        """
        freqs = self.freqs
        known = self._key_for
        if known is not None and known[0] is freqs and known[1] == freqs._version:
            return known[2]
        values = tuple(freqs.detach().cpu().tolist())
        exact = tuple(self.exact_frequencies().tolist())
        key = ("exact", self.kind, self.rope_dim) if values == exact else ("values", values)
        self._key_for = (freqs, freqs._version, key)
        return key

    def tables(self, positions: Tensor, width: int | None = None) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` ``[N, width or span]`` for ``positions [N, 3]`` (see :func:`rope_tables`)."""
        return rope_tables(positions, self.freqs, width)

    def video_tables(self, coords: Tensor, text_offset, extents: Tensor,
                     width: int | None = None) -> tuple[Tensor, Tensor]:
        """Tables for video rows at window-local ``coords [N, 3]`` of windows ``extents [N, 3]`` long.

        ``text_offset`` (a callable returning ``[N]``, called only by mmrope3d) is the text length of each row's
        sample, added to the time coordinate; rope3d maps each window axis onto [-1, 1] instead.
        """
        if self.kind == "mmrope3d":
            positions = coords.clone()
            positions[:, 0] += text_offset()
        else:
            positions = unit_positions(coords, extents)
        return self.tables(positions, width)

    def extra_repr(self) -> str:
        return f"rope_dim={self.rope_dim}, kind={self.kind}, rotated_channels={self.span}"
