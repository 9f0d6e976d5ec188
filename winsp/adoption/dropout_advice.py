"""Whether a row-wise dropout draw inside a :func:`winsp.parallelize` region is the original's, and so what a refusal
may suggest: only what is exact for that model.

:class:`winsp.RowDropout` draws the original's mask over the current grid's tokens channels-last, row-major in
(t, h, w), samples one after the other, and keeps this rank's rows. ``ParallelPlan(dropout="rows")`` draws it over the
region's token tensor as it came in: in the ``TokenIO``'s axis order (``FlatTokens(order="hwt")``: frames fastest),
with the replicated tokens the region holds at their place (a class token in front). Either is the original's draw
only where the original's tensor at that dropout is that tensor. winsp knows none is when the dropout's input is not
this rank's rows (a batch of one, a window-cut tensor) or the ``TokenIO`` presents the tokens otherwise than as rows
(``Patches``); it *cannot know* when the dropout runs inside a forward the plan swapped (the original may have applied
it to a padded, rolled or window-cut tensor: a Swin attention's ``proj_drop``) or under a ``TokenIO`` that does not
say its order (a ``row_major`` attribute). Then the refusal says so and points to ``winsp.testing.check_parallel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn

__all__ = ["Advice", "advice", "token_order", "presented_dims", "not_exact_refusal"]

CHECK = ("check with winsp.testing.check_parallel(..., train=True) against the untouched model before training with "
         "it")
OFF = "train with it off (p=0) or in eval mode, or end the region before it"


@dataclass(frozen=True)
class Advice:
    """``exact``: True (a row-wise draw is the original's), False (winsp knows none is) or None (cannot know); ``why``:
    the cause, for False and None; ``at``: for an exact draw over the region's tokens in their own order or with the
    replicated tokens beside them, ``(index, total)`` for :func:`winsp.runtime.row_dropout` (only
    ``ParallelPlan(dropout="rows")`` draws that way; :class:`winsp.RowDropout` draws row-major over the rows alone)."""

    exact: Optional[bool]
    why: str = ""
    at: Optional[tuple[Tensor, int]] = None


def not_exact_refusal(where: str, said: Advice, only_where: str) -> str:
    """The refusal's text where ``said`` is not exact: after ``where`` (what would be drawn over local rows), why no
    row-wise draw is the original's and the ways out (False), or why winsp cannot know, ``only_where`` (the sentence
    that says where the suggested draw would be the original's) and the check to run (None)."""
    if said.exact is False:
        return f"{where}, and no row-wise draw reproduces it here: {said.why}. {OFF[0].upper() + OFF[1:]}"
    return f"{where}; {said.why}. {only_where}: {CHECK}, or {OFF}"


def token_order(tokens: Any) -> Union[str, Literal[False], None]:
    """The axis order in which a region's ``TokenIO`` holds each sample's tokens (``"thw"``: row-major), False for one
    that does not hold them as rows of a ``[B, L, C]`` / ``[B, T, H, W, C]`` tensor, None where it does not say."""
    from winsp.adoption.parallelize import ChannelsLast
    from winsp.adoption.region import ChannelsFirst
    from winsp.adoption.token_io import FlatTokens, Patches

    if isinstance(tokens, (ChannelsLast, ChannelsFirst)):
        return "thw"
    if isinstance(tokens, FlatTokens):
        return tokens.order
    if isinstance(tokens, Patches):
        return False
    said = getattr(tokens, "row_major", None)
    return "thw" if said is True else False if said is False else None


def presented_dims(x: Any, rows: int, tokens: Any) -> Optional[tuple[int, int]]:
    """``(rows dim, channels dim)`` of ``x`` if it holds this rank's ``rows`` as a ``ChannelsFirst`` region
    (``tokens``) presents them, one sample ``[1, C, L, 1, 1]``, or as the model's permute to channels-last makes them,
    ``[1, L, 1, 1, C]`` (``[1, C, L, 1]`` / ``[1, L, 1, C]`` for ``spatial_dims=2``); None for any other tensor or
    region."""
    from winsp.adoption.region import ChannelsFirst

    if not isinstance(tokens, ChannelsFirst) or not isinstance(x, Tensor) or x.dim() != tokens.spatial_dims + 2 \
            or x.shape[0] != 1:
        return None
    if x.shape[2] == rows and all(n == 1 for n in x.shape[3:]):
        return 2, 1
    if x.shape[1] == rows and all(n == 1 for n in x.shape[2:-1]):
        return 1, x.dim() - 1
    return None


def _swapped_above(model: nn.Module, applied: Any, path: str) -> Optional[str]:
    """The innermost module at or above ``path`` that the plan swapped (its forward is the adapter's), if any."""
    swaps = {id(parent._modules[name]) for parent, name, *_ in applied.swapped if name in parent._modules}
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


def _positions(request: Any, order: str, replicated: Any) -> Optional[tuple[Tensor, int]]:
    """``(index, total)``: where each row of ``[held; local]`` (or ``[local; held]``) lies in the original's tensor
    ``[B, count + L, ...]`` flattened, the tokens in ``order``; None for samples on different grids."""
    grids = sorted(set(request.stage_model_grids[request.stage]))
    if len(grids) != 1:
        return None
    sizes = dict(zip("thw", grids[0], strict=True))
    samples, per_sample = len(request.stage_model_grids[request.stage]), math.prod(grids[0])
    count = replicated.count if replicated is not None else 0
    first = replicated is not None and replicated.at == "first"
    stride, total = per_sample + count, samples * (per_sample + count)
    ids = request.model_rows
    q = ids % per_sample
    coords = {"t": q // (sizes["h"] * sizes["w"]), "h": (q // sizes["w"]) % sizes["h"], "w": q % sizes["w"]}
    pos = torch.zeros_like(ids)
    for axis in order:
        pos = pos * sizes[axis] + coords[axis]
    rows = torch.where(ids < samples * per_sample, ids // per_sample * stride + (count if first else 0) + pos, total)
    if not count:
        return rows, total
    j = torch.arange(samples * count, device=ids.device)
    held = j // count * stride + (j % count if first else per_sample + j % count)
    return (torch.cat([held, rows]) if first else torch.cat([rows, held])), total


def advice(model: Optional[nn.Module], path: str, x: Any, request: Any, *, held: bool) -> Advice:
    """Whether a row-wise draw is exact for the dropout at ``path`` (a module, or the innermost region module calling a
    dropout function) taking ``x`` in ``model``'s region; ``held``: ``x`` is this rank's rows next to replicated
    tokens."""
    shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
    rows = request._current_layout().num_rows
    if not held and (not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != rows):
        return Advice(False, f"its input {shape} is not this rank's {rows} rows (a batch of one, a window-cut or "
                             f"reshaped tensor), so no row-wise draw is the original's")
    applied = getattr(model, "_winsp_parallel", None) if model is not None else None
    if model is None or applied is None:
        return Advice(None, "winsp cannot see which tensor the original applies it to")
    tokens, replicated = applied.plan.region.tokens, applied.plan.replicated
    order = token_order(tokens)
    if order is False:
        return Advice(False, f"the region's {type(tokens).__name__} presents the tokens otherwise than as rows, so no "
                             f"row-wise draw is the original's")
    if order is None:
        return Advice(None, f"the region's {type(tokens).__name__} does not say in which order it holds the tokens "
                            f"(give it row_major = True or False)")
    if held and (replicated is None or not replicated.held):
        return Advice(None, f"its input {shape} holds {request.num_text_rows} replicated rows next to this rank's "
                            f"{rows}, which the region's input does not hold: winsp cannot tell where the original "
                            f"holds them")
    at = None if order == "thw" and not held else _positions(request, order, replicated if held else None)
    if at is None and (order != "thw" or held):
        return Advice(False, "the samples are on different grids, so the original's tensor has no one layout")
    above = _swapped_above(model, applied, path)
    if above is not None:
        return Advice(None, f"it runs inside {above!r}, whose forward the plan replaced: winsp cannot tell which "
                            f"tensor the original applies it to (a padded, rolled or window-cut one, as a window "
                            f"attention's is, draws another mask)", at)
    return Advice(True, at=at)
