"""``python -m examples.seedvr2 restore INPUT -o OUTPUT``: see :mod:`examples.seedvr2.cli`.

With ``--ranks N`` this process is the launcher (:mod:`examples.seedvr2.launcher`): it starts the N ranks before
anything imports torch here, so torch is imported once per rank and never in the launcher.
Importing torch takes seconds; a stop signal in that time (Ctrl-C, SIGTERM, SIGHUP, ...: every one the CLI handles,
before it installs its handling) is one line and exit 128 + N like any other stop, not a ``KeyboardInterrupt``
traceback nor a silent death by the signal. Nothing has been written yet then. Of several ranks only rank 0 says it.

The signal is held until the imports finish rather than acted on inside them: a ``KeyboardInterrupt`` raised in the
middle of an import that some library catches leaves a half-initialised module behind (numpy without ``multiply``),
and the run went on with it.
"""

import os
import signal
import sys

STOPPED_LINE = "python -m examples.seedvr2: stopped by {name} during start-up: nothing was written"
_HELD = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
                                                 "SIGALRM") if hasattr(signal, name))


def _run() -> int:
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in _HELD}
    try:
        from .launcher import launch, wants_launcher

        launcher = wants_launcher(sys.argv[1:])
        if not launcher:
            from .cli import main
        if not held:  # until the CLI's own handling (or the launcher's forwarding) takes over: at once
            for s in _HELD:
                signal.signal(s, _stop_now)
    finally:
        if held:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if held:
        _say_stopped(held[0])
        return 128 + held[0]
    try:
        return launch(sys.argv[1:]) if launcher else main()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _say_stopped(signum: int) -> None:
    from .launcher import env_rank

    if env_rank() == 0:
        print(STOPPED_LINE.format(name=signal.Signals(signum).name), file=sys.stderr, flush=True)


def _stop_now(signum, frame) -> None:
    _say_stopped(signum)
    os._exit(128 + signum)


if __name__ == "__main__":
    sys.exit(_run())
