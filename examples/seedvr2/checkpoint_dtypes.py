"""Bringing a checkpoint's tensors to the model's dtypes: fp16/bf16 repacks cast, fp8 dequantised or refused.

Users mostly hold community repacks of the SeedVR2 weights (fp16/bf16 DiTs of about 6.8 GB (3B) and 16.5 GB (7B), an
fp16 VAE of about 500 MB) rather than the fp32 release. The DiT and VAE loaders call :func:`match_model_dtypes` after
reading a file: every floating tensor whose dtype differs from the model's entry for that key is cast to it, and what
was cast is summarised in one line.

fp8 (``float8_e4m3fn`` / ``float8_e5m2``) tensors are dequantised only with a per-tensor scale stored beside them
(``<name>.scale_weight``, the ComfyUI "scaled fp8" layout, or ``<name>_scale``, e.g. ``weight_scale``): value =
fp8 value x scale. Without one there is no way to know what the numbers mean, so the file is refused with a message
naming the tensor.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Optional

import torch

__all__ = ["FP8_DTYPES", "match_model_dtypes", "dtype_name"]

FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                     "float8_e5m2fnuz") if hasattr(torch, name))
#: keys some fp8 repacks add that are not model tensors (a format marker)
_FP8_MARKERS = ("scaled_fp8",)
_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``/``fp16``/``bf16``/``fp64`` or torch's own name (``float8_e4m3fn``)."""
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)}, {dtype_name(value.dtype)}"
    return type(value).__name__


def _is_fp8(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in FP8_DTYPES


def _scale_keys(key: str) -> tuple[str, ...]:
    stem, _, leaf = key.rpartition(".")
    return (f"{stem}.scale_{leaf}" if stem else f"scale_{leaf}", f"{key}_scale")


def _dequantise_fp8(state: dict, expected: Mapping[str, torch.Tensor], what: str) -> tuple[dict, int]:
    """Replace every fp8 model tensor by ``value * scale`` (float32) and drop the scale/marker entries."""
    fp8 = sorted(k for k, v in state.items() if _is_fp8(v) and k in expected)
    used = set()
    for key in fp8:
        scale_key = next((s for s in _scale_keys(key) if s in state), None)
        if scale_key is None:
            raise ValueError(
                f"{what}: tensor {key!r} is {dtype_name(state[key].dtype)} with no per-tensor scale (looked for "
                f"{' or '.join(repr(s) for s in _scale_keys(key))}); fp8 checkpoints without scales are not "
                f"supported: use an fp16, bf16 or fp32 checkpoint"
            )
        scale = state[scale_key]
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(
                f"{what}: scale {scale_key!r} of fp8 tensor {key!r} is not one floating-point number "
                f"({_describe(scale)}); only one scale per tensor is supported"
            )
        state[key] = state[key].to(torch.float32) * scale.to(torch.float32).reshape(())
        used.add(scale_key)
    if fp8:  # scales and the format marker are no model tensors (anything else left over, the strict loader names)
        for key in list(used) + [k for k in _FP8_MARKERS if k in state]:
            if key not in expected:
                del state[key]
    return state, len(fp8)


def match_model_dtypes(
    state: Mapping[str, torch.Tensor], model: torch.nn.Module, *, what: str = "checkpoint"
) -> tuple[dict[str, torch.Tensor], Optional[str]]:
    """``state`` with every floating tensor in the dtype of the model's entry of the same key, and a one-line
    summary of what changed (None when nothing did).

    Keys the model does not have are left alone (the strict loader reports them). Integer and bool tensors are never
    cast. A model built on the meta device has dtypes too: build it in the compute dtype (``.to(torch.bfloat16)`` on
    meta) to keep a bf16 checkpoint in bf16 instead of casting it up and back down.
    """
    expected = model.state_dict()
    origin = {k: v.dtype for k, v in state.items() if isinstance(v, torch.Tensor)}
    state, dequantised = _dequantise_fp8(dict(state), expected, what)
    casts: Counter = Counter()
    for key, value in state.items():
        target = expected.get(key)
        if target is None or not isinstance(value, torch.Tensor) or not value.is_floating_point() \
                or not target.is_floating_point():
            continue
        if origin[key] != target.dtype:
            casts[(origin[key], target.dtype)] += 1
            state[key] = value.to(target.dtype)
    if not casts:
        return state, None
    parts = [f"{n} tensor{'s' if n != 1 else ''} {dtype_name(a)} -> {dtype_name(b)}"
             for (a, b), n in sorted(casts.items(), key=lambda item: -item[1])]
    scaled = f" ({dequantised} fp8 tensors dequantised with their per-tensor scales)" if dequantised else ""
    return state, f"{what}: cast {', '.join(parts)} to the model's dtypes{scaled}"
