"""``winsp.Replicated``: tokens every rank holds whole (text, a CLS token, register tokens), as plain data in a
:class:`~winsp.adoption.parallelize.ParallelPlan`.

Where the video rows of a region are dealt out by window, replicated tokens stay whole on every rank: the modules that
run on them between attentions (norms, MLPs, modulation) run on every rank alike, and an attention layer they *join*
takes them as the request's text: they attend to and are attended by each window of their sample, and their output is
the sum over the windows' copies divided by the global window count of the layer (one all-reduce), the design's rule,
also where a window is split across ranks or a layer is global. Gradients follow winsp's convention
(``docs/training.md``): every rank's copy is its own contribution, ``winsp.sync_gradients`` averages.

They come with the region's input in one of two ways, ``at``:

- ``"first"`` / ``"last"``: ``count`` tokens per sample prepended / appended to the region's first positional argument
  ``[B, count + L, ...]`` (a ViT's CLS token). The region's TokenIO reads the rest; inside the region the local tensor
  is ``[R + L_local, ...]`` (``R = B * count`` replicated rows first, or last), layer entries move only the local rows,
  and the region's output gets them back at the same place (its first item ``[B, L', ...]``, a tensor, tuple or
  ``ModelOutput``).
- a positional index or an argument name: a separate argument ``[B, n, ...]`` (``n`` tokens per sample; ``[B, C]``
  is one each) that the model carries itself (a text stream); winsp reads only their count.

``joins``: whether an attention layer takes them: True (every layer), False, one bool per stage or per layer, or the
attention modules they join by glob (``"**.attn"``, a tuple of globs: the rule of ``ParallelPlan.attention``), for a
block with two attentions the tokens join one of (a class token in the spatial attention, not the temporal one).

``valid``: for a separate argument, how many of each sample's tokens attention takes, where that is not the argument's
count: a function of the region start's arguments (by name, defaults applied) returning one count per sample. A model
that pads its text and masks the padding (valid tokens first), or builds its joint text stream inside the region from
several inputs (diffusers' HunyuanVideo 1.5: text, ByT5 glyphs and image tokens, valid ones first), gives the count
of rows, first in each sample's text, that attend and are attended; its swapped attention passes those rows
(``request.num_text_rows``) and leaves the rest out.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

__all__ = ["Replicated"]

_SIDES = ("first", "last")


@dataclass(frozen=True)
class Replicated:
    """Tokens every rank holds whole, and the attention layers they join (module docstring).

    Args:
        at: ``"first"`` / ``"last"`` (``count`` tokens per sample before / after the rows of the region's first
            positional argument), or the name or position of a separate argument of the region's start.
        count: tokens per sample for ``"first"`` / ``"last"`` (a separate argument's count is read from its shape).
        joins: True (every attention layer takes them), False, one bool per stage or per layer, or a glob (a tuple of
            globs) of the attention modules they join.
        valid: for a separate argument, ``valid(arguments) -> one count per sample``: the tokens of each sample that
            attention takes (the first ones of its text), read from the region start's arguments by name; None: the
            argument's count.
    """

    at: Union[str, int] = "first"
    count: int = 1
    joins: Union[bool, tuple[bool, ...], str, tuple[str, ...]] = True
    valid: Optional[Callable[[dict[str, Any]], Sequence[int]]] = None

    def __post_init__(self) -> None:
        if isinstance(self.at, bool) or not isinstance(self.at, (str, int)) or (isinstance(self.at, int)
                                                                                 and self.at < 0):
            raise ValueError(f"Replicated.at must be 'first', 'last', an argument name or a positional index, got "
                             f"{self.at!r}")
        if self.at in _SIDES and (isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1):
            raise ValueError(f"Replicated.count (tokens per sample at the {self.at} rows) must be a positive integer, "
                             f"got {self.count!r}")
        joins: object = (self.joins,) if isinstance(self.joins, str) else self.joins
        if not isinstance(joins, bool):
            joins = tuple(joins) if isinstance(joins, (tuple, list)) else ()
            if not joins or not (all(isinstance(j, bool) for j in joins)
                                 or all(isinstance(j, str) and j for j in joins)):
                raise ValueError(f"Replicated.joins must be True, False, one bool per stage or per layer, or globs of "
                                 f"the attention modules they join, got {self.joins!r}")
            object.__setattr__(self, "joins", joins)
        if self.valid is not None and (self.held or not callable(self.valid)):
            raise ValueError(f"Replicated.valid must be a function of the region's arguments returning one count per "
                             f"sample, for a separate argument (at=name or index), got valid={self.valid!r} with "
                             f"at={self.at!r}")

    @property
    def held(self) -> bool:
        """Whether the tokens travel inside the region's token tensor (``at="first"`` / ``"last"``)."""
        return self.at in _SIDES

    @property
    def by_module(self) -> bool:
        """Whether ``joins`` names the attention modules (globs) rather than layers."""
        return isinstance(self.joins, tuple) and isinstance(self.joins[0], str)

    def layers(self, layers_per_stage: Sequence[int],
               attention: Optional[Sequence[str]] = None) -> tuple[bool, ...]:
        """Per layer, whether it joins: ``joins`` spelled out over the stages' layers, or, for globs, over the paths
        of the layers' ``attention`` modules (in layer order)."""
        total = sum(layers_per_stage)
        if isinstance(self.joins, bool):
            return (self.joins,) * total
        if self.by_module:
            from winsp.adoption.parallelize import path_matches  # parallelize imports this module

            if attention is None or len(attention) != total:
                raise ValueError(f"Replicated.joins={self.joins!r} names attention modules; the plan's "
                                 f"{total} layers need their {total} attention paths")
            globs = [str(g) for g in self.joins]
            joined = tuple(any(path_matches(path, g) for g in globs) for path in attention)
            if not any(joined):
                raise ValueError(f"Replicated.joins={self.joins!r} matches none of the attention modules "
                                 f"{list(attention)} (globs match module paths component by component)")
            return joined
        flags = [bool(j) for j in self.joins]
        if len(flags) == len(layers_per_stage):
            return tuple(j for j, n in zip(flags, layers_per_stage, strict=True) for _ in range(n))
        if len(flags) == total:
            return tuple(flags)
        raise ValueError(f"Replicated.joins has {len(self.joins)} entries; the plan has {len(layers_per_stage)} stages "
                         f"and {total} layers (give one per stage or one per layer)")

    def take(self, module: nn.Module, args: tuple,
             kwargs: dict) -> tuple[tuple, dict, Optional[Tensor], tuple[int, Union[int, tuple[int, ...]]]]:
        """The region start's ``(args, kwargs)`` without held tokens, the held tokens ``[B * count, ...]`` (None for an
        argument) and ``(B, tokens per sample)`` (with ``valid``: one count per sample)."""
        if self.held:
            x = args[0] if args else None
            if not isinstance(x, Tensor) or x.dim() < 3 or x.shape[1] <= self.count:
                got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"Replicated(at={self.at!r}, count={self.count}): the region's first positional "
                                 f"argument must be [B, {self.count} + L, ...] tokens, got {got}")
            cut = (slice(None, self.count), slice(self.count, None)) if self.at == "first" else \
                (slice(x.shape[1] - self.count, None), slice(None, x.shape[1] - self.count))
            return (x[:, cut[1]],) + tuple(args[1:]), kwargs, x[:, cut[0]].flatten(0, 1), (x.shape[0], self.count)
        t = self._argument(module, args, kwargs)
        if self.valid is not None:
            return args, kwargs, None, (t.shape[0], self._valid_counts(module, args, kwargs, t.shape[0]))
        return args, kwargs, None, (t.shape[0], t.shape[1] if t.dim() >= 3 else 1)

    def _valid_counts(self, module: nn.Module, args: tuple, kwargs: dict, samples: int) -> tuple[int, ...]:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        counts = self.valid(dict(bound.arguments))  # type: ignore[misc]
        try:
            counts = tuple(operator.index(c) for c in counts)  # ints, or 0-dim integer tensors
        except TypeError:
            counts = None
        if counts is None or len(counts) != samples or min(counts, default=0) < 0:
            raise ValueError(f"Replicated(at={self.at!r}).valid must return one non-negative integer count per "
                             f"sample, for the {samples} sample(s) of {type(module).__name__}'s call")
        return counts

    def _argument(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        if isinstance(self.at, int) and self.at < len(args):
            t = args[self.at]
        elif isinstance(self.at, int):  # passed by keyword: the parameter at that position of the forward
            names = list(inspect.signature(module.forward).parameters)
            t = kwargs.get(names[self.at]) if self.at < len(names) else None
        elif self.at in kwargs:
            t = kwargs[self.at]
        else:
            try:
                t = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get(self.at)
            except TypeError:
                t = None
        if not isinstance(t, Tensor) or t.dim() < 2:
            got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"Replicated(at={self.at!r}): the region's {type(module).__name__} call has no tensor "
                             f"argument {self.at!r} of [B, n, ...] (or [B, C]) replicated tokens (got {got})")
        return t

    def lengths(self, counts: tuple[int, Union[int, tuple[int, ...]]], samples: int) -> tuple[int, ...]:
        """The request's text lengths from :meth:`take`'s counts, checked against the region's ``samples``."""
        if counts[0] != samples:
            raise ValueError(f"Replicated(at={self.at!r}): the replicated tokens are for {counts[0]} samples but the "
                             f"region's tokens hold {samples}")
        per_sample = counts[1]
        return per_sample if isinstance(per_sample, tuple) else (per_sample,) * samples

    def join(self, rows: Tensor, held: Tensor) -> Tensor:
        """Local rows with the held tokens at their side (inside the region)."""
        return torch.cat([held, rows] if self.at == "first" else [rows, held])

    def part(self, x: Tensor, held_rows: int) -> tuple[Tensor, Tensor]:
        """``(held tokens, local rows)`` of a region tensor ``[R + L, ...]`` (the inverse of :meth:`join`)."""
        if self.at == "first":
            return x[:held_rows], x[held_rows:]
        return x[x.shape[0] - held_rows:], x[:x.shape[0] - held_rows]

    def write_back(self, tokens: Tensor, held: Tensor, samples: int) -> Tensor:
        """The region's rebuilt output tokens ``[B, L', ...]`` with the held tokens back at their side."""
        held = held.reshape((samples, self.count) + tuple(held.shape[1:]))
        return torch.cat([held, tokens] if self.at == "first" else [tokens, held], 1)
