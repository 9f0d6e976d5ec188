"""``python -m examples.seedvr2 restore INPUT -o OUTPUT``: see :mod:`examples.seedvr2.cli`.

With ``--ranks N`` this process is the launcher (:mod:`examples.seedvr2.launcher`): it starts the N ranks before
anything imports torch here, so torch is imported once per rank and never in the launcher.
"""

import sys


def _run() -> int:
    from .launcher import launch, wants_launcher

    if wants_launcher(sys.argv[1:]):
        return launch(sys.argv[1:])
    from .cli import main

    return main()


if __name__ == "__main__":
    sys.exit(_run())
