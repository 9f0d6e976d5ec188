"""Writing small GGUF checkpoints for the tests: ``gguf.quants.quantize`` where the gguf package has a quantiser,
simple hand-packed blocks for the K types it only decodes (Q4_K, Q5_K, Q6_K).

The hand packers choose scales by min/max per sub-block (not llama.cpp's search), which is enough to produce valid
blocks whose decoded values stay within the type's resolution; the tests decode them with ``gguf.quants.dequantize``
to check the packing itself.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np
import torch

from examples.seedvr2.checkpoints.gguf_file import ORIG_SHAPE_KEY


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return _f16(x).reshape(-1, 1).view(np.uint8)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block ``[n, 8]`` -> the 12 packed bytes of Q4_K/Q5_K."""
    lo = (sc[:, :4] | ((sc[:, 4:] >> 4) << 6)).astype(np.uint8)
    mid = (mn[:, :4] | ((mn[:, 4:] >> 4) << 6)).astype(np.uint8)
    hi = ((sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)).astype(np.uint8)
    return np.concatenate([lo, mid, hi], axis=1)


def _k_min_max(blocks: np.ndarray, levels: int):
    """Per 32-value sub-block: 6-bit scale/min indices, the float16 super-scales and the quants 0..levels."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)
    scale = (sub.max(axis=-1) - low) / levels
    minimum = -low
    d = _f16(scale.max(axis=-1) / 63).astype(np.float32)
    dmin = _f16(minimum.max(axis=-1) / 63).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.round(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin[:, None] > 0, np.round(minimum / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = (d[:, None] * sc)[..., None]
        q = np.where(step > 0, np.round((sub + (dmin[:, None] * mn)[..., None]) / step), 0)
    return sc, mn, d, dmin, q.clip(0, levels).astype(np.uint8)


def _pack_q4_k(blocks: np.ndarray) -> np.ndarray:
    sc, mn, d, dmin, q = _k_min_max(blocks, 15)
    n = blocks.shape[0]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # group g: sub-block 2g low nibbles, 2g+1 high
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), qs], axis=1)


def _pack_q5_k(blocks: np.ndarray) -> np.ndarray:
    sc, mn, d, dmin, q = _k_min_max(blocks, 31)
    n = blocks.shape[0]
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for i in range(8):  # bit i of byte j: the fifth bit of value j of sub-block i
        qh |= ((q[:, i] >> 4) & 1) << i
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), qh, qs], axis=1)


def _pack_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = _f16(scale.max(axis=-1) / 127).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.round(scale / d[:, None]), 0).clip(-128, 127).astype(np.int8)
        step = (d[:, None] * sc)[..., None]
        q = (np.where(step > 0, np.round(sub / step), 0) + 32).clip(0, 63).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)  # half h, 32-value chunk k, position p
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


_HAND_PACKED: dict[str, Callable[[np.ndarray], np.ndarray]] = {"Q4_K": _pack_q4_k, "Q5_K": _pack_q5_k,
                                                                "Q6_K": _pack_q6_k}


def quantize(values: np.ndarray, kind: str) -> np.ndarray:
    """``values`` (float32, last dim a multiple of the block) as the bytes of GGML type ``kind``, rows kept."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if kind in _HAND_PACKED:
        rows = values.reshape(-1, values.shape[-1])
        packed = _HAND_PACKED[kind](rows.reshape(-1, 256).astype(np.float32))
        return packed.reshape(*values.shape[:-1], -1)
    return gguf_quantize(values.astype(np.float32), GGMLQuantizationType[kind])


def write_gguf(path, state: Mapping[str, torch.Tensor], kind_of: Callable[[str, torch.Tensor], str],
               *, flatten: Callable[[str, torch.Tensor], bool] = lambda k, v: False) -> None:
    """Write ``state`` as a GGUF file, each tensor in the type ``kind_of(key, tensor)`` returns; tensors for which
    ``flatten`` is true are stored as ``[numel / 256, 256]`` with their torch shape in ``comfy.gguf.orig_shape.*``
    (what the ComfyUI-GGUF converter does for shapes K-quant rows do not fit)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), arch="seedvr2")
    for key, tensor in state.items():
        kind = kind_of(key, tensor)
        values = tensor.detach().float().numpy()
        if flatten(key, tensor):
            writer.add_array(ORIG_SHAPE_KEY + key, [int(d) for d in tensor.shape])
            values = values.reshape(math.prod(tensor.shape) // 256, 256)
        if kind == "F32":
            writer.add_tensor(key, values.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(key, values.astype(np.float16))
        else:
            writer.add_tensor(key, quantize(values, kind), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_bytes(metadata: list[bytes] = (), tensors: list[bytes] = (), *, data: bytes = b"", order: str = "<",
               version: int = 3, tensor_count: int | None = None, metadata_count: int | None = None) -> bytes:
    """A GGUF file assembled by hand from already-encoded metadata entries and tensor-table entries (see
    :func:`gguf_entry` and :func:`gguf_tensor_entry`); the counts may lie (hostile files), the data is aligned to 32."""
    import struct

    head = b"GGUF" + struct.pack(order + "IQQ", version, len(tensors) if tensor_count is None else tensor_count,
                                 len(metadata) if metadata_count is None else metadata_count)
    body = head + b"".join(metadata) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + data


def gguf_string(text: bytes | str, order: str = "<") -> bytes:
    import struct

    raw = text.encode() if isinstance(text, str) else text
    return struct.pack(order + "Q", len(raw)) + raw


def gguf_entry(key: str, value_type: int, payload: bytes, order: str = "<") -> bytes:
    """One metadata entry: key, value type id (4 u32, 8 string, 9 array, ...), the value's encoded bytes."""
    import struct

    return gguf_string(key, order) + struct.pack(order + "I", value_type) + payload


def gguf_tensor_entry(name: bytes | str, dims: list[int], type_id: int, offset: int, order: str = "<") -> bytes:
    import struct

    return (gguf_string(name, order) + struct.pack(order + "I", len(dims)) + struct.pack(order + f"{len(dims)}Q", *dims)
            + struct.pack(order + "IQ", type_id, offset))
