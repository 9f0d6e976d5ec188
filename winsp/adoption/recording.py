"""Recording the order a model's forward runs a plan's steps in, before its first parallel forward.

The model runs once with its original modules back in place on meta tensors (or, for a model that cannot, on the real
inputs without grad); each layer entry and grid change notes itself as it starts. The plan's layers and grid changes
are then numbered in that order (:func:`renumber`, re-applying the plan where needed), or a stated order is checked.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from winsp.adoption.region_fit import check_fit

if TYPE_CHECKING:
    from winsp.adoption.parallelize import _Applied

__all__ = ["dry_run", "renumber", "forward_originals", "HOOK_DICTS"]

def dry_run(applied: _Applied, module: nn.Module, args: tuple, kwargs: dict, *, repeats: bool) -> None:
    """Before the first forward: record the steps the forward takes with the original modules on meta tensors (or,
    for a model that cannot run on them and an order not stated, once on the real inputs without grad); renumber
    the layers in that order unless the plan stated it; raise if they do not fit the plan's stages."""
    model, order = applied.model, applied.order
    seen: dict = {}  # what the recording forward saw of the region (region_fit)
    found = "a forward on meta tensors"
    try:
        recorded = order.record(lambda: forward_originals(applied, module, args, kwargs, meta=True, seen=seen))
    except Exception as err:  # noqa: BLE001 - an op without a meta kernel, data-dependent code (.item(), nonzero)
        why = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        if applied.stated:
            warnings.warn(f"winsp.parallelize: {type(model).__name__} cannot run on meta tensors ({why}); the plan's "
                          f"forward order is checked step by step as the forward runs", stacklevel=2)
            order.dry_run_done = True
            return
        try:
            recorded = order.record(lambda: forward_originals(applied, module, args, kwargs, meta=False,
                                                                     seen=seen))
        except Exception as again:  # noqa: BLE001 - e.g. a module put in after parallelize that needs a request
            again_why = (str(again).strip().splitlines() or [type(again).__name__])[0][:160]
            warnings.warn(f"winsp.parallelize: {type(model).__name__} cannot run on meta tensors ({why}) nor as its "
                          f"original modules ({again_why}); its layers keep named_modules order, checked step by step "
                          f"as the forward runs (ParallelPlan.forward_order states another)", stacklevel=2)
            order.dry_run_done = True
            return
        warnings.warn(f"winsp.parallelize: {type(model).__name__} cannot run on meta tensors ({why}); its forward "
                      f"order is recorded once from a no-grad forward of the original modules on the real inputs "
                      f"(ParallelPlan.forward_order states it instead)", stacklevel=2)
        found = "a no-grad forward of the original modules"
    check_fit(applied, seen)
    if not applied.stated:
        recorded = renumber(applied, recorded)
    applied.order.check(recorded, repeats=repeats, found=found)


def renumber(applied: _Applied, recorded: list) -> list:
    """Number the layers and grid changes in the order ``recorded`` ran them (re-applying the plan if that is not how
    they are numbered now); returns ``recorded`` in the new numbering."""
    attention, entries, grids = applied.numbering
    steps = applied.order.steps
    first: dict = {}
    for step in recorded:
        first.setdefault(step, len(first))
    missing = [s for s in steps if (s.kind, s.index) not in first]
    if missing:
        raise ValueError(f"winsp.parallelize: the forward never runs {missing[0]} (found by recording the forward "
                         f"before any rows moved); ParallelPlan.attention / grid_changes match modules the forward "
                         f"does not call")
    layers = sorted(range(len(attention)), key=lambda i: first[("layer", i)])
    changing = sorted(grids)
    moves = sorted(changing, key=lambda s: first[("grid", s)])
    new_layer = {old: new for new, old in enumerate(layers)}
    new_stage = {old: new for old, new in zip(moves, changing, strict=True)}
    relabeled = [(kind, new_layer[i] if kind == "layer" else new_stage[i]) for kind, i in recorded]
    if layers != list(range(len(attention))) or moves != changing:
        from winsp.adoption.parallelize import _apply, _undo  # re-applying is parallelize's

        numbering = ([attention[i] for i in layers], [entries[i] for i in layers],
                     {new_stage[s]: grids[s] for s in changing})
        # by the path each swap was made at: the parent of a nested swap (an attention inside a swapped block) is
        # the original block, no longer in the model
        applied.carried = {path: parent._modules[name] for parent, name, _, path in applied.swapped}
        _undo(applied)  # winsp's own hooks go; the user's stay in the swapped modules' hook dicts, carried over
        try:
            _apply(applied, numbering)
        finally:
            applied.carried = {}
    return relabeled


HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def forward_originals(applied: _Applied, region: nn.Module, args: tuple, kwargs: dict, *, meta: bool,
                      seen: Optional[dict] = None) -> None:
    """``region``'s forward with the original modules back in place, on meta tensors (parameters, buffers and inputs)
    or, ``meta`` False, on the real ones without grad (buffers copied, so running statistics stay as they are), noting
    each layer entry and grid change as it starts (and, in ``seen``, the region's input, first layer entry's tokens
    and output: :mod:`winsp.adoption.region_fit`). Every other forward hook inside the region (winsp's and the
    user's: a hook recording features must not see this forward) is set aside meanwhile; the random state is kept."""
    model, seen = applied.model, {} if seen is None else seen
    current = [(parent, name, parent._modules[name]) for parent, name, _, _ in applied.swapped]
    stash: list = []
    try:
        for parent, name, original, _ in applied.swapped:
            parent._modules[name] = original
        for module in region.modules():
            stash.append((module, {d: getattr(module, d) for d in HOOK_DICTS if hasattr(module, d)}))
            for d in stash[-1][1]:
                object.__setattr__(module, d, OrderedDict())
        for (kind, index), path in applied.step_paths.items():
            target = model.get_submodule(path) if path else model
            target.register_forward_pre_hook(lambda module, a, kind=kind, index=index:
                                             applied.order.arrive(kind, index))
            if kind == "layer":  # the tokens the first layer entry the forward reaches takes (region_fit)
                target.register_forward_pre_hook(lambda module, a, k, path=path: _note(
                    seen, "entry", (path, a[0] if a else next(iter(k.values()), None))), with_kwargs=True)
        start, end = (model.get_submodule(p) if p else model for p in (applied.plan.region.start,
                                                                       applied.plan.region.end))
        start.register_forward_pre_hook(lambda module, a, k: _note(seen, "start", (a, k)), with_kwargs=True)
        end.register_forward_hook(lambda module, a, out: _note(seen, "end", out))
        if meta:
            # torch.empty, not empty_like: a parameter FSDP2 sharded is a DTensor whose .shape is the whole tensor's
            tensors = {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
                       for name, t in list(region.named_parameters()) + list(region.named_buffers())}
            convert = lambda v: tree_map(  # noqa: E731 - tensors inside tuples too (RoPE's (cos, sin))
                lambda t: torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t, v)
        else:
            tensors = {name: t.clone() for name, t in region.named_buffers()}
            convert = lambda v: v  # noqa: E731
        devices = sorted({t.device.index or 0 for t in list(tensors.values()) + list(args) + list(kwargs.values())
                          if isinstance(t, Tensor) and t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.func.functional_call(region, tensors, tuple(convert(a) for a in args),
                                       {k: convert(v) for k, v in kwargs.items()})
    finally:
        for module, hooks in stash:
            for d, value in hooks.items():
                object.__setattr__(module, d, value)
        for parent, name, module in current:
            parent._modules[name] = module


def _note(seen: dict, key: str, value) -> None:
    """Keep the first ``value`` seen under ``key`` (a hook that returns None: the forward runs unchanged)."""
    seen.setdefault(key, value)
