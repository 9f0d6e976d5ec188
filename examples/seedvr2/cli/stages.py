"""The restore command's stages, as its progress line shows them; :func:`~examples.seedvr2.cli.restore.run_restore`
runs them in order.

- read: every cheap check (:func:`_prepare`: the input read once, nothing built), the ranks' agreement to start, the
  memory plan;
- load: the DiT and VAE from their checkpoints (or the demo weights), the text embeddings, the pipeline;
- restore: each group's temporal batches, decoded on a thread as the one before is restored;
- write: the writer cross-fades and encodes the batches in order; then :func:`finish` gathers the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoints.file import read_error_reason
from ..media.geometry import Geometry, check_scale, frames_to_model, model_to_frames, parse_resolution, plan_geometry
from ..media.reading import MediaError
from ..media.writing import check_output_directory, h264_frame_size, output_kind
from ..weights.discovery import WeightsError, how_to_get_weights, resolve_cli_weights
from .agreement import Launch, RunState, _open_kept_batches, agree_loaded, agree_to_start
from .checks import (
    LARGE_OUTPUT_PIXELS,
    _check_checkpoint_files,
    _check_given_checkpoints,
    _check_output_path,
    _check_shardable,
    _default_image_output,
    _resolve_dtype,
    _txt_in_dim,
    estimate_restore_time,
    resolve_output_path,
)
from .memory_plan import (
    MemoryPlan,
    _peak_memory,
    _per_rank_figures,
    is_out_of_memory,
    out_of_memory_error,
    pinned_settings,
    plan_memory,
)
from .parser import DEFAULT_TEXT_EMBEDS, PROG, InputError
from .progress import StageProgress

#: a run projected (at the first batch's measured speed) to take longer than this is announced in one line
LONG_RUN_S = 600.0


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


def _prepare(args: argparse.Namespace, launch: Launch, progress: StageProgress) -> tuple:
    """The checks and reads before the run, identical on every rank (no collective): the settings the user pinned,
    the SP size, the output path (and, on the writing rank, that its directory takes a new file), demo or not, dtype,
    colour fix, the input's description, the geometry, and notes for the user (a --batch-frames clamped to the clip).
    Nothing is read before the options and the output are checked."""
    from ..media.reading import probe_media
    from ..restore.pipeline import causal_frame_count

    if isinstance(args.input, (list, tuple)):  # parse_args' list, for callers of run_restore (main splits a batch)
        if len(args.input) != 1:
            raise InputError(f"run_restore restores one file; got {len(args.input)} (main() runs a batch)")
        args.input = args.input[0]
    resolution = parse_resolution(args.resolution) if args.resolution is not None else None
    if args.scale is not None:
        check_scale(args.scale)  # the number itself; the size it gives is checked against the input below
    pinned = pinned_settings(args)
    if getattr(args, "shard_weights", False) and getattr(args, "weights", "stored") == "fp8":
        raise InputError("--shard-weights cannot go with --weights fp8 (the fp8 conversion scales each weight by its "
                         "whole tensor's maximum, which a rank holding a shard never reads); use --weights stored")
    sp_size = launch.world_size if args.sp_size is None else args.sp_size
    if sp_size < 1 or launch.world_size % sp_size:
        raise InputError(
            f"--sp-size {sp_size}: the world size {launch.world_size} must be a positive multiple of it (run "
            f"--ranks with a multiple of {max(sp_size, 1)}, or choose an --sp-size dividing "
            f"{launch.world_size})"
        )
    output = resolve_output_path(args)
    _check_output_path(output)
    if launch.rank == 0:  # the writer: the only rank whose file system must take the output
        check_output_directory(output)
    notes = []
    try:
        weights_line = resolve_cli_weights(args)
    except WeightsError as exc:
        _check_given_checkpoints(args)  # a given file that cannot be what it is given as is the real cause
        raise InputError(str(exc)) from None
    if weights_line is not None:
        notes.append(weights_line)
    demo = args.dit_checkpoint is None and args.vae_checkpoint is None
    if not demo:
        _check_checkpoint_files(args)
    if args.text_embeds:  # read again at load; checked now so that a bad file is said before any slow work
        _read_text_embeds(args.text_embeds, _txt_in_dim(args.model, demo))
    if getattr(args, "shard_weights", False) and args.dit_checkpoint is not None:
        _check_shardable(args)
    dtype = _resolve_dtype(args.dtype, launch.device, demo)
    color_fix = args.color_fix or ("none" if demo else "wavelet")

    progress.start("read")
    info = probe_media(args.input, allow_partial=args.allow_partial_input)
    output = _default_image_output(args, output, info.is_image)
    _check_output_path(output, info.num_frames)
    geometry: Geometry = plan_geometry((info.height, info.width), resolution=resolution, scale=args.scale)
    if geometry.output[0] * geometry.output[1] > LARGE_OUTPUT_PIXELS and not getattr(args, "allow_large_output", False):
        raise InputError(
            f"the output would be {geometry.output[1]}x{geometry.output[0]}, larger than 8K UHD (7680x4320): "
            f"{estimate_restore_time(geometry, info.num_frames, demo, launch.device)}; pass --allow-large-output to "
            f"run it, or choose a smaller --scale or --resolution")
    latent_rows = geometry.work[0] // 8
    if pinned.vae_parallel == "height" and sp_size > latent_rows:
        raise InputError(
            f"--vae-parallel height needs at least one latent row (8 pixels) per rank: the working height "
            f"{geometry.work[0]} has {latent_rows} rows for {sp_size} ranks; use --vae-parallel replicated"
        )
    whole = causal_frame_count(info.num_frames)
    if pinned.batch_frames is not None and pinned.batch_frames > whole:
        frames = f"{info.num_frames} frame{'s' if info.num_frames != 1 else ''}"
        notes.append(f"note: --batch-frames {pinned.batch_frames} is longer than the clip ({frames}): one batch of "
                     f"{frames}" + (f" (--batch-frames {whole})" if whole != info.num_frames else ""))
        pinned = dataclasses.replace(pinned, batch_frames=whole,
                                     overlap=None if pinned.overlap is None else min(pinned.overlap, whole - 1))
    return pinned, sp_size, output, demo, dtype, color_fix, info, geometry, tuple(notes)


@dataclass
class ReadStage:
    """What the read stage settled, on every rank alike: the input, the output, and the memory plan's settings."""

    output: str
    demo: bool
    dtype: torch.dtype
    color_fix: str
    info: Any  # a MediaInfo
    geometry: Geometry
    sp_size: int
    memory: MemoryPlan
    plan: list  # the temporal batches
    is_video_out: bool
    kept: Any  # resume hook (issue 48): the kept batches (a restore.kept_batches.KeptBatches), agreed by every rank

    @property
    def settings(self):
        return self.memory.settings


def read_stage(args: argparse.Namespace, launch: Launch, progress: StageProgress, state: RunState) -> ReadStage:
    """Read: check everything cheap (the input read once), agree with the other ranks to start, plan the memory."""
    from ..memory.limits import usable_memory
    from ..restore.temporal import plan_temporal_batches

    # Everything cheap to check is checked before anything is read or any model built, identically on every rank;
    # then the ranks meet once (the only collective before the run) and agree to start, or all stop.
    try:
        prepared = _prepare(args, launch, progress)
        error = None
    except (MediaError, InputError) as exc:
        prepared, error = None, exc
    except Exception as exc:  # noqa: BLE001 - an allocation failure while reading is reported like any other
        if not is_out_of_memory(exc):
            raise
        prepared, error = None, out_of_memory_error(exc, None, launch.device)
    limit = agree_to_start(usable_memory(launch.device), error, launch, state)
    pinned, sp_size, output, demo, dtype, color_fix, info, geometry, notes = prepared
    is_rank0 = launch.rank == 0
    memory = plan_memory(args, pinned, geometry, info.num_frames, dtype, sp_size, launch.device, demo, limit,
                         weights_loaded=state.models is not None)
    state.memory = memory
    settings = memory.settings
    plan = plan_temporal_batches(info.num_frames, settings.batch_frames, settings.overlap)
    is_video_out = output_kind(output) == "video"
    if is_rank0:
        for note in info.notes + notes:
            progress.note(f"{PROG}: {note}")
        if memory.warning is not None:
            progress.note(f"{PROG}: {memory.warning}")
        elif memory.reason.startswith("chose"):  # an exact setting instead of a faster one: said, quietly
            progress.note(f"{PROG}: note: memory: {memory.reason}")
        if geometry.output[0] * geometry.output[1] > LARGE_OUTPUT_PIXELS:
            progress.note(f"{PROG}: note: the output is {geometry.output[1]}x{geometry.output[0]}, larger than 8K "
                          f"(7680x4320): {estimate_restore_time(geometry, info.num_frames, demo, launch.device)}")
        coded = h264_frame_size(*geometry.output)
        if is_video_out and coded != geometry.output:
            progress.note(
                f"{PROG}: note: {geometry.output[1]}x{geometry.output[0]} has an odd side; H.264 yuv420p (what "
                f"players accept) needs even sides, so it is written as {coded[1]}x{coded[0]} with the edge "
                f"repeated (use --resolution with even sides to avoid this)"
            )
    # ---- resume hook (issue 48): the kept batches decide where this run starts; every rank agrees before the load
    kept = _open_kept_batches(args, launch, progress, state, output, settings, plan, geometry, info, dtype, color_fix,
                              sp_size, demo)
    if state.on_resume is not None and is_rank0:
        state.on_resume(kept.resume.frames, info.num_frames)
    return ReadStage(output, demo, dtype, color_fix, info, geometry, sp_size, memory, plan, is_video_out, kept)


def load_stage(args: argparse.Namespace, launch: Launch, progress: StageProgress, state: RunState, read: ReadStage):
    """Load: the models (or the ones an earlier file of a batch loaded), the SP mesh, and the pipeline over them."""
    from winsp.comm.temporal import build_temporal_mesh

    from ..memory.fit import tile_overlap
    from ..restore.pipeline import SeedVR2Pipeline

    dtype, sp_size, settings = read.dtype, read.sp_size, read.settings
    is_rank0 = launch.rank == 0
    progress.start("load")
    fresh = state.models is None
    mesh = build_temporal_mesh(sp_size)
    if fresh:
        # a bad checkpoint fails the same way on every rank (else on the rank that read the bad bytes): the ranks meet
        # once more, so that it is one line, from the lowest rank that failed, and every rank stops
        try:
            models, error = load_models(args, launch.device, dtype, report=progress.note if is_rank0 else None,
                                        group=mesh.sp), None
        except InputError as exc:
            models, error = None, exc
        agree_loaded(error, launch, state)
    else:
        models = state.models
    state.lockstep = False
    state.models = models
    if models.demo and is_rank0 and fresh:
        progress.note(
            f"{PROG}: WARNING: running the embedded tiny DEMO weights (random, seeded): the output is NOT a "
            f"restoration. "
            + ("" if args.demo else f"No SeedVR2 weights were found; {how_to_get_weights(args.model)}.")
        )
    tile = settings.vae_tile if settings.vae_tile is not None else 256
    pipe = SeedVR2Pipeline(models.dit, models.vae, settings.vae_parallel, group=mesh.sp, vae_tile_size=tile,
                           vae_tile_overlap=tile_overlap(tile), shard_weights=getattr(args, "shard_weights", False))
    return models, mesh, pipe


@dataclass
class RestoreRun:
    """The restore stage under way: its ordered batches (a generator the writer drains) and what they measure."""

    results: Any
    live: Any  # a RestoreProgress
    computed: list
    started: float


def restore_stage(args: argparse.Namespace, launch: Launch, progress: StageProgress, state: RunState,
                  read: ReadStage, models: LoadedModels, mesh, pipe) -> RestoreRun:
    """Restore: every rank's group restores its temporal batches as the input is decoded (on a thread); the batches
    come out in order on the writer."""
    import numpy as np

    from winsp.comm.temporal import ordered_results

    from ..media.reading import iter_frames
    from ..memory.fit import tile_overlap
    from ..restore import stage_clock
    from ..restore.overlap import prefetch
    from ..restore.stage_clock import timed_iter
    from ..restore.temporal import temporal_batches
    from .progress import RestoreProgress, expected_calls, format_seconds

    info, geometry, settings, plan, color_fix = read.info, read.geometry, read.settings, read.plan, read.color_fix
    kept = read.kept
    is_rank0 = launch.rank == 0
    tile = settings.vae_tile if settings.vae_tile is not None else 256
    progress.start("restore")
    started = time.perf_counter()
    if stage_clock.active() is not None:
        stage_clock.active().mark("restore started")
    needed = np.zeros(info.num_frames, dtype=bool)  # frames of the batches this rank's group restores
    for batch in plan:
        if mesh.owns(batch.index) and batch.index >= kept.first:  # resume hook: kept batches are not read again
            needed[batch.start:batch.stop] = True
    model_frames = (
        None if frame is None else frames_to_model(frame[None], geometry)[:, 0]
        for _, frame, _ in iter_frames(info, keep=lambda i: bool(needed[i]))
    )
    # the next batch's frames are decoded on a thread while this one is restored (see .overlap)
    batches = iter(prefetch(temporal_batches(timed_iter(model_frames, "read"), settings.batch_frames,
                                             settings.overlap)))
    computed = []
    owned = [batch for batch in plan if mesh.owns(batch.index) and batch.index >= kept.first]
    progress.break_line()  # the stage bar keeps its line; the restore bar below it (on a terminal)
    # each frame counted once: a batch adds its frames less those it shares with the previous batch
    live = RestoreProgress.for_stream(sum(b.num_frames - b.blend for b in owned), len(owned),
                                      enabled=is_rank0 and not args.quiet).attach(models.vae, models.dit)
    tiles = 1
    if settings.vae_parallel == "tiled":
        step = tile - tile_overlap(tile)
        tiles = math.prod(max(1, math.ceil((side - tile_overlap(tile)) / step)) for side in geometry.work)

    def next_batch(index: int):
        for batch, clip in batches:  # skip the batches other groups restore (their frames were not converted)
            if batch.index == index:
                return batch, clip
        raise RuntimeError(f"the input ended before temporal batch {index} of {len(plan)}")

    def compute(index: int) -> torch.Tensor:
        with stage_clock.stage("input wait"):
            batch, clip = next_batch(index)
        live.begin_batch(batch.num_frames - batch.blend,
                         expected_calls(batch.num_frames, steps=len(pipe.timesteps), tiles=tiles))
        # the colour fix and the conversion to 8-bit frames are shared by the group's ranks (see the pipeline)
        frames = pipe.restore_batch_frames(clip.transpose(0, 1), models.txt, batch.start, args.seed, color_fix,
                                           lambda v: torch.from_numpy(model_to_frames(v.cpu(), geometry)))
        live.end_batch()
        computed.append(batch.num_frames)
        projected = live.projected_seconds()
        if is_rank0 and len(computed) == 1 and len(owned) > 1 and projected is not None and projected > LONG_RUN_S:
            live.write(f"{PROG}: note: at the speed of the first batch this restore takes about "
                       f"{format_seconds(projected)} ({len(owned)} batches); Ctrl-C stops it and removes the partial "
                       f"output")
        return frames

    results = ordered_results(mesh, len(plan), compute, before=state.before_batch, first=kept.first)
    return RestoreRun(results, live, computed, started)


def write_stage(args: argparse.Namespace, state: RunState, read: ReadStage, mesh, results) -> None:
    """Write: the writer cross-fades and encodes the batches as they finish (on a thread); the other ranks drain
    theirs."""
    from ..media.writing import OutputTaken

    kept = read.kept
    if mesh.is_writer:
        try:
            _write_output(args, state, read, results)
        except OutputTaken:
            kept.discard_own()  # resume hook: another run's output is there; batches this run kept are of no use
            raise
        kept.complete()  # resume hook: the output is published; its kept batches go
    else:
        for _ in results:
            pass


def _write_output(args: argparse.Namespace, state: RunState, read: ReadStage, results) -> None:
    """The writer's half of :func:`write_stage`: cross-fade, keep and encode each batch as it finishes."""
    from ..media.writing import MediaWriter
    from ..restore import stage_clock
    from ..restore.overlap import background_worker

    output, info, geometry, settings, plan = read.output, read.info, read.geometry, read.settings, read.plan
    is_video_out, kept = read.is_video_out, read.kept
    use_pts = is_video_out and len(info.frame_pts) == info.num_frames
    with MediaWriter(output, *geometry.output, info.fps, time_base=info.time_base if use_pts else None,
                     audio_from=args.input if is_video_out and info.has_audio else None, crf=args.crf,
                     overwrite=args.overwrite) as writer:
        kept.note_partial(getattr(writer, "partial_path", None))  # resume hook: a resumed run removes it
        blender = kept.blender()  # resume hook: the kept blend state, and the kept frames encoded first
        with stage_clock.stage("write"):
            for frame in kept.replay():
                writer.write(frame, info.frame_pts[writer.frames_written] if use_pts else None)

        def write_batch(item: tuple[int, torch.Tensor]) -> None:
            index, frames = item
            with stage_clock.stage("write"):
                try:
                    final = list(blender.push(plan[index], frames.cpu(), settings.overlap))
                    kept.keep(plan[index], final, blender)  # resume hook: kept as soon as final
                finally:
                    kept.mark_handled(index)
                for frame in final:
                    writer.write(frame.numpy(), info.frame_pts[writer.frames_written] if use_pts else None)
            if state.on_frames is not None:
                state.on_frames(writer.frames_written, info.num_frames)

        # finished batches are cross-faded and encoded on a thread while the next one is restored
        write = background_worker(write_batch)
        try:
            for item in results:
                with stage_clock.stage("writer wait"):
                    write.submit(item)
                    kept.wait(item[0], lambda: write.failed)  # resume hook: kept before the next batch starts
        except BaseException:
            write.abandon()  # the thread must not write on while the partial output is removed
            raise
        with stage_clock.stage("writer wait"):
            write.close()
        for frame in blender.finish():
            writer.write(frame.numpy(), info.frame_pts[writer.frames_written] if use_pts else None)
        if writer.frames_written != info.num_frames:  # a bug, never a silently short file
            raise RuntimeError(f"wrote {writer.frames_written} frames, expected {info.num_frames}")


def finish(args: argparse.Namespace, launch: Launch, progress: StageProgress, state: RunState, read: ReadStage,
           models: LoadedModels, mesh, pipe, run: RestoreRun) -> str:
    """The stages' end: the restore's figures gathered from every rank, and the summary line."""
    from ..restore import stage_clock
    from .progress import summary_line

    output, info, geometry, settings, plan = read.output, read.info, read.geometry, read.settings, read.plan
    is_video_out, sp_size, dtype, color_fix = read.is_video_out, read.sp_size, read.dtype, read.color_fix
    live, computed, started = run.live, run.computed, run.started
    live.close()
    seconds_restore = time.perf_counter() - started
    if stage_clock.active() is not None:
        stage_clock.active().mark("restore finished")
    peak, peak_kind = _peak_memory(launch.device)
    figures = _per_rank_figures([peak, float(sum(computed)), seconds_restore], launch.device)
    progress.done()

    seconds, stages = _command_time(progress, state)
    written = h264_frame_size(*geometry.output) if is_video_out else geometry.output
    vae = f"tiled {settings.vae_tile}px" if settings.vae_parallel == "tiled" else settings.vae_parallel
    if sp_size == 1 and settings.vae_parallel in ("height", "wavefront"):
        vae = "replicated"  # what one rank runs (see SeedVR2Pipeline)
    if settings.vae_parallel == "wavefront" and sp_size > 1 and pipe.vae_splits:  # what the cost model chose
        from ..models.vae.wavefront import splits_in_words

        vae += f" ({'; '.join(sorted({splits_in_words(*splits) for splits in pipe.vae_splits}))})"
    if pipe.weight_shards is not None:
        vae += f"; DiT blocks sharded x{mesh.sp_size}"
    return summary_line(
        PROG, output, written, info.num_frames, None if info.is_image else f"{float(info.fps):.5g} fps",
        weights=f"{'DEMO' if models.demo else 'SeedVR2'} {(args.model or '3b').upper()}",
        dtype="bf16" if dtype == torch.bfloat16 else "fp32", device=launch.device.type, world=launch.world_size,
        sp=mesh.sp_size, vae=vae, batches=len(plan), batch_frames=settings.batch_frames, overlap=settings.overlap,
        seconds=seconds, stages=stages, peak_gib=max(row[0] for row in figures) / 2**30,
        color_fix=color_fix, work=geometry.work if geometry.work != geometry.output else None)


def _command_time(progress: StageProgress, state: RunState) -> tuple[float, dict]:
    """The closing line's time: the whole command's wall time and the stages in it (``start-up`` first: the
    interpreter, imports, ranks and process group before the input is read), or, for a file of several (or a caller
    that gives no start), the file's own stages."""
    stages = dict(progress.seconds)
    if state.command_started is None:
        return sum(stages.values()), stages
    wall = time.time() - state.command_started
    return wall, {"start-up": max(0.0, wall - sum(stages.values())), **stages}
