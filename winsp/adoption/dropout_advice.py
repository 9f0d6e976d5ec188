"""What a dropout refusal inside a :func:`winsp.parallelize` region may suggest: only what is exact for that model.

:class:`winsp.RowDropout` and ``ParallelPlan(dropout="rows")`` draw the original's mask over the current grid's tokens
channels-last, row-major in (t, h, w), samples one after the other, and keep this rank's rows. That is the original's
draw only where the original's tensor at that dropout is exactly that. winsp knows it is *not* when

- the dropout's input is not this rank's rows alone (the replicated tokens held next to them, a batch of one, a
  window-cut tensor);
- the region's tokens are ordered otherwise (``FlatTokens(order="hwt")``: frames fastest);

and it *cannot know* when the dropout runs inside a forward the plan swapped (the original may have applied it to a
padded, rolled or window-cut tensor: a Swin attention's ``proj_drop``) or under a ``TokenIO`` that does not say its
order (a ``row_major`` attribute). Then the refusal says so and points to ``winsp.testing.check_parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

__all__ = ["Advice", "advice", "token_order"]

CHECK = ("check with winsp.testing.check_parallel(..., train=True) against the untouched model before training with "
         "it")
OFF = "train with it off (p=0) or in eval mode, or end the region before it"


@dataclass(frozen=True)
class Advice:
    """``exact``: True (the row-wise draw is the original's), False (winsp knows it is not) or None (cannot know);
    ``why``: the cause, for False and None."""

    exact: Optional[bool]
    why: str = ""


def token_order(tokens: Any) -> Optional[bool]:
    """Whether a region's ``TokenIO`` holds the tokens row-major in (t, h, w) (None: it does not say)."""
    from winsp.adoption.parallelize import ChannelsLast
    from winsp.adoption.token_io import FlatTokens, Patches

    if isinstance(tokens, ChannelsLast):
        return True
    if isinstance(tokens, FlatTokens):
        return tokens.order == "thw"
    if isinstance(tokens, Patches):
        return False
    order = getattr(tokens, "row_major", None)
    return order if isinstance(order, bool) else None


def _swapped_above(model: nn.Module, applied: Any, path: str) -> Optional[str]:
    """The innermost module at or above ``path`` that the plan swapped (its forward is the adapter's), if any."""
    swaps = {id(parent._modules[name]) for parent, name, _ in applied.swapped if name in parent._modules}
    parts = path.split(".") if path and path != "<root>" else []
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            continue
        if id(module) in swaps:
            return prefix
    return None


def advice(model: Optional[nn.Module], path: str, x: Any, request: Any, *, held: bool) -> Advice:
    """Whether a row-wise draw is exact for the dropout at ``path`` (a module, or the innermost region module calling a
    dropout function) taking ``x`` in ``model``'s region; ``held``: ``x`` is this rank's rows next to held replicated
    tokens."""
    shape = list(x.shape) if hasattr(x, "shape") else type(x).__name__
    rows = request._current_layout().num_rows
    if held:
        return Advice(False, f"its input {shape} holds the replicated tokens next to this rank's {rows} rows, and the "
                             f"original draws their mask together with the video's in its own order")
    if not hasattr(x, "shape") or x.dim() == 0 or x.shape[0] != rows:
        return Advice(False, f"its input {shape} is not this rank's {rows} rows (a batch of one, a window-cut or "
                             f"reshaped tensor), so no row-wise draw is the original's")
    applied = getattr(model, "_winsp_parallel", None) if model is not None else None
    if model is None or applied is None:
        return Advice(None, "winsp cannot see which tensor the original applies it to")
    tokens = applied.plan.region.tokens
    order = token_order(tokens)
    if order is False and getattr(tokens, "order", None):
        return Advice(False, f"the region's tokens are flattened in order {tokens.order!r} (FlatTokens.order), not "
                             f"row-major in (t, h, w) as the row-wise draw assumes")
    if order is False:
        return Advice(False, f"the region's {type(tokens).__name__} presents the tokens otherwise than row-major rows")
    above = _swapped_above(model, applied, path)
    if above is not None:
        return Advice(None, f"it runs inside {above!r}, whose forward the plan replaced: winsp cannot tell which "
                            f"tensor the original applies it to (a padded, rolled or window-cut one, as a window "
                            f"attention's is, draws another mask)")
    if order is None:
        return Advice(None, f"the region's {type(tokens).__name__} does not say whether it holds the tokens row-major "
                            f"in (t, h, w) (give it row_major = True or False)")
    return Advice(True)
