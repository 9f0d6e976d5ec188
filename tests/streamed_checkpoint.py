"""Full-size checkpoints for memory tests, written tensor by tensor (never whole in memory) from a key manifest.

``write_safetensors_streamed`` writes the safetensors layout (8-byte header length, JSON header, the tensors' bytes
back to back) itself, so that one tensor at a time is alive. With ``values=None`` the data section is left as a hole
(a sparse file: the header is real, the size on disk is a few KB), enough for anything that reads only the header
(the memory fitter).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

__all__ = ["write_safetensors_streamed", "manifest", "GOLDEN"]

GOLDEN = Path(__file__).parent / "golden"
_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def manifest(name: str) -> dict[str, list[int]]:
    """``{key: shape}`` of a released checkpoint (``seedvr2_7b_dit``, ``seedvr2_3b_dit``, ``seedvr2_vae``)."""
    return json.loads((GOLDEN / f"{name}_keys.json").read_text())["keys"]


def _dtype_of(key: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if key.endswith("freqs") else dtype  # RoPE frequencies stay float32, as released


def write_safetensors_streamed(path, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype = torch.bfloat16, *,
                               values: Optional[str] = "random", seed: int = 0, std: float = 0.02) -> int:
    """Write a safetensors file of ``shapes`` in ``dtype`` (RoPE ``freqs`` in float32); returns its size in bytes.

    ``values="random"``: normal draws times ``std`` (frequencies uniform in [0, 1)) from ``seed``: a bank of 32M
    draws, each tensor (each 16M-value slab of it) copied from a random place in it, one at a time; ``None``: a
    sparse file with a real header and no data."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        kind = _dtype_of(key, dtype)
        size = math.prod(shape) * torch.empty((), dtype=kind).element_size()
        header[key] = {"dtype": _NAMES[kind], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    generator = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        if values is None:
            f.truncate(8 + len(text) + offset)
            return 8 + len(text) + offset
        # one bank of random values, written from a random place for each piece: the writer is as fast as the disk
        slab = 16 * 2**20
        weights = (torch.randn(2 * slab, generator=generator) * std).to(dtype)
        frequencies = torch.rand(2 * slab, generator=generator)
        for key, shape in shapes.items():
            bank, numel = frequencies if key.endswith("freqs") else weights, math.prod(shape)
            for start in range(0, numel, slab):
                count = min(slab, numel - start)
                at = int(torch.randint(0, slab, (1,), generator=generator))
                f.write(bank[at:at + count].view(torch.uint8).numpy().tobytes())
    return 8 + len(text) + offset
