"""``flash_varlen``: FlashAttention's ``flash_attn_varlen_func`` over all windows packed into one sequence (CUDA)."""

from __future__ import annotations

from .base import Backend
from .varlen import varlen_runner, varlen_unavailable_reason


def _import():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # ImportError, or a broken CUDA extension
        return None
    return flash_attn_varlen_func


def _load():
    kernel = _import()

    def call(q, k, v, cu, longest, scale):
        return kernel(q, k, v, cu, cu, longest, longest, dropout_p=0.0, softmax_scale=scale, causal=False)

    return varlen_runner(call)


BACKEND = Backend(
    name="flash_varlen",
    unavailable_reason=lambda device, segments, dtype: varlen_unavailable_reason(
        device, segments, dtype, _import, "flash_attn.flash_attn_varlen_func"),
    load=_load,
)
