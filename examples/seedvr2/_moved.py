"""The module paths from before examples/seedvr2 was laid out in folders by layer, kept working.

``examples.seedvr2.cli``, ``.media`` and ``.pipeline`` were single modules. Now ``cli/`` and ``media/`` are folders
and the pipeline lives in ``restore/``; the names those modules defined still import from the old paths
(``from examples.seedvr2.cli import main``), each from the module that defines it now. They are looked up lazily, so
that importing a light module of a folder (``cli.launcher``: no torch) does not import the rest. New code imports from
the defining module (the ``MOVED`` table of each old path says which).
"""

from __future__ import annotations

import importlib
from typing import Callable


def moved_names(path: str, homes: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the old module path ``path``: name -> the module that defines it now."""

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {path!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    def __dir__() -> list[str]:
        return sorted(set(homes) | set(vars(importlib.import_module(path))))

    return __getattr__, __dir__
