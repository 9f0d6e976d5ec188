"""Command line: python -m examples.seedvr2 restore INPUT... -o OUTPUT [options]

INPUT is a video or image, or a folder of them, or several: a folder's videos and images are restored into the
output folder under their own names with the models loaded once (see docs/seedvr2.md). Single process; or W ranks
started by the command itself with --ranks W (one per GPU; gloo on the CPU), or under torchrun --nproc-per-node W.
The clip is restored in temporal batches of --batch-frames frames that share --overlap cross-faded frames, decoded
lazily from the input and encoded to the output as they finish, so memory does not grow with the clip. With
--sp-size N the W ranks form W / N groups of N: each group takes whole batches (round-robin), runs the DiT
window-parallel and the VAE in its --vae-parallel mode over its N ranks, and sends its finished batches to rank 0,
which writes them in order. Across machines, run one torchrun --nnodes M --rdzv-backend c10d --rdzv-endpoint
HOST:PORT agent per node; ranks are numbered node by node, every rank reads the input, global rank 0 writes the
output.

With --dit-checkpoint and --vae-checkpoint it is the SeedVR2 3B restorer (--model 7b: the 7B). Without them it
looks for downloaded weights in ./ckpts/, $SEEDVR2_HOME and the Hugging Face cache (no network) and says which files
it uses; only when nothing is found (or with --demo) it runs embedded tiny demo weights of that architecture
(examples/seedvr2/models/demo.py) so that the command works anywhere in seconds, and says so, since that restores
nothing.

Exit codes: 0 success; 2 bad input, usage, not enough memory, or a failed write (one "error:" line on stderr, no
output file); 128 + N stopped by signal N (143 SIGTERM, 130 SIGINT, 129 SIGHUP; also SIGQUIT, SIGUSR1/2, SIGALRM):
the partial output is removed and one line says so; anything else is a bug (docs/failures.md has the details).
A rank that fails once the run has started reports it and leaves at once; the others then stop too, within seconds
(under torchrun with a line "rank N: stopped: another rank failed"; under --ranks silently); a rank that stops
answering is named after the collective timeout (600 s, WINSP_COLLECTIVE_TIMEOUT seconds when set).

The command never loses data: an output path that is the input (same path, a symlink or a hard link to it) is
refused, an existing output is only replaced with --overwrite (nor one that appears during the run: the output is
published without replacing anything), an output directory that cannot take a new file is refused before anything
is read, a video that decodes fewer frames than its container declares is refused unless
--allow-partial-input, and a request that fits the usable memory in no setting is refused before anything is
allocated (settings left out are chosen to fit; see the memory options below). Without -o the output goes beside
the input as <input>_restored.<ext>.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Optional, Sequence

import torch

from ..media.geometry import Geometry, check_scale, frames_to_model, model_to_frames, parse_resolution, plan_geometry
from ..media.reading import MediaError
from ..media.writing import check_output_directory, h264_frame_size, output_kind
from .agreement import Launch, RunState, _peer_failure, agree_loaded, agree_to_start, is_peer_failure
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
from .loading import _read_text_embeds, load_models
from .memory_plan import (
    _peak_memory,
    _per_rank_figures,
    is_out_of_memory,
    out_of_memory_error,
    pinned_settings,
    plan_memory,
)
from .parser import PROG, InputError, build_parser
from .progress import STAGES, StageProgress
from .terminal_text import printable

__all__ = ["main", "run_restore"]

from ..weights.discovery import WeightsError, how_to_get_weights, resolve_cli_weights
from .launcher import PORT_TAKEN_EXIT, env_rank, leave_note, record_port_taken, speaks_for_stop

#: a run projected (at the first batch's measured speed) to take longer than this is announced in one line
LONG_RUN_S = 600.0


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


def run_restore(args: argparse.Namespace, launch: Launch, progress: StageProgress,
                state: Optional[RunState] = None) -> str:
    """Run the ``restore`` command; returns the one-line summary. Raises MediaError / InputError for bad input,
    :class:`OutOfMemory` when the request cannot fit."""
    state = RunState() if state is None else state
    import numpy as np

    from winsp.comm.temporal import build_temporal_mesh, ordered_results

    from ..media.reading import iter_frames
    from ..media.writing import MediaWriter
    from ..memory.fit import tile_overlap
    from ..memory.limits import usable_memory
    from ..restore import stage_clock
    from ..restore.overlap import background_worker, prefetch
    from ..restore.pipeline import SeedVR2Pipeline
    from ..restore.stage_clock import timed_iter
    from ..restore.temporal import TemporalBlender, plan_temporal_batches, temporal_batches
    from .progress import RestoreProgress, expected_calls, format_seconds, summary_line

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

    progress.start("restore")
    started = time.perf_counter()
    if stage_clock.active() is not None:
        stage_clock.active().mark("restore started")
    needed = np.zeros(info.num_frames, dtype=bool)  # frames of the batches this rank's group restores
    for batch in plan:
        if mesh.owns(batch.index):
            needed[batch.start:batch.stop] = True
    model_frames = (
        None if frame is None else frames_to_model(frame[None], geometry)[:, 0]
        for _, frame, _ in iter_frames(info, keep=lambda i: bool(needed[i]))
    )
    # the next batch's frames are decoded on a thread while this one is restored (see .overlap)
    batches = iter(prefetch(temporal_batches(timed_iter(model_frames, "read"), settings.batch_frames,
                                             settings.overlap)))
    computed = []
    owned = [batch for batch in plan if mesh.owns(batch.index)]
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

    results = ordered_results(mesh, len(plan), compute, before=state.before_batch)
    if mesh.is_writer:
        use_pts = is_video_out and len(info.frame_pts) == info.num_frames
        with MediaWriter(output, *geometry.output, info.fps, time_base=info.time_base if use_pts else None,
                         audio_from=args.input if is_video_out and info.has_audio else None, crf=args.crf,
                         overwrite=args.overwrite) as writer:
            blender = TemporalBlender()

            def write_batch(item: tuple[int, torch.Tensor]) -> None:
                index, frames = item
                with stage_clock.stage("write"):
                    for frame in blender.push(plan[index], frames.cpu(), settings.overlap):
                        writer.write(frame.numpy(), info.frame_pts[writer.frames_written] if use_pts else None)
                if state.on_frames is not None:
                    state.on_frames(writer.frames_written, info.num_frames)

            # finished batches are cross-faded and encoded on a thread while the next one is restored
            write = background_worker(write_batch)
            try:
                for item in results:
                    with stage_clock.stage("writer wait"):
                        write.submit(item)
            except BaseException:
                write.abandon()  # the thread must not write on while the partial output is removed
                raise
            with stage_clock.stage("writer wait"):
                write.close()
            for frame in blender.finish():
                writer.write(frame.numpy(), info.frame_pts[writer.frames_written] if use_pts else None)
            if writer.frames_written != info.num_frames:  # a bug, never a silently short file
                raise RuntimeError(f"wrote {writer.frames_written} frames, expected {info.num_frames}")
    else:
        for _ in results:
            pass
    live.close()
    seconds_restore = time.perf_counter() - started
    if stage_clock.active() is not None:
        stage_clock.active().mark("restore finished")
    peak, peak_kind = _peak_memory(launch.device)
    figures = _per_rank_figures([peak, float(sum(computed)), seconds_restore], launch.device)
    progress.done()

    written = h264_frame_size(*geometry.output) if is_video_out else geometry.output
    vae = f"tiled {settings.vae_tile}px" if settings.vae_parallel == "tiled" else settings.vae_parallel
    if sp_size == 1 and settings.vae_parallel in ("height", "wavefront"):
        vae = "replicated"  # what one rank runs (see SeedVR2Pipeline)
    if settings.vae_parallel == "wavefront" and sp_size > 1 and pipe.vae_splits:  # what the cost model chose
        from ..models.vae.wavefront import describe_splits

        vae += f" ({'; '.join(sorted({describe_splits(*splits) for splits in pipe.vae_splits}))})"
    if pipe.weight_shards is not None:
        vae += f"; DiT blocks sharded x{mesh.sp_size}"
    return summary_line(
        PROG, output, written, info.num_frames, None if info.is_image else f"{float(info.fps):.5g} fps",
        weights=f"{'DEMO' if models.demo else 'SeedVR2'} {(args.model or '3b').upper()}",
        dtype="bf16" if dtype == torch.bfloat16 else "fp32", device=launch.device.type, world=launch.world_size,
        sp=mesh.sp_size, vae=vae, batches=len(plan), batch_frames=settings.batch_frames, overlap=settings.overlap,
        seconds=sum(progress.seconds.values()), peak_gib=max(row[0] for row in figures) / 2**30,
        color_fix=color_fix, work=geometry.work if geometry.work != geometry.output else None)


def describe_batches(plan) -> str:
    """The temporal batches that ran, for the summary: ``1 batch of 1 frame``, ``10 batches of 21 frames (the last
    16), overlap 5``."""
    frames = lambda n: f"{n} frame{'s' if n != 1 else ''}"  # noqa: E731
    if len(plan) == 1:
        return f"1 batch of {frames(plan[0].num_frames)}"
    first, last = plan[0].num_frames, plan[-1].num_frames
    return (f"{len(plan)} batches of {frames(first)}{f' (the last {last})' if last != first else ''}, overlap "
            f"{plan[1].blend}")


def _print_error(progress: StageProgress, message: str, names: Sequence[Optional[str]] = ()) -> None:
    progress.break_line()
    # one line, whatever the exception carried; names from files escaped (no terminal control sequences), file
    # ``names`` first, so that a newline in one is shown as \x0a, naming the file exactly, not joined into a space
    for name in names:
        if name and not name.isprintable():
            message = message.replace(name, printable(name))
    print(printable(f"{PROG}: error: {' '.join(message.split())}"), file=sys.stderr)


def _stop_message(rank: int):
    """The one line printed when a signal stops the run (by rank 0 only: the others stop silently)."""
    def message(signum: int, removed: list) -> Optional[str]:
        if not speaks_for_stop(rank):  # rank 0 alone; under --ranks, not when another rank failed
            return None
        import signal

        what = (f"removed the partial output {', '.join(os.path.basename(p) for p in removed)}" if removed
                else "no partial output left")
        return printable(f"{PROG}: stopped by {signal.Signals(signum).name}: {what}")
    return message


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code.

    Bad input is found identically on every rank before any collective, so rank 0 reports it for all. A failure once
    ranks talk (an allocation that fails on one rank, or a bug) is reported by the rank it happened on; that rank
    leaves the process group at once (no meeting), its peers' pending collectives fail, and they exit too (with a
    one-line note), so no rank waits on a failed one. SIGTERM, SIGINT, SIGHUP and the other stop signals end the
    process at once (see :mod:`.stop_signals`); a Ctrl-C before their handling is in place is one line too.
    """
    from ..restore import stage_clock

    if os.environ.get(stage_clock.PROFILE_ENV):
        stage_clock.enable(comm=True).mark("main entered")
    try:
        from .stop_signals import StopOnSignals

        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print(f"{PROG}: stopped by SIGINT during start-up: nothing was written", file=sys.stderr)
        return 130
    with StopOnSignals(_stop_message(env_rank())):
        try:
            return _main(args)
        except Exception:
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
                raise
            # A bug on one rank of several: its traceback, then out at once. The process group is already torn down
            # (mid-run, without meeting); finalising the interpreter beside gloo's threads ended the process with
            # SIGABRT instead of exit 1 once in a CI run.
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)


def _main(args: argparse.Namespace) -> int:
    from ..media.inputs import plan_jobs

    try:
        launch = Launch.from_env()
    except ValueError as exc:  # a malformed WINSP_COLLECTIVE_TIMEOUT, say
        print(printable(f"{PROG}: error: {exc}"), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - rank 0 could not listen on MASTER_PORT: the launcher tries another
        if "EADDRINUSE" not in str(exc) or env_rank() != 0:
            raise
        if record_port_taken():
            return PORT_TAKEN_EXIT
        print(printable(f"{PROG}: error: rank 0 cannot listen on MASTER_PORT {os.environ.get('MASTER_PORT')}: the "
                        f"port is taken by another program; choose another MASTER_PORT"), file=sys.stderr)
        return 2
    failed = False
    try:
        try:
            job = plan_jobs(args.input, args.output)
        except MediaError as exc:  # the same on every rank, before any collective: rank 0 reports it
            if launch.rank == 0:
                _print_error(StageProgress(STAGES, enabled=False), str(exc), names=(*args.input, args.output))
            return 2
        if not job.batch:
            args.input, args.output = job.pairs[0]
            code, failed, _ = _restore_file(args, launch, RunState())
            return code
        code, failed = _restore_batch(args, launch, job)
        return code
    except BaseException:  # a bug: this rank leaves without meeting the others (they may be mid-collective)
        failed = True
        raise
    finally:
        launch.close(failed=failed)


def _restore_batch(args: argparse.Namespace, launch: Launch, job) -> tuple[int, bool]:
    """Restore every (input, output) pair of ``job`` with the models loaded once; one line per file, then one summary
    line. A file that fails is reported and the next one runs, unless the failure broke the ranks' lockstep (then the
    process group is gone and the batch stops). Returns (exit code: 2 if any file failed, whether the group broke)."""
    if job.output_dir is not None:
        try:  # refused before anything runs, like a single output's folder (every rank: it is the same folder)
            os.makedirs(job.output_dir, exist_ok=True)
        except OSError as exc:
            error: Optional[MediaError] = MediaError(f"cannot create the output folder {job.output_dir} "
                                                     f"({exc.strerror or exc}); choose another -o")
        else:
            try:
                check_output_directory(os.path.join(job.output_dir, "probe"))
                error = None
            except MediaError as exc:
                error = exc
        if error is not None:
            if launch.rank == 0:
                _print_error(StageProgress(STAGES, enabled=False), str(error))
            return 2, False
    started = time.perf_counter()
    models, failures, done, broken = None, [], 0, False
    for index, (path, output) in enumerate(job.pairs):
        args.input, args.output = path, output
        state = RunState(models=models)
        code, broken, _ = _restore_file(args, launch, state)
        models = state.models
        if code == 0:
            done += 1
        else:
            failures.append(os.path.basename(path))
        if broken and launch.world_size > 1:
            failures += [os.path.basename(p) + " (not run)" for p, _ in job.pairs[index + 1:]]
            break
    if launch.rank == 0:
        where = f" into {job.output_dir}" if job.output_dir is not None else ""
        failed = f"; FAILED {len(failures)}: {', '.join(failures)}" if failures else ""
        print(printable(f"{PROG}: restored {done} of {len(job.pairs)} files{where} in "
                        f"{time.perf_counter() - started:.1f}s{failed}"), file=sys.stderr)
    return (2 if failures else 0), broken


def _restore_file(args: argparse.Namespace, launch: Launch, state: RunState) -> tuple[int, bool, Optional[str]]:
    """Restore ``args.input`` into ``args.output``: (exit code, whether this rank failed out of lockstep, summary).
    Errors are printed as one line (by the rank that reports them), the summary by rank 0."""
    progress = StageProgress(STAGES, enabled=launch.rank == 0 and not args.quiet)
    prefix = f"rank {launch.rank}: " if launch.world_size > 1 else ""
    from ..restore.pipeline import NonFiniteOutput

    try:
        summary = run_restore(args, launch, progress, state)
    except (MediaError, InputError, NonFiniteOutput) as exc:
        failed = not state.lockstep
        if launch.rank == state.reporter or failed:
            _print_error(progress, (prefix if failed or state.reporter else "") + str(exc),
                         names=(args.input, args.output))
        return 2, failed, None
    except Exception as exc:  # noqa: BLE001 - only memory and lost-peer failures are handled; the rest re-raised
        # whatever it is, this rank leaves without meeting the others (they may be mid-collective)
        if is_out_of_memory(exc):
            message = str(out_of_memory_error(exc, state.memory, launch.device))
            del exc
            _print_error(progress, prefix + message)
            return 2, True, None
        if launch.world_size > 1 and is_peer_failure(exc):
            line = printable(f"{PROG}: {prefix}stopped: {_peer_failure(exc)}")
            if leave_note(launch.rank, line[len(PROG) + 2:]):  # under --ranks: the launcher's to say, or not
                return 2, True, None
            progress.break_line()
            print(line, file=sys.stderr)
            return 2, True, None
        raise
    _write_profile(launch.rank, progress.seconds)
    if launch.rank == 0:
        _write_stage_times(progress.seconds)
        print(printable(summary), file=sys.stderr)
    return 0, False, summary


STAGE_TIMES_ENV = "SEEDVR2_STAGE_TIMES"


def _write_stage_times(stages: dict) -> None:
    """With ``SEEDVR2_STAGE_TIMES=FILE``: the CLI's own stage seconds (read, load, restore) as JSON, from rank 0.

    What ``benchmarks/bench_whole_command.py`` reads; unlike ``SEEDVR2_PROFILE`` it times nothing more, so the
    command runs as a user's does."""
    path = os.environ.get(STAGE_TIMES_ENV)
    if path:
        import json

        with open(path, "w") as f:
            json.dump({name: round(seconds, 4) for name, seconds in stages.items()}, f)


def _write_profile(rank: int, cli_stages: dict) -> None:
    """With ``SEEDVR2_PROFILE=DIR``: this rank's stage figures (and the CLI's own ``cli_stages`` seconds) to
    ``DIR/rank<N>.json`` (see :mod:`.stage_clock`)."""
    from ..restore import stage_clock

    directory = os.environ.get(stage_clock.PROFILE_ENV)
    if directory and stage_clock.active() is not None:
        stage_clock.active().mark("main left")
        stage_clock.write_profile(directory, rank, {"cli": dict(cli_stages)})
        stage_clock.disable()

