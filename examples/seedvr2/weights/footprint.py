"""How many bytes a checkpoint's weights will take once loaded, from the file's header alone.

The resident size is not the file size: an fp32 file run in bf16 takes half of it, an fp8 file expanded to bf16 twice
it, and Linear weights kept packed (``--weights stored`` / ``fp8``, see :mod:`~examples.seedvr2.checkpoints.dtypes`)
take their stored
size, plus one layer's weight expanded to the compute dtype at a time. :func:`resident_weight_bytes` reads only the
dtypes and shapes (the safetensors header, the GGUF tensor table (parsed once, shared with the loader), a
memory-mapped ``.pth``) so that the memory plan is made before any weight is read.
"""

from __future__ import annotations

import math
import os
import re
from typing import Collection, Optional

import torch

from ..checkpoints.gguf_dequant import BLOCK_LAYOUTS, packed_nbytes
from ..checkpoints.quantized_linear import FP8_KINDS

__all__ = ["checkpoint_layout", "resident_weight_bytes", "run_weight_bytes", "sharded_weight_bytes"]

_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                      "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_SAFETENSORS_KIND = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_FLOAT_NAMES = {"F64", "F32", "F16", "BF16", "float64", "float32", "float16", "bfloat16"}


def checkpoint_layout(path: str) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """``{key: (kind, shape, stored bytes)}`` of a checkpoint file without reading its values. ``kind`` is a float
    name (``F32``, ``float16``, ...), a float8 name, a GGML block type, or an integer type. A file whose header
    cannot be read is a ``ValueError`` naming it."""
    try:
        return _layout(path)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged header fails in any way inside the readers
        from ..checkpoints.file import read_error_reason

        raise ValueError(f"checkpoint {path!r}: its header cannot be read ({read_error_reason(err)})") from None


def _layout(path: str) -> dict[str, tuple[str, tuple[int, ...], int]]:
    suffix = os.path.splitext(path)[1].lower()
    layout: dict[str, tuple[str, tuple[int, ...], int]] = {}
    if suffix == ".safetensors":
        from ..checkpoints.file import safetensors_header

        for key, entry in safetensors_header(path).items():
            layout[key] = (_SAFETENSORS_KIND.get(entry.dtype, entry.dtype), entry.shape,
                           math.prod(entry.shape) * _SAFETENSORS_BYTES.get(entry.dtype, 4))
    elif suffix == ".gguf":
        from ..checkpoints.gguf_file import gguf_header

        layout = gguf_header(path).layout()  # parsed once: the loader reuses it
    else:
        from ..checkpoints.file import compressed_zip_records

        if compressed_zip_records(path):  # mmap would misread it; reading it whole here would double the load
            raise ValueError(f"{path!r} has compressed records; its layout is not read without loading it")
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                layout[key] = (str(value.dtype).replace("torch.", ""), tuple(value.shape),
                               value.numel() * value.element_size())
    return layout


def _unpacked_file_bytes(path: str) -> int:
    """The file's size, or for a zip its records' uncompressed sizes (what loading it allocates at least)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return sum(r.file_size for r in archive.infolist())
    except Exception:  # noqa: BLE001 - not a zip, or a damaged one
        return os.path.getsize(path)


def resident_weight_bytes(path: str, *, compute_dtype: torch.dtype, weights: str = "compute",
                          packable: Collection[str] = ()) -> int:
    """Bytes the checkpoint at ``path`` takes loaded for ``compute_dtype`` with ``weights`` (``stored``, ``fp8``,
    ``compute``): keys in ``packable`` that stay packed count their stored size (fp8: one byte a value), the largest
    of them once more expanded (the per-call copy); every other floating tensor counts in ``compute_dtype``."""
    by_key, largest_packed = _resident_bytes_by_key(path, compute_dtype, weights, packable)
    return sum(by_key.values()) + largest_packed


def _resident_bytes_by_key(path: str, compute_dtype: torch.dtype, weights: str,
                           packable: Collection[str]) -> tuple[dict[str, int], int]:
    """``({key: resident bytes}, bytes of the largest packed weight expanded)`` (see :func:`resident_weight_bytes`)."""
    element = torch.finfo(compute_dtype).bits // 8
    by_key, largest_packed = {}, 0
    packable = set(packable)
    for key, (kind, shape, stored) in checkpoint_layout(path).items():
        numel = math.prod(shape)
        quantised = kind in FP8_KINDS or kind in BLOCK_LAYOUTS
        if weights != "compute" and key in packable and (quantised or (weights == "fp8" and kind in _FLOAT_NAMES)):
            by_key[key] = packed_nbytes(kind, numel) if kind in BLOCK_LAYOUTS else numel  # fp8: one byte a value
            largest_packed = max(largest_packed, numel * element)
        elif quantised or kind in _FLOAT_NAMES:
            by_key[key] = numel * element
        else:
            by_key[key] = stored
    return by_key, largest_packed


def sharded_weight_bytes(path: str, *, compute_dtype: torch.dtype, parts: int) -> int:
    """Bytes one of ``parts`` ranks holds of the DiT checkpoint at ``path`` with its blocks sharded (see
    :mod:`.sharded`): its share of the blocks, everything else whole, and two blocks gathered at once (the
    running one and the prefetched next one; none at one rank, whose chunk is the whole block)."""
    by_key, _ = _resident_bytes_by_key(path, compute_dtype, "compute", ())
    blocks: dict[str, int] = {}
    rest = 0
    for key, size in by_key.items():
        match = _BLOCK_KEY.match(key)
        if match:
            blocks[match.group(1)] = blocks.get(match.group(1), 0) + size
        else:
            rest += size
    if parts <= 1:
        return rest + sum(blocks.values())
    return rest + sum(-(-size // parts) for size in blocks.values()) + 2 * max(blocks.values(), default=0)


def run_weight_bytes(model: str, dit_path: str, vae_path: str, *, compute_dtype: torch.dtype,
                     weights: str = "stored", shard_parts: Optional[int] = None) -> int:
    """Resident bytes of a run's DiT (``model`` "3b"/"7b") and VAE checkpoints (see :func:`resident_weight_bytes`);
    with ``shard_parts``, the DiT's blocks sharded over that many ranks (see :func:`sharded_weight_bytes`).

    A file whose header cannot be read counts its size on disk (the loader then reports what is wrong with it)."""
    from ..models.dit import NaDiTConfig, SeedVR2NaDiT, packable_dit_weights

    with torch.device("meta"):
        packable = packable_dit_weights(SeedVR2NaDiT(NaDiTConfig.released(model)))
    total = 0
    for path, keys, mode in ((dit_path, packable, weights), (vae_path, (), "compute")):
        if not path or not os.path.isfile(path):
            continue  # the loader names the missing file
        try:
            if shard_parts is not None and path == dit_path:
                total += sharded_weight_bytes(path, compute_dtype=compute_dtype, parts=shard_parts)
            else:
                total += resident_weight_bytes(path, compute_dtype=compute_dtype, weights=mode, packable=keys)
        except Exception:  # noqa: BLE001 - an unreadable file is reported by the loader, with its reason
            total += _unpacked_file_bytes(path)
    return total
