"""Attention backends: a registry mapping a name to (why it cannot run here, how to load its runner).

Each backend lives in a small module of its own and registers one :class:`Backend`. The runtime resolves the choice
once per request shape (device, dtype, segments) and keeps the loaded runner in its store, so a layer call neither
re-selects nor retries an import.
"""

from __future__ import annotations

import torch

from ..segments import WindowSegments
from .base import Backend, Runner
from . import batched_sdpa, flash_varlen, grouped_sdpa, torch_varlen

__all__ = ["Backend", "Runner", "REGISTRY", "BACKENDS", "check_backend_name", "available_backends",
           "select_backend", "load_backend"]

#: Every backend by name, in ``"auto"`` preference order.
REGISTRY: dict[str, Backend] = {
    b.name: b for b in (flash_varlen.BACKEND, torch_varlen.BACKEND, batched_sdpa.BACKEND, grouped_sdpa.BACKEND)
}
BACKENDS: tuple[str, ...] = tuple(REGISTRY)


def check_backend_name(name: object) -> str:
    """``name`` if it is ``"auto"`` or a registered backend, else a ValueError listing the choices."""
    if not isinstance(name, str) or (name != "auto" and name not in REGISTRY):
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {list(BACKENDS)}")
    return name


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on ``device`` for some inputs, in ``"auto"`` preference order.

    The varlen kernels additionally need float16/bfloat16 inputs; ``batched_sdpa`` needs windows of a single segment
    length. :func:`select_backend` checks those against concrete segments.
    """
    device = torch.device(device)
    return [name for name, b in REGISTRY.items() if b.unavailable_reason(device, None, None) is None]


def select_backend(
    device: torch.device | str,
    segments: WindowSegments,
    requested: str = "auto",
    *,
    dtype: torch.dtype | None = None,
) -> str:
    """Resolve ``requested`` to a concrete backend for ``segments`` on ``device``.

    ``"auto"`` takes the first backend of :data:`BACKENDS` that can run (flash_varlen, torch_varlen: CUDA with
    float16/bfloat16; batched_sdpa: one segment length; grouped_sdpa: always). An explicit backend that cannot run
    raises ValueError naming it and the reason. ``dtype`` None skips the dtype check.
    """
    device = torch.device(device)
    check_backend_name(requested)
    if requested == "auto":
        for name, backend in REGISTRY.items():
            if backend.unavailable_reason(device, segments, dtype) is None:
                return name
        raise AssertionError("grouped_sdpa always runs")  # pragma: no cover
    reason = REGISTRY[requested].unavailable_reason(device, segments, dtype)
    if reason is not None:
        raise ValueError(f"attention backend {requested!r} cannot run: {reason}")
    return requested


def load_backend(name: str) -> Runner:
    """The runner of a backend that :func:`select_backend` chose (imports its kernel once)."""
    return REGISTRY[check_backend_name(name)].load()
