"""The planning/compute split, marked in code: :func:`planning_phase` says "this block plans".

A request has two phases (docs/design.md, "Planning and compute"). **Planning** reads host values (grids, lengths,
split sizes) once a request and builds plans as host tensors, moved to the device in one place. **Compute** (the
layer loop) never reads a value back from the device, never mixes devices, and issues the same collectives on every
rank. Code outside a :func:`planning_phase` block is compute.

The marker costs a thread-local flag in a normal run. A checker (``winsp.testing.fake_gpu``) installs an observer
with :func:`set_phase_observer` to learn where planning starts and ends, and holds compute to its rule.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, Protocol, TypeVar

__all__ = ["planning_phase", "plans", "current_phase", "set_phase_observer", "PhaseObserver"]

F = TypeVar("F", bound=Callable)


class PhaseObserver(Protocol):
    def enter_planning(self, what: str) -> None: ...

    def exit_planning(self, what: str) -> None: ...


_state = threading.local()
_observer: list[PhaseObserver | None] = [None]


def current_phase() -> str:
    """``"planning"`` inside a :func:`planning_phase` block (on this thread), else ``"compute"``."""
    return "planning" if getattr(_state, "depth", 0) else "compute"


@contextlib.contextmanager
def planning_phase(what: str = "") -> Iterator[None]:
    """Mark a block as planning: it may read host values (``.tolist()``, ``.item()``) of host tensors; ``what``
    names it in a checker's report. Nested blocks are one phase."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    observer = _observer[0]
    if observer is not None and depth == 0:
        observer.enter_planning(what)
    try:
        yield
    finally:
        _state.depth = depth
        if observer is not None and depth == 0:
            observer.exit_planning(what)


def plans(fn: F) -> F:
    """Decorator: every call of ``fn`` is a :func:`planning_phase` block named after ``fn``."""
    what = getattr(fn, "__qualname__", repr(fn))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with planning_phase(what):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def set_phase_observer(observer: PhaseObserver | None) -> PhaseObserver | None:
    """Install ``observer`` (told where each outermost planning block starts and ends); returns the previous one."""
    previous, _observer[0] = _observer[0], observer
    return previous
