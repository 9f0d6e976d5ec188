"""The load stage's models: the DiT and VAE from their checkpoints (or the demo weights) and the text embeddings.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from ..checkpoints.file import read_error_reason
from .parser import DEFAULT_TEXT_EMBEDS, InputError


@dataclass
class LoadedModels:
    dit: torch.nn.Module
    vae: torch.nn.Module
    txt: torch.Tensor
    demo: bool


def _read_text_embeds(path: str, txt_in_dim: int) -> torch.Tensor:
    """``[L, txt_in_dim]`` prompt embedding from a safetensors file (key ``pos``, or its only tensor) or a .pt/.pth:
    string keys, a finite real floating-point tensor (else one line naming the file and what is wrong)."""
    if os.path.isdir(path):
        raise InputError(f"text embeddings {path} is a directory, not a file")
    if not os.path.isfile(path):
        raise InputError(f"text embeddings file not found: {path}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(path)
        else:
            import pickle
            import warnings

            try:
                with warnings.catch_warnings():  # torch warns about a raw pickle's protocol: the error says it all
                    warnings.simplefilter("ignore")
                    loaded = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:
                raise InputError(f"refused to read text embeddings {path}: it is not a plain tensor file (reading it "
                                 f"would need to run pickled code, which is never done, or it is damaged)") from None
            tensors = loaded if isinstance(loaded, dict) else {"pos": loaded}
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - any read failure is the file's fault, reported in one line
        kind = "safetensors" if path.endswith(".safetensors") else "torch (.pt/.pth)"
        raise InputError(f"text embeddings {path} is not a readable {kind} file ({read_error_reason(exc)})") from None
    odd = [k for k in tensors if not isinstance(k, str)]
    if odd:
        raise InputError(f"text embeddings {path} has keys that are not strings ({', '.join(map(repr, odd[:3]))}); "
                         f"it must map names to tensors (key 'pos')")
    if "pos" in tensors:
        txt = tensors["pos"]
    elif len(tensors) == 1:
        txt = next(iter(tensors.values()))
    else:
        raise InputError(f"text embeddings {path} has no 'pos' tensor (keys: {sorted(tensors)})")
    if not isinstance(txt, torch.Tensor) or txt.dim() != 2 or txt.shape[1] != txt_in_dim or txt.shape[0] < 1:
        shape = list(txt.shape) if isinstance(txt, torch.Tensor) else type(txt).__name__
        raise InputError(f"text embeddings {path} must be [tokens, {txt_in_dim}] for this DiT, got {shape}")
    if not txt.is_floating_point():
        raise InputError(f"text embeddings {path} must be a real floating-point tensor, got {txt.dtype}")
    finite = torch.isfinite(txt)
    if not bool(finite.all()):
        raise InputError(f"text embeddings {path} has {int((~finite).sum())} non-finite values (NaN or inf) of "
                         f"{txt.numel()}")
    return txt.float()


def load_models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, report=None,
                group=None) -> LoadedModels:
    """The released models from the two checkpoints, or the embedded demo models when neither is given.

    ``report`` receives the loaders' one-line notes (what a half-precision checkpoint was cast to). With
    ``--shard-weights`` each rank of the SP ``group`` reads only its chunk of the DiT's blocks."""
    if (args.dit_checkpoint is None) != (args.vae_checkpoint is None):
        given, missing = (("--dit-checkpoint", "--vae-checkpoint") if args.vae_checkpoint is None
                          else ("--vae-checkpoint", "--dit-checkpoint"))
        raise InputError(f"{given} was given without {missing}; give both checkpoints, or neither for the demo weights")
    if args.dit_checkpoint is None:
        from ..models.demo import demo_models, demo_text_embeds

        dit, vae = demo_models(device, dtype, model=args.model or "3b")
        txt = _read_text_embeds(args.text_embeds, dit.config.txt_in_dim) if args.text_embeds else demo_text_embeds()
        return LoadedModels(dit, vae, txt, demo=True)

    from ..models.dit import load_dit_checkpoint
    from ..models.vae import load_vae_checkpoint
    from ..restore.pipeline import released_models_on_meta

    found = getattr(args, "found_weights", False)  # discovered, not given: name the files, not the flags
    dit_flag, vae_flag = ("the DiT weights", "the VAE weights") if found else ("--dit-checkpoint", "--vae-checkpoint")
    for flag, path in ((dit_flag, args.dit_checkpoint), (vae_flag, args.vae_checkpoint)):
        if os.path.isdir(path):
            raise InputError(f"{flag}: {path} is a directory, not a checkpoint file")
        if not os.path.isfile(path):
            raise InputError(f"{flag}: file not found: {path}")
    dit, vae = released_models_on_meta(args.model or "3b", dtype)
    weights = {"weights": getattr(args, "weights", "stored")}
    dit_loader = load_dit_checkpoint
    if getattr(args, "shard_weights", False):
        from ..weights.sharded import load_sharded_dit

        weights["device"] = device
        dit_loader = lambda model, path, **options: load_sharded_dit(model, path, group, **options)  # noqa: E731
    for flag, loader, model, path, options in (
            (dit_flag, dit_loader, dit, args.dit_checkpoint, weights),
            (vae_flag, load_vae_checkpoint, vae, args.vae_checkpoint, {})):
        try:
            loader(model, path, report=report, **options)
        except (ValueError, OSError) as exc:  # the loaders report every checkpoint problem as one of these
            raise InputError(f"{flag} {path}: {exc}") from None
    txt = _read_text_embeds(args.text_embeds or DEFAULT_TEXT_EMBEDS, dit.config.txt_in_dim)
    return LoadedModels(dit.to(device=device, dtype=dtype).eval(), vae.to(device=device, dtype=dtype).eval(), txt,
                        demo=False)
