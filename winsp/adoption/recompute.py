"""Activation checkpointing inside a :func:`winsp.parallelize` region: a module recomputed during backward runs with
the request, and the layout, it ran with in the forward.

``torch.utils.checkpoint`` (reentrant or not) calls a block's forward a second time during backward, after the region
ended: no request is current then, and the request's current layout is the region's last. So every module inside the
region notes, each time it is called with a request current, that request and its layout, keyed by the call's first
tensor argument (a checkpoint hands the recomputation the same tensor, or a detached alias of it: same data pointer,
shape and strides). A call during backward with no request current looks its note up, makes the request current in
that layout for the call (rows then move and attend exactly as in the forward, through the same collectives in the
same order on every rank; a training forward's functional dropout draws again as it did, under the region's
:class:`~winsp.adoption.region_dropout.RegionDropout`), and puts both back after it. A call that finds no note (the
checkpointed function is not a module of the region, so its modules get recomputed tensors) is refused by
:func:`winsp.current_request` as before; so is one inside a ``torch.compile`` d block (its calls take no notes: the
hooks stay out of the graph).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

import winsp.adoption.region_dropout as region_dropout
import winsp.runtime.context as context

__all__ = ["watch_recompute", "replaying"]

NOTES_PER_MODULE = 64  # forward calls remembered per module (a few forwards' worth; older ones are dropped)


def _key(args: tuple) -> Optional[tuple]:
    x = next((a for a in args if isinstance(a, Tensor)), None)
    if x is None or x.device.type == "meta":
        return None
    return x.data_ptr(), tuple(x.shape), tuple(x.stride())


def _state(request) -> tuple:
    return request.layer, request._slot, request._now


def _set_state(request, state: tuple) -> None:
    request.layer, request._slot, request._now = state


def watch_recompute(model: nn.Module, paths: list[str], modes: Optional[list] = None) -> list:
    """Hooks on the modules at ``paths`` that note each forward call's request and layout and restore them when the
    call is recomputed during backward; returns the handles. The note hook runs before any other pre-hook of the
    module (a layer entry moves rows from the layout noted). ``modes``: the region calls' dropout modes in progress
    (:func:`winsp.adoption.region_checks.watch_rows`'s), pushed again for a recomputation of a call made under one."""
    handles = []
    modes = [] if modes is None else modes
    for path in paths:
        module = model.get_submodule(path)
        notes: OrderedDict = OrderedDict()
        restored: list = []
        handles.append(module.register_forward_pre_hook(_before(path, notes, restored, modes), prepend=True))
        handles.append(module.register_forward_hook(_after(restored), always_call=True))
    return handles


def _before(path: str, notes: OrderedDict, restored: list, modes: list):
    def hook(module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():  # a compiled block's call: no notes (its recomputation is refused)
            return None
        request = context.current_request_or_none()
        key = _key(args)
        if request is not None:
            if key is not None and request._now is not None:
                notes[key] = (request, _state(request), modes[-1] if modes else None)
                notes.move_to_end(key)
                while len(notes) > NOTES_PER_MODULE:
                    notes.popitem(last=False)
            restored.append(None)
            return None
        note = notes.get(key) if key is not None and torch._C._current_graph_task_id() != -1 else None
        if note is None:
            restored.append(None)
            return None
        noted, state, mode = note
        restored.append((noted, _state(noted), context._enter(noted), _again(mode, path)))
        _set_state(noted, state)
        return None

    return hook


def _again(mode: Optional[region_dropout.RegionDropout], path: str) -> Optional[region_dropout.RegionDropout]:
    """A dropout mode for a recomputation, as the forward's ``mode`` was (None: the forward pushed none)."""
    if mode is None:
        return None
    again = region_dropout.enter(mode.policy, path)
    if again is not None:
        again.model, again.tokens = mode.model, mode.tokens
    return again


def _after(restored: list):
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():
            return None
        entry = restored.pop() if restored else None
        if entry is not None:
            request, state, token, mode = entry
            region_dropout.leave(mode)
            _set_state(request, state)
            context._leave(token)
        return None

    return hook


def replaying() -> Callable[..., Any]:
    """Called in a forward inside a region: a runner ``run(fn, *args, **kwargs)`` that calls ``fn`` as is while the
    same request is current in the same layout, and otherwise (a recomputation in backward, after the region ended)
    with that request current in the layout noted now, and the region's dropout mode pushed again. For a checkpointed
    function that is not a module call (:func:`winsp.swapped` with ``checkpoint=True``)."""
    request = context.current_request_or_none()
    state = _state(request) if request is not None else ()
    mode = next((m for m in reversed(torch.overrides._get_current_function_mode_stack())
                 if isinstance(m, region_dropout.RegionDropout)), None)
    policy = mode.policy if mode is not None else None

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if request is None or context.current_request_or_none() is request:
            return fn(*args, **kwargs)
        before, token = _state(request), context._enter(request)
        dropout = None if policy is None else region_dropout.enter(policy, "<recomputed>")
        _set_state(request, state)
        try:
            return fn(*args, **kwargs)
        finally:
            region_dropout.leave(dropout)
            _set_state(request, before)
            context._leave(token)

    return run
