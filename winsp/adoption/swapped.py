"""``winsp.swapped(fn)``: a module swap written as one function, for a
:class:`~winsp.adoption.parallelize.ParallelPlan`.

A swapped module must reuse the original's parameters (``winsp.adopt``) and usually needs to know which window layer
(or stage) it is; most adapters then only differ in ``forward``. ``swapped(fn)`` is the factory a plan takes for
``make_attention``, ``make_grid_change`` or a ``swaps`` entry: it builds a :class:`Swapped` module that adopts the
original (same tensors, same state_dict keys, same training mode) and whose forward is ``fn(module, *args, **kwargs)``
with ``module.index`` the layer or stage index the plan passed (None for ``swaps``). The original's plain attributes
(``n_heads``, ``window_size``, ...) are kept too, so ``fn`` reads them as the original's forward does, and
``module.swapped_from`` is the original's class name (one ``fn`` serving several kinds of block can tell them apart).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from winsp.adoption.parallelize import adopt

__all__ = ["Swapped", "swapped"]


class Swapped(nn.Module):
    """The original module's parameters, buffers, children and plain attributes, with
    ``forward = fn(self, *args, **kwargs)``."""

    def __init__(self, fn: Callable[..., Any], original: nn.Module, index: Optional[int] = None) -> None:
        super().__init__()
        if not callable(fn):
            raise ValueError(f"winsp.swapped needs a function fn(module, *args), got {type(fn).__name__}")
        for name in ("fn", "index"):
            if hasattr(original, name):
                raise ValueError(f"winsp.swapped: {type(original).__name__} has an attribute {name!r}, which the "
                                 f"swapped module uses; write a module with winsp.adopt instead")
        adopt(self, original)
        for name, value in vars(original).items():  # plain attributes; parameters, buffers and children are adopted
            if not name.startswith("_") and name != "training" and name not in vars(self):
                object.__setattr__(self, name, value)
        self.fn, self.index = fn, index
        self.swapped_from = type(original).__name__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.swapped_from} -> {getattr(self.fn, '__qualname__', self.fn)}, index={self.index}"


def swapped(fn: Callable[..., Any]) -> Callable[..., Swapped]:
    """The factory ``(original, index=None) -> Swapped(fn, original, index)`` for a plan's swaps."""
    if not callable(fn):
        raise ValueError(f"winsp.swapped needs a function fn(module, *args), got {type(fn).__name__}")

    def make(original: nn.Module, index: Optional[int] = None) -> Swapped:
        return Swapped(fn, original, index)

    return make
