"""Window placement: the LPT rule and the :class:`Plan` object (which windows each rank owns, and what follows).

LPT (deterministic, so every rank computes the same plan with no communication): windows sorted by
(-token count, window id); each goes to the rank with the smallest (assigned tokens, rank id); each rank then lists
its windows in ascending window id. A rank may end up with no window. Other placements (see
:mod:`winsp.planning.schedule`) hand a :class:`Plan` their own ``rank_windows``.
"""

from __future__ import annotations

import heapq
import math
from functools import cached_property
from itertools import pairwise
from typing import Sequence

import numpy as np

from winsp.geometry.layout import Layout, inverse_permutation
from winsp.planning.costs import DEFAULT_COSTS
from winsp.utils.checks import count_tuple

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


def _check_rank_pieces(rank_pieces, counts: np.ndarray, world_size: int) -> tuple:
    """Validate a split placement: per rank, ``(window, first row, end row)`` pieces that tile every window once."""
    out = tuple(tuple((int(w), int(a), int(b)) for w, a, b in pieces) for pieces in rank_pieces)
    if len(out) != world_size:
        raise ValueError(f"rank_pieces has {len(out)} lists but the plan is for {world_size} ranks")
    covered = np.zeros(counts.size, dtype=np.int64)
    spans: dict[int, list[tuple[int, int]]] = {}
    for rank, pieces in enumerate(out):
        seen = [w for w, _, _ in pieces]
        if len(set(seen)) != len(seen):
            twice = next(w for w in seen if seen.count(w) > 1)
            raise ValueError(f"rank_pieces[{rank}] holds two pieces of window {twice}; give each rank one row range "
                             "of a window")
        for w, a, b in pieces:
            if not (0 <= w < counts.size and 0 <= a < b <= counts[w]):
                raise ValueError(f"rank_pieces[{rank}] has piece {(w, a, b)}, which is not a non-empty row range of "
                                 f"one of the {counts.size} windows")
            covered[w] += b - a
            spans.setdefault(w, []).append((a, b))
    for w, ranges in spans.items():
        ranges.sort()
        if ranges[0][0] != 0 or any(x[1] != y[0] for x, y in pairwise(ranges)):
            raise ValueError(f"rank_pieces: the pieces of window {w} overlap or leave a gap: {ranges}")
    if not np.array_equal(covered, counts):
        missing = int(np.nonzero(covered != counts)[0][0])
        raise ValueError(f"rank_pieces must cover each window's rows exactly once; window {missing} is not covered")
    return out


class Plan:
    """Which rows of a layout each of ``world_size`` ranks owns: whole windows, or pieces of split windows.

    A rank's local rows are its pieces' tokens, piece after piece in the order ``rank_pieces`` lists them, row-major
    inside a window. With whole windows (the LPT and locality planners) every piece is a whole window and
    ``rank_windows`` lists them (ascending window id for LPT). A *split* window has its rows shared by several ranks
    (``window_holders``); :mod:`winsp.attention.split` computes its attention exactly across them.

    Balance is reported against a perfect split (``N / P``): ``rank_rows`` (tokenwise work) and ``rank_attention``
    (video query x video key pairs summed over heads, a split window's share counted by its rows, which is how its
    heads are shared out); ``row_imbalance`` and ``attention_imbalance`` are the largest rank's share of each against
    ``1 / P``, and ``imbalance`` is the worse of the two (what the default planner keeps within 5 %).
    ``work_imbalance`` is the same for the two combined into a layer's predicted work with the cost constants of
    :mod:`winsp.planning.costs` (what a rank's time follows on the modelled GPU). ``window_bound_imbalance`` is the
    former figure: the largest rank's rows against the best whole windows could do (``max(largest window, ceil(N /
    P))``).

    Args:
        layout: the windows.
        world_size: the number of ranks.
        key: a hashable identity (the planner's cache key); plans with equal non-empty keys are interchangeable.
        rank_windows: one list of window ids per rank, covering every window exactly once; None runs LPT.
        rank_pieces: instead of ``rank_windows``, one list of ``(window, first row, end row)`` per rank; the pieces of
            a window tile its rows exactly once.
    """

    def __init__(self, layout: Layout, world_size: int, key: tuple = (), *,
                 rank_windows: Sequence[Sequence[int]] | None = None,
                 rank_pieces: Sequence[Sequence[tuple[int, int, int]]] | None = None) -> None:
        self.layout = layout
        self.world_size = _check_world_size(world_size)
        self.key = key
        counts = layout.token_counts
        if rank_pieces is not None:
            if rank_windows is not None:
                raise ValueError("give rank_windows or rank_pieces, not both")
            self.rank_pieces = _check_rank_pieces(rank_pieces, counts, self.world_size)
            self.rank_windows: tuple[tuple[int, ...], ...] = tuple(
                tuple(w for w, a, b in pieces if a == 0 and b == counts[w]) for pieces in self.rank_pieces)
        else:
            if rank_windows is None:
                rank_windows = lpt_assign(counts.tolist(), self.world_size)
            self.rank_windows = _check_rank_windows(rank_windows, layout.num_windows, self.world_size)
            self.rank_pieces = tuple(tuple((w, 0, int(counts[w])) for w in ws) for ws in self.rank_windows)
        self.rank_token_counts: tuple[int, ...] = tuple(sum(b - a for _, a, b in ps) for ps in self.rank_pieces)
        self.rank_rows = self.rank_token_counts
        self.rank_attention: tuple[int, ...] = tuple(
            int(sum((b - a) * int(counts[w]) for w, a, b in ps)) for ps in self.rank_pieces)
        n, p = layout.num_tokens, self.world_size
        largest = int(counts.max()) if counts.size else 0
        self.ideal_lower_bound: int = max(largest, math.ceil(n / p))
        self.window_bound_imbalance: float = (max(self.rank_token_counts) / self.ideal_lower_bound
                                              if self.ideal_lower_bound else 1.0)
        total_pairs = int((counts.astype(np.int64) ** 2).sum())
        self.row_imbalance: float = max(self.rank_rows) * p / n if n else 1.0
        self.attention_imbalance: float = max(self.rank_attention) * p / total_pairs if total_pairs else 1.0
        self.imbalance: float = max(self.row_imbalance, self.attention_imbalance)
        work = np.asarray(self.rank_rows) * DEFAULT_COSTS.row_s + np.asarray(self.rank_attention) * DEFAULT_COSTS.pair_s
        self.work_imbalance: float = float(work.max() * p / work.sum()) if work.sum() else 1.0

    @cached_property
    def window_holders(self) -> dict[int, tuple[tuple[int, int, int], ...]]:
        """Split windows only: window id -> its ``(rank, first row, end row)`` pieces in row order."""
        counts = self.layout.token_counts
        out: dict[int, list] = {}
        for rank, pieces in enumerate(self.rank_pieces):
            for w, a, b in pieces:
                if b - a != counts[w]:
                    out.setdefault(w, []).append((rank, a, b))
        return {w: tuple(sorted(v, key=lambda x: x[1])) for w, v in sorted(out.items())}

    @property
    def has_split_windows(self) -> bool:
        """Whether any window's rows are shared by several ranks."""
        return bool(self.window_holders)

    @cached_property
    def window_owner(self) -> np.ndarray:
        """[n] rank owning each window (for a split window: the rank holding its first row)."""
        owner = np.empty(self.layout.num_windows, dtype=np.int64)
        for rank, pieces in enumerate(self.rank_pieces):
            for w, a, _ in pieces:
                if a == 0:
                    owner[w] = rank
        return owner

    @cached_property
    def _rank_positions(self) -> tuple[np.ndarray, ...]:
        lay = self.layout
        out: list[np.ndarray] = []
        for pieces in self.rank_pieces:
            if not pieces:
                out.append(np.empty(0, dtype=np.int64))
                continue
            arr = np.asarray(pieces, dtype=np.int64)
            first = lay.offsets[arr[:, 0]] + arr[:, 1]
            lengths = arr[:, 2] - arr[:, 1]
            # positions = concat(range(first[i], first[i] + lengths[i])) without a per-piece loop
            starts = np.repeat(first - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
            out.append(starts + np.arange(int(lengths.sum()), dtype=np.int64))
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
        if not self.has_split_windows:
            return self.window_owner[self.layout.window_of_position[self.layout.position_of_token]]
        owner = np.empty(self.layout.num_tokens, dtype=np.int64)
        for rank in range(self.world_size):
            owner[self.rank_token_ids(rank)] = rank
        return owner

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
                f"split_windows={len(self.window_holders)}, imbalance={self.imbalance:.3f})")
