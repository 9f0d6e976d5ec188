"""The restore command's checks before anything is read or built: the output path, the checkpoint files given, the
dtype, and a time estimate for outputs larger than 8K.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

from ..media.geometry import Geometry
from ..media.reading import IMAGE_EXTENSIONS, MediaError, default_output_path, same_file
from ..media.writing import output_kind
from .parser import InputError

#: outputs larger than 8K UHD (7680 x 4320 pixels) are refused without --allow-large-output, with a time estimate
LARGE_OUTPUT_PIXELS = 7680 * 4320


#: restore seconds per megapixel-frame of the working size, fp32, one process on a 2-core CPU (benchmarks/README.md,
#: "The whole restore at P = 2", 2026-12-02): the demo weights' whole restore stage (1280x720 x 9: 62.2 s), and for
#: SeedVR2's weights the VAE alone at its released widths (160x120 x 17: 60.4 s), a floor since the DiT comes on top
CPU_SECONDS_PER_MEGAPIXEL_FRAME = {"demo": 7.5, "released": 185.0}


def _fmt_size(hw: tuple[int, int], frames: int) -> str:
    return f"{hw[1]}x{hw[0]}, {frames} frame{'s' if frames != 1 else ''}"


def _resolve_dtype(name: Optional[str], device: torch.device, demo: bool) -> torch.dtype:
    if name is None:
        name = "bf16" if (device.type == "cuda" and not demo) else "fp32"
    return torch.bfloat16 if name == "bf16" else torch.float32


def resolve_output_path(args: argparse.Namespace) -> str:
    """``-o`` or the default ``<input>_restored.<ext>``; refuses the input itself and, without ``--overwrite``, any
    existing file. Checked before anything is read or run."""
    path = args.output if args.output is not None else default_output_path(args.input)
    if os.path.exists(args.input) and same_file(path, args.input):
        raise MediaError(f"the output {path} is the input {args.input} (same file, or a link to it); "
                         f"choose another -o so the input is not overwritten")
    if os.path.isdir(path):
        raise MediaError(f"output path is a directory: {path}")
    if os.path.lexists(path) and not args.overwrite:
        raise MediaError(f"the output {path} exists; pass --overwrite to replace it, or choose another -o")
    return path


def _default_image_output(args: argparse.Namespace, path: str, is_image: bool) -> str:
    """A default output for an image input whose extension cannot be written (bmp, webp, ...) is a .png."""
    if args.output is None and is_image and os.path.splitext(path)[1].lower() not in IMAGE_EXTENSIONS:
        path = os.path.splitext(path)[0] + ".png"
        if os.path.lexists(path) and not args.overwrite:
            raise MediaError(f"the output {path} exists; pass --overwrite to replace it, or choose another -o")
    return path


def _check_output_path(path: str, num_frames_hint: Optional[int] = None) -> None:
    kind = output_kind(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise MediaError(f"output directory does not exist: {directory}")
    if kind == "image" and num_frames_hint is not None and num_frames_hint > 1:
        raise MediaError(
            f"the input has {num_frames_hint} frames but {path} is an image file; use a video extension (.mp4)"
        )


def _check_shardable(args: argparse.Namespace) -> None:
    """Refuse, before anything is read, a ``--shard-weights`` run whose DiT checkpoint cannot be sharded."""
    from ..weights.footprint import checkpoint_layout
    from ..weights.sharded import check_shardable_checkpoint

    if not os.path.isfile(args.dit_checkpoint):
        return  # the loader names the missing file
    try:
        layout = checkpoint_layout(args.dit_checkpoint)
    except Exception:  # noqa: BLE001 - an unreadable header is reported by the loader, with its reason
        return
    try:
        check_shardable_checkpoint(args.dit_checkpoint, layout, getattr(args, "weights", "stored"))
    except ValueError as exc:
        raise InputError(str(exc)) from None


#: key prefixes of which a SeedVR2 checkpoint of each kind has at least one
_CHECKPOINT_KEYS = {"DiT": ("blocks.", "vid_in."), "VAE": ("encoder.", "decoder.")}


def _check_checkpoint_files(args: argparse.Namespace) -> None:
    """One line for a checkpoint path that is missing or a folder, before the memory plan (whose notes would come
    first) and before any weight is read."""
    found = getattr(args, "found_weights", False)  # discovered, not given: name the files, not the flags
    for flag, path in ((("the DiT weights" if found else "--dit-checkpoint"), args.dit_checkpoint),
                       (("the VAE weights" if found else "--vae-checkpoint"), args.vae_checkpoint)):
        if os.path.isdir(path):
            raise InputError(f"{flag}: {path} is a directory, not a checkpoint file")
        if not os.path.isfile(path):
            raise InputError(f"{flag}: file not found: {path}")


def _check_given_checkpoints(args: argparse.Namespace) -> None:
    """Raise :class:`InputError` for a ``--dit-checkpoint`` / ``--vae-checkpoint`` the user gave that cannot be a
    SeedVR2 checkpoint of that kind: missing, unreadable, or without any of its keys (the file's header only)."""
    from ..weights.footprint import checkpoint_layout

    for flag, path, what in (("--dit-checkpoint", args.dit_checkpoint, "DiT"),
                             ("--vae-checkpoint", args.vae_checkpoint, "VAE")):
        if path is None:
            continue
        if os.path.isdir(path):
            raise InputError(f"{flag}: {path} is a directory, not a checkpoint file")
        if not os.path.isfile(path):
            raise InputError(f"{flag}: file not found: {path}")
        try:
            keys = list(checkpoint_layout(path))
        except ValueError as exc:
            if "mmap" in str(exc):  # torch's legacy .pth format: no header to read without loading it all
                continue
            raise InputError(f"{flag} {path}: {exc}") from None
        if not any(key.startswith(_CHECKPOINT_KEYS[what]) for key in keys):
            example = f", e.g. {keys[0]!r}," if keys else ""
            raise InputError(f"{flag} {path}: not a SeedVR2 {what} checkpoint (none of its {len(keys)} "
                             f"tensors{example} is under {' or '.join(k + '*' for k in _CHECKPOINT_KEYS[what])})")


def _txt_in_dim(model: Optional[str], demo: bool) -> int:
    """The width of the prompt embedding the DiT a run builds expects."""
    if demo:
        from ..models.demo import DEMO_DIT_CONFIGS

        return DEMO_DIT_CONFIGS[model or "3b"].txt_in_dim
    from ..models.dit import NaDiTConfig

    return NaDiTConfig.released(model or "3b").txt_in_dim


def estimate_restore_time(geometry: Geometry, frames: int, demo: bool, device: torch.device) -> str:
    """An up-front estimate of the restore stage's time for a message, from :data:`CPU_SECONDS_PER_MEGAPIXEL_FRAME`
    (one 2-core CPU process; more cores or ranks go faster); no figure for a GPU, where none was measured yet."""
    from .progress import format_seconds

    if device.type != "cpu":
        return f"no {device.type} speed has been measured yet to estimate its time; expect long and much memory"
    megapixel_frames = geometry.work[0] * geometry.work[1] * frames / 1e6
    seconds = megapixel_frames * CPU_SECONDS_PER_MEGAPIXEL_FRAME["demo" if demo else "released"]
    return (f"at the speed measured on a 2-core CPU its restore takes {'about' if demo else 'at least'} "
            f"{format_seconds(seconds)} ({megapixel_frames:.1f} megapixel-frames)")
