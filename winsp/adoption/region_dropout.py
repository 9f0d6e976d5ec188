"""Functional dropout inside a :func:`winsp.parallelize` region: reproduced on local rows, or refused by path.

A block may call ``F.dropout(x, p, self.training)`` (or ``torch.dropout``) itself instead of holding an
``nn.Dropout``: no module to swap, and on local rows ``[L, ...]`` its mask would be drawn over this rank's rows only,
not over the original's whole tensor, so the parallel model would silently draw other numbers. While a region runs a
training forward, :class:`RegionDropout` (a ``TorchFunctionMode``) sees every dropout call on a tensor of local rows
(dim 0 is this rank's row count; under :class:`~winsp.adoption.ChannelsFirst`, also the one sample it presents them
as, ``[1, C, L, 1, 1]``, or ``[1, L, 1, 1, C]`` after the model's permute) and, as ``ParallelPlan.dropout`` says:

- ``"refuse"`` (the default): raises, naming the innermost region module whose forward made the call, the function,
  ``p`` and a fix that is exact for the model, or saying that winsp cannot know (:mod:`winsp.adoption.dropout_advice`);
- ``"rows"``: draws the original's mask over the region's token tensor as it came in, then this rank's rows
  (:func:`winsp.runtime.row_dropout`): channels-last, the tokens in the ``TokenIO``'s order (row-major for
  ``ChannelsLast``), with the replicated tokens the region holds at their place (a tensor of rows beside them is drawn
  so too); under ``ChannelsFirst`` over the original's ``[B, C, T, H, W]`` in the memory order the tensor has there
  (:func:`winsp.runtime.drop_path.presented_dropout`; any other batch of one holding the rows is refused by name);
  refused where winsp knows no row-wise draw is the original's (:mod:`winsp.adoption.dropout_advice`);
- ``"unchecked"``: no mode is pushed (a mode costs about 2 us a torch call in a training forward); for a model known
  to call no functional dropout on local rows. ``nn.Dropout`` modules are still refused by their hooks.

Attention-probability dropout (``scaled_dot_product_attention(..., dropout_p > 0)``) inside the region is refused
by name too; ``request.attention(..., dropout_p=)`` refuses it the same way in a swapped attention.

Channel-wise and alpha dropouts (``dropout1d/2d/3d``, ``alpha_dropout``, ``feature_alpha_dropout``) have no row-wise
equivalent and are refused by name either way. Dropout on any other tensor (a per-sample conditioning vector
``[B, C]``, drawn alike on every rank since every rank holds the same generator state), with ``p == 0`` or not
training runs unchanged. An eval forward pushes no mode, so inference pays nothing.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

import winsp.runtime.drop_path as drop_path
from winsp.adoption.dropout_advice import OFF, advice, not_exact_refusal, presented_dims
from winsp.adoption.region import ChannelsFirst, TokenIO
from winsp.runtime.context import current_request_or_none
from winsp.runtime.drop_path import presented_dropout, row_dropout
from winsp.utils.compile import planning

__all__ = ["DROPOUT_POLICIES", "RegionDropout"]

DROPOUT_POLICIES = ("refuse", "rows", "unchecked")

# element-wise dropout drawn as the original draws: function -> (its name in messages, in place: None for the argument)
_ELEMENTWISE = {F.dropout: ("torch.nn.functional.dropout", None), torch.dropout: ("torch.dropout", False),
                torch.dropout_: ("torch.dropout_", True)}
_CHANNELS = "it drops whole channels or rescales otherwise, which has no row-wise equivalent"
# refused on local rows: function -> (its name, why)
_NO_ROW_WISE: dict[Callable, tuple[str, str]] = {
    **{f: (f"torch.nn.functional.{f.__name__}", _CHANNELS)
       for f in (F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)},
    **{f: (f"torch.{f.__name__}", _CHANNELS)
       for f in (torch.alpha_dropout, torch.alpha_dropout_, torch.feature_dropout, torch.feature_dropout_,
                 torch.feature_alpha_dropout, torch.feature_alpha_dropout_)},
    torch.native_dropout: ("torch.native_dropout", "it returns its mask too, which winsp does not draw row-wise"),
}
_ORDER = ("input", "p", "training", "inplace")  # the functional signatures; torch.* names the third "train"


def _arguments(args: tuple, kwargs: dict) -> tuple[object, float, bool, bool]:
    """(input, p, training, inplace) of a dropout call, whichever of its signatures it used."""
    named = dict(zip(_ORDER, args, strict=False))
    named.update({("training" if k == "train" else k): v for k, v in kwargs.items()})
    return named.get("input"), float(named.get("p", 0.5)), bool(named.get("training", True)), bool(
        named.get("inplace", False))


class RegionDropout(TorchFunctionMode):
    """Active while one region call runs a training forward; ``paths`` is the stack of region modules running now
    (the region's start at the bottom; :func:`winsp.adoption.region_checks.watch_rows` pushes and pops the inner
    ones)."""

    def __init__(self, policy: str, start: str) -> None:
        super().__init__()
        if policy not in DROPOUT_POLICIES:
            raise ValueError(f"ParallelPlan.dropout must be one of {DROPOUT_POLICIES}, got {policy!r}")
        self.policy = policy
        self.paths: list[str] = [start or "<root>"]
        self.model = None  # the parallelized model, noted by the region's row checks (for the refusals' advice)
        self.tokens: Optional[TokenIO] = None  # the region's TokenIO, noted by the region's start

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs)
        elementwise = _ELEMENTWISE.get(func)
        refused = _NO_ROW_WISE.get(func) if elementwise is None else None
        if elementwise is None and refused is None:
            return func(*args, **kwargs)
        return self._dropout(func, elementwise, refused, args, kwargs)

    def _attention(self, func, args: tuple, kwargs: dict):
        """``scaled_dot_product_attention`` inside the region: refused by name where it drops probabilities."""
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        request = current_request_or_none()
        if p and request is not None and request._now is not None:
            raise ValueError(f"winsp.parallelize: {self.paths[-1]!r} calls scaled_dot_product_attention(dropout_p={p}) "
                             f"in a training forward inside the region: attention-probability dropout is not offered "
                             f"by winsp (its mask is drawn over the original's [heads, n, n] probabilities, which no "
                             f"window layout reproduces); train with it off (p=0) or in eval mode")
        return func(*args, **kwargs)

    @planning  # eager under torch.compile: a traced draw would run again through this mode when its graph runs
    def _dropout(self, func, elementwise, refused, args, kwargs):
        if drop_path.drawing():
            return func(*args, **kwargs)
        name = (elementwise or refused)[0]
        x, p, training, inplace = _arguments(args, kwargs)
        if elementwise is not None and elementwise[1] is not None:
            inplace = elementwise[1]
        request = current_request_or_none()
        if (not training or p == 0.0 or request is None or request._now is None or not isinstance(x, Tensor)
                or x.dim() == 0):
            return func(*args, **kwargs)
        rows = request._now.num_rows
        tokens = self.tokens if self.tokens is not None else _tokens_of(self.model)
        dims = presented_dims(x, rows, tokens)
        if dims is not None:
            return self._presented(name, elementwise, refused, x, p, inplace, request, dims)
        lead = x.shape[1] if x.shape[0] == 1 and x.dim() > 1 else x.shape[0]
        held = bool(request.num_text_rows) and x.shape[0] == rows + request.num_text_rows
        where = (f"winsp.parallelize: {self.paths[-1]!r} calls {name}(p={p}, training=True) on local rows "
                 f"{list(x.shape)} (rank {request.group.rank})")
        if x.shape[0] != rows and not held:  # (local rows with held replicated tokens beside them are drawn too)
            if lead in (rows, rows + request.num_text_rows) or (
                    isinstance(tokens, ChannelsFirst) and x.shape[0] == 1 and x.dim() > 2 and rows > 1
                    and any(n in (rows, rows + request.num_text_rows) for n in x.shape[2:])):  # rows as a batch of one
                raise ValueError(f"{where}, presented as a batch of one: its mask cannot be drawn as the original "
                                 f"draws it; train with it off or end the region before it")
            return func(*args, **kwargs)
        if elementwise is None:
            raise ValueError(f"{where}: {refused[1]} (its draws cannot be reproduced on this rank's rows); drop it "
                             f"in the parallel model, end the region before it, or train with it off")
        said = advice(self.model, self.paths[-1], x, request, held=held)
        refusal = self._refusal(where, said, held)
        if refusal is not None:
            raise ValueError(refusal)
        return row_dropout(x, p, request, inplace=inplace, at=said.at)

    def _presented(self, name: str, elementwise, refused, x: Tensor, p: float, inplace: bool, request,
                   dims: tuple[int, int]) -> Tensor:
        """Dropout on this rank's rows as a :class:`ChannelsFirst` region presents them (one sample, ``dims``: the
        rows' dim and the channels'): drawn as the original draws over its ``[B, C, T, H, W]``, or refused."""
        rows_dim, channels_dim = dims
        where = (f"winsp.parallelize: {self.paths[-1]!r} calls {name}(p={p}, training=True) on this rank's rows as "
                 f"one channels-{'first' if rows_dim > channels_dim else 'last'} sample {list(x.shape)} (rank "
                 f"{request.group.rank})")
        if elementwise is None:
            raise ValueError(f"{where}: {refused[1]} (its draws cannot be reproduced on this rank's rows); drop it "
                             f"in the parallel model, end the region before it, or train with it off")
        stand_in = x.new_empty(()).expand(x.shape[rows_dim], x.shape[channels_dim])  # [L, C]: what advice reads
        refusal = self._refusal(where, advice(self.model, self.paths[-1], stand_in, request, held=False), False)
        if refusal is not None:
            raise ValueError(refusal)
        return presented_dropout(x, p, request, rows_dim=rows_dim, channels_dim=channels_dim, inplace=inplace)

    def _refusal(self, where: str, said, held: bool) -> Optional[str]:
        """The refusal of a dropout on local rows under this policy and ``said`` advice; None: draw it."""
        if self.policy == "refuse":
            mask = (f"{where}: its mask would be drawn over this rank's rows only, not as the original draws it over "
                    f"the whole tensor")
            if said.exact:
                return (f"{mask}. Set ParallelPlan(..., dropout='rows') to draw exactly the original's mask (over the "
                        f"region's tokens as they came in), or {OFF}")
            return not_exact_refusal(mask, said, "ParallelPlan(..., dropout='rows') draws the original's mask only "
                                                 "where the original's tensor there is the region's tokens as they "
                                                 "came in")
        if said.exact is False or (held and said.at is None):
            return (f"{where}: ParallelPlan(dropout='rows') cannot draw the original's mask here: {said.why}. "
                    f"{OFF[0].upper() + OFF[1:]}")
        return None


def _tokens_of(model) -> Optional[TokenIO]:
    """The ``TokenIO`` of ``model``'s plan, if it is a parallelized model."""
    applied = getattr(model, "_winsp_parallel", None) if model is not None else None
    return applied.plan.region.tokens if applied is not None else None


def enter(policy: str, start: str) -> RegionDropout:
    """Push a :class:`RegionDropout` for one region call; :func:`leave` pops it."""
    mode = RegionDropout(policy, start)
    mode.__enter__()
    return mode


def leave(mode: Optional[RegionDropout]) -> None:
    if mode is not None:
        mode.__exit__(None, None, None)
