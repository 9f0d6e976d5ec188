"""Test-only (tests/test_serve_resume.py, tests/test_resume.py): kills a rank that a launcher started (``restore
--ranks N``, or ``serve``), or the launcher with it, at a chosen point of a restore that keeps its batches.

With this folder first on ``PYTHONPATH`` and ``WINSP_TEST_KILL=POINT:N:RANK:TARGET:MARKER`` in the launcher's
environment, its rank of world rank RANK (the launcher itself has no ``RANK``, so it is left alone) installs
:func:`tests.cli_with_kill.install`: while it restores a file whose batches are kept (a ``serve`` job, not its
warm-up image; any ``restore`` without ``--no-resume-store``) it is killed at POINT N. TARGET ``rank`` SIGKILLs that
rank alone (``restore --ranks`` stops the others, ``serve`` restarts its ranks); ``server`` SIGKILLs the rank's
parent first, then the rank (a lost machine: nothing of the service is left). MARKER is created just before the
kill and no rank installs the kill once it exists, so the ranks started after it run as usual. POINT ``none`` kills
nothing: the ranks only say which batches they compute.
"""

import os

_SPEC = os.environ.get("WINSP_TEST_KILL")


def _install(spec: str) -> None:
    import signal
    import sys

    point, n, rank, target, marker = spec.split(":", 4)
    if target not in ("rank", "server"):
        raise ValueError(f"WINSP_TEST_KILL's target must be rank or server, got {target!r}")
    here = os.environ.get("RANK") == rank and not os.path.exists(marker)  # every rank counts its batches
    from examples.seedvr2 import cli
    from examples.seedvr2.cli import restore as cli_restore
    from tests.cli_with_kill import install

    # serve's worker runs as __main__ (its Rank is not the module's): a job is told from the warm-up by what the
    # worker asks of the CLI, which it looks up at each call; a job keeps its batches, the warm-up image does not
    in_job = [False]
    original_restore_file = cli_restore._restore_file

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

    cli_restore._restore_file = cli._restore_file = restore_file  # restore's own call, and the worker's
    install(point, int(n), here, die, armed=lambda: in_job[0])


if _SPEC and "RANK" in os.environ:
    _install(_SPEC)
