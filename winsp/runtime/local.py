"""One rank's share of one plan: its windows and rows on the CPU (:class:`LocalWindows`), and the same prepared as
device tensors that the per-layer steps read (:class:`LayoutTensors`, built once per plan, rank and device)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from winsp.attention.segments import WindowIndexTensors, WindowSegments
from winsp.comm.text import TextReduction, TextReductionTensors
from winsp.planning.plan import Plan

__all__ = ["LocalWindows", "LayoutTensors", "layout_tensors"]


class LocalWindows:
    """One rank's share of one plan, on the CPU: its windows, rows, positions and attention segments.

    ``windows``, ``segments`` and ``text`` describe the windows this rank holds whole; the rows of split windows'
    pieces (a plan with split windows) are in ``positions`` too, and :mod:`winsp.attention.split` computes their
    attention.
    """

    def __init__(self, plan: Plan, rank: int, text_lengths: tuple[int, ...]) -> None:
        self.plan, self.rank = plan, rank
        lay = plan.layout
        self.windows = np.asarray(plan.rank_windows[rank], dtype=np.int64)
        self.num_rows = plan.rank_token_counts[rank]
        self.positions = plan.rank_positions(rank)
        counts = lay.token_counts[self.windows]
        samples = lay.window_sample[self.windows]
        text_len = np.asarray(text_lengths, dtype=np.int64)
        text_start = np.concatenate([[0], np.cumsum(text_len)[:-1]]).astype(np.int64)
        self.segments = WindowSegments(
            vid_counts=tuple(int(c) for c in counts),
            txt_lengths=tuple(int(text_len[s]) for s in samples),
            txt_starts=tuple(int(text_start[s]) for s in samples),
        )
        # window-text row k -> packed text row; each text row is divided by its sample's global window count
        lengths = text_len[samples]
        row_target = (np.repeat(text_start[samples] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
                      + np.arange(int(lengths.sum()), dtype=np.int64)) if lengths.size else np.empty(0, np.int64)
        self.text = TextReduction(
            row_target=row_target.astype(np.int64),
            row_divisor=np.repeat(lay.windows_per_sample, text_len),
            num_text_rows=int(text_len.sum()),
        )

    @cached_property
    def token_ids(self) -> np.ndarray:
        """[L] canonical packed token id of each local row."""
        return self.plan.layout.token_ids[self.positions]

    @cached_property
    def window_ids(self) -> np.ndarray:
        """[L] id of each local row's window in the plan's layout (the geometry's window order, sample by sample)."""
        return self.plan.layout.window_of_position[self.positions]

    @cached_property
    def local_window(self) -> np.ndarray:
        """[L] index of each local row's window among this rank's windows or window pieces (local order; equal to
        the index in ``self.windows`` when every window is whole)."""
        lengths = [b - a for _, a, b in self.plan.rank_pieces[self.rank]]
        return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)

    @cached_property
    def row_sample(self) -> np.ndarray:
        """[L] sample index of each local row."""
        lay = self.plan.layout
        return lay.window_sample[lay.window_of_position[self.positions]]

    @cached_property
    def window_coords(self) -> np.ndarray:
        """[L, 3] window-local (dt, dh, dw) of each local row."""
        return self.plan.layout.window_coords[self.positions]

    @cached_property
    def window_shape(self) -> np.ndarray:
        """[L, 3] extent (t, h, w) of the window each local row belongs to."""
        lay = self.plan.layout
        return lay.window_shape[lay.window_of_position[self.positions]]

    @cached_property
    def grid_coords(self) -> np.ndarray:
        """[L, 3] global (t, h, w) of each local row inside its sample's grid."""
        return self.plan.layout.token_coords(self.token_ids, self.row_sample)


@dataclass(frozen=True, eq=False)
class LayoutTensors:
    """One rank's share of one plan on one device: everything the per-layer steps read, prepared once."""

    plan: Plan
    local: LocalWindows
    index: WindowIndexTensors
    text: TextReductionTensors
    token_ids: Tensor
    row_sample: Tensor
    window_coords: Tensor
    window_shape: Tensor
    grid_coords: Tensor
    window_ids: Tensor
    local_window: Tensor
    gather_order: Tensor

    @property
    def segments(self) -> WindowSegments:
        return self.local.segments

    @property
    def num_rows(self) -> int:
        return self.local.num_rows


def _tensor(array: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)



def layout_tensors(plan: Plan, rank: int, text_lengths: tuple[int, ...], device: torch.device) -> LayoutTensors:
    """``rank``'s share of ``plan`` for a batch with these text lengths, prepared on ``device``."""
    local = LocalWindows(plan, rank, text_lengths)
    return LayoutTensors(
        plan=plan, local=local, index=local.segments.index_tensors(device), text=local.text.to(device),
        token_ids=_tensor(local.token_ids, device), row_sample=_tensor(local.row_sample, device),
        window_coords=_tensor(local.window_coords, device), window_shape=_tensor(local.window_shape, device),
        grid_coords=_tensor(local.grid_coords, device),
        window_ids=_tensor(local.window_ids, device), local_window=_tensor(local.local_window, device),
        gather_order=_tensor(plan.gather_order, device),
    )
