"""Attention backends: a registry mapping a name to (why it cannot run here, how to load its runner).

Each backend lives in a small module of its own and registers one :class:`Backend`. The runtime resolves the choice
once per request shape (device, dtype, segments) and keeps the loaded runner in its store, so a layer call neither
re-selects nor retries an import.
"""

from __future__ import annotations

import torch

import winsp.attention.backends.batched_sdpa as batched_sdpa
import winsp.attention.backends.flash_varlen as flash_varlen
import winsp.attention.backends.flex as flex
import winsp.attention.backends.grouped_sdpa as grouped_sdpa
import winsp.attention.backends.torch_varlen as torch_varlen
from winsp.attention.backends.base import Backend, Runner
from winsp.attention.segments import WindowSegments

__all__ = ["Backend", "Runner", "REGISTRY", "BACKENDS", "check_backend_name", "available_backends",
           "select_backend", "explain_backend", "load_backend", "bind_backend"]

#: Every backend by name, in ``"auto"`` preference order.
REGISTRY: dict[str, Backend] = {
    b.name: b for b in (flash_varlen.BACKEND, torch_varlen.BACKEND, flex.BACKEND, batched_sdpa.BACKEND,
                        grouped_sdpa.BACKEND)
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


def bind_backend(name: str, segments: WindowSegments, index) -> Runner:
    """The runner of backend ``name`` bound to one rank's ``segments`` and their device ``index`` tensors."""
    return REGISTRY[check_backend_name(name)].bind(segments, index)


def explain_backend(
    device: torch.device | str,
    segments: WindowSegments | None,
    requested: str = "auto",
    *,
    dtype: torch.dtype | None = None,
    modded: bool = False,
) -> tuple[str, tuple[str, ...]]:
    """Resolve ``requested`` to a backend; returns ``(name, why the backends before it were passed over)``.

    ``"auto"`` takes the first backend of :data:`BACKENDS` that can run these ``segments`` with ``dtype`` on
    ``device`` and, for a call with a ``score_mod`` / ``mask_mod`` (``modded``), can apply it (flash_varlen,
    torch_varlen: CUDA with float16/bfloat16, no mods; flex: CUDA, calls with mods; batched_sdpa: one segment length;
    grouped_sdpa: always). An explicit backend that cannot run raises ValueError naming it and the reason.
    ``dtype`` None skips the dtype check.
    """
    device = torch.device(device)
    check_backend_name(requested)
    if requested != "auto":
        backend = REGISTRY[requested]
        reason = backend.unavailable_reason(device, segments, dtype)
        if reason is None and modded and not backend.takes_score_mods:
            reason = "it cannot take a score_mod or mask_mod"
        if reason is not None:
            raise ValueError(f"attention backend {requested!r} cannot run: {reason}")
        return requested, ()
    skipped: list[str] = []
    for name, backend in REGISTRY.items():
        reason = backend.auto_rule(device, modded) or backend.unavailable_reason(device, segments, dtype)
        if reason is None:
            return name, tuple(skipped)
        skipped.append(f"{name}: {reason}")
    raise AssertionError("grouped_sdpa always runs")  # pragma: no cover


def select_backend(
    device: torch.device | str,
    segments: WindowSegments | None,
    requested: str = "auto",
    *,
    dtype: torch.dtype | None = None,
    modded: bool = False,
) -> str:
    """The backend :func:`explain_backend` resolves ``requested`` to."""
    return explain_backend(device, segments, requested, dtype=dtype, modded=modded)[0]


def load_backend(name: str) -> Runner:
    """The runner of a backend that :func:`select_backend` chose (imports its kernel once)."""
    return REGISTRY[check_backend_name(name)].load()
