"""``python -m tests.cli_with_kill POINT N RANK restore ...``: the CLI, SIGKILLed by itself at one point on world rank
RANK, and saying which temporal batches its pipeline computed.

For tests/test_resume.py. Every rank prints ``computing batch at frame S`` (S: the batch's first frame) on stderr as
its pipeline starts a temporal batch, so a test can count the batches a killed run and its resumed run computed.
On rank RANK, POINT is:

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


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    point, n, rank, cli_args = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    from examples.seedvr2 import cli
    from examples.seedvr2.media import writing as media
    from examples.seedvr2.restore import batch_store, pipeline

    here = int(os.environ.get("RANK", "0")) == rank
    computed = [0]
    original_restore = pipeline.SeedVR2Pipeline.restore_batch

    def restore_batch(self, video, txt, start, seed, color_fix="none"):
        print(f"computing batch at frame {start}", file=sys.stderr, flush=True)
        if here and point == "mid_batch" and computed[0] == n:
            _die()
        computed[0] += 1
        return original_restore(self, video, txt, start, seed, color_fix)

    pipeline.SeedVR2Pipeline.restore_batch = restore_batch
    if here and point == "between":
        original_write = batch_store.BatchStore.write_batch

        def write_batch(self, record):
            original_write(self, record)
            if record.index == n:
                _die()

        batch_store.BatchStore.write_batch = write_batch
    if here and point == "mid_write":
        original_atomic = batch_store.write_atomic

        def write_atomic(path, parts):
            if os.path.basename(path).endswith(f"-{n:06d}.bin"):
                data = b"".join(parts)
                with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                _die()
            original_atomic(path, parts)

        batch_store.write_atomic = write_atomic
    if here and point == "mid_encode":
        original_frame = media.MediaWriter.write

        def write(self, frame, pts=None):
            if self.frames_written == n:
                _die()
            return original_frame(self, frame, pts)

        media.MediaWriter.write = write
    return cli.main(cli_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
