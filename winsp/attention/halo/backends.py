"""Which kernel runs a neighborhood layer's video queries: ``"tiled"``, ``"flex"`` or ``"natten"`` (or ``"auto"``).

- ``tiled``: masked SDPA over query tiles (:mod:`winsp.attention.halo.layer`): every device and dtype, with backward,
  score mods and text rows. Always runs.
- ``flex``: FlexAttention under a block mask (:mod:`winsp.attention.halo.flex`): compiled on CUDA; on the CPU eager and
  forward only (a call that needs gradients there is refused).
- ``natten``: NATTEN's kernels on each rank's extended box (:mod:`winsp.attention.halo.natten`), where that box is exact
  and the call has no score_mod / mask_mod. Without libnatten, natten runs its own FlexAttention path (float32, forward
  only on the CPU).

``"auto"`` (the default of :class:`winsp.WindowRuntime`'s ``neighborhood_backend``): natten when libnatten is
importable, the device is CUDA and the layer fits; else flex on CUDA (float32 / float16 / bfloat16); else tiled.
The choice is made once per request shape, layer, dtype and head dim, and kept in the runtime's store with the
backend's prepared data (block mask, boxes).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch

from winsp.attention.score_mods import ScoreMods

__all__ = ["NEIGHBORHOOD_BACKENDS", "check_neighborhood_backend", "libnatten_available",
           "explain_neighborhood_backend", "neighborhood_backend", "neighborhood_runner"]

#: Neighborhood backends in ``"auto"`` preference order.
NEIGHBORHOOD_BACKENDS: tuple[str, ...] = ("natten", "flex", "tiled")

_HALF_OR_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def check_neighborhood_backend(name: object) -> str:
    """``name`` if it is ``"auto"`` or a neighborhood backend, else a ValueError listing the choices."""
    if not isinstance(name, str) or (name != "auto" and name not in NEIGHBORHOOD_BACKENDS):
        raise ValueError(f"unknown neighborhood backend {name!r}; choose 'auto' or one of "
                         f"{list(NEIGHBORHOOD_BACKENDS)}")
    return name


def _natten():
    try:
        import natten
    except Exception:
        return None
    return natten


def libnatten_available() -> bool:
    """Whether natten is installed with its compiled kernels (libnatten)."""
    natten = _natten()
    return bool(natten is not None and getattr(natten, "HAS_LIBNATTEN", False))


def _natten_reason(device, dtype, modded, head_dim, auto: bool, layer_reason: Callable[[], Optional[str]]):
    if _natten() is None:
        return "natten is not installed (pip install -e '.[natten]')"
    kernels = libnatten_available()
    if auto and not kernels:
        return "natten is installed without libnatten (its compiled kernels)"
    if auto and device.type != "cuda":
        return "NATTEN's kernels run on CUDA"
    if modded:
        return "NATTEN takes no score_mod / mask_mod"
    if dtype is not None and dtype not in (_HALF_OR_FLOAT if kernels else (torch.float32,)):
        return (f"natten runs float32, float16 and bfloat16, got {dtype}" if kernels else
                f"without libnatten natten runs its FlexAttention path, float32 only here, got {dtype}")
    if kernels and head_dim is not None and head_dim % 8:
        return f"NATTEN's kernels need a head dim that is a multiple of 8, got {head_dim}"
    return layer_reason()


def _flex_reason(device, dtype, auto: bool):
    from winsp.attention.backends.flex import _import

    if _import() is None:
        return "torch.nn.attention.flex_attention is not importable (torch >= 2.5 is needed)"
    if device.type not in ("cuda", "cpu"):
        return f"FlexAttention runs on CUDA and CPU, got {device.type!r}"
    if auto and device.type != "cuda":
        return "on CPU FlexAttention runs eagerly and without a backward; the tiled path is exact with one"
    if auto and dtype is not None and dtype not in _HALF_OR_FLOAT:
        return f"FlexAttention's kernels are used for float32, float16 and bfloat16 only, got {dtype}"
    return None


def explain_neighborhood_backend(
    requested: str,
    device: torch.device | str,
    dtype: Optional[torch.dtype] = None,
    *,
    modded: bool = False,
    head_dim: Optional[int] = None,
    layer_reason: Callable[[], Optional[str]] = lambda: None,
) -> tuple[str, tuple[str, ...]]:
    """Resolve ``requested``; returns ``(name, why the backends before it were passed over)``.

    ``layer_reason()`` says why the layer's extended boxes do not fit NATTEN (None: they do; the same on every rank,
    so that all ranks choose alike). An explicit backend that
    cannot run raises ValueError naming it and the reason.
    """
    device = torch.device(device)
    check_neighborhood_backend(requested)
    reasons = {"natten": lambda auto: _natten_reason(device, dtype, modded, head_dim, auto, layer_reason),
               "flex": lambda auto: _flex_reason(device, dtype, auto), "tiled": lambda auto: None}
    if requested != "auto":
        reason = reasons[requested](False)
        if reason is not None:
            raise ValueError(f"neighborhood backend {requested!r} cannot run: {reason}")
        return requested, ()
    skipped: list[str] = []
    for name in NEIGHBORHOOD_BACKENDS:
        reason = reasons[name](True)
        if reason is None:
            return name, tuple(skipped)
        skipped.append(f"{name}: {reason}")
    raise AssertionError("tiled always runs")  # pragma: no cover


def _layer_key(request, layer: int) -> tuple:
    plan, runtime = request.plan(layer), request.runtime
    return (plan.key or id(plan), runtime.schedule[layer].fingerprint, runtime.rank, str(request.device),
            request.text_lengths)


def _natten_boxes(request, layer: int):
    from winsp.attention.halo.layer import halo_tensors
    from winsp.attention.halo.natten import natten_boxes

    # planning reads the halo's host copy: no device-to-host copy (winsp's planning/compute rule, docs/design.md)
    return request.runtime.store.get(("halo-natten", _layer_key(request, layer)), lambda: natten_boxes(
        halo_tensors(request, layer, "cpu"), request.runtime.schedule[layer], request.plan(layer).layout.grids,
        request.text_lengths, request.device))


def neighborhood_backend(request, layer: int, dtype: Optional[torch.dtype] = None, *, modded: bool = False,
                         head_dim: Optional[int] = None) -> str:
    """The backend ``request``'s neighborhood layer ``layer`` runs with (its runtime's ``neighborhood_backend``)."""
    return _resolve(request, layer, dtype, modded, head_dim)[0]


def _resolve(request, layer, dtype, modded, head_dim):
    key = ("halo-backend", _layer_key(request, layer), request.runtime.neighborhood_backend, dtype, modded, head_dim)
    return request.runtime.store.get(key, lambda: explain_neighborhood_backend(
        request.runtime.neighborhood_backend, request.device, dtype, modded=modded, head_dim=head_dim,
        layer_reason=lambda: _natten_plan_reason(request, layer)))


def _natten_plan_reason(request, layer: int) -> Optional[str]:
    from winsp.attention.halo.natten import natten_plan_reason

    return natten_plan_reason(request.plan(layer), request.runtime.schedule[layer])


def _natten_runner(boxes, q, k_all, v_all, txt, halo, scale, mods):
    from winsp.attention.halo.natten import natten_video_queries

    if not libnatten_available() and q.device.type == "cpu" and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k_all, v_all, *(txt[:2] if txt is not None else ()))):
        raise ValueError("neighborhood_backend='natten' without libnatten runs natten's FlexAttention path, which has "
                         "no backward on CPU; use neighborhood_backend='tiled' (or 'auto') to train on CPU")
    return natten_video_queries(boxes, q, k_all, v_all, txt, scale)


def _flex_runner(data, q, k_all, v_all, txt, halo, scale, mods):
    from winsp.attention.halo.flex import flex_video_queries

    return flex_video_queries(data, q, k_all, v_all, txt, scale, mods)


def neighborhood_runner(request, layer: int, q: torch.Tensor, mods: Optional[ScoreMods]) -> Optional[Callable]:
    """The video-query runner ``(q, k_all, v_all, txt, halo, scale, mods) -> [L, H, D]`` of this call (None: the
    tiled path)."""
    name = _resolve(request, layer, q.dtype, bool(mods), q.shape[-1])[0]
    if name == "tiled":
        return None
    store = request.runtime.store
    if name == "natten":
        boxes, why = _natten_boxes(request, layer)
        if boxes is None:  # the plan-wide check passed, so every rank's boxes must fit
            raise AssertionError(f"rank {request.runtime.rank}: natten boxes refused after the plan's check: {why}")
        return partial(_natten_runner, boxes)
    from winsp.attention.halo.flex import build_flex_neighborhood
    from winsp.attention.halo.layer import _text_samples, halo_tensors

    data = store.get(("halo-flex", _layer_key(request, layer)), lambda: build_flex_neighborhood(
        halo_tensors(request, layer, "cpu"), request.runtime.schedule[layer], request.plan(layer).layout.grids,
        _text_samples(request, "cpu"), request.device))
    return partial(_flex_runner, data)
