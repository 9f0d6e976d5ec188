"""Marking the planning phase for torch.compile without importing dynamo up front.

``torch.compiler.disable`` applied at definition time imports ``torch._dynamo``, which costs seconds at ``import
winsp``. :func:`planning` defers it: while dynamo has not been imported nothing can be compiling, so the function just
runs; once it has, calls go through ``torch._dynamo.disable``, so a compiled caller runs the planning eagerly.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

__all__ = ["planning"]


def planning(fn: F) -> F:
    """Run ``fn`` eagerly under torch.compile (a planning-phase function: numpy, store look-ups, host reads)."""
    disabled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = sys.modules["torch._dynamo"].disable(fn)
        return disabled(*args, **kwargs)

    return run  # type: ignore[return-value]
