"""``python -m examples.seedvr2 restore INPUT -o OUTPUT``: see :mod:`examples.seedvr2.cli`.

With ``--ranks N`` this process is the launcher (:mod:`examples.seedvr2.launcher`): it starts the N ranks before
anything imports torch here, so torch is imported once per rank and never in the launcher.
Importing torch takes seconds; a Ctrl-C in that time (before the CLI installs its signal handling) is one line and
exit 130 like any other stop, not a ``KeyboardInterrupt`` traceback. Nothing has been written yet then.

The Ctrl-C is held until the imports finish rather than raised inside them: a ``KeyboardInterrupt`` raised in the
middle of an import that some library catches leaves a half-initialised module behind (numpy without ``multiply``),
and the run went on with it.
"""

import signal
import sys

STOPPED_LINE = "python -m examples.seedvr2: stopped by SIGINT during start-up: nothing was written"


def _run() -> int:
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        if sys.argv[1:2] == ["plan"]:  # the memory planner: no launcher, no restore CLI
            from .plan import main as plan
        else:
            plan = None
        from .launcher import launch, wants_launcher

        launcher = wants_launcher(sys.argv[1:])
        if not launcher:
            from .cli import main
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        print(STOPPED_LINE, file=sys.stderr)
        return 130
    if plan is not None:
        return plan(sys.argv[2:])
    return launch(sys.argv[1:]) if launcher else main()


if __name__ == "__main__":
    sys.exit(_run())
