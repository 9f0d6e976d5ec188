"""Window placement: the LPT rule and the :class:`Plan` object (which windows each rank owns, and what follows).

LPT (deterministic, so every rank computes the same plan with no communication): windows sorted by
(-token count, window id); each goes to the rank with the smallest (assigned tokens, rank id); each rank then lists
its windows in ascending window id. A rank may end up with no window. Other placements (see :mod:`winsp.schedule`)
hand a :class:`Plan` their own ``rank_windows``.
"""

from __future__ import annotations

import heapq
import math
from functools import cached_property
from typing import Sequence

import numpy as np

from .checks import count_tuple
from .layout import Layout, inverse_permutation

__all__ = [
    "PLANNER_VERSION",
    "lpt_assign",
    "Plan",
]

PLANNER_VERSION = 1


def _check_world_size(world_size: int) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    return int(world_size)


def lpt_assign(window_token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Assign windows to ``world_size`` ranks by longest-processing-time-first on token counts.

    Returns one ascending list of window ids per rank (empty lists for ranks that get nothing).
    """
    world_size = _check_world_size(world_size)
    counts = count_tuple("window_token_counts", window_token_counts)
    order = sorted(range(len(counts)), key=lambda w: (-counts[w], w))
    heap = [(0, r) for r in range(world_size)]  # (assigned tokens, rank id): heap order is the tie-break rule
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for w in order:
        load, rank = heapq.heappop(heap)
        assigned[rank].append(w)
        heapq.heappush(heap, (load + counts[w], rank))
    for windows in assigned:
        windows.sort()
    return assigned


def _check_rank_windows(rank_windows: Sequence[Sequence[int]], num_windows: int,
                        world_size: int) -> tuple[tuple[int, ...], ...]:
    """Validate a placement: ``world_size`` lists that together hold every window id exactly once."""
    out = tuple(tuple(int(w) for w in ws) for ws in rank_windows)
    if len(out) != world_size:
        raise ValueError(f"rank_windows has {len(out)} lists but the plan is for {world_size} ranks")
    flat = np.fromiter((w for ws in out for w in ws), dtype=np.int64)
    if flat.size != num_windows or (flat.size and (flat.min() < 0 or flat.max() >= num_windows
                                                   or np.bincount(flat, minlength=num_windows).max() != 1)):
        raise ValueError(f"rank_windows must place each of the {num_windows} windows on exactly one rank")
    return out


class Plan:
    """Which windows of a layout each of ``world_size`` ranks owns, and the rows that follow from it.

    A rank's local rows are its windows' tokens, window after window in the order ``rank_windows`` lists them
    (ascending window id for LPT), row-major inside a window.

    Args:
        layout: the windows.
        world_size: the number of ranks.
        key: a hashable identity (the planner's cache key); plans with equal non-empty keys are interchangeable.
        rank_windows: one list of window ids per rank, covering every window exactly once; None runs LPT.
    """

    def __init__(self, layout: Layout, world_size: int, key: tuple = (), *,
                 rank_windows: Sequence[Sequence[int]] | None = None) -> None:
        self.layout = layout
        self.world_size = _check_world_size(world_size)
        self.key = key
        if rank_windows is None:
            rank_windows = lpt_assign(layout.token_counts.tolist(), self.world_size)
        self.rank_windows: tuple[tuple[int, ...], ...] = _check_rank_windows(
            rank_windows, layout.num_windows, self.world_size)
        counts = layout.token_counts
        self.rank_token_counts: tuple[int, ...] = tuple(int(counts[list(ws)].sum()) for ws in self.rank_windows)
        largest = int(counts.max()) if counts.size else 0
        self.ideal_lower_bound: int = max(largest, math.ceil(layout.num_tokens / self.world_size))
        self.imbalance: float = max(self.rank_token_counts) / self.ideal_lower_bound if self.ideal_lower_bound else 1.0

    @cached_property
    def window_owner(self) -> np.ndarray:
        """[n] rank owning each window."""
        owner = np.empty(self.layout.num_windows, dtype=np.int64)
        for rank, windows in enumerate(self.rank_windows):
            owner[list(windows)] = rank
        return owner

    @cached_property
    def _rank_positions(self) -> tuple[np.ndarray, ...]:
        lay = self.layout
        out = []
        for windows in self.rank_windows:
            w = np.asarray(windows, dtype=np.int64)
            if w.size == 0:
                out.append(np.empty(0, dtype=np.int64))
                continue
            counts = lay.token_counts[w]
            # positions = concat(range(offsets[w], offsets[w] + counts[w])) without a per-window loop
            starts = np.repeat(lay.offsets[w] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
            out.append(starts + np.arange(int(counts.sum()), dtype=np.int64))
        return tuple(out)

    def rank_positions(self, rank: int) -> np.ndarray:
        """Layout positions of ``rank``'s local rows, in local order."""
        return self._rank_positions[self._check_rank(rank)]

    def rank_token_ids(self, rank: int) -> np.ndarray:
        """Canonical token ids of ``rank``'s local rows, in local order."""
        return self.layout.token_ids[self.rank_positions(rank)]

    @cached_property
    def token_owner(self) -> np.ndarray:
        """[N] rank owning each canonical token id."""
        return self.window_owner[self.layout.window_of_position[self.layout.position_of_token]]

    @cached_property
    def token_local_index(self) -> np.ndarray:
        """[N] row index of each canonical token id inside its owner's local rows."""
        local = np.empty(self.layout.num_tokens, dtype=np.int64)
        for rank in range(self.world_size):
            ids = self.rank_token_ids(rank)
            local[ids] = np.arange(ids.size, dtype=np.int64)
        return local

    @cached_property
    def gather_order(self) -> np.ndarray:
        """[N] for each canonical id, its row in the concatenation of all ranks' local rows (rank order)."""
        return inverse_permutation(np.concatenate([self.rank_token_ids(r) for r in range(self.world_size)]))

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a plan for {self.world_size} ranks")
        return rank

    def __repr__(self) -> str:
        return (f"Plan(windows={self.layout.num_windows}, tokens={self.layout.num_tokens}, "
                f"world_size={self.world_size}, rank_tokens={list(self.rank_token_counts)}, "
                f"imbalance={self.imbalance:.3f})")
