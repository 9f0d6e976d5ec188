"""``flash_varlen``: FlashAttention's ``flash_attn_varlen_func`` over all windows packed into one sequence (CUDA)."""

from __future__ import annotations

from winsp.attention.backends.varlen import varlen_backend


def _import():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # ImportError, or a broken CUDA extension
        return None
    return flash_attn_varlen_func


def _call(kernel):
    def call(q, k, v, cu, longest, scale):
        return kernel(q, k, v, cu, cu, longest, longest, dropout_p=0.0, softmax_scale=scale, causal=False)
    return call


BACKEND = varlen_backend("flash_varlen", lambda: _import(), "flash_attn.flash_attn_varlen_func", _call)
