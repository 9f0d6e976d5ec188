"""``winsp.swapped(fn)``: a module swap written as one function, for a
:class:`~winsp.adoption.parallelize.ParallelPlan`.

A swapped module must reuse the original's parameters (``winsp.adopt``) and usually needs to know which window layer
(or stage) it is; most adapters then only differ in ``forward``. ``swapped(fn)`` is the factory a plan takes for
``make_attention``, ``make_grid_change`` or a ``swaps`` entry: it builds a :class:`Swapped` module that adopts the
original (same tensors, same state_dict keys, same training mode) and whose forward is ``fn(module, *args, **kwargs)``
with ``module.index`` the layer or stage index the plan passed (None for ``swaps``). The original's plain attributes
(``n_heads``, ``window_size``, ...) are kept, and so are its methods (bound to the swapped module, so ``fn`` may call
``module.lerp(...)`` as the original's forward does; a method using zero-argument ``super()`` cannot be called on it).
``module.request`` is :func:`winsp.current_request`; ``module.swapped_from`` is the original's class name (one ``fn``
serving several kinds of block can tell them apart).

``swapped(fn, checkpoint=True)`` recomputes ``fn`` in backward (``torch.utils.checkpoint``, non-reentrant) in a
training forward, for a model whose replaced forward checkpointed itself; the recomputation runs with the request and
layout of the forward call (:func:`winsp.adoption.recompute.replaying`).
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Optional

import torch
from torch import nn

from winsp.adoption.parallelize import adopt
from winsp.adoption.recompute import replaying
from winsp.runtime.context import current_request

__all__ = ["Swapped", "swapped"]


class Swapped(nn.Module):
    """The original module's parameters, buffers, children, plain attributes and methods, with
    ``forward = fn(self, *args, **kwargs)``."""

    def __init__(self, fn: Callable[..., Any], original: nn.Module, index: Optional[int] = None, *,
                 checkpoint: bool = False) -> None:
        super().__init__()
        if not callable(fn):
            raise ValueError(f"winsp.swapped needs a function fn(module, *args), got {type(fn).__name__}")
        for name in ("fn", "index", "request"):
            if hasattr(original, name):
                raise ValueError(f"winsp.swapped: {type(original).__name__} has an attribute {name!r}, which the "
                                 f"swapped module uses; write a module with winsp.adopt instead")
        adopt(self, original)
        for name, value in vars(original).items():  # plain attributes; parameters, buffers and children are adopted
            if not name.startswith("_") and name != "training" and name not in vars(self):
                object.__setattr__(self, name, value)
        self.fn, self.index, self.checkpoint = fn, index, checkpoint
        self.swapped_from = type(original).__name__
        object.__setattr__(self, "_swapped_class", type(original))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            cls = self.__dict__.get("_swapped_class")
            if cls is None or name.startswith("__"):
                raise
            try:
                static = inspect.getattr_static(cls, name)
            except AttributeError:
                raise AttributeError(f"{type(self).__name__} (swapped from {cls.__name__}) has no attribute "
                                     f"{name!r}") from None
            if isinstance(static, property) and static.fget is not None:
                return static.fget(self)
            if isinstance(static, types.FunctionType):  # a method: bound to the swapped module
                return types.MethodType(static, self)
            return getattr(cls, name)  # staticmethod, classmethod, class attribute

    @property
    def request(self):
        """:func:`winsp.current_request` (the request of the region running now)."""
        return current_request()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.checkpoint and self.training and torch.is_grad_enabled():
            replay = replaying()
            return torch.utils.checkpoint.checkpoint(lambda *a: replay(self.fn, self, *a, **kwargs), *args,
                                                     use_reentrant=False)
        return self.fn(self, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.swapped_from} -> {getattr(self.fn, '__qualname__', self.fn)}, index={self.index}"


def swapped(fn: Callable[..., Any], *, checkpoint: bool = False) -> Callable[..., Swapped]:
    """The factory ``(original, index=None) -> Swapped(fn, original, index)`` for a plan's swaps; ``checkpoint``:
    recompute ``fn`` in backward (module docstring).

    The swapped module ``m`` runs ``fn(m, *args, **kwargs)`` in place of the original's forward. ``m`` holds the
    original's parameters, buffers, children, plain attributes and methods, and two more names for ``fn``:

    - ``m.index``: which window layer this module is (``make_attention``: the i-th attention the forward runs) or
      which stage it leads into (``make_grid_change``); None for a ``swaps`` entry;
    - ``m.request``: the request of the region running now (:func:`winsp.current_request`), whose methods do the
      parallel work: ``m.request.attention(q, k, v, layer=m.index)`` (rows ``[N, heads, head_dim]``, returns
      ``(out, text_out)``), ``m.request.to_grid(x, m.index)``, ``m.request.sample_rows(cond)``.

    For example, for an attention module with ``qkv``, ``proj`` and ``heads`` (``make_attention=swapped(attend)``)::

        def attend(m, x):  # x: this rank's rows [N, dim], already in layer m.index's layout
            q, k, v = m.qkv(x).unflatten(-1, (3, m.heads, -1)).unbind(-3)
            return m.proj(m.request.attention(q, k, v, layer=m.index)[0].flatten(1))

    ``m.swapped_from`` is the original's class name. Guide: docs/adopting_a_model.md.
    """
    if not callable(fn):
        raise ValueError(f"winsp.swapped needs a function fn(module, *args), got {type(fn).__name__}")

    def make(original: nn.Module, index: Optional[int] = None) -> Swapped:
        return Swapped(fn, original, index, checkpoint=checkpoint)

    return make
