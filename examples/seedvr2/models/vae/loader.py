"""Strict loading of VAE weights (``.safetensors``, ``.gguf``, or ``.pth``/``.pt`` read without running pickled code,
see :mod:`..checkpoint_file`). Every tensor is expanded to the module's dtypes: the VAE is convolutions, whose packed
weights would save little (an fp16 VAE is about 500 MB)."""

from __future__ import annotations

import logging
import os
from typing import Callable, Mapping, Optional, Union

import torch
from torch import nn

from ...checkpoints.dtypes import match_model_dtypes
from ...checkpoints.file import read_checkpoint_file
from ...checkpoints.match import check_checkpoint_matches

__all__ = ["load_vae_checkpoint", "check_state_dict"]

StateSource = Union[str, "os.PathLike[str]", Mapping[str, torch.Tensor]]
_LIST_LIMIT = 12
_log = logging.getLogger("examples.seedvr2")


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _LIST_LIMIT else "")


def check_state_dict(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming every missing, unexpected, non-tensor, wrongly shaped or wrongly typed key."""
    expected = module.state_dict()
    not_tensors = sorted(k for k in set(state) & set(expected) if not isinstance(state[k], torch.Tensor))
    if not_tensors:
        raise ValueError(f"checkpoint does not fit {type(module).__name__}: values that are not tensors: "
                         f"{_listing(not_tensors)}")
    # keys, shapes and dtypes: the check every loader shares (one message)
    check_checkpoint_matches({k: (tuple(v.shape), v.dtype) for k, v in expected.items()},
                             {k: (tuple(v.shape), v.dtype) for k, v in state.items()})


def load_vae_checkpoint(
    vae: nn.Module, source: StateSource, *, report: Optional[Callable[[str], None]] = None
) -> nn.Module:
    """Load ``source`` (a file path or a state dict) into ``vae`` strictly and return ``vae``.

    Floating tensors are first cast to the module's dtypes (fp16/bf16 repacks; fp8 with or without per-tensor scales;
    GGUF types decoded, see :mod:`..checkpoint_dtypes`), and ``report`` receives one line saying what was cast (default:
    the ``examples.seedvr2`` logger at INFO). A module built on the meta device (``with torch.device("meta"):``) then
    takes the tensors themselves (``assign=True``: no second copy); a materialised module copies the values.
    """
    if isinstance(source, Mapping):
        state = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        state = read_checkpoint_file(source)
    else:
        raise TypeError(f"source must be a path or a state dict, got {type(source).__name__}")
    state, cast = match_model_dtypes(state, vae, what="VAE checkpoint")
    check_state_dict(vae, state)
    if cast:
        (report or _log.info)(cast)
    on_meta = any(t.is_meta for t in list(vae.parameters()) + list(vae.buffers()))
    vae.load_state_dict(state, strict=True, assign=on_meta)
    return vae
