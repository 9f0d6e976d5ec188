"""``torch_varlen``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` over all windows packed (CUDA)."""

from __future__ import annotations

from winsp.attention.backends.varlen import varlen_backend


def _import():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


def _call(kernel):
    def call(q, k, v, cu, longest, scale):
        return kernel(q, k, v, cu, cu, longest, longest, scale=scale)
    return call


BACKEND = varlen_backend("torch_varlen", lambda: _import(), "torch.nn.attention.varlen.varlen_attn", _call)
