"""``python -m tests.cli_with_fault FAULT RANK restore ...``: the CLI with one failure injected on world rank RANK.

For tests/test_cli_stop.py. FAULT is ``disk_full`` (the writer's encoder raises PyAV's kind of error, an
``OSError`` ENOSPC "No space left on device", as the first frame is written), ``oom`` (the batch's restore raises
MemoryError), ``bug`` (it raises RuntimeError) or ``hang`` (the rank stops itself with SIGSTOP, a stuck rank). The
failing rank prints ``injected FAULT at <unix time>`` on stderr just before it raises, so the test can measure
how long every rank takes to exit after it.
"""

from __future__ import annotations

import os
import sys
import time


def _announce(fault: str) -> None:
    print(f"injected {fault} at {time.time():.3f}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    fault, rank, cli_args = argv[0], int(argv[1]), argv[2:]
    from examples.seedvr2 import cli, media, pipeline

    if int(os.environ.get("RANK", "0")) == rank:
        if fault == "disk_full":
            def write(self, frame, pts=None):
                import errno

                _announce(fault)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

            media.MediaWriter._write = write
        else:
            def restore_batch(self, *args, **kwargs):
                _announce(fault)
                if fault == "hang":
                    import signal

                    os.kill(os.getpid(), signal.SIGSTOP)
                raise MemoryError("injected") if fault == "oom" else RuntimeError("injected bug")

            pipeline.SeedVR2Pipeline.restore_batch = restore_batch
    return cli.main(cli_args)


if __name__ == "__main__":
    from examples.seedvr2.__main__ import end_rank  # a failed rank ends as the command's own ranks do

    sys.exit(end_rank(main(sys.argv[1:])))
