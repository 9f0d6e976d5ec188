"""Strict loading of VAE weights (``.safetensors``, or ``.pth``/``.pt`` read without running pickled code)."""

from __future__ import annotations

import os
import pickle
from typing import Mapping, Union

import torch
from torch import nn

__all__ = ["load_vae_checkpoint", "read_state_dict", "check_state_dict"]

StateSource = Union[str, "os.PathLike[str]", Mapping[str, torch.Tensor]]
_LIST_LIMIT = 12


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file. Pickle files go through ``torch.load(weights_only=True, mmap=True)``,
    which refuses anything but tensors and plain containers, so a crafted file cannot run code."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("reading .safetensors needs the 'safetensors' package (pip install safetensors)") from exc
        return load_file(path, device="cpu")
    if suffix in (".pth", ".pt", ".bin", ".ckpt"):
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"refused to load {path}: it holds more than tensors (torch.load weights_only=True rejected it): {exc}"
            ) from exc
        except RuntimeError as exc:
            raise ValueError(f"could not read {path} as a torch checkpoint: {exc}") from exc
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state dict")
        return dict(loaded)
    raise ValueError(f"unsupported checkpoint format {suffix!r} for {path}; use .safetensors, .pth or .pt")


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _LIST_LIMIT else "")


def check_state_dict(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming every missing, unexpected, non-tensor or wrongly shaped key."""
    expected = module.state_dict()
    problems = []
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    not_tensors = sorted(k for k in set(state) & set(expected) if not isinstance(state[k], torch.Tensor))
    if not_tensors:
        problems.append(f"values that are not tensors: {_listing(not_tensors)}")
    mismatched = sorted(
        f"{k} (checkpoint {list(state[k].shape)}, model {list(expected[k].shape)})"
        for k in set(state) & set(expected)
        if isinstance(state[k], torch.Tensor) and tuple(state[k].shape) != tuple(expected[k].shape)
    )
    if mismatched:
        problems.append(f"shape mismatches: {_listing(mismatched)}")
    if problems:
        raise ValueError(f"checkpoint does not fit {type(module).__name__}: " + "; ".join(problems))


def load_vae_checkpoint(vae: nn.Module, source: StateSource) -> nn.Module:
    """Load ``source`` (a file path or a state dict) into ``vae`` strictly and return ``vae``.

    A module built on the meta device (``with torch.device("meta"):``) takes the checkpoint's tensors
    themselves (``assign=True``: no second copy, dtype and device of the checkpoint); a materialised module
    copies the values into its existing parameters (casting to their dtype).
    """
    if isinstance(source, Mapping):
        state = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        state = read_state_dict(source)
    else:
        raise TypeError(f"source must be a path or a state dict, got {type(source).__name__}")
    check_state_dict(vae, state)
    on_meta = any(t.is_meta for t in list(vae.parameters()) + list(vae.buffers()))
    vae.load_state_dict(state, strict=True, assign=on_meta)
    return vae
