"""Test-only (tests/test_serve_resume.py): kills a ``serve`` rank, or its whole server, at a chosen point of a job.

With this folder first on ``PYTHONPATH`` and ``WINSP_TEST_SERVE_KILL=POINT:N:RANK:TARGET:MARKER`` in the server's
environment, the serve rank of world rank RANK (a server process has no ``RANK``, so it is left alone) installs
:func:`tests.cli_with_kill.install`: while it restores a job (not its warm-up image) it is killed at POINT N.
TARGET ``rank`` SIGKILLs that rank alone (the server restarts its ranks); ``server`` SIGKILLs its server first, then
the rank (a lost machine: nothing of the service is left). MARKER is created just before the kill and no rank
installs the kill once it exists, so the ranks started after it run as usual.
"""

import os

_SPEC = os.environ.get("WINSP_TEST_SERVE_KILL")


def _install(spec: str) -> None:
    import signal
    import sys

    point, n, rank, target, marker = spec.split(":", 4)
    if target not in ("rank", "server"):
        raise ValueError(f"WINSP_TEST_SERVE_KILL's target must be rank or server, got {target!r}")
    if os.environ.get("RANK") != rank or os.path.exists(marker):
        return
    from examples.seedvr2 import cli
    from tests.cli_with_kill import install

    # the worker runs as __main__ (its Rank is not the module's): a job is told from the warm-up by what the worker
    # asks of the CLI, which it looks up at each call; a job keeps its batches, the warm-up image does not
    in_job = [False]
    original_restore_file = cli._restore_file

    def restore_file(args, launch, state):
        in_job[0] = bool(state.keep_batches)
        try:
            return original_restore_file(args, launch, state)
        finally:
            in_job[0] = False

    def die() -> None:
        open(marker, "w").close()
        sys.stderr.flush()
        if target == "server":
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    cli._restore_file = restore_file
    install(point, int(n), True, die, armed=lambda: in_job[0])


if _SPEC and "RANK" in os.environ:
    _install(_SPEC)
