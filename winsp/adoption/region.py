"""Where a :func:`winsp.parallelize` region's tokens are: :class:`Region` (its start and end modules) and its
:class:`TokenIO` (how the start's input holds the tokens and how the end's output is rebuilt); :class:`ChannelsLast`
reads ``[B, T, H, W, C]`` / ``[B, H, W, C]``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from winsp.geometry.windows import Grid

__all__ = ["TokenIO", "ChannelsLast", "ChannelsFirst", "Region"]

class TokenIO:
    """How a region's input holds its tokens and how its output is rebuilt from the gathered rows.

    Subclass it for a model whose region takes tokens some other way (``[B, L, C]`` plus a grid argument, a
    dataclass output, ...). Every method sees the region start's ``(args, kwargs)`` or the region end's output.
    """

    def read(self, args: tuple, kwargs: dict) -> tuple[Tensor, list[Grid]]:
        """(canonical rows ``[N, ...]``: every sample's tokens row-major in (t, h, w), samples concatenated; grids)."""
        raise NotImplementedError

    def with_rows(self, args: tuple, kwargs: dict, rows: Tensor) -> tuple[tuple, dict]:
        """The start module's ``(args, kwargs)`` with the local rows in place of the tokens."""
        raise NotImplementedError

    def output_rows(self, output: Any) -> Tensor:
        """The local rows inside the end module's output."""
        raise NotImplementedError

    def with_output(self, output: Any, rows: Tensor, grids: Sequence[Grid]) -> Any:
        """The end module's output rebuilt from the gathered canonical rows of ``grids``."""
        raise NotImplementedError

    @staticmethod
    def first_item(output: Any) -> Tensor:
        """The tokens of a module output that is a tensor, a tuple whose first item they are, or a mapping (a Hugging
        Face ``ModelOutput``) whose first field they are."""
        if isinstance(output, Tensor):
            return output
        if isinstance(output, (tuple, list)) and output:
            return output[0]
        if hasattr(output, "keys") and hasattr(output, "__getitem__"):
            return output[next(iter(output.keys()))]
        raise ValueError(f"the region's end module returned a {type(output).__name__}; a tensor, a tuple or a "
                         f"ModelOutput whose first item is the tokens is expected")

    @staticmethod
    def with_first_item(output: Any, tokens: Tensor) -> Any:
        """``output`` (as :meth:`first_item` reads it) with ``tokens`` in place of its first item."""
        if isinstance(output, Tensor):
            return tokens
        if isinstance(output, tuple):
            return (tokens,) + tuple(output[1:])
        if isinstance(output, list):
            return [tokens] + output[1:]
        output[next(iter(output.keys()))] = tokens  # a ModelOutput: its first field (last_hidden_state, sample)
        return output


@dataclass(frozen=True)
class ChannelsLast(TokenIO):
    """Tokens as the first positional argument ``[B, T, H, W, C]`` (``spatial_dims=3``) or ``[B, H, W, C]`` (2).

    Every sample of the batch has the same grid; the region's output is the same layout on the last stage's grid (a
    tensor, or the first item of a tuple or ``ModelOutput``: the other items pass through).
    """

    spatial_dims: int = 3

    def __post_init__(self) -> None:
        if self.spatial_dims not in (2, 3):
            raise ValueError(f"ChannelsLast.spatial_dims must be 2 or 3, got {self.spatial_dims!r}")

    def read(self, args, kwargs):
        if not args or not isinstance(args[0], Tensor) or args[0].dim() != self.spatial_dims + 2:
            want = "[B, T, H, W, C]" if self.spatial_dims == 3 else "[B, H, W, C]"
            got = tuple(args[0].shape) if args and isinstance(args[0], Tensor) else type(args[0]).__name__ if args \
                else "no positional argument"
            raise ValueError(f"the region's first input must be a {want} tensor, got {got}: say how it holds its "
                             f"tokens with tokens= (Hourglass(..., tokens=) or Region(start, end, tokens=)): "
                             f"winsp.ChannelsLast(2) for [B, H, W, C], ChannelsLast(3) for [B, T, H, W, C], or a "
                             f"winsp.TokenIO subclass")
        x = args[0]
        grid = tuple(x.shape[1:-1]) if self.spatial_dims == 3 else (1,) + tuple(x.shape[1:-1])
        return x.reshape(-1, x.shape[-1]), [grid] * x.shape[0]

    def with_rows(self, args, kwargs, rows):
        return (rows,) + tuple(args[1:]), kwargs

    def output_rows(self, output):
        return self.first_item(output)

    def with_output(self, output, rows, grids):
        if len(set(grids)) != 1:
            raise ValueError(f"ChannelsLast: samples end on different grids {sorted(set(grids))}")
        grid = grids[0] if self.spatial_dims == 3 else grids[0][1:]
        return self.with_first_item(output, rows.reshape((len(grids),) + tuple(grid) + tuple(rows.shape[1:])))


@dataclass(frozen=True)
class Region:
    """The window-parallel part of a forward: from the call of module ``start`` to the return of module ``end``.

    ``start``'s input tokens are scattered (``tokens`` reads them and the grids), ``end``'s output is gathered and
    rebuilt (the gather is the only all-gather of the forward; ``start == end`` is the usual case: a model's
    ``features`` / ``encoder`` container).
    """

    start: str
    end: str
    tokens: TokenIO = field(default_factory=ChannelsLast)


@dataclass(frozen=True)
class ChannelsFirst(TokenIO):
    """Tokens as the first positional argument ``[B, C, T, H, W]`` (``spatial_dims=3``) or ``[B, C, H, W]`` (2): a
    CNN's layout, such as a Swin encoder on volumes whose stages take and return channels-first tensors.

    Inside the region this rank's rows ``[L, C]`` reach the model as one sample on an ``(L, 1, 1)`` grid,
    ``[1, C, L, 1, 1]`` in the input's memory order (channels-first unless it is ``channels_last_3d``, which the
    original's dropout draws follow), so the model's own permutes to channels-last (``[1, L, 1, 1, C]``) and back keep
    them in order, and winsp's layer entries take either. The region's output (a tensor, or the first item of a tuple or
    ``ModelOutput``) comes back as ``[B, C', T', H', W']`` on the last stage's grid.
    """

    spatial_dims: int = 3

    def __post_init__(self) -> None:
        if self.spatial_dims not in (2, 3):
            raise ValueError(f"ChannelsFirst.spatial_dims must be 2 or 3, got {self.spatial_dims!r}")

    def read(self, args, kwargs):
        x = args[0] if args else None
        if not isinstance(x, Tensor) or x.dim() != self.spatial_dims + 2:
            want = "[B, C, T, H, W]" if self.spatial_dims == 3 else "[B, C, H, W]"
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"ChannelsFirst: the region's first input must be a {want} tensor, got {got}")
        grid = tuple(x.shape[2:]) if self.spatial_dims == 3 else (1,) + tuple(x.shape[2:])
        return x.movedim(1, -1).reshape(-1, x.shape[1]), [grid] * x.shape[0]

    def with_rows(self, args, kwargs, rows):
        presented = rows.t().reshape((1, rows.shape[1], rows.shape[0]) + (1,) * (self.spatial_dims - 1))
        # in the input's memory order (what the original's ops and dropout draws follow), with canonical strides
        last = torch.channels_last_3d if self.spatial_dims == 3 else torch.channels_last
        x = args[0]
        layout = last if not x.is_contiguous() and x.is_contiguous(memory_format=last) else torch.contiguous_format
        return (presented.clone(memory_format=layout),) + tuple(args[1:]), kwargs

    def output_rows(self, output):
        x = self.first_item(output)
        if not isinstance(x, Tensor) or x.dim() != self.spatial_dims + 2 or x.shape[0] != 1 \
                or any(s != 1 for s in x.shape[3:]):
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"ChannelsFirst: the region's end returned {got}, not this rank's rows as one "
                             f"channels-first sample [1, C, L{', 1' * (self.spatial_dims - 1)}]: the region must end "
                             f"where the tokens are channels-first again (the module whose input it scattered, or one "
                             f"like it)")
        return x[0].flatten(1).t()

    def with_output(self, output, rows, grids):
        if len(set(grids)) != 1:
            raise ValueError(f"ChannelsFirst: samples end on different grids {sorted(set(grids))}")
        grid = grids[0] if self.spatial_dims == 3 else grids[0][1:]
        return self.with_first_item(output, rows.reshape((len(grids),) + tuple(grid) + (-1,)).movedim(-1, 1))
