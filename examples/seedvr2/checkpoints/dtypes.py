"""Bringing a checkpoint's tensors to the model's dtypes: fp16/bf16 repacks cast, fp8 and GGUF kept packed or expanded.

Users mostly hold community repacks of the SeedVR2 weights (fp16/bf16 DiTs of about 6.8 GB (3B) and 16.5 GB (7B), an
fp16 VAE of about 500 MB, fp8 and GGUF DiTs) rather than the fp32 release. The DiT and VAE loaders call
:func:`match_model_dtypes` after reading a file: every floating tensor whose dtype differs from the model's entry for
that key is cast to it, and what was cast is summarised in one line.

fp8 (``float8_e4m3fn`` / ``float8_e5m2``) tensors mean stored value x scale. The scale is the per-tensor one stored
beside them (``<name>.scale_weight``, the ComfyUI "scaled fp8" layout, or ``<name>_scale``, e.g. ``weight_scale``)
or, without one, 1: the plain fp8 repacks (``seedvr2_ema_3b_fp8_e4m3fn.safetensors``) are the weights cast directly.
A scale under another name is left over and the strict loader names it, so a scaled file is never read as plain.

``weights`` chooses what becomes of the Linear weights named in ``packable`` (the DiT passes its Linear layers):
``stored`` keeps fp8 and GGUF-quantised ones in their stored form (:class:`~.quantized_linear.PackedWeight`, expanded
per layer at call time) and casts the rest; ``fp8`` also converts the wider ones (fp16/bf16/fp32) to float8_e4m3fn
with a per-tensor scale; ``compute`` expands everything to the model's dtypes at load (the most memory, no per-call
expansion). Tensors not in ``packable`` are always expanded.
"""

from __future__ import annotations

from collections import Counter
from typing import Collection, Mapping, Optional

import torch

from .quantized_linear import PackedWeight, to_fp8

__all__ = ["FP8_DTYPES", "WEIGHT_MODES", "match_model_dtypes", "dtype_name"]

#: what ``--weights`` may ask of the packable (Linear) weights, see the module docstring
WEIGHT_MODES = ("stored", "fp8", "compute")

FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                     "float8_e5m2fnuz") if hasattr(torch, name))
#: keys some fp8 repacks add that are not model tensors (a format marker)
_FP8_MARKERS = ("scaled_fp8",)
_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``/``fp16``/``bf16``/``fp64`` or torch's own name (``float8_e4m3fn``)."""
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def _describe(value) -> str:
    if isinstance(value, PackedWeight):
        return value.describe()
    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)}, {dtype_name(value.dtype)}"
    return type(value).__name__


def _is_fp8(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in FP8_DTYPES


def _scale_keys(key: str) -> tuple[str, ...]:
    stem, _, leaf = key.rpartition(".")
    return (f"{stem}.scale_{leaf}" if stem else f"scale_{leaf}", f"{key}_scale")


def _pack_fp8(state: dict, expected: Mapping[str, torch.Tensor], what: str) -> tuple[dict, int, int]:
    """Turn every fp8 model tensor into a :class:`PackedWeight` with its scale (1 when none is stored) and drop the
    scale/marker entries; returns the state and how many tensors had a scale and how many had none."""
    fp8 = sorted(k for k, v in state.items() if _is_fp8(v) and k in expected)
    used = set()
    scaled = 0
    for key in fp8:
        scale_key = next((s for s in _scale_keys(key) if s in state), None)
        scale = 1.0
        if scale_key is not None:
            value = state[scale_key]
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
                raise ValueError(
                    f"{what}: scale {scale_key!r} of fp8 tensor {key!r} is not one floating-point number "
                    f"({_describe(value)}); only one scale per tensor is supported"
                )
            scale = float(value.float().reshape(()))
            used.add(scale_key)
            scaled += 1
        state[key] = PackedWeight.from_fp8(state[key], scale)
    if fp8:  # scales and the format marker are no model tensors (anything else left over, the strict loader names)
        for key in list(used) + [k for k in _FP8_MARKERS if k in state]:
            if key not in expected:
                del state[key]
    return state, scaled, len(fp8) - scaled


def _plural(n: int, word: str = "tensor") -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def match_model_dtypes(
    state: Mapping[str, torch.Tensor], model: torch.nn.Module, *, what: str = "checkpoint",
    packable: Collection[str] = (), weights: str = "compute",
) -> tuple[dict, Optional[str]]:
    """``state`` with every floating tensor in the dtype of the model's entry of the same key (or, for ``packable``
    keys, packed as ``weights`` asks: see the module docstring), and a one-line summary of what changed (None when
    nothing did).

    Keys the model does not have are left alone (the strict loader reports them). Integer and bool tensors are never
    cast. A model built on the meta device has dtypes too: build it in the compute dtype (``.to(torch.bfloat16)`` on
    meta) to keep a bf16 checkpoint in bf16 instead of casting it up and back down.
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    expected = model.state_dict()
    origin = {k: (v.kind if isinstance(v, PackedWeight) else dtype_name(v.dtype)) for k, v in state.items()
              if isinstance(v, (torch.Tensor, PackedWeight))}
    state, scaled, plain = _pack_fp8(dict(state), expected, what)
    keep = set(packable) if weights != "compute" else set()
    casts: Counter = Counter()
    kept: Counter = Counter()
    for key, value in state.items():
        target = expected.get(key)
        if target is None or not target.is_floating_point():
            continue
        if isinstance(value, PackedWeight):
            if key in keep:
                kept[value.kind] += 1
                continue
            state[key] = value.dequantize(torch.float32).to(target.dtype)
            casts[(origin[key], dtype_name(target.dtype))] += 1
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            if weights == "fp8" and key in keep:
                state[key] = to_fp8(value)
                kept[f"{origin[key]} -> float8_e4m3fn"] += 1
            elif value.dtype != target.dtype:
                casts[(origin[key], dtype_name(target.dtype))] += 1
                state[key] = value.to(target.dtype)
    parts = [f"cast {', '.join(f'{_plural(n)} {a} -> {b}' for (a, b), n in casts.most_common())} to the model's dtypes"
             ] if casts else []
    if kept:
        parts.append(f"kept {sum(kept.values())} Linear weights packed "
                     f"({', '.join(f'{n} {k}' for k, n in kept.most_common())}), expanded per layer at call time")
    if scaled or plain:
        notes = ([f"{_plural(scaled, 'fp8 tensor')} with their per-tensor scales"] if scaled else []) + \
                ([f"{_plural(plain, 'fp8 tensor')} without scales (value as stored)"] if plain else [])
        parts.append(" and ".join(notes))
    if not parts:
        return state, None
    return state, f"{what}: " + "; ".join(parts)
