"""Strict checkpoint loading for :class:`SeedVR2NaDiT`.

Exactly one key rename is applied: the reference stores each block's RoPE table as ``blocks.<i>.attn.rope.rope.freqs``
and this port as ``blocks.<i>.attn.rope.freqs``. After that, any missing, unexpected, shape-mismatched or wrongly typed
key (an integer or bool tensor where a weight belongs) is an error (:mod:`..checkpoint_match`, the check the sharded
loader shares), so a checkpoint that does not match the model cannot reach inference. Files are read by
:mod:`..checkpoint_file` (``.pth``/``.pt`` through ``torch.load(weights_only=True)``, which never runs pickled code).

fp16/bf16 repacks are cast to the model's dtypes; fp8 and GGUF Linear weights stay packed (``weights="stored"``, a
:class:`..quantized_linear.QuantizedLinear` expands each at call time) or are expanded (:mod:`..checkpoint_dtypes`);
the input patch projection ``vid_in.proj`` is always expanded (the model reads its compute dtype from it; it holds
0.01% of the weights).
RoPE frequency buffers stored in half precision are replaced by their exact float32 values (a fixed function of the
config) when they agree to that precision, since rounded frequencies would shift every rotation angle.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Callable, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from ...checkpoints.dtypes import match_model_dtypes
from ...checkpoints.file import read_checkpoint_file, tensor_state
from ...checkpoints.match import check_checkpoint_matches
from ...checkpoints.quantized_linear import PackedWeight, linear_weight_keys, pack_linear_layers
from .rope import RotaryEmbedding3d

__all__ = ["load_dit_checkpoint", "check_dit_keys", "read_state_dict", "normalize_checkpoint_keys",
           "packable_dit_weights"]

_REFERENCE_ROPE_KEY = re.compile(r"^(blocks\.\d+\.attn\.rope)\.rope\.freqs$")
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
# In a truncated 3B checkpoint the model's new (video-only) last block has no text MLP path; these keys have no home.
_TEXT_MLP_PATH = re.compile(r"^blocks\.(\d+)\.(mlp|ada|mlp_norm)\.txt\.")

Source = Union[str, os.PathLike, Mapping[str, Tensor]]
_log = logging.getLogger("examples.seedvr2")
_HALF = (torch.float16, torch.bfloat16)
#: Linear layers never kept packed: the forward reads the compute dtype from this one's weight
_ALWAYS_EXPANDED = ("vid_in.proj",)


def packable_dit_weights(model: nn.Module) -> set[str]:
    """Keys of the DiT weights that may stay packed: every Linear weight but ``vid_in.proj``'s."""
    return linear_weight_keys(model, exclude=_ALWAYS_EXPANDED)


def _short(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def read_state_dict(source: Source) -> dict[str, Tensor]:
    """Tensors of a checkpoint: a ``.safetensors`` / ``.pth`` / ``.pt`` path, or a mapping of name -> tensor."""
    if isinstance(source, (str, os.PathLike)):
        return read_checkpoint_file(source)
    if not isinstance(source, Mapping):
        raise TypeError(f"checkpoint source must be a path or a mapping of tensors, got {type(source).__name__}")
    return tensor_state(source)


def normalize_checkpoint_keys(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename ``blocks.<i>.attn.rope.rope.freqs`` -> ``blocks.<i>.attn.rope.freqs``; nothing else.

    A key already in the port's form is kept as is. Two source keys that would land on one target key raise.
    """
    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    for key, value in state.items():
        match = _REFERENCE_ROPE_KEY.match(key)
        target = f"{match.group(1)}.freqs" if match else key
        if target in out:
            raise ValueError(
                f"checkpoint keys {origin[target]!r} and {key!r} both map to {target!r}; refusing to pick one"
            )
        out[target] = value
        origin[target] = key
    return out


def _drop_extra_blocks(
    state: dict[str, Tensor], num_layers: int, allow_truncated: bool, last_video_only: bool
) -> dict[str, Tensor]:
    block_ids = {int(m.group(1)) for m in map(_BLOCK_KEY.match, state) if m}
    extra = sorted(i for i in block_ids if i >= num_layers)
    if not extra:
        return state
    if not allow_truncated:
        example = next(k for k in sorted(state) if k.startswith(f"blocks.{extra[0]}."))
        raise ValueError(
            f"checkpoint has {max(block_ids) + 1} blocks but the model has {num_layers} (extra blocks "
            f"{extra[0]}..{extra[-1]}, e.g. key {example!r}); pass allow_truncated=True to load only the first "
            f"{num_layers} blocks"
        )
    kept = {}
    for key, value in state.items():
        m = _BLOCK_KEY.match(key)
        if m and int(m.group(1)) >= num_layers:
            continue
        t = _TEXT_MLP_PATH.match(key)
        if last_video_only and t and int(t.group(1)) == num_layers - 1:
            continue  # the truncated model's last block has no text MLP path
        kept[key] = value
    return kept


def _restore_exact_rope(model: nn.Module, state: dict[str, Tensor]) -> int:
    """Replace half-precision RoPE frequency buffers that round the model's exact values; returns how many."""
    restored = 0
    for name, module in model.named_modules():
        key = f"{name}.freqs"
        if isinstance(module, RotaryEmbedding3d) and isinstance(state.get(key), Tensor) and state[key].dtype in _HALF:
            exact = module.exact_frequencies()
            stored = state[key].float()
            if stored.shape == exact.shape and torch.allclose(stored, exact, rtol=1e-2, atol=0):
                state[key] = exact
                restored += 1
    return restored


def check_dit_keys(expected: Mapping[str, tuple], found: Mapping[str, tuple]) -> None:
    """``ValueError`` naming the missing, unexpected, mis-shaped and wrongly typed keys of a checkpoint (``found``:
    key -> (shape, dtype or dtype name), after the key rename) against the model's (``expected``); nothing when they
    agree. The one check of the whole and the sharded loaders (:mod:`..checkpoint_match`)."""
    check_checkpoint_matches(expected, found)


def load_dit_checkpoint(
    model: nn.Module, source: Source, *, allow_truncated: bool = False,
    report: Optional[Callable[[str], None]] = None, weights: str = "stored",
) -> nn.Module:
    """Load a SeedVR2 DiT checkpoint into ``model`` strictly (see the module docstring); returns ``model``.

    ``source`` is a ``.safetensors``/``.pth``/``.pt``/``.gguf`` path or a state dict in the reference or the port
    layout. ``weights`` (``stored``, ``fp8``, ``compute``; see :mod:`..checkpoint_dtypes`) says which Linear layers
    become :class:`..quantized_linear.QuantizedLinear` (their ``.weight`` is then a ``.packed`` buffer). A
    checkpoint with more blocks than the model is refused unless ``allow_truncated`` (then extra blocks are dropped).
    A model built on the meta device receives the checkpoint's tensors directly (``assign=True``), after they are
    cast to its dtypes. ``report`` receives one line saying what was cast, if anything (default: the
    ``examples.seedvr2`` logger at INFO).
    """
    state = normalize_checkpoint_keys(read_state_dict(source))
    num_layers = len(getattr(model, "blocks", ()))
    config = getattr(model, "config", None)
    last_video_only = getattr(config, "last_layer_video_only", True)
    state = _drop_extra_blocks(state, num_layers, allow_truncated, last_video_only)
    exact_rope = _restore_exact_rope(model, state)
    state, cast = match_model_dtypes(state, model, what="DiT checkpoint", packable=packable_dit_weights(model),
                                     weights=weights)
    if exact_rope:
        cast = (cast or "DiT checkpoint: nothing else cast") + f"; {exact_rope} RoPE frequency buffers set to " \
            "their exact float32 values"
    if cast:
        (report or _log.info)(cast)

    expected = model.state_dict()
    check_dit_keys({k: (tuple(v.shape), v.dtype) for k, v in expected.items()},
                   {k: (tuple(v.shape), v.kind if isinstance(v, PackedWeight) else v.dtype) for k, v in state.items()})

    on_meta = any(t.is_meta for t in expected.values())
    packed = {k: v for k, v in state.items() if isinstance(v, PackedWeight)}
    pack_linear_layers(model, packed, state)
    result = model.load_state_dict({k: v for k, v in state.items() if k not in packed}, strict=False,
                                   assign=on_meta)
    stray = set(result.missing_keys) - {k[: -len("weight")] + "packed" for k in packed}
    if stray or result.unexpected_keys:  # the checks above make this unreachable; never run half-loaded
        raise RuntimeError(f"DiT checkpoint left keys unloaded: {_short(stray | set(result.unexpected_keys))}")
    if on_meta:
        for module in model.modules():
            if isinstance(module, RotaryEmbedding3d) and module.freqs.dtype != torch.float32:
                module.freqs = module.freqs.float()  # RoPE frequencies stay float32 (see rope.py)
    return model
