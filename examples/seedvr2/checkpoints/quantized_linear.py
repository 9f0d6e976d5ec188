"""Linear layers whose weights stay in their stored form (fp8, GGUF blocks) and are expanded per call.

:class:`PackedWeight` is a checkpoint tensor kept as it was stored: float8 values with one scale, or the bytes of a
GGML block type (Q8_0, Q4_K, ...). :class:`QuantizedLinear` holds one as a uint8 buffer and, at each call, expands it
to the input's dtype, runs ``F.linear`` and drops the expanded copy, so the resident weight memory is the stored size
(fp8: half of bf16; Q4/Q5: about a quarter to a third) and only one layer's expanded weight exists at a time. The
bytes are a uint8 buffer so that ``module.to(dtype)`` moves them but never casts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gguf_dequant import BLOCK_LAYOUTS, dequantize_blocks

__all__ = ["PackedWeight", "QuantizedLinear", "pack_linear_layers", "linear_weight_keys", "to_fp8", "expand",
           "FP8_KINDS"]

FP8_KINDS = {name: getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}
#: largest finite float8_e4m3fn value (the scale of :func:`to_fp8` maps a tensor's max-abs onto it)
_E4M3_MAX = 448.0


@dataclass
class PackedWeight:
    """A tensor in its stored form: ``kind`` is a float8 dtype name (``data`` its bytes, value = stored x ``scale``)
    or a GGML block type (``data`` the blocks); ``shape`` is the tensor's logical (torch) shape."""

    data: Tensor
    kind: str
    shape: tuple[int, ...]
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in FP8_KINDS and self.kind not in BLOCK_LAYOUTS:
            raise ValueError(f"unknown packed kind {self.kind!r}")
        if self.data.dtype != torch.uint8:
            self.data = self.data.contiguous().view(torch.uint8)
        self.shape = tuple(int(d) for d in self.shape)

    @classmethod
    def from_fp8(cls, tensor: Tensor, scale: float = 1.0) -> "PackedWeight":
        kind = str(tensor.dtype).replace("torch.", "")
        return cls(tensor.contiguous().view(torch.uint8), kind, tuple(tensor.shape), float(scale))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values in ``dtype``, on the device of ``data``."""
        return expand(self.data, self.kind, self.shape, self.scale, dtype)

    def describe(self) -> str:
        return f"shape {list(self.shape)}, {self.kind}"


def expand(data: Tensor, kind: str, shape: tuple[int, ...], scale: float, dtype: torch.dtype) -> Tensor:
    """Stored bytes -> values of ``shape`` in ``dtype`` (see :class:`PackedWeight`)."""
    if kind in FP8_KINDS:
        values = data.view(FP8_KINDS[kind]).reshape(shape)
        if scale == 1.0:
            return values.to(dtype)  # every fp8 value is exact in fp16/bf16/fp32
        return (values.float() * scale).to(dtype)
    return dequantize_blocks(data, kind, math.prod(shape)).reshape(shape).to(dtype)


def to_fp8(tensor: Tensor) -> PackedWeight:
    """``tensor`` as float8_e4m3fn with one scale (max-abs onto the largest finite e4m3 value)."""
    amax = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    scale = amax / _E4M3_MAX if amax > 0 else 1.0
    stored = (tensor.detach().float() / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return PackedWeight.from_fp8(stored, scale)


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with a :class:`PackedWeight`: the weight is expanded to the input's dtype at every call."""

    def __init__(self, weight: PackedWeight, bias: Tensor | None) -> None:
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(f"a Linear weight is 2-D, got {weight.describe()}")
        self.out_features, self.in_features = weight.shape
        self.kind, self.scale = weight.kind, weight.scale
        self.register_buffer("packed", weight.data)
        self.bias = None if bias is None else nn.Parameter(bias)

    def expanded_weight(self, dtype: torch.dtype) -> Tensor:
        return expand(self.packed, self.kind, (self.out_features, self.in_features), self.scale, dtype)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.expanded_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        scale = f", scale={self.scale:.3g}" if self.scale != 1.0 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}{scale}"


def pack_linear_layers(model: nn.Module, packed: Mapping[str, PackedWeight], state: Mapping[str, Tensor]) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose ``<name>.weight`` is in ``packed`` by a :class:`QuantizedLinear`
    (bias from ``state[<name>.bias]``); returns how many. Names must be Linear layers of ``model``."""
    modules = dict(model.named_modules())
    for key, weight in packed.items():
        name = key[: -len(".weight")]
        linear = modules.get(name)
        if not key.endswith(".weight") or not isinstance(linear, nn.Linear):
            raise ValueError(f"{key!r} is not the weight of a Linear layer; it cannot stay packed")
        if weight.shape != tuple(linear.weight.shape):
            raise ValueError(f"{key!r}: packed {weight.describe()} vs model {list(linear.weight.shape)}")
        bias = state.get(f"{name}.bias") if linear.bias is not None else None
        if linear.bias is not None and bias is None:
            raise ValueError(f"missing key {name}.bias for the packed layer {name!r}")
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, leaf, QuantizedLinear(weight, bias))
    return len(packed)


def linear_weight_keys(model: nn.Module, exclude: Iterable[str] = ()) -> set[str]:
    """``<name>.weight`` of every ``nn.Linear`` of ``model`` except the layers named in ``exclude``."""
    skip = set(exclude)
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in skip}
