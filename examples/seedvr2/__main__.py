"""``python -m examples.seedvr2 restore INPUT -o OUTPUT``: see :mod:`examples.seedvr2.cli`.

With ``--ranks N`` this process is the launcher (:mod:`examples.seedvr2.cli.launcher`): it starts the N ranks before
anything imports torch here, so torch is imported once per rank and never in the launcher.
Importing torch takes seconds; a stop signal in that time (Ctrl-C, SIGTERM, SIGHUP, ...: every one the CLI handles,
before it installs its own handling) ends the process at once with one line and exit 128 + N like any other stop,
not a ``KeyboardInterrupt`` traceback nor a silent death by the signal. Nothing has been written yet then. Of
several ranks only rank 0 says it, and none when the launcher is stopping them because another failed.

The process ends from the signal handler itself (``os._exit``), never by an exception raised inside an import: a
``KeyboardInterrupt`` in the middle of an import that some library catches leaves a half-initialised module behind
(numpy without ``multiply``), and the run went on with it.
"""

import os
import signal
import sys
import time

# the command's start, for the closing line's wall time (kept when set: the ranks --ranks starts inherit the launcher's)
os.environ.setdefault("SEEDVR2_COMMAND_STARTED", repr(time.time()))

STOPPED_LINE = "python -m examples.seedvr2: stopped by {name} during start-up: nothing was written"
_STOPS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
                                                  "SIGALRM") if hasattr(signal, name))


def _stop_now(signum, frame) -> None:
    """Until the CLI's own handling (or the launcher's forwarding) takes over: one line, and out."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)  # a second signal (Ctrl-C and the launcher's copy) adds no line
    try:
        from .cli.launcher import speaks_for_stop

        speak = speaks_for_stop()
    except Exception:  # noqa: BLE001 - the signal came while the launcher module itself was being imported
        speak = os.environ.get("RANK", "0") in ("", "0")
    if speak:
        os.write(2, (STOPPED_LINE.format(name=signal.Signals(signum).name) + "\n").encode())
    os._exit(128 + signum)


def _restore_here(argv: list[str]) -> int:
    """The restore command in this process (``--ranks 1``): imported only then, as torch comes with it."""
    from .cli.restore import main

    return main(argv)


def _run() -> int:
    if sys.argv[1:2] == ["serve"]:  # the HTTP server starts its own ranks (see .serve)
        from .serve.process import main as serve

        return serve(sys.argv[2:])
    previous = {s: signal.signal(s, _stop_now) for s in _STOPS}
    try:
        if sys.argv[1:2] == ["plan"]:  # the memory planner: no launcher, no restore CLI
            from .cli.plan import main as plan

            return plan(sys.argv[2:])
        from .cli.launcher import launch, wants_launcher

        launcher = wants_launcher(sys.argv[1:])
        if not launcher:
            from .cli.restore import main
        code = launch(sys.argv[1:], run_here=_restore_here) if launcher else main()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code if launcher else end_rank(code)


def end_rank(code: int) -> int:
    """``code``; or, for a failed rank of several, the process ends here with it (``os._exit``): its process group
    was torn down mid-run, and finalising the interpreter beside the backend's threads can end in std::terminate (a
    stray "terminate called ..." line, SIGABRT) instead of the exit code."""
    if code and os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(_run())
