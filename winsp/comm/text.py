"""The replicated-text reducer.

Text stays identical on every rank. Inside a layer every window produces its own copy of its sample's text
outputs; the next text state is the mean of those copies over *all* windows of the sample, across ranks:

    T_next = (sum over ranks r, windows w of r: T_w) / W_global(sample)

Each rank sums its local copies (in float32 for half-precision inputs), one SUM all-reduce runs on the SP group, and
every rank divides by the global window count. A rank without windows contributes zeros of the same shape and dtype,
so every rank enters the same collective. Neither a token-weighted mean nor a mean of per-rank means.

Backward (winsp's gradient convention: each rank's copy of a replicated value is its own contribution, and
:func:`winsp.sync_gradients` averages afterwards): every rank's copy of ``T_next`` depends on every rank's window
copies, so the all-reduce's backward sums the gradients of all copies over the group, and each local window copy
receives that sum divided by its sample's window count. That is the only collective text needs in backward; the
replicated text's use by this rank's windows needs none (it is this rank's own copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from winsp.comm.group import SPGroup

__all__ = ["TextReduction", "TextReductionTensors", "reduce_window_text", "sum_window_text",
           "finish_text_reduction"]


@dataclass(frozen=True, eq=False)
class TextReduction:
    """Index data of one reduction, built once per (plan, rank, text lengths), on the CPU.

    ``row_target[k]`` is the packed text row that window-text row ``k`` contributes to; ``row_divisor[j]`` is the
    global number of windows of text row ``j``'s sample.
    """

    row_target: np.ndarray
    row_divisor: np.ndarray
    num_text_rows: int

    def to(self, device: torch.device | str) -> "TextReductionTensors":
        """The same indices as tensors on ``device`` (the runtime's store keeps them per request shape)."""
        return TextReductionTensors(
            row_target=torch.from_numpy(np.ascontiguousarray(self.row_target, dtype=np.int64)).to(device),
            row_divisor=torch.from_numpy(self.row_divisor.astype(np.float64)).to(device),
            num_text_rows=self.num_text_rows,
        )


@dataclass(frozen=True, eq=False)
class TextReductionTensors:
    """A :class:`TextReduction` on one device."""

    row_target: torch.Tensor
    row_divisor: torch.Tensor
    num_text_rows: int


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def reduce_window_text(
    window_text: torch.Tensor, reduction: TextReduction | TextReductionTensors, group: SPGroup
) -> torch.Tensor:
    """Mean over all windows (all ranks) of the per-window text outputs; identical on every rank.

    ``window_text`` [R, ...] holds this rank's window copies, window-major (R may be 0 on a rank without windows).
    Returns [num_text_rows, ...] in the input dtype. Differentiable, and traceable by torch.compile.
    """
    return finish_text_reduction(sum_window_text(window_text, reduction, group), reduction, group,
                                 window_text.dtype)


def sum_window_text(window_text: torch.Tensor, reduction: TextReduction | TextReductionTensors,
                    group: SPGroup) -> torch.Tensor:
    """This rank's sum of its window copies per packed text row (accumulated in float32 for half precision)."""
    if not isinstance(reduction, TextReductionTensors):
        reduction = reduction.to(window_text.device)
    if window_text.shape[0] != reduction.row_target.shape[0]:
        raise ValueError(
            f"rank {group.rank}: {window_text.shape[0]} window-text rows given, the layout expects "
            f"{reduction.row_target.shape[0]}"
        )
    acc_dtype = _accumulate_dtype(window_text.dtype)
    acc = window_text.new_zeros((reduction.num_text_rows,) + tuple(window_text.shape[1:]), dtype=acc_dtype)
    return acc.index_add(0, reduction.row_target, window_text.to(acc_dtype))


def finish_text_reduction(acc: torch.Tensor, reduction: TextReduction | TextReductionTensors, group: SPGroup,
                          dtype: torch.dtype) -> torch.Tensor:
    """The one SUM all-reduce of the per-rank sums, divided by each sample's global window count, in ``dtype``."""
    if not isinstance(reduction, TextReductionTensors):
        reduction = reduction.to(acc.device)
    acc = group.all_reduce_sum(acc)
    shape = (-1,) + (1,) * (acc.dim() - 1)
    return (acc / reduction.row_divisor.to(acc.dtype).view(shape)).to(dtype)
