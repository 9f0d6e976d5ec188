"""Attention inside each local window: ``[window video rows, then its sample's text rows]``.

After the runtime has placed this rank's video rows window by window, every window is an independent
attention segment made of its own video rows followed by the text of the sample it belongs to (the text
is replicated on every rank; a packed batch holds several samples whose texts differ in length).
Each window yields its video outputs and its own copy of its sample's text outputs; averaging those
text copies over all windows is the runtime's job, not this module's.

:class:`WindowSegments` describes the local windows and precomputes, once and on the CPU, every
length and index the kernels need. :func:`window_attention` runs one of several backends over them;
:func:`reference_window_attention` is the plain per-window loop that serves as the oracle in tests.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BACKENDS",
    "WindowSegments",
    "WindowIndexTensors",
    "WindowAttention",
    "window_attention",
    "reference_window_attention",
    "available_backends",
    "select_backend",
]

#: Every backend name :func:`window_attention` understands, in ``"auto"`` preference order.
BACKENDS: tuple[str, ...] = ("flash_varlen", "torch_varlen", "batched_sdpa", "grouped_sdpa")

_INT32_MAX = int(np.iinfo(np.int32).max)
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def _as_count_tuple(name: str, values: object) -> tuple[int, ...]:
    """Coerce ``values`` to a tuple of non-negative Python ints, or raise a ValueError naming ``name``."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"WindowSegments.{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for position, value in enumerate(values):  # type: ignore[union-attr]
        if isinstance(value, (bool, np.bool_)):
            raise ValueError(f"WindowSegments.{name}[{position}] must be an int, got a bool")
        try:
            number = operator.index(value)
        except TypeError:
            raise ValueError(
                f"WindowSegments.{name}[{position}] must be an int, got {type(value).__name__}"
            ) from None
        if number < 0:
            raise ValueError(f"WindowSegments.{name}[{position}] must be non-negative, got {number}")
        out.append(int(number))
    return tuple(out)


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True)
class WindowIndexTensors:
    """The index tensors of one :class:`WindowSegments` on one device (built once, then reused).

    ``pack_index`` gathers the packed sequence (pack order, see :attr:`WindowSegments.pack_order`)
    from the rows of ``cat([vid, txt])``; ``unpack_index`` gathers ``cat([vid_out, txt_out])`` from the
    packed output; ``packed_cu_seqlens`` (int32) bounds each non-empty window in the packed sequence;
    ``uniform_txt_index`` (only when every window has the same shape) gathers the window-major text rows.
    """

    pack_index: Tensor
    unpack_index: Tensor
    packed_cu_seqlens: Tensor
    uniform_txt_index: Tensor | None


@dataclass(frozen=True)
class WindowSegments:
    """Per local window: its video row count, and where its sample's text lives in the packed text tensor.

    Video rows are contiguous window by window in the order given here (the local order). Windows may be
    empty; a rank may have no window at all. Every derived length and index is computed once, on the CPU,
    and cached, so the per-layer hot path never synchronises with the device nor rebuilds an index.
    """

    vid_counts: tuple[int, ...]
    """Video rows of each local window, in local order."""
    txt_lengths: tuple[int, ...]
    """Text length of each window's sample (0 for a model without text)."""
    txt_starts: tuple[int, ...]
    """First row of that sample's text in the packed text tensor."""
    _device_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        vid_counts = _as_count_tuple("vid_counts", self.vid_counts)
        txt_lengths = _as_count_tuple("txt_lengths", self.txt_lengths)
        txt_starts = _as_count_tuple("txt_starts", self.txt_starts)
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
        lengths = _as_count_tuple("sample_txt_lengths", sample_txt_lengths)
        samples = _as_count_tuple("window_samples", window_samples)
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
    @property
    def num_windows(self) -> int:
        return len(self.vid_counts)

    @cached_property
    def seq_lens(self) -> tuple[int, ...]:
        """Segment length of each window: its video rows plus its text rows."""
        return tuple(v + t for v, t in zip(self.vid_counts, self.txt_lengths))

    @cached_property
    def total_vid(self) -> int:
        """Video rows on this rank (the expected length of ``q_vid``)."""
        return sum(self.vid_counts)

    @cached_property
    def total_txt(self) -> int:
        """Window-text rows: the length of the window-major ``txt_out``."""
        return sum(self.txt_lengths)

    @cached_property
    def total_seq(self) -> int:
        """Rows of the packed ``[window video, window text]`` sequence over all windows."""
        return self.total_vid + self.total_txt

    @cached_property
    def txt_extent(self) -> int:
        """Minimal length of the packed text tensor that every window's text fits in."""
        return max((s + n for s, n in zip(self.txt_starts, self.txt_lengths) if n > 0), default=0)

    @cached_property
    def max_seqlen(self) -> int:
        """Longest segment (0 without windows); a Python int, so kernels never read it from the device."""
        return max(self.seq_lens, default=0)

    @cached_property
    def groups(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``(segment length, window indices)`` for each set of non-empty windows of equal segment length.

        Groups appear in order of their first window; windows keep local order inside a group.
        """
        members: dict[int, list[int]] = {}
        for window, length in enumerate(self.seq_lens):
            if length > 0:
                members.setdefault(length, []).append(window)
        return tuple((length, tuple(windows)) for length, windows in members.items())

    @cached_property
    def pack_order(self) -> tuple[int, ...]:
        """Non-empty windows in the order the kernels see them: group by group (see :attr:`groups`)."""
        return tuple(w for _, windows in self.groups for w in windows)

    @cached_property
    def group_slices(self) -> tuple[tuple[int, int, int], ...]:
        """``(first packed row, window count, segment length)`` of each group in the packed sequence."""
        slices, start = [], 0
        for length, windows in self.groups:
            slices.append((start, len(windows), length))
            start += len(windows) * length
        return tuple(slices)

    @cached_property
    def is_uniform(self) -> bool:
        """True when there is at least one window and all have the same video count and text length.

        Then the packed sequence is ``[N, V + T]`` with the video part a plain view of ``vid``.
        """
        return (
            self.num_windows > 0
            and self.seq_lens[0] > 0
            and len(set(self.vid_counts)) == 1
            and len(set(self.txt_lengths)) == 1
        )

    @cached_property
    def packing_is_identity(self) -> bool:
        """True when the packed sequence is ``vid`` itself: no window text, and pack order is local order."""
        return self.total_txt == 0 and list(self.pack_order) == sorted(self.pack_order)

    # ----------------------------------------------------------------- CPU arrays
    def _check_int32(self) -> None:
        if self.total_seq > _INT32_MAX:
            raise ValueError(
                f"window segments hold {self.total_seq} rows in total, which overflows the int32 "
                f"cu_seqlens used by varlen kernels (max {_INT32_MAX}); split the work across more ranks"
            )

    @cached_property
    def cu_seqlens(self) -> np.ndarray:
        """int32 cumulative segment lengths in local window order, ``[num_windows + 1]`` (read-only)."""
        self._check_int32()
        cu = np.zeros(self.num_windows + 1, dtype=np.int64)
        np.cumsum(self.seq_lens, out=cu[1:])
        return _readonly(cu.astype(np.int32))

    @cached_property
    def packed_cu_seqlens(self) -> np.ndarray:
        """int32 cumulative lengths of the non-empty windows in pack order (what varlen kernels take)."""
        self._check_int32()
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
        """The index tensors on ``device``, built on the first request and cached per device."""
        device = torch.device(device)
        cached = self._device_cache.get(device)
        if cached is None:
            uniform = self.uniform_txt_index
            cached = WindowIndexTensors(
                pack_index=torch.tensor(self.concat_index, dtype=torch.int64, device=device),
                unpack_index=torch.tensor(self.unpack_index, dtype=torch.int64, device=device),
                packed_cu_seqlens=torch.tensor(self.packed_cu_seqlens, dtype=torch.int32, device=device),
                uniform_txt_index=None
                if uniform is None
                else torch.tensor(uniform, dtype=torch.int64, device=device),
            )
            self._device_cache[device] = cached
        return cached


# --------------------------------------------------------------------------- backend availability
def _flash_varlen_fn() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # ImportError, or a broken CUDA extension
        return None
    return flash_attn_varlen_func


def _torch_varlen_fn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


def _cuda_reason(device: torch.device) -> str | None:
    """Why a CUDA-only varlen kernel cannot run on ``device`` (None when it can)."""
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "it needs a GPU of compute capability 8.0 or newer"
    return None


def _backend_unavailable_reason(
    backend: str, device: torch.device, segments: WindowSegments | None, dtype: torch.dtype | None
) -> str | None:
    """Why ``backend`` cannot run here (None when it can); ``segments``/``dtype`` None skip those checks."""
    if backend in ("flash_varlen", "torch_varlen"):
        # the device check comes first: importing the kernels is slow (torch.nn.attention.varlen pulls in dynamo)
        reason = _cuda_reason(device)
        if reason is not None:
            return reason
        loader = _flash_varlen_fn if backend == "flash_varlen" else _torch_varlen_fn
        if loader() is None:
            where = "flash_attn.flash_attn_varlen_func" if backend == "flash_varlen" else (
                "torch.nn.attention.varlen.varlen_attn"
            )
            return f"{where} is not importable"
        if dtype is not None and dtype not in _VARLEN_DTYPES:
            return f"it needs float16 or bfloat16 inputs, got {dtype}"
        if segments is not None:
            try:
                segments._check_int32()
            except ValueError as err:
                return str(err)
        return None
    if backend == "batched_sdpa":
        if segments is not None and len(segments.groups) > 1:
            lengths = sorted(length for length, _ in segments.groups)
            return f"it needs all windows to share one segment length, got lengths {lengths}"
        return None
    if backend == "grouped_sdpa":
        return None
    raise ValueError(f"unknown attention backend {backend!r}; choose 'auto' or one of {list(BACKENDS)}")


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on ``device`` for some inputs, in ``"auto"`` preference order.

    The varlen kernels additionally need float16/bfloat16 inputs; ``batched_sdpa`` needs windows of a
    single segment length. :func:`select_backend` checks those against concrete segments.
    """
    device = torch.device(device)
    return [name for name in BACKENDS if _backend_unavailable_reason(name, device, None, None) is None]


def select_backend(
    device: torch.device | str,
    segments: WindowSegments,
    requested: str = "auto",
    *,
    dtype: torch.dtype | None = None,
) -> str:
    """Resolve ``requested`` to a concrete backend for ``segments`` on ``device``.

    ``"auto"`` prefers flash_varlen, then torch_varlen (CUDA, float16/bfloat16), then batched_sdpa when all
    non-empty windows share one segment length, else grouped_sdpa. An explicit backend that cannot run
    raises ValueError naming it and the reason. ``dtype`` None skips the dtype check.
    """
    device = torch.device(device)
    if requested == "auto":
        for name in ("flash_varlen", "torch_varlen"):
            if _backend_unavailable_reason(name, device, segments, dtype) is None:
                return name
        return "batched_sdpa" if len(segments.groups) == 1 else "grouped_sdpa"
    if not isinstance(requested, str) or requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose 'auto' or one of {list(BACKENDS)}")
    reason = _backend_unavailable_reason(requested, device, segments, dtype)
    if reason is not None:
        raise ValueError(f"attention backend {requested!r} cannot run: {reason}")
    return requested


# --------------------------------------------------------------------------- input checks
def _check_inputs(
    q_vid: Tensor,
    k_vid: Tensor,
    v_vid: Tensor,
    q_txt: Tensor | None,
    k_txt: Tensor | None,
    v_txt: Tensor | None,
    segments: WindowSegments,
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate shapes against ``segments``; returns the text tensors (empty ones when text is None)."""
    if not isinstance(segments, WindowSegments):
        raise TypeError(f"segments must be a WindowSegments, got {type(segments).__name__}")
    for name, tensor in (("q_vid", q_vid), ("k_vid", k_vid), ("v_vid", v_vid)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be [rows, heads, head_dim], got shape {tuple(tensor.shape)}")
        if tensor.shape != q_vid.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but q_vid has {tuple(q_vid.shape)}")
        if tensor.dtype != q_vid.dtype or tensor.device != q_vid.device:
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device} but q_vid is {q_vid.dtype} on {q_vid.device}"
            )
    if q_vid.shape[0] != segments.total_vid:
        raise ValueError(
            f"q_vid has {q_vid.shape[0]} rows but the segments describe {segments.total_vid} video rows"
        )
    text = (q_txt, k_txt, v_txt)
    if all(t is None for t in text):
        if segments.total_txt > 0:
            raise ValueError(
                f"no text tensors were given but the segments describe {segments.total_txt} window-text rows"
            )
        empty = q_vid.new_empty((0, *q_vid.shape[1:]))
        return empty, empty, empty
    if any(t is None for t in text):
        raise ValueError("q_txt, k_txt and v_txt must be all tensors or all None")
    assert q_txt is not None and k_txt is not None and v_txt is not None
    _, heads, head_dim = q_vid.shape
    txt_rows = q_txt.shape[0] if isinstance(q_txt, Tensor) and q_txt.dim() > 0 else None
    for name, tensor in (("q_txt", q_txt), ("k_txt", k_txt), ("v_txt", v_txt)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (heads, head_dim):
            raise ValueError(
                f"{name} must be [rows, {heads}, {head_dim}] like the video, got shape {tuple(tensor.shape)}"
            )
        if tensor.shape[0] != txt_rows:
            raise ValueError(f"{name} has {tensor.shape[0]} rows but q_txt has {txt_rows}")
        if tensor.dtype != q_vid.dtype or tensor.device != q_vid.device:
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device} but q_vid is {q_vid.dtype} on {q_vid.device}"
            )
    if q_txt.shape[0] < segments.txt_extent:
        raise ValueError(
            f"q_txt has {q_txt.shape[0]} rows but the segments read text up to row {segments.txt_extent}"
        )
    return q_txt, k_txt, v_txt


def _empty_outputs(q_vid: Tensor, k_vid: Tensor, v_vid: Tensor) -> tuple[Tensor, Tensor]:
    """Zero-row outputs for a rank whose windows are all empty (so there is no window text either).

    They still depend on q, k and v, so a backward pass through them yields empty/zero gradients instead of
    failing, and upstream parameters get a gradient on every rank.
    """
    vid_out = q_vid[:0] + k_vid[:0] + v_vid[:0]
    return vid_out, vid_out.clone()


# --------------------------------------------------------------------------- backends
def _pack(vid: Tensor, txt: Tensor, index: Tensor, segments: WindowSegments) -> Tensor:
    """The packed ``[window video, window text]`` sequence, in pack order."""
    if segments.packing_is_identity:
        return vid
    return torch.cat([vid, txt]).index_select(0, index)


def _unpack(packed_out: Tensor, index: Tensor, segments: WindowSegments) -> tuple[Tensor, Tensor]:
    if segments.packing_is_identity:
        out = packed_out
    else:
        out = packed_out.index_select(0, index)
    return out[: segments.total_vid], out[segments.total_vid :]


def _sdpa_segments(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Attention over ``[G, S, heads, head_dim]`` segments; returns the same layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


def _grouped_sdpa(qkv_vid, qkv_txt, segments: WindowSegments, scale: float) -> tuple[Tensor, Tensor]:
    idx = segments.index_tensors(qkv_vid[0].device)
    q, k, v = (_pack(vid, txt, idx.pack_index, segments) for vid, txt in zip(qkv_vid, qkv_txt))
    heads_dim = q.shape[1:]
    outs = []
    for start, count, length in segments.group_slices:
        rows = slice(start, start + count * length)
        shape = (count, length, *heads_dim)
        out = _sdpa_segments(q[rows].reshape(shape), k[rows].reshape(shape), v[rows].reshape(shape), scale)
        outs.append(out.reshape(count * length, *heads_dim))
    packed_out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return _unpack(packed_out, idx.unpack_index, segments)


def _batched_sdpa(qkv_vid, qkv_txt, segments: WindowSegments, scale: float) -> tuple[Tensor, Tensor]:
    if not segments.is_uniform:  # one segment length but mixed video/text splits: one gathered group
        return _grouped_sdpa(qkv_vid, qkv_txt, segments, scale)
    idx = segments.index_tensors(qkv_vid[0].device)
    count, vid_len, txt_len = segments.num_windows, segments.vid_counts[0], segments.txt_lengths[0]
    heads_dim = qkv_vid[0].shape[1:]

    def window_batch(vid: Tensor, txt: Tensor) -> Tensor:
        vid = vid.reshape(count, vid_len, *heads_dim)
        if txt_len == 0:
            return vid
        txt = txt.index_select(0, idx.uniform_txt_index).view(count, txt_len, *heads_dim)
        return torch.cat([vid, txt], dim=1)

    q, k, v = (window_batch(vid, txt) for vid, txt in zip(qkv_vid, qkv_txt))
    out = _sdpa_segments(q, k, v, scale)
    vid_out = out[:, :vid_len].reshape(count * vid_len, *heads_dim)
    txt_out = out[:, vid_len:].reshape(count * txt_len, *heads_dim)
    return vid_out, txt_out


def _varlen(kernel_name: str, kernel: Callable, qkv_vid, qkv_txt, segments: WindowSegments, scale: float):
    """Pack all windows into one sequence and run a varlen kernel bounded by int32 cu_seqlens."""
    idx = segments.index_tensors(qkv_vid[0].device)
    q, k, v = (_pack(vid, txt, idx.pack_index, segments).contiguous() for vid, txt in zip(qkv_vid, qkv_txt))
    cu, longest = idx.packed_cu_seqlens, segments.max_seqlen
    if kernel_name == "flash_varlen":
        packed_out = kernel(q, k, v, cu, cu, longest, longest, dropout_p=0.0, softmax_scale=scale, causal=False)
    else:
        packed_out = kernel(q, k, v, cu, cu, longest, longest, scale=scale)
    return _unpack(packed_out, idx.unpack_index, segments)


def window_attention(
    q_vid: Tensor,
    k_vid: Tensor,
    v_vid: Tensor,
    q_txt: Tensor | None,
    k_txt: Tensor | None,
    v_txt: Tensor | None,
    segments: WindowSegments,
    *,
    backend: str = "auto",
    softmax_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention inside every local window over ``[window video rows, window's sample text rows]``.

    ``q_vid``/``k_vid``/``v_vid`` are ``[Lv, heads, head_dim]`` (this rank's rows, window by window);
    ``q_txt``/``k_txt``/``v_txt`` are ``[Lt, heads, head_dim]``, the packed replicated text of all samples
    (or None / zero rows without text). Returns ``(vid_out [Lv, heads, head_dim], txt_out
    [sum(txt_lengths), heads, head_dim])`` with ``txt_out`` window-major: window 0's copy of its sample's
    text outputs, then window 1's, ... The output dtype is the input dtype. ``softmax_scale`` defaults to
    ``head_dim ** -0.5``.
    """
    q_txt, k_txt, v_txt = _check_inputs(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments)
    name = select_backend(q_vid.device, segments, backend, dtype=q_vid.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_vid.shape[-1])
    if segments.total_seq == 0:
        return _empty_outputs(q_vid, k_vid, v_vid)
    qkv_vid, qkv_txt = (q_vid, k_vid, v_vid), (q_txt, k_txt, v_txt)
    if name == "grouped_sdpa":
        return _grouped_sdpa(qkv_vid, qkv_txt, segments, scale)
    if name == "batched_sdpa":
        return _batched_sdpa(qkv_vid, qkv_txt, segments, scale)
    kernel = _flash_varlen_fn() if name == "flash_varlen" else _torch_varlen_fn()
    return _varlen(name, kernel, qkv_vid, qkv_txt, segments, scale)


def reference_window_attention(
    q_vid: Tensor,
    k_vid: Tensor,
    v_vid: Tensor,
    q_txt: Tensor | None,
    k_txt: Tensor | None,
    v_txt: Tensor | None,
    segments: WindowSegments,
    *,
    softmax_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The oracle: one ``scaled_dot_product_attention`` call per window, with plain slicing and no index.

    Same contract as :func:`window_attention`; slow, and meant for tests.
    """
    q_txt, k_txt, v_txt = _check_inputs(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_vid.shape[-1])
    vid_outs, txt_outs = [], []
    vid_row = 0
    for vid_len, txt_len, txt_start in zip(segments.vid_counts, segments.txt_lengths, segments.txt_starts):
        if vid_len + txt_len == 0:
            continue
        vid_rows = slice(vid_row, vid_row + vid_len)
        txt_rows = slice(txt_start, txt_start + txt_len)
        # [S, heads, d] -> [heads, S, d] for SDPA, and back
        q, k, v = (
            torch.cat([vid[vid_rows], txt[txt_rows]]).transpose(0, 1)
            for vid, txt in ((q_vid, q_txt), (k_vid, k_txt), (v_vid, v_txt))
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
        vid_outs.append(out[:vid_len])
        txt_outs.append(out[vid_len:])
        vid_row += vid_len
    if not vid_outs:
        return _empty_outputs(q_vid, k_vid, v_vid)
    return torch.cat(vid_outs), torch.cat(txt_outs)


class WindowAttention(nn.Module):
    """Thin module over :func:`window_attention` holding the backend choice and the softmax scale."""

    def __init__(self, *, backend: str = "auto", softmax_scale: float | None = None) -> None:
        super().__init__()
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose 'auto' or one of {list(BACKENDS)}")
        self.backend = backend
        self.softmax_scale = softmax_scale

    def forward(
        self,
        q_vid: Tensor,
        k_vid: Tensor,
        v_vid: Tensor,
        q_txt: Tensor | None,
        k_txt: Tensor | None,
        v_txt: Tensor | None,
        segments: WindowSegments,
    ) -> tuple[Tensor, Tensor]:
        return window_attention(
            q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments,
            backend=self.backend, softmax_scale=self.softmax_scale,
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, softmax_scale={self.softmax_scale}"
