"""GGML block formats decoded with torch, on whatever device the packed bytes live.

A GGUF tensor of a quantised type is a run of fixed-size blocks along its contiguous (last torch) dimension; each
block packs ``block_size`` values into ``type_size`` bytes. :func:`dequantize_blocks` turns such bytes back into float
values, so a packed weight can stay packed on the GPU and be expanded one layer at a time (see
:mod:`.quantized_linear`). The layouts are llama.cpp's; the tests check every decoder here against the reference
decoder of the ``gguf`` package (``gguf.quants.dequantize``) on random bytes, bit for bit in float32.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["BLOCK_LAYOUTS", "QUANTISED_TYPES", "dequantize_blocks", "packed_nbytes"]

#: type name -> (values per block, bytes per block), for the quantised types decoded here
BLOCK_LAYOUTS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
QUANTISED_TYPES = tuple(BLOCK_LAYOUTS)


def packed_nbytes(kind: str, numel: int) -> int:
    """Bytes a tensor of ``numel`` values takes in the block type ``kind``."""
    block, size = BLOCK_LAYOUTS[kind]
    return numel // block * size


def _half(raw: Tensor) -> Tensor:
    """``[n, 2]`` bytes -> ``[n, 1]`` float32 (little-endian float16)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """``[n, k]`` bytes -> ``[n, 2, k]``: low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1)


def _bits(raw: Tensor, count: int) -> Tensor:
    """``[n, count // 8]`` little-endian bytes -> ``[n, count]`` bits (bit j of the word at position j)."""
    shifts = torch.arange(8, device=raw.device, dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> shifts) & 1).reshape(raw.shape[0], count)


def _q8_0(b: Tensor) -> Tensor:
    return _half(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 2:]).reshape(b.shape[0], 32).float()
    return _half(b[:, :2]) * (q - 8)


def _q4_1(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 4:]).reshape(b.shape[0], 32).float()
    return _half(b[:, :2]) * q + _half(b[:, 2:4])


def _five_bit(low: Tensor, high: Tensor) -> Tensor:
    """Q5_0/Q5_1 quants: 16 bytes of nibbles and a 32-bit word of fifth bits -> ``[n, 32]`` values 0..31."""
    return (_nibbles(low).reshape(low.shape[0], 32) | (_bits(high, 32) << 4)).float()


def _q5_0(b: Tensor) -> Tensor:
    return _half(b[:, :2]) * (_five_bit(b[:, 6:], b[:, 2:6]) - 16)


def _q5_1(b: Tensor) -> Tensor:
    return _half(b[:, :2]) * _five_bit(b[:, 8:], b[:, 4:8]) + _half(b[:, 2:4])


def _k_scales(raw: Tensor) -> tuple[Tensor, Tensor]:
    """The 12 scale bytes of Q4_K/Q5_K -> eight 6-bit scales and eight 6-bit mins ``[n, 8]`` each.

    Sub-blocks 0..3 keep scale and min in the low 6 bits of bytes 0..3 and 4..7; sub-blocks 4..7 take their low 4
    bits from the nibbles of bytes 8..11 and their top 2 bits from the top bits of bytes 0..3 (scales) / 4..7 (mins).
    """
    a, m, lo = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    scales = torch.cat((a & 0x3F, (lo & 0x0F) | ((a >> 6) << 4)), dim=1)
    mins = torch.cat((m & 0x3F, (lo >> 4) | ((m >> 6) << 4)), dim=1)
    return scales.float(), mins.float()


def _k_low_nibbles(qs: Tensor) -> Tensor:
    """128 bytes -> ``[n, 8, 32]``: four 32-byte groups, each the low nibbles (sub-block 2g) then the high (2g+1)."""
    n = qs.shape[0]
    return torch.stack((qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4), dim=2).reshape(n, 8, 32)


def _q4_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    scales, mins = _k_scales(b[:, 4:16])
    q = _k_low_nibbles(b[:, 16:]).float()
    out = (_half(b[:, :2]) * scales).unsqueeze(-1) * q - (_half(b[:, 2:4]) * mins).unsqueeze(-1)
    return out.reshape(n, 256)


def _q5_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    scales, mins = _k_scales(b[:, 4:16])
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).reshape(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # [n, 8, 32]: bit i of byte j is the fifth bit of sub-block i
    q = (_k_low_nibbles(b[:, 48:]) | (high << 4)).float()
    out = (_half(b[:, :2]) * scales).unsqueeze(-1) * q - (_half(b[:, 2:4]) * mins).unsqueeze(-1)
    return out.reshape(n, 256)


def _q6_k(b: Tensor) -> Tensor:
    """Two halves of 128 values; in half h, 32-value chunk 2s+c has its low nibble from ``ql[h, c*32:(c+1)*32]``
    shifted by 4s and its top 2 bits from ``qh[h]`` shifted by 2(2s+c); 16 int8 scales, one per 16 values."""
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = (ql >> torch.tensor([0, 4], device=b.device, dtype=torch.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh >> torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(n, 2, 4, 32) | (high << 4)).float() - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _half(b[:, 208:210])
    return ((d * scales).reshape(n, 16, 1) * q.reshape(n, 16, 16)).reshape(n, 256)


_DECODERS: dict[str, Callable[[Tensor], Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def dequantize_blocks(raw: Tensor, kind: str, numel: int) -> Tensor:
    """The ``numel`` float32 values packed in the uint8 tensor ``raw`` (any shape) as blocks of type ``kind``."""
    if kind not in BLOCK_LAYOUTS:
        raise ValueError(f"unknown GGML block type {kind!r} (decoded here: {', '.join(QUANTISED_TYPES)})")
    block, size = BLOCK_LAYOUTS[kind]
    if raw.dtype != torch.uint8:
        raise TypeError(f"packed {kind} data must be uint8 bytes, got {raw.dtype}")
    if numel % block or raw.numel() != numel // block * size:
        raise ValueError(f"{kind}: {raw.numel()} bytes do not hold {numel} values in {block}-value blocks of "
                         f"{size} bytes")
    return _DECODERS[kind](raw.reshape(-1, size)).reshape(numel)
