"""The replicated-text reducer.

Text stays identical on every rank. Inside a layer every window produces its own copy of its sample's text
outputs; the next text state is the mean of those copies over *all* windows of the sample, across ranks:

    T_next = (sum over ranks r, windows w of r: T_w) / W_global(sample)

Each rank sums its local copies (in float32 for half-precision inputs), one SUM all-reduce runs on the SP group, and
every rank divides by the global window count. A rank without windows contributes zeros of the same shape and dtype,
so every rank enters the same collective. Neither a token-weighted mean nor a mean of per-rank means.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .group import SPGroup

__all__ = ["TextReduction", "reduce_window_text", "replicated_text_entry"]


@dataclass(eq=False)
class TextReduction:
    """Index data of one reduction, built once per (plan, rank, text lengths).

    ``row_target[k]`` is the packed text row that window-text row ``k`` contributes to; ``row_divisor[j]`` is the
    global number of windows of text row ``j``'s sample.
    """

    row_target: np.ndarray
    row_divisor: np.ndarray
    num_text_rows: int
    _device_cache: dict = field(default_factory=dict, repr=False)

    def device_arrays(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        cached = self._device_cache.get(key)
        if cached is None:
            cached = (torch.from_numpy(self.row_target).to(device),
                      torch.from_numpy(self.row_divisor.astype(np.float64)).to(device))
            self._device_cache[key] = cached
        return cached


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _ReduceWindowText(torch.autograd.Function):
    @staticmethod
    def forward(ctx, window_text, reduction: TextReduction, group: SPGroup):
        target, divisor = reduction.device_arrays(window_text.device)
        acc_dtype = _accumulate_dtype(window_text.dtype)
        acc = window_text.new_zeros((reduction.num_text_rows,) + tuple(window_text.shape[1:]), dtype=acc_dtype)
        if window_text.shape[0]:
            acc.index_add_(0, target, window_text.to(acc_dtype))
        group.all_reduce_sum(acc)
        shape = (-1,) + (1,) * (acc.dim() - 1)
        out = acc / divisor.to(acc_dtype).view(shape)
        ctx.reduction = reduction
        ctx.in_dtype = window_text.dtype
        return out.to(window_text.dtype)

    @staticmethod
    def backward(ctx, grad):
        # The output is replicated, so its gradient is too: each window's copy receives grad / W_global(sample).
        target, divisor = ctx.reduction.device_arrays(grad.device)
        shape = (-1,) + (1,) * (grad.dim() - 1)
        acc_dtype = _accumulate_dtype(grad.dtype)
        scaled = grad.to(acc_dtype) / divisor.to(acc_dtype).view(shape)
        return scaled.index_select(0, target).to(ctx.in_dtype), None, None


def reduce_window_text(window_text: torch.Tensor, reduction: TextReduction, group: SPGroup) -> torch.Tensor:
    """Mean over all windows (all ranks) of the per-window text outputs; identical on every rank.

    ``window_text`` [R, ...] holds this rank's window copies, window-major (R may be 0 on a rank without windows).
    Returns [num_text_rows, ...] in the input dtype.
    """
    if window_text.shape[0] != reduction.row_target.shape[0]:
        raise ValueError(
            f"rank {group.rank}: {window_text.shape[0]} window-text rows given, the layout expects "
            f"{reduction.row_target.shape[0]}"
        )
    return _ReduceWindowText.apply(window_text, reduction, group)


class _ReplicatedEntry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: SPGroup):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Each rank saw the replicated tensor only through its own windows: the full gradient is the sum.
        return ctx.group.all_reduce_sum(grad.clone()), None


def replicated_text_entry(x: torch.Tensor, group: SPGroup) -> torch.Tensor:
    """Identity on a replicated tensor that is about to be used by this rank's windows only.

    Its backward sums the partial gradients over the SP group, so a replicated input gets the full gradient on every
    rank. A no-op without autograd or at one rank.
    """
    if group.is_single or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _ReplicatedEntry.apply(x, group)
