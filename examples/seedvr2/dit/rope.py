"""3-axis rotary position embedding of SeedVR2's NaDiT ("mmrope3d"), written out as plain tensor math.

Frequencies: one axis gets ``F = (rope_dim // 3) // 2`` frequencies ``f_j = 10000 ** (-2j / (rope_dim // 3))``
("language-model" spacing). A position p turns into angles ``p * f_j``, each used for one adjacent channel pair
(2j, 2j+1), so an axis covers 2F channels. The three axes (t, h, w) are laid out one after another, covering
``6F`` channels (126 of 128 for the 3B); the remaining channels of a head pass through unrotated.

Rotation of a pair (x0, x1) by angle a: ``(x0 cos a - x1 sin a, x1 cos a + x0 sin a)``, computed in float32.

Positions: a video token at window-local (dt, dh, dw) of a sample with ``n`` text tokens uses (n + dt, dh, dw);
text token i uses (i, i, i). Windows restart at 0, so the embedding is relative to the window, not the frame.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .layers import compute_dtype

__all__ = ["rope_frequencies", "rope_tables", "apply_rope", "RotaryEmbedding3d"]


def rope_frequencies(rope_dim: int, theta: float = 10000.0, device=None) -> Tensor:
    """The per-axis frequency vector ``[ (rope_dim // 3) // 2 ]`` in float32."""
    axis_dim = rope_dim // 3
    exponents = torch.arange(0, axis_dim, 2, device=device)[: axis_dim // 2].float() / axis_dim
    return 1.0 / (theta ** exponents)


def rope_tables(positions: Tensor, freqs: Tensor, width: int | None = None) -> tuple[Tensor, Tensor]:
    """``cos``/``sin`` tables ``[N, width]`` (float32) for integer ``positions [N, 3]`` (t, h, w) and ``freqs [F]``.

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
    """Holds one block's RoPE frequency buffer (checkpoint key ``...attn.rope.freqs``, ``[F]``).

    The buffer stays float32 when the model is cast to a lower precision: positions times frequencies must be exact
    for large positions, and the values are a fixed function of ``rope_dim`` anyway.
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.register_buffer("freqs", rope_frequencies(rope_dim), persistent=True)

    @property
    def span(self) -> int:
        return 6 * self.freqs.shape[0]

    def _apply(self, fn, recurse: bool = True):
        before = self.freqs
        super()._apply(fn, recurse)
        after = self.freqs
        if after is not None and before is not None and after.dtype != before.dtype and before.dtype == torch.float32:
            self.freqs = before.to(device=after.device)  # keep float32, follow the device change only
        return self

    def tables(self, positions: Tensor, width: int | None = None) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` ``[N, width or span]`` for ``positions [N, 3]`` (see :func:`rope_tables`)."""
        return rope_tables(positions, self.freqs, width)

    def extra_repr(self) -> str:
        return f"rope_dim={self.rope_dim}, rotated_channels={self.span}"
