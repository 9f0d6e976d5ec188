"""The restore's memory plan: the settings that fit the usable memory (or a refusal that says what would fit), and
out-of-memory errors and peak figures as the command reports them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

import torch

from ..media.geometry import Geometry
from ..restore.temporal import DEFAULT_BATCH_FRAMES, DEFAULT_OVERLAP, check_batching
from .parser import InputError


def _gib(n: float) -> str:
    """A size for messages: GiB with one decimal, MiB under 1 GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class OutOfMemory(InputError):
    """The request does not fit the memory this rank may use (refused up front, or an allocation failed)."""


#: what helps when memory runs short, in the order a user should try them
_MEMORY_HELP = ("--vae-parallel tiled with a smaller --vae-tile", "a smaller --batch-frames",
                "more ranks (--ranks N: --vae-parallel height shares the VAE)", "a smaller --resolution")


def pinned_settings(args: argparse.Namespace):
    """The memory-relevant settings the user fixed (the others are chosen by :func:`plan_memory`), checked."""
    from ..memory.fit import PinnedSettings

    if args.vae_tile is not None:
        if args.vae_parallel not in (None, "tiled"):
            raise InputError(f"--vae-tile is the tile size of --vae-parallel tiled; it cannot go with "
                             f"--vae-parallel {args.vae_parallel}")
        if args.vae_tile < 16 or args.vae_tile % 8:
            raise InputError(f"--vae-tile must be a multiple of 8 pixels, at least 16, got {args.vae_tile}")
    try:
        if args.batch_frames is not None:
            check_batching(args.batch_frames, 0)
        if args.overlap is not None:
            check_batching(args.batch_frames if args.batch_frames is not None else DEFAULT_BATCH_FRAMES, args.overlap)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return PinnedSettings(batch_frames=args.batch_frames, overlap=args.overlap,
                          vae_parallel="tiled" if args.vae_tile is not None else args.vae_parallel,
                          vae_tile=args.vae_tile)


@dataclass
class MemoryPlan:
    """The settings a run uses, their estimated need per rank, the memory limit seen, and why they were chosen."""

    settings: object  # memory_fit.RunSettings
    need: Optional[int]
    limit: object  # memory_limits.MemoryLimit
    reason: str
    warning: Optional[str] = None  # set when memory forced a setting that changes the output

    def summary(self) -> str:
        return f"memory: {self.reason}"


def _model_sizes(args: argparse.Namespace, demo: bool, dtype: torch.dtype = torch.float32,
                 shard_parts: Optional[int] = None) -> tuple[int, int, int]:
    """(first VAE level channels, DiT width, resident weight bytes in ``dtype``) of the models a run will load; with
    ``shard_parts``, the DiT's blocks sharded over that many ranks."""
    if demo:
        from ..models.demo import DEMO_DIT_CONFIGS, demo_vae_config

        try:
            vae_config = demo_vae_config()
        except ValueError as error:
            raise InputError(str(error)) from None
        return vae_config["block_out_channels"][0], DEMO_DIT_CONFIGS[args.model or "3b"].vid_dim, 0
    from ..models.dit import NaDiTConfig
    from ..models.vae import VideoVAEConfig
    from ..weights.footprint import run_weight_bytes

    weights = run_weight_bytes(args.model or "3b", args.dit_checkpoint, args.vae_checkpoint, compute_dtype=dtype,
                               weights=getattr(args, "weights", "stored"), shard_parts=shard_parts)
    return VideoVAEConfig.seedvr2().block_out_channels[0], NaDiTConfig.released(args.model or "3b").vid_dim, weights


def plan_memory(args: argparse.Namespace, pinned, geometry: Geometry, num_frames: int, dtype: torch.dtype,
                sp_size: int, device: torch.device, demo: bool, limit=None, *,
                weights_loaded: bool = False) -> MemoryPlan:
    """Choose the fastest settings whose estimated peak fits the memory this rank may use (see
    :mod:`~examples.seedvr2.memory.fit`).

    Raises :class:`OutOfMemory` (before anything is allocated) when pinned settings do not fit, naming settings that
    would, or when nothing fits; when fp32 was chosen by default (the CPU's) and bf16 would fit, it says so.
    """
    try:
        return _plan_memory(args, pinned, geometry, num_frames, dtype, sp_size, device, demo, limit,
                            weights_loaded=weights_loaded)
    except OutOfMemory as exc:
        if getattr(args, "dtype", None) is not None or dtype != torch.float32 or demo:
            raise
        try:
            half = _plan_memory(argparse.Namespace(**{**vars(args), "dtype": "bf16"}), pinned, geometry, num_frames,
                                torch.bfloat16, sp_size, device, demo, limit, weights_loaded=weights_loaded)
        except OutOfMemory:
            raise exc from None
        raise OutOfMemory(f"{exc}; or add --dtype bf16, which fits (about {_gib(half.need or 0)} per rank): without "
                          f"--dtype this {device.type} run computes in fp32, which doubles the memory of bf16 "
                          f"weights and activations") from None


def _plan_memory(args: argparse.Namespace, pinned, geometry: Geometry, num_frames: int, dtype: torch.dtype,
                 sp_size: int, device: torch.device, demo: bool, limit=None, *,
                 weights_loaded: bool = False) -> MemoryPlan:
    from ..memory.estimate import estimate_restore_bytes
    from ..memory.fit import candidate_settings, fit_settings, tile_overlap
    from ..memory.limits import usable_memory

    sharded = getattr(args, "shard_weights", False)
    vae_channels, dit_width, weights = _model_sizes(args, demo, dtype, sp_size if sharded else None)
    if weights_loaded:  # already held (an earlier file of a batch): the usable memory left them out
        weights = 0
    height, width = geometry.work

    def need(settings) -> int:
        tile = settings.vae_tile
        estimate = estimate_restore_bytes(
            frames=min(settings.batch_frames, num_frames), height=height, width=width, vae_channels=vae_channels,
            dit_width=dit_width, element_bytes=torch.finfo(dtype).bits // 8, vae_parallel=settings.vae_parallel,
            sp_size=sp_size, tile=None if tile is None else (tile, tile),
            tile_overlap=None if tile is None else tile_overlap(tile))
        return estimate.total + weights

    def candidates(p):
        return candidate_settings(num_frames, height // 8, sp_size, p, default_batch=DEFAULT_BATCH_FRAMES,
                                  default_overlap=DEFAULT_OVERLAP, frame_size=(height, width))

    limit = usable_memory(device) if limit is None else limit
    fit = fit_settings(candidates, pinned, need, limit.usable)
    where = f"{num_frames} frame{'s' if num_frames != 1 else ''} at {width}x{height}"
    if fit.chosen is None and not sharded and not demo and limit.usable is not None:
        _suggest_sharding(args, dtype, sp_size, weights, fit, limit, where)
    if fit.chosen is None:
        if fit.suggestion is not None:
            raise OutOfMemory(
                f"{fit.first.describe()} needs about {_gib(fit.first_need)} per rank for {where} but "
                f"{limit.describe()} is usable; {fit.suggestion.flags()} would fit (about "
                f"{_gib(fit.suggestion_need)}), or leave those flags out to let it choose")
        raise OutOfMemory(
            f"nothing fits: {'no settings allowed by the flags given' if pinned.anything else 'no settings'} fit the "
            f"{limit.describe()} usable per rank for {where} (the fastest needs about {_gib(fit.first_need)}, the "
            f"most frugal about {_gib(fit.smallest_need)}); try {', '.join(_MEMORY_HELP[2:])}")
    if limit.usable is None:
        reason = f"estimate {_gib(fit.need)} per rank (no memory limit could be read)"
    else:
        reason = f"estimate {_gib(fit.need)} of {limit.describe()} usable per rank"
    warning = None
    if fit.changed:
        reason = (f"chose {fit.chosen.describe()} because {fit.first.describe()} needs about {_gib(fit.first_need)}; "
                  + reason)
        warning = _output_changes(fit.first, fit.chosen, fit.first_need, limit)
    return MemoryPlan(fit.chosen, fit.need, limit, reason, warning)


def _output_changes(first, chosen, first_need: int, limit) -> Optional[str]:
    """The loud line for settings chosen to fit that change the output (shorter batches, less overlap, tiles); None
    when the change keeps the output (one exact VAE mode for another)."""
    changes = []
    if chosen.batch_frames != first.batch_frames:
        changes.append(f"temporal batches of {chosen.batch_frames} frames instead of {first.batch_frames}")
    if chosen.overlap != first.overlap:
        changes.append(f"an overlap of {chosen.overlap} frames instead of {first.overlap}")
    if chosen.vae_parallel == "tiled" and first.vae_parallel != "tiled":
        changes.append(f"the VAE in {chosen.vae_tile}px tiles (approximate)")
    if not changes:
        return None
    return (f"WARNING: to fit the {limit.describe()} usable per rank this run uses {' and '.join(changes)}, which "
            f"CHANGES THE OUTPUT (the exact settings need about {_gib(first_need)} per rank); free memory, use more "
            f"ranks (--ranks N), or a smaller --resolution to avoid it")


def _suggest_sharding(args: argparse.Namespace, dtype: torch.dtype, sp_size: int, weights: int, fit, limit,
                      where: str) -> None:
    """Raise :class:`OutOfMemory` recommending ``--shard-weights`` when whole weights are what does not fit: the
    most frugal settings fit once the DiT's blocks are split over the SP group (over 2 ranks when it has one)."""
    parts = max(sp_size, 2)
    sharded = _model_sizes(args, False, dtype, parts)[2]
    if fit.smallest_need - weights + sharded > limit.usable:
        return
    how = (f"add --shard-weights (the DiT's blocks split over the {sp_size} ranks of the SP group)" if sp_size > 1
           else "run 2 or more ranks (torchrun --nproc-per-node 2) with --shard-weights")
    raise OutOfMemory(
        f"the weights do not fit: every rank holds all {_gib(weights)} of them and needs about "
        f"{_gib(fit.smallest_need)} for {where} in the most frugal settings, but {limit.describe()} is usable; "
        f"{how}: each rank then holds about {_gib(sharded)} of weights and needs about "
        f"{_gib(fit.smallest_need - weights + sharded)}")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: torch's (CPU allocator, CUDA) or Python's/numpy's MemoryError."""
    if isinstance(exc, MemoryError) or isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("DefaultCPUAllocator" in text or "can't allocate memory" in text
                                              or "out of memory" in text.lower())


def out_of_memory_error(exc: BaseException, memory: Optional[MemoryPlan], device: torch.device) -> OutOfMemory:
    """The one-line error for an allocation that failed although the estimate fitted."""
    detail = " ".join(str(exc).split())
    detail = detail.split("DefaultCPUAllocator: ")[-1].split(" (Triggered internally")[0][:160]
    if memory is None:
        seen = "before the memory plan was made"
    else:
        seen = (f"the estimate was {_gib(memory.need or 0)} per rank ({memory.settings.describe()}) with "
                f"{memory.limit.describe()} usable")
    return OutOfMemory(f"out of memory on {device.type} ({detail}); {seen}; try {', '.join(_MEMORY_HELP)}")


def _peak_memory(device: torch.device) -> tuple[float, str]:
    """This process's peak memory so far: GPU memory allocated by torch on CUDA, else the peak resident set."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "peak GPU memory"
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak RSS"


def _per_rank_figures(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (one row per rank), through winsp's world group (one collective)."""
    from winsp.comm.group import SPGroup

    world = SPGroup.world()
    row = torch.tensor([values], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    return world.all_gather_rows(row, [1] * world.size).cpu().tolist()
