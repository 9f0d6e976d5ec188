"""One rank of ``serve``: load the models once, then restore the jobs the server sends, one at a time.

The server starts N copies of ``python -m examples.seedvr2.serve.worker RESTORE_FLAGS...`` with torchrun's
environment (:func:`examples.seedvr2.cli.launcher.rank_environment`). Each rank restores a tiny image first (the weights
load through the exact path of ``restore``), then reads jobs from its stdin, one JSON line each, the same line to
every rank, and runs each through the CLI's own per-file function with the models kept (as a folder run does), so a
job's output is byte for byte that of ``restore`` with the same flags.

Messages go back on the original stdout, one JSON line each (the process's fd 1 is pointed at stderr, so nothing
else can corrupt them): ``ready`` (usable memory, peak memory), ``resumed`` (rank 0: the frames a job took from its
kept batches), ``batch`` (rank 0: a temporal batch is about to be computed), ``progress`` (rank 0: frames written),
``done`` (exit code, the one-line error the CLI printed, whether the process group broke). A job keeps its finished
batches beside its result (as ``restore`` does), so a job run again after its ranks died or its server stopped
continues after its last finished batch. A job is cancelled at a temporal
batch boundary: before each round of batches every rank looks for the job's cancel file and the ranks agree (one
tiny all-gather over the world), so all of them stop at the same batch and stay in step for the next job.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, Iterator, Optional, Sequence

ERROR_PREFIX = "python -m examples.seedvr2: error:"
STOPPED_PREFIX = "python -m examples.seedvr2: "
#: test-only (tests/test_serve.py), ``MIB`` or ``MIB:RANK,...``: once ready, every rank blinds restore's memory
#: estimate (every setting "needs" nothing) and the listed ranks (all without a list) limit their own address space
#: (``RLIMIT_AS``) to what they map plus the CLI's reserve plus ``MIB`` MiB; so a job the server's real check accepted
#: meets the real allocator's failure mid-run. Never set it outside a test.
TEST_MEMORY_ENV = "SEEDVR2_SERVE_TEST_RANK_MEMORY_MIB"
#: test-only, a path: while that file exists, every rank waits before each temporal batch of a job (until the file
#: is removed or the job's cancel file appears), so that a test holds a job running for exactly as long as it needs,
#: whatever the machine's speed. Never set it outside a test.
TEST_GATE_ENV = "SEEDVR2_SERVE_TEST_GATE"


def warm_side(world_size: int) -> int:
    """The warm-up image's side: small (its restore is start-up time), with a latent row (8 pixels) per rank."""
    return max(16, 8 * world_size)


class JobCancelled(Exception):
    """Raised on every rank at the batch boundary where the ranks agreed a cancel was asked."""


class _Tee(io.TextIOBase):
    """stderr that also keeps what was written (to find the CLI's one-line error); with ``stream`` None, only kept."""

    def __init__(self, stream):
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        if self.stream is not None:
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        if self.stream is not None:
            self.stream.flush()

    def isatty(self) -> bool:
        return False


def error_line(text: str) -> Optional[str]:
    """The last line the CLI printed as its one-line error (``error:`` or ``stopped:``), without its prefix."""
    for line in reversed(text.splitlines()):
        if line.startswith(ERROR_PREFIX):
            return line[len(ERROR_PREFIX):].strip()
        if line.startswith(STOPPED_PREFIX) and is_stop(line):
            return line[len(STOPPED_PREFIX):].strip()
    return None


def is_stop(line: str) -> bool:
    """Whether an error line says the rank stopped (because of another rank, or a signal) rather than why it failed."""
    return ": stopped" in line


class Channel:
    """The JSON-lines channel to the server: the process's original stdout (fd 1 then points at stderr)."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        self._lock = threading.Lock()

    def send(self, **message) -> None:
        with self._lock:
            self._out.write(json.dumps(message) + "\n")
            self._out.flush()


def _write_warm_image(path: str, side: int) -> None:
    import numpy as np

    from ..media import MediaWriter

    y, x = np.mgrid[0:side, 0:side]
    frame = np.stack([x * 16 % 256, y * 16 % 256, (x + y) * 8 % 256], -1).astype(np.uint8)
    with MediaWriter(path, side, side) as writer:
        writer.write(frame)


class Rank:
    """This rank's loop state: its launch, the models once loaded, and the channel."""

    def __init__(self, base: Sequence[str], channel: Channel) -> None:
        from .. import cli
        from ..media.untrusted import install

        install()  # every input opened as data (the server checked its size; a job's file is the server's copy)
        self.cli, self.base, self.channel = cli, list(base), channel
        self.launch = cli.Launch.from_env()
        self.models = None

    def restore(self, input_path: str, output: str, flags: Sequence[str], cancel: Optional[str],
                job_id: Optional[str], echo: bool = True) -> dict:
        """Restore one file as ``restore INPUT -o OUTPUT BASE FLAGS --quiet`` would; the outcome as a message (with
        ``text``, what it printed, when not ``echo``-ed to stderr)."""
        cli, launch = self.cli, self.launch
        tee = _Tee(sys.stderr if echo else None)
        code, broken, cancelled = 2, False, False
        with contextlib.redirect_stderr(tee):
            try:
                args = cli.build_parser().parse_args(["restore", input_path, "-o", output, *self.base, *flags,
                                                      "--quiet"])
            except SystemExit:
                args = None
            if args is not None:
                # a job's finished batches are kept in its folder: run again, it continues after them
                state = cli.RunState(models=self.models, keep_batches=job_id is not None, start_over=True)
                if cancel is not None:
                    state.before_batch = self._cancel_check(cancel, args, job_id)
                if launch.rank == 0 and job_id is not None:
                    state.on_frames = lambda done, total: self.channel.send(event="progress", id=job_id,
                                                                            frames=done, total=total)
                    state.on_resume = lambda reused, total: self.channel.send(event="resumed", id=job_id,
                                                                              frames=reused, total=total)
                try:
                    code, broken, _ = cli._restore_file(args, launch, state)
                    broken = broken and launch.world_size > 1  # alone, a failed allocation leaves nothing behind
                except JobCancelled:
                    cancelled = True
                except Exception as exc:  # noqa: BLE001 - a bug: said in one line, and the ranks restarted
                    traceback.print_exc()
                    print(f"{ERROR_PREFIX} internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
                    broken = launch.world_size > 1
                self.models = state.models
        peak, kind = cli._peak_memory(launch.device)
        return dict(event="done", id=job_id, rank=launch.rank, code=0 if cancelled else code, cancelled=cancelled,
                    broken=broken, error=None if cancelled or code == 0 else error_line(tee.kept.getvalue()),
                    peak_bytes=peak, peak_kind=kind, text=None if echo else tee.kept.getvalue())

    def _cancel_check(self, path: str, args, job_id: Optional[str]):
        """``before_batch``: at each round of batches (one batch per SP group) the ranks agree whether to stop; then
        rank 0 says the batch is computed (the server counts them)."""
        world = self.launch.world_size
        groups = world // (args.sp_size or world) if world > 1 else 1

        gate = os.environ.get(TEST_GATE_ENV)

        def before(index: int) -> None:
            while gate and os.path.exists(gate) and not os.path.exists(path):
                time.sleep(0.02)
            if index % max(groups, 1) == 0:
                asked = 1.0 if os.path.exists(path) else 0.0
                if world > 1:
                    asked = max(row[0] for row in self.cli._per_rank_figures([asked], self.launch.device))
                if asked:
                    raise JobCancelled(f"cancelled before temporal batch {index}")
            if self.launch.rank == 0 and job_id is not None:
                self.channel.send(event="batch", id=job_id, index=index)
        return before

    def warm_up(self) -> dict:
        """Restore a tiny image: loads the weights (as ``restore`` does) and builds the run's state once. What it
        prints is held back and printed only when it worked (the server prints a failure's one line itself)."""
        folder = tempfile.mkdtemp(prefix="seedvr2-serve-warm-")
        try:
            source = os.path.join(folder, "warm.png")
            _write_warm_image(source, warm_side(self.launch.world_size))
            outcome = self.restore(source, os.path.join(folder, "warm_restored.png"), [], None, None, echo=False)
            if outcome["code"] == 0:  # its notes (the weights found, the DEMO warning); a failure the server says
                sys.stderr.write(outcome["text"])
                sys.stderr.flush()
            return outcome
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _apply_test_memory_limit(rank: int) -> None:
    """What :data:`TEST_MEMORY_ENV` asks for (nothing when it is unset)."""
    value = os.environ.get(TEST_MEMORY_ENV, "").strip()
    if not value:
        return
    import resource

    from ..memory import estimate as pipeline
    from ..memory.limits import ADDRESS_SPACE_RESERVE

    mib, _, ranks = value.partition(":")
    pipeline.estimate_restore_bytes = lambda **_: pipeline.MemoryEstimate(0, 0, 0)  # type: ignore[assignment]
    if ranks and str(rank) not in ranks.split(","):
        return
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = mapped + ADDRESS_SPACE_RESERVE + int(mib) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def serve_jobs(rank: Rank, jobs: Iterator[dict], answer: Callable[[dict], None]) -> str:
    """This rank's life: the warm-up, then each job of ``jobs`` until a ``quit`` one; every message to ``answer``
    (``failed`` or ``ready``, then one ``done`` a job). Returns ``quit``, ``failed`` (the warm-up failed in step) or
    ``broken`` (the process group broke: the rank must leave without meeting the others)."""
    warm = rank.warm_up()
    if warm["code"] != 0:
        answer(dict(event="failed", rank=rank.launch.rank, error=warm["error"] or "the warm-up restore failed"))
        return "broken" if warm["broken"] else "failed"
    from ..memory.limits import usable_memory

    answer(dict(event="ready", rank=rank.launch.rank, world=rank.launch.world_size,
                usable=usable_memory(rank.launch.device).usable, device=rank.launch.device.type,
                peak_bytes=warm["peak_bytes"]))
    _apply_test_memory_limit(rank.launch.rank)
    for job in jobs:
        if job.get("quit"):
            return "quit"
        outcome = rank.restore(job["input"], job["output"], job["flags"], job["cancel"], job["id"])
        answer(outcome)
        if outcome["broken"]:
            return "broken"
    return "quit"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """A rank started by :class:`.ranks.RankPool`: jobs on stdin, messages on the original stdout."""
    argv = list(sys.argv[1:] if argv is None else argv)
    channel = Channel()
    rank = Rank(argv, channel)
    ended = "broken"
    try:
        ended = serve_jobs(rank, (json.loads(line) for line in sys.stdin), lambda message: channel.send(**message))
        return 0 if ended == "quit" else 2
    finally:
        rank.launch.close(failed=ended == "broken")


if __name__ == "__main__":
    sys.exit(main())
