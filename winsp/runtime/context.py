"""The request of the forward in progress, for code that cannot take it as an argument.

Blocks of a third-party model keep their signatures (``forward(x)``), so the modules :func:`winsp.parallelize` swaps
in (attention, patch merging, drop paths) reach the current :class:`~winsp.runtime.runtime.WindowRequest` through a
``ContextVar`` instead. :func:`winsp.parallelize` sets it when the window-parallel region starts and resets it when
the region ends; a model written for winsp can set it too (``with request.active(): ...`` or :func:`active_request`).
A ``ContextVar`` is per thread and per asyncio task, so two forwards in two threads never see each other's request.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Iterator, Optional

import torch

if TYPE_CHECKING:
    from winsp.runtime.runtime import WindowRequest

__all__ = ["current_request", "current_request_or_none", "active_request"]

_CURRENT: ContextVar[Optional["WindowRequest"]] = ContextVar("winsp_current_request", default=None)


def current_request() -> "WindowRequest":
    """The request of the window-parallel region running now; a RuntimeError outside one."""
    request = _CURRENT.get()
    if request is None and torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            "no winsp request is active: a module of a window-parallel region runs during backward, after its region "
            "ended, on a tensor that no module of the region was called with in the forward. That is activation "
            "checkpointing (torch.utils.checkpoint) of a function whose modules get recomputed inputs: checkpoint a "
            "module of the region instead (checkpoint(block, x, ...): winsp re-runs it in the layout it ran in), or "
            "turn checkpointing off inside the region"
        )
    if request is None:
        raise RuntimeError(
            "no winsp request is active: this module runs inside a window-parallel region; call the model "
            "that winsp.parallelize(model, plan, config) prepared (or enter `with request.active():` yourself)"
        )
    return request


def current_request_or_none() -> Optional["WindowRequest"]:
    """The active request, or None outside a window-parallel region."""
    return _CURRENT.get()


@contextmanager
def active_request(request: "WindowRequest") -> Iterator["WindowRequest"]:
    """Make ``request`` the one :func:`current_request` returns inside the ``with`` block (nesting restores)."""
    token = _CURRENT.set(request)
    try:
        yield request
    finally:
        _CURRENT.reset(token)


def _enter(request: "WindowRequest"):
    """Set ``request`` current without a ``with`` block (for a pair of forward hooks); returns the reset token."""
    return _CURRENT.set(request)


def _leave(token) -> None:
    _CURRENT.reset(token)
