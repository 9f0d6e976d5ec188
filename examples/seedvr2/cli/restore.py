"""The restore command: ``main``, one file or a folder of them, errors as one line, the stage-time profile.

Its help text, what ``restore --help`` prints, is the docstring of :mod:`examples.seedvr2.cli.parser`; the stages of
one file are :mod:`examples.seedvr2.cli.stages`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

from ..media.reading import MediaError
from ..media.writing import check_output_directory
from .agreement import Launch, RunState, _peer_failure, is_peer_failure
from .memory_plan import (
    is_out_of_memory,
    out_of_memory_error,
)
from .parser import PROG, InputError, build_parser
from .progress import STAGES, StageProgress
from .stages import finish, load_stage, read_stage, restore_stage, write_stage
from .terminal_text import printable

__all__ = ["main", "run_restore"]

from .launcher import PORT_TAKEN_EXIT, env_rank, leave_note, record_port_taken, speaks_for_stop


def run_restore(args: argparse.Namespace, launch: Launch, progress: StageProgress,
                state: Optional[RunState] = None) -> str:
    """Run the ``restore`` command; returns the one-line summary. Raises MediaError / InputError for bad input,
    :class:`OutOfMemory` when the request cannot fit. The stages are the ones the progress line shows: read (every
    check, the ranks' agreement, the memory plan), load, restore, and the writer's write."""
    state = RunState() if state is None else state
    read = read_stage(args, launch, progress, state)
    models, mesh, pipe = load_stage(args, launch, progress, state, read)
    run = restore_stage(args, launch, progress, state, read, models, mesh, pipe)
    write_stage(args, state, read, mesh, run.results)
    return finish(args, launch, progress, state, read, models, mesh, pipe, run)


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
        from ..restore.kept_batches import kept_folder  # resume hook (issue 48)

        kept = kept_folder()
        if kept is not None:
            what += f"; kept the finished batches in {os.path.basename(kept)} (the same command resumes after them)"
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

    global _MAIN_ENTERED
    _MAIN_ENTERED = time.time()
    if os.environ.get(stage_clock.PROFILE_ENV):
        stage_clock.enable(comm=True).mark("main entered")
    try:
        from .stop_signals import StopOnSignals

        args = build_parser().parse_args(argv)
        if args.untrusted_input:  # inputs opened as data (media/untrusted.py), as serve opens uploads
            from ..media.untrusted import install

            install()
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
            code, failed, _ = _restore_file(args, launch, RunState(command_started=_command_started(),
                                                                   keep_batches=True))
            return code
        code, failed = _restore_batch(args, launch, job)
        return code
    except BaseException:  # a bug: this rank leaves without meeting the others (they may be mid-collective)
        failed = True
        raise
    finally:
        launch.close(failed=failed)


#: set by ``python -m examples.seedvr2`` as it starts (inherited by the ranks ``--ranks`` starts): the command's start
COMMAND_STARTED_ENV = "SEEDVR2_COMMAND_STARTED"


def _command_started() -> float:
    """When the command started: ``$SEEDVR2_COMMAND_STARTED`` (set by ``python -m examples.seedvr2``), else when
    :func:`main` was entered."""
    try:
        return float(os.environ[COMMAND_STARTED_ENV])
    except (KeyError, ValueError):
        return _MAIN_ENTERED


_MAIN_ENTERED = time.time()


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
        state = RunState(models=models, keep_batches=True)
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
    ``DIR/rank<N>.json`` (see :mod:`~examples.seedvr2.restore.stage_clock`)."""
    from ..restore import stage_clock

    directory = os.environ.get(stage_clock.PROFILE_ENV)
    if directory and stage_clock.active() is not None:
        stage_clock.active().mark("main left")
        stage_clock.write_profile(directory, rank, {"cli": dict(cli_stages)})
        stage_clock.disable()

