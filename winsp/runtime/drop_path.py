"""Random ops on local rows that draw exactly what the original draws: stochastic depth per *sample*, and
element-wise dropout.

A drop path (stochastic depth) zeroes a residual branch for whole samples at random while training. On a
``[B, ...]`` tensor it draws one number per sample; on window-parallel local rows ``[L, C]`` the batch dimension is
gone, so :class:`SampleDropPath` draws the same ``B`` numbers, in the same way and order as the original module (every
rank holds the same generator state, so every rank draws the same ones), and gives each row its sample's number
through ``request.row_sample``. :class:`RowDropout` (element-wise dropout, ``nn.Dropout``; :func:`row_dropout` is its
function, also what ``ParallelPlan.dropout="rows"`` runs for ``F.dropout`` calls) draws the original's mask over the
whole ``[N, ...]`` tensor of the current grid, row-major as a channels-last original holds it, and keeps this rank's
rows (``request.model_rows``): every rank draws the full mask, which is the price of equal draws. In eval mode, or
with probability 0, both are the identity.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import Tensor, nn

from winsp.runtime.context import current_request
from winsp.utils.compile import planning

__all__ = ["SampleDropPath", "RowDropout", "row_dropout", "presented_dropout"]

_DRAWS = ("bernoulli", "rand")
_DRAWING = threading.local()  # .active: this thread runs _full_mask's F.dropout, which RegionDropout lets through


class SampleDropPath(nn.Module):
    """Per-sample drop path on local rows; ``draw`` reproduces the original's random draws exactly.

    Args:
        p: probability of dropping a sample's branch.
        draw: ``"bernoulli"`` (torchvision's ``StochasticDepth(p, "row")``: ``empty(B).bernoulli_(1 - p)``) or
            ``"rand"`` (timm / transformers ``drop_path``: ``floor(1 - p + rand(B))``).
        scale: divide kept branches by ``1 - p`` (both originals do).
    """

    def __init__(self, p: float, draw: str = "bernoulli", scale: bool = True) -> None:
        super().__init__()
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"drop probability must be in [0, 1], got {p!r}")
        if draw not in _DRAWS:
            raise ValueError(f"draw must be one of {_DRAWS}, got {draw!r}")
        self.p, self.draw, self.scale = float(p), draw, bool(scale)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        request = current_request()
        keep = 1.0 - self.p
        batch = len(request.grids)
        if self.draw == "bernoulli":
            noise = torch.empty(batch, dtype=x.dtype, device=x.device).bernoulli_(keep)
        else:
            noise = (keep + torch.rand(batch, dtype=x.dtype, device=x.device)).floor_()
        if self.scale and keep > 0.0:
            noise = noise.div(keep)
        return x * noise[request.row_sample].view((-1,) + (1,) * (x.dim() - 1))

    def extra_repr(self) -> str:
        return f"p={self.p}, draw={self.draw!r}, scale={self.scale}"


class RowDropout(nn.Module):
    """Element-wise dropout on local rows with the original's draws (the mask ``F.dropout`` draws over the full
    tensor, kept values scaled by ``1 / (1 - p)``: :func:`row_dropout`), for an original whose tensor is ``[..., C]``
    channels-last with the tokens row-major in (t, h, w), samples one after the other (:class:`winsp.ChannelsLast`,
    flat tokens)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p!r}")
        self.p = float(p)

    @classmethod
    def like(cls, original: nn.Module) -> "RowDropout":
        """The swap for an ``nn.Dropout`` (a plan's ``swaps`` factory); other dropout kinds are refused by name."""
        if type(original) is not nn.Dropout:
            raise ValueError(f"RowDropout.like reproduces nn.Dropout (element-wise); {type(original).__name__} drops "
                             f"whole channels or scales otherwise and has no row-wise equivalent here")
        return cls(original.p).train(original.training)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        return row_dropout(x, self.p, current_request())

    def extra_repr(self) -> str:
        return f"p={self.p}"


def row_dropout(x: Tensor, p: float, request, *, inplace: bool = False,
                at: Optional[tuple[Tensor, int]] = None) -> Tensor:
    """Element-wise dropout (training) of local rows ``x [L, ...]`` with the original's draws: ``F.dropout`` itself
    on a tensor of ones shaped as the original's full ``[N, ...]`` (the same function on the same shape, dtype and
    device draws the same mask, on any device and for ``p == 1`` too), this rank's rows of it multiplied in.

    Assumes the original's tensor is channels-last with the tokens row-major in (t, h, w), samples one after the
    other; padding rows get zero. Every rank draws the whole mask: the price of equal draws. ``at``: ``(index,
    total)`` for an original whose ``total`` rows are in another order or hold other rows too (replicated tokens):
    row ``i`` of ``x`` is the original's row ``index[i]`` (``total`` for a padding row)."""
    index, total = (request.model_rows, request.num_model_rows) if at is None else at
    rows = index.shape[0]
    if x.dim() == 0 or x.shape[0] != rows:
        held = x.dim() > 0 and x.shape[0] == rows + request.num_text_rows
        raise ValueError(f"row_dropout (winsp.RowDropout, dropout='rows') takes this rank's {rows} local rows "
                         f"[L, ...], got {list(x.shape)}" + (" (the replicated tokens next to them: their mask is "
                                                             "drawn with ParallelPlan(dropout='rows'), or train with "
                                                             "it off)" if held else ""))
    keep = _full_mask((total,) + tuple(x.shape[1:]), p, x.dtype, x.device)
    keep = torch.cat([keep, keep.new_zeros((1,) + tuple(x.shape[1:]))]).index_select(0, index)
    return x.mul_(keep) if inplace else x * keep


def presented_dropout(x: Tensor, p: float, request, *, rows_dim: int, channels_dim: int,
                      inplace: bool = False) -> Tensor:
    """Element-wise dropout (training) of this rank's rows presented as one sample ``x`` (``[1, C, L, 1, 1]`` as
    :class:`winsp.adoption.ChannelsFirst` hands them in, or ``[1, L, 1, 1, C]`` after the model's permute), every
    other dim of size 1, with the original's draws: ``F.dropout`` of ones shaped as the original's ``[B, C, T, H, W]``
    in the memory order ``x`` has (the original's draw follows its memory order: channels-first unless ``x``'s
    channels are its innermost dim), this rank's rows of it multiplied in; padding rows get zero. The samples must
    share one grid. Every rank draws the whole mask, as in :func:`row_dropout`. The memory order is read from the
    strides of the rows' and the channels' dims; where they are equal (a rank holding one row), channels-first."""
    stage = request.stage_model_grids[request.stage]
    grids, rows, channels = sorted(set(stage)), x.shape[rows_dim], x.shape[channels_dim]
    if len(grids) != 1:
        raise ValueError(f"dropout on rows presented as one sample {list(x.shape)}: the samples are on different "
                         f"grids {grids}, so the original's tensor has no one layout to draw over")
    grid, total = grids[0][3 - (x.dim() - 2):], request.num_model_rows
    if x.stride(channels_dim) < x.stride(rows_dim):  # channels innermost: the original's memory is channels-last
        full = _full_mask((len(stage),) + grid + (channels,), p, x.dtype, x.device).reshape(total, channels)
    else:
        full = _full_mask((len(stage), channels) + grid, p, x.dtype, x.device).movedim(1, -1).reshape(total, channels)
    keep = torch.cat([full, full.new_zeros((1, channels))]).index_select(0, request.model_rows)
    shape = [1] * x.dim()
    shape[rows_dim], shape[channels_dim] = rows, channels
    keep = torch.empty_like(x).copy_((keep if rows_dim < channels_dim else keep.t()).reshape(shape))
    return x.mul_(keep) if inplace else x * keep  # ``keep`` in ``x``'s strides: the product's are F.dropout's


@planning  # eager under torch.compile: a traced draw would meet a RegionDropout mode again when its graph runs
def _full_mask(shape: tuple, p: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``F.dropout`` of ones of the original's full shape: its mask, kept values ``1 / (1 - p)``."""
    full = torch.ones(shape, dtype=dtype, device=device)
    _DRAWING.active = True  # the draw itself, not a call on local rows
    try:
        return torch.nn.functional.dropout(full, p, True)
    finally:
        _DRAWING.active = False


def drawing() -> bool:
    """Whether this thread is inside :func:`row_dropout`'s own draw."""
    return getattr(_DRAWING, "active", False)
