"""What the two packed-varlen backends share: their availability rule and the packing around the kernel call."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from winsp.attention.backends.base import Backend, Runner, pack, unpack

VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def cuda_reason(device: torch.device) -> Optional[str]:
    """Why a CUDA-only kernel cannot run on ``device`` (None when it can)."""
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "it needs a GPU of compute capability 8.0 or newer"
    return None


def varlen_unavailable_reason(device, segments, dtype, importer: Callable[[], Optional[Callable]],
                              where: str) -> Optional[str]:
    """Why a CUDA varlen kernel cannot run (None when it can). The device is checked before the (slow) import."""
    reason = cuda_reason(device)
    if reason is not None:
        return reason
    if importer() is None:
        return f"{where} is not importable"
    if dtype is not None and dtype not in VARLEN_DTYPES:
        return f"it needs float16 or bfloat16 inputs, got {dtype}"
    if segments is not None:
        try:
            segments.check_int32()
        except ValueError as err:
            return str(err)
    return None


def varlen_runner(call: Callable) -> Runner:
    """A runner that packs all windows into one sequence and calls ``call(q, k, v, cu_seqlens, max_seqlen, scale)``."""

    def run(qkv_vid, qkv_txt, segments, idx, scale, mods=None):
        if mods:
            raise ValueError("a packed varlen kernel cannot take a score_mod or mask_mod; use another backend")
        q, k, v = (pack(vid, txt, idx.pack_index, segments).contiguous()
                   for vid, txt in zip(qkv_vid, qkv_txt, strict=True))
        packed_out = call(q, k, v, idx.packed_cu_seqlens, segments.max_seqlen, scale)
        return unpack(packed_out, idx.unpack_index, segments)

    return run


def _imported(importer: Callable[[], Optional[Callable]], where: str) -> Callable:
    """The kernel ``importer()`` finds; a ValueError naming ``where`` when it is absent."""
    kernel = importer()
    if kernel is None:
        raise ValueError(f"{where} is not importable")
    return kernel


def varlen_backend(name: str, importer: Callable[[], Optional[Callable]], where: str,
                   call: Callable[[Callable], Callable]) -> Backend:
    """A varlen :class:`Backend`: ``importer()`` finds the kernel (None when absent, named ``where`` in the reason);
    ``call(kernel)`` adapts it to ``(q, k, v, cu_seqlens, max_seqlen, scale) -> packed output``.

    ``importer`` is looked up again at every use, through the backend module, so tests can stand in a fake kernel.
    """
    return Backend(
        name=name,
        unavailable_reason=lambda device, segments, dtype: varlen_unavailable_reason(
            device, segments, dtype, importer, where),
        load=lambda: varlen_runner(call(_imported(importer, where))),
        takes_score_mods=False,
        auto_rule=lambda device, modded: "it cannot take a score_mod or mask_mod" if modded else None,
    )
