"""``torch_varlen``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` over all windows packed (CUDA)."""

from __future__ import annotations

from .base import Backend
from .varlen import varlen_runner, varlen_unavailable_reason


def _import():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


def _load():
    kernel = _import()

    def call(q, k, v, cu, longest, scale):
        return kernel(q, k, v, cu, cu, longest, longest, scale=scale)

    return varlen_runner(call)


BACKEND = Backend(
    name="torch_varlen",
    unavailable_reason=lambda device, segments, dtype: varlen_unavailable_reason(
        device, segments, dtype, _import, "torch.nn.attention.varlen.varlen_attn"),
    load=_load,
)
