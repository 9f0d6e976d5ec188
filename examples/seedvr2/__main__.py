"""``python -m examples.seedvr2 restore INPUT -o OUTPUT``: see :mod:`examples.seedvr2.cli`.

Importing torch takes seconds; a Ctrl-C in that time (before the CLI installs its signal handling) is one line and
exit 130 like any other stop, not a ``KeyboardInterrupt`` traceback. Nothing has been written yet then.
"""

import sys

if __name__ == "__main__":
    try:
        from .cli import main
    except KeyboardInterrupt:
        print("python -m examples.seedvr2: stopped by SIGINT during start-up: nothing was written", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
