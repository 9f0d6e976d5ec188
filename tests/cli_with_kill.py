"""``python -m tests.cli_with_kill POINT N RANK restore ...``: the CLI, SIGKILLed by itself at one point on world rank
RANK, and saying which temporal batches its pipeline computed.

For tests/test_resume.py (and, through :func:`install`, tests/kill_hook/ for a rank a launcher started). Every rank
prints ``computing batch at frame S on rank R`` (S: the batch's first frame; R: its world rank) on stderr as its
pipeline starts a temporal batch, so a test can count the batches a killed run and its resumed run computed. On
rank RANK, POINT is:

* ``between``: right after the batch store kept batch N (before the next batch is handed to the writer);
* ``mid_batch``: inside the N-th batch this run computes (0-based), after its restore started;
* ``mid_write``: half-way through writing a file of kept batch N (a truncated temporary file is left);
* ``mid_encode``: as the output's encoder is handed frame N;
* ``none``: no kill (the counting only).

The kill is SIGKILL to this process: no handler, no clean-up, as the OOM killer or a lost machine does.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

POINTS = ("between", "mid_batch", "mid_write", "mid_encode", "none")
#: the folder of the test-only kill hook for a launcher's ranks (``tests/kill_hook/sitecustomize.py``): put first on
#: the launcher's PYTHONPATH
KILL_HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_hook")


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, n: int, here: bool, die: Callable[[], None] = _die,
            armed: Callable[[], bool] = lambda: True) -> None:
    """Patch the pipeline, the batch store and the encoder of this process: count the batches computed, and on this
    rank (``here``) call ``die`` at ``point`` N (see the module's docstring) while ``armed()`` is true."""
    if point not in POINTS:
        raise ValueError(f"kill point must be one of {POINTS}, got {point!r}")
    from examples.seedvr2.media import writing as media
    from examples.seedvr2.restore import batch_store, pipeline

    computed, rank = [0], int(os.environ.get("RANK", "0"))
    original_restore = pipeline.SeedVR2Pipeline.restore_batch

    def restore_batch(self, video, txt, start, seed, color_fix="none"):
        sys.stderr.flush()  # then the line in one write: whole, even where several ranks share one stderr (torchrun)
        os.write(2, f"computing batch at frame {start} on rank {rank}\n".encode())
        if armed():
            if here and point == "mid_batch" and computed[0] == n:
                die()
            computed[0] += 1
        return original_restore(self, video, txt, start, seed, color_fix)

    pipeline.SeedVR2Pipeline.restore_batch = restore_batch
    if here and point == "between":
        original_write = batch_store.BatchStore.write_batch

        def write_batch(self, record):
            original_write(self, record)
            if record.index == n and armed():
                die()

        batch_store.BatchStore.write_batch = write_batch
    if here and point == "mid_write":
        original_atomic = batch_store.write_atomic

        def write_atomic(path, parts):
            if os.path.basename(path).endswith(f"-{n:06d}.bin") and armed():
                data = b"".join(parts)
                with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                die()
            original_atomic(path, parts)

        batch_store.write_atomic = write_atomic
    if here and point == "mid_encode":
        original_frame = media.MediaWriter.write

        def write(self, frame, pts=None):
            if self.frames_written == n and armed():
                die()
            return original_frame(self, frame, pts)

        media.MediaWriter.write = write


def main(argv: list[str]) -> int:
    point, n, rank, cli_args = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    from examples.seedvr2 import cli

    install(point, n, int(os.environ.get("RANK", "0")) == rank)
    return cli.main(cli_args)


if __name__ == "__main__":
    from examples.seedvr2.__main__ import end_rank  # a failed rank ends as the command's own ranks do

    sys.exit(end_rank(main(sys.argv[1:])))
