"""``python -m examples.seedvr2 restore INPUT -o OUTPUT``: see :mod:`examples.seedvr2.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
