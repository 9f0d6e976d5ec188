"""Window segments: the lengths, grouping and indices of one rank's attention windows.

Each local window is one attention segment: its own video rows followed by the text rows of its sample (text is
replicated; a packed batch holds several samples whose texts differ in length). :class:`WindowSegments` computes,
once and on the CPU, every length and index the attention backends need; :class:`WindowIndexTensors` holds the device
copies of those indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from winsp.utils.checks import count_tuple

__all__ = ["WindowSegments", "WindowIndexTensors", "INT32_MAX"]

INT32_MAX = int(np.iinfo(np.int32).max)


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True)
class WindowIndexTensors:
    """The index tensors of one :class:`WindowSegments` on one device (built once, then reused).

    ``pack_index`` gathers the packed sequence (pack order, see :attr:`WindowSegments.pack_order`)
    from the rows of ``cat([vid, txt])``; ``unpack_index`` gathers ``cat([vid_out, txt_out])`` from the
    packed output; ``packed_cu_seqlens`` (int32) bounds each non-empty window in the packed sequence;
    ``uniform_txt_index`` (only when every window has the same shape) gathers the window-major text rows;
    ``pack_vid_row`` names, for each packed row, a video row of its own window (itself for a video row; see
    :attr:`WindowSegments.pack_vid_row`), which is where score modifications are evaluated.
    """

    pack_index: Tensor
    unpack_index: Tensor
    packed_cu_seqlens: Tensor
    uniform_txt_index: Tensor | None
    pack_vid_row: Tensor


@dataclass(frozen=True)
class WindowSegments:
    """Per local window: its video row count, and where its sample's text lives in the packed text tensor.

    Video rows are contiguous window by window in the order given here (the local order). Windows may be
    empty; a rank may have no window at all. Every derived length and index is computed once, on the CPU,
    and cached on the object (it is immutable), so the per-layer hot path never synchronises with the device nor
    rebuilds an index. Device copies are made by :meth:`index_tensors`; the runtime's store keeps them.
    """

    vid_counts: tuple[int, ...]
    """Video rows of each local window, in local order."""
    txt_lengths: tuple[int, ...]
    """Text length of each window's sample (0 for a model without text)."""
    txt_starts: tuple[int, ...]
    """First row of that sample's text in the packed text tensor."""

    # derived at construction by _derive_lengths (see there); not arguments, not compared
    seq_lens: tuple[int, ...] = field(init=False, repr=False, compare=False)
    total_vid: int = field(init=False, repr=False, compare=False)
    total_txt: int = field(init=False, repr=False, compare=False)
    total_seq: int = field(init=False, repr=False, compare=False)
    txt_extent: int = field(init=False, repr=False, compare=False)
    max_seqlen: int = field(init=False, repr=False, compare=False)
    groups: tuple[tuple[int, tuple[int, ...]], ...] = field(init=False, repr=False, compare=False)
    pack_order: tuple[int, ...] = field(init=False, repr=False, compare=False)
    group_slices: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)
    is_uniform: bool = field(init=False, repr=False, compare=False)
    packing_is_identity: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        vid_counts = count_tuple("WindowSegments.vid_counts", self.vid_counts)
        txt_lengths = count_tuple("WindowSegments.txt_lengths", self.txt_lengths)
        txt_starts = count_tuple("WindowSegments.txt_starts", self.txt_starts)
        if len(txt_lengths) != len(vid_counts):
            raise ValueError(
                f"WindowSegments.txt_lengths has {len(txt_lengths)} entries but vid_counts has "
                f"{len(vid_counts)}: one entry per local window is required"
            )
        if len(txt_starts) != len(vid_counts):
            raise ValueError(
                f"WindowSegments.txt_starts has {len(txt_starts)} entries but vid_counts has "
                f"{len(vid_counts)}: one entry per local window is required"
            )
        object.__setattr__(self, "vid_counts", vid_counts)
        object.__setattr__(self, "txt_lengths", txt_lengths)
        object.__setattr__(self, "txt_starts", txt_starts)
        self._derive_lengths()

    @classmethod
    def from_samples(
        cls,
        vid_counts: tuple[int, ...] | list[int],
        window_samples: tuple[int, ...] | list[int],
        sample_txt_lengths: tuple[int, ...] | list[int],
    ) -> "WindowSegments":
        """Build segments from each window's sample id and the text lengths of the packed samples.

        The packed text tensor holds sample 0's text, then sample 1's, ...; ``window_samples[i]`` is the
        sample that local window ``i`` belongs to.
        """
        lengths = count_tuple("WindowSegments.sample_txt_lengths", sample_txt_lengths)
        samples = count_tuple("WindowSegments.window_samples", window_samples)
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        for position, sample in enumerate(samples):
            if sample >= len(lengths):
                raise ValueError(
                    f"window_samples[{position}] = {sample} but only {len(lengths)} samples have text lengths"
                )
        return cls(
            vid_counts=tuple(vid_counts),
            txt_lengths=tuple(lengths[s] for s in samples),
            txt_starts=tuple(int(starts[s]) for s in samples),
        )

    # ----------------------------------------------------------------- lengths (pure Python, no arrays)
    def _derive_lengths(self) -> None:
        """Compute every Python-level length once, at construction (plain attributes: nothing to lock or trace).

        Attributes: ``seq_lens`` (video + text rows of each window), ``total_vid`` (video rows on this rank),
        ``total_txt`` (window-text rows, the length of the window-major ``txt_out``), ``total_seq``, ``txt_extent``
        (minimal packed-text length every window's text fits in), ``max_seqlen`` (longest segment, 0 without
        windows), ``groups`` (``(segment length, window indices)`` per set of non-empty windows of equal length, in
        order of first window), ``pack_order`` (non-empty windows group by group: the order kernels see),
        ``group_slices`` (``(first packed row, window count, segment length)`` per group), ``is_uniform`` (at least
        one window, all with the same video count and text length: the packed sequence is ``[N, V + T]`` with the
        video a view of ``vid``) and ``packing_is_identity`` (no window text and pack order is local order).
        """
        seq_lens = tuple(v + t for v, t in zip(self.vid_counts, self.txt_lengths, strict=True))
        members: dict[int, list[int]] = {}
        for window, length in enumerate(seq_lens):
            if length > 0:
                members.setdefault(length, []).append(window)
        groups = tuple((length, tuple(windows)) for length, windows in members.items())
        pack_order = tuple(w for _, windows in groups for w in windows)
        slices: list[tuple[int, int, int]] = []
        start = 0
        for length, windows in groups:
            slices.append((start, len(windows), length))
            start += len(windows) * length
        total_vid, total_txt = sum(self.vid_counts), sum(self.txt_lengths)
        derived = dict(
            seq_lens=seq_lens,
            total_vid=total_vid,
            total_txt=total_txt,
            total_seq=total_vid + total_txt,
            txt_extent=max((s + n for s, n in zip(self.txt_starts, self.txt_lengths, strict=True) if n > 0), default=0),
            max_seqlen=max(seq_lens, default=0),
            groups=groups,
            pack_order=pack_order,
            group_slices=tuple(slices),
            is_uniform=(len(seq_lens) > 0 and seq_lens[0] > 0 and len(set(self.vid_counts)) == 1
                        and len(set(self.txt_lengths)) == 1),
            packing_is_identity=total_txt == 0 and list(pack_order) == sorted(pack_order),
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def num_windows(self) -> int:
        return len(self.vid_counts)

    # ----------------------------------------------------------------- CPU arrays
    def check_int32(self) -> None:
        if self.total_seq > INT32_MAX:
            raise ValueError(
                f"window segments hold {self.total_seq} rows in total, which overflows the int32 "
                f"cu_seqlens used by varlen kernels (max {INT32_MAX}); split the work across more ranks"
            )

    @cached_property
    def cu_seqlens(self) -> np.ndarray:
        """int32 cumulative segment lengths in local window order, ``[num_windows + 1]`` (read-only)."""
        self.check_int32()
        cu = np.zeros(self.num_windows + 1, dtype=np.int64)
        np.cumsum(self.seq_lens, out=cu[1:])
        return _readonly(cu.astype(np.int32))

    @cached_property
    def packed_cu_seqlens(self) -> np.ndarray:
        """int32 cumulative lengths of the non-empty windows in pack order (what varlen kernels take)."""
        self.check_int32()
        lengths = [self.seq_lens[w] for w in self.pack_order]
        cu = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        return _readonly(cu.astype(np.int32))

    @cached_property
    def _vid_offsets(self) -> np.ndarray:
        offsets = np.zeros(self.num_windows + 1, dtype=np.int64)
        np.cumsum(self.vid_counts, out=offsets[1:])
        return offsets

    @cached_property
    def _txt_out_offsets(self) -> np.ndarray:
        offsets = np.zeros(self.num_windows + 1, dtype=np.int64)
        np.cumsum(self.txt_lengths, out=offsets[1:])
        return offsets

    @cached_property
    def concat_index(self) -> np.ndarray:
        """int64 ``[total_seq]``: ``cat([vid, txt])[concat_index]`` is the packed sequence (pack order).

        Row ``r`` of ``vid`` is concat row ``r``; row ``r`` of the packed text is concat row ``total_vid + r``.
        """
        parts = []
        for w in self.pack_order:
            start = self._vid_offsets[w]
            parts.append(np.arange(start, start + self.vid_counts[w], dtype=np.int64))
            txt_start = self.total_vid + self.txt_starts[w]
            parts.append(np.arange(txt_start, txt_start + self.txt_lengths[w], dtype=np.int64))
        return _readonly(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))

    @cached_property
    def pack_vid_row(self) -> np.ndarray:
        """int64 ``[total_seq]``: per packed row, its local video row, or for a text row the first video row of its
        window (0 in a window without video).

        A score modification is a function of two video rows of one window; evaluating it where a pair is not such
        a pair (a text row, or two windows in one packed sequence) at a row paired with itself keeps every index the
        function computes inside what it was written for (a relative-position table, say).
        """
        parts = []
        for w in self.pack_order:
            start, vid, txt = self._vid_offsets[w], self.vid_counts[w], self.txt_lengths[w]
            parts.append(np.arange(start, start + vid, dtype=np.int64))
            parts.append(np.full(txt, start if vid else 0, dtype=np.int64))
        return _readonly(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))

    @cached_property
    def unpack_index(self) -> np.ndarray:
        """int64 ``[total_seq]``: ``packed_out[unpack_index]`` is ``cat([vid_out, txt_out])``."""
        index = np.empty(self.total_seq, dtype=np.int64)
        packed_row = 0
        for w in self.pack_order:
            vid, txt = self.vid_counts[w], self.txt_lengths[w]
            vid_dst = self._vid_offsets[w]
            index[vid_dst : vid_dst + vid] = np.arange(packed_row, packed_row + vid)
            txt_dst = self.total_vid + self._txt_out_offsets[w]
            index[txt_dst : txt_dst + txt] = np.arange(packed_row + vid, packed_row + vid + txt)
            packed_row += vid + txt
        return _readonly(index)

    @cached_property
    def uniform_txt_index(self) -> np.ndarray | None:
        """For :attr:`is_uniform` segments: int64 ``[num_windows * T]`` text rows, window-major; else None."""
        if not self.is_uniform:
            return None
        length = self.txt_lengths[0]
        starts = np.asarray(self.txt_starts, dtype=np.int64)[:, None]
        return _readonly((starts + np.arange(length, dtype=np.int64)[None, :]).reshape(-1))

    # ----------------------------------------------------------------- device tensors
    def index_tensors(self, device: torch.device | str) -> WindowIndexTensors:
        """The index tensors on ``device`` (built anew on every call: keep the result, as the runtime's store does)."""
        device = torch.device(device)
        uniform = self.uniform_txt_index
        return WindowIndexTensors(
            pack_index=torch.tensor(self.concat_index, dtype=torch.int64, device=device),
            unpack_index=torch.tensor(self.unpack_index, dtype=torch.int64, device=device),
            packed_cu_seqlens=torch.tensor(self.packed_cu_seqlens, dtype=torch.int32, device=device),
            uniform_txt_index=None if uniform is None else torch.tensor(uniform, dtype=torch.int64, device=device),
            pack_vid_row=torch.tensor(self.pack_vid_row, dtype=torch.int64, device=device),
        )
