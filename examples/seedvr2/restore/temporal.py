"""Long clips as a stream of temporal batches: the plan, the lazy batcher, the cross-fade of overlaps, per-batch seeds.

A clip of ``T`` frames is restored ``batch_frames`` frames at a time (``4n + 1``, the causal VAE's natural length);
consecutive batches share ``overlap`` frames. Batch ``i`` covers ``[i * stride, i * stride + batch_frames)`` with
``stride = batch_frames - overlap``, and the last batch is cut at ``T`` (the pipeline pads it to ``4n + 1``). Every
batch after the first starts inside its predecessor, so it always brings at least one new frame.

Blending happens in pixels, on the finished frames: over the ``overlap`` shared frames the output moves linearly from
the earlier batch to the later one (weights ``(j + 1) / (overlap + 1)`` for the later batch). Pixels rather than latents
because latent frames of two batches do not correspond: the causal VAE encodes a batch's first frame alone and then
groups of 4, so a latent frame of one batch covers different input frames than any latent frame of the next unless the
overlap is ``4m + 1`` and aligned, and a latent blend would still need the decoder's causal state across batches. The
pixel blend works for any overlap, needs only the last ``overlap`` frames of the previous batch, and is exactly the same
wherever (on whichever rank) a batch was computed.

Everything here is plain data and small iterators, independent of models and of ``torch.distributed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

import torch

__all__ = [
    "DEFAULT_BATCH_FRAMES",
    "DEFAULT_OVERLAP",
    "TemporalBatch",
    "check_batching",
    "plan_temporal_batches",
    "temporal_batches",
    "TemporalBlender",
    "noise_seed",
    "clip_noise",
]

#: 21 = 4 * 5 + 1 frames: 6 latent frames. With the VAE's temporal chunks of 4 frames the VAE's memory does not depend
#: on the batch length; what grows with it is the DiT's token count (720p: 6 x 45 x 80 = 21,600 tokens, a few GB of
#: activations in bf16 for the 3B) and the batch's frames in float32 (720p: ~0.5 GB for input plus output). That fits
#: a 24 GB GPU next to the 3B's bf16 weights, while giving the DiT's 3D windows several latent frames of context.
DEFAULT_BATCH_FRAMES = 21
#: 5 shared frames are cross-faded; they cost 5 / 16 = 31% more frames computed. 5 = 4 + 1 makes consecutive batches
#: start 16 frames apart, a whole number of latent frames, so their shared latent frames get the same noise (see
#: :func:`clip_noise`), which shrinks the difference the cross-fade has to hide (see benchmarks/README.md).
DEFAULT_OVERLAP = 5


def causal_frame_count(num_frames: int, temporal_factor: int = 4) -> int:
    """The frame count a clip is padded to: unchanged for one frame, else the next ``4k + 1`` with ``k >= 1``."""
    if num_frames < 1:
        raise ValueError(f"a clip needs at least one frame, got {num_frames}")
    if num_frames == 1:
        return 1
    k = max(1, math.ceil((num_frames - 1) / temporal_factor))
    return temporal_factor * k + 1


@dataclass(frozen=True)
class TemporalBatch:
    """Frames ``[start, stop)`` of the clip; ``blend`` leading frames are shared with the previous batch."""

    index: int
    start: int
    stop: int
    blend: int

    @property
    def num_frames(self) -> int:
        return self.stop - self.start


def check_batching(batch_frames: int, overlap: int, temporal_factor: int = 4) -> None:
    """``ValueError`` unless ``batch_frames`` is ``4n + 1`` (n >= 0) and ``0 <= overlap < batch_frames``."""
    if isinstance(batch_frames, bool) or not isinstance(batch_frames, int) or batch_frames < 1 or (
            (batch_frames - 1) % temporal_factor):
        raise ValueError(
            f"--batch-frames must be {temporal_factor}n+1 (1, 5, 9, 13, 17, 21, ...) for the causal VAE's "
            f"{temporal_factor}x time compression, got {batch_frames!r}"
        )
    if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < batch_frames:
        raise ValueError(f"--overlap must be an integer in [0, --batch-frames) = [0, {batch_frames}), got {overlap!r}")


def plan_temporal_batches(num_frames: int, batch_frames: int, overlap: int) -> tuple[TemporalBatch, ...]:
    """The batches of a ``num_frames`` clip (see the module docstring)."""
    check_batching(batch_frames, overlap)
    if num_frames < 1:
        raise ValueError(f"a clip needs at least one frame, got {num_frames}")
    stride = batch_frames - overlap
    batches = [TemporalBatch(0, 0, min(batch_frames, num_frames), 0)]
    while batches[-1].stop < num_frames:
        start = batches[-1].start + stride
        batches.append(TemporalBatch(len(batches), start, min(start + batch_frames, num_frames),
                                     batches[-1].stop - start))
    return tuple(batches)


def temporal_batches(
    frames: Iterable[Optional[torch.Tensor]], batch_frames: int, overlap: int
) -> Iterator[tuple[TemporalBatch, Optional[torch.Tensor]]]:
    """Group a stream of frames into the batches of :func:`plan_temporal_batches`, holding at most one batch.

    ``frames`` yields frames ``[...]`` (any shape; stacked along a new first dim) or None for frames this caller does
    not need; a batch containing a None is yielded as None (another rank restores it). The clip's length need not be
    known in advance.
    """
    check_batching(batch_frames, overlap)
    stride = batch_frames - overlap
    buffer: list = []
    start, index, previous_stop = 0, 0, 0
    for frame in frames:
        buffer.append(frame)
        if len(buffer) == batch_frames:
            yield _emit(index, start, buffer, previous_stop)
            previous_stop = start + batch_frames
            start, index = start + stride, index + 1
            buffer = buffer[stride:]
    if index == 0 or len(buffer) > overlap:  # the remainder brings new frames (or the clip is shorter than a batch)
        if buffer:
            yield _emit(index, start, buffer, previous_stop)


def _emit(index: int, start: int, buffer: Sequence, previous_stop: int) -> tuple[TemporalBatch, Optional[torch.Tensor]]:
    batch = TemporalBatch(index, start, start + len(buffer), max(0, previous_stop - start))
    if any(f is None for f in buffer):
        return batch, None
    return batch, torch.stack(list(buffer))


class TemporalBlender:
    """Takes finished batches in order (``[t, ...]`` tensors, frames first) and yields the clip's frames in order,
    cross-fading each batch's ``blend`` leading frames with the previous batch's last frames. Holds only those.

    Integer frames (uint8) are blended in float32 and rounded back.
    """

    def __init__(self) -> None:
        self._tail: Optional[torch.Tensor] = None  # the previous batch's frames that the next batch may overlap
        self._next_index = 0
        self.frames_out = 0

    def push(self, batch: TemporalBatch, frames: torch.Tensor, overlap: int) -> Iterator[torch.Tensor]:
        """Add batch ``batch`` (the next in order) and yield the frames that are now final, in order.

        ``overlap`` is the planned overlap: the last ``overlap`` frames of this batch are held back for the next one
        (call :meth:`finish` after the last batch to release them).
        """
        if batch.index != self._next_index:
            raise ValueError(f"batches must arrive in order: expected batch {self._next_index}, got {batch.index}")
        if frames.shape[0] != batch.num_frames:
            raise ValueError(f"batch {batch.index} covers {batch.num_frames} frames, got {frames.shape[0]}")
        self._next_index += 1
        k = batch.blend
        if k:
            tail = self._tail
            if tail is None or tail.shape[0] != k:
                raise ValueError(f"batch {batch.index} overlaps {k} frames but {0 if tail is None else tail.shape[0]} "
                                 f"are held from the previous batch")
            frames = torch.cat([crossfade(tail, frames[:k]), frames[k:]])
        hold = min(overlap, frames.shape[0])
        ready, self._tail = frames[: frames.shape[0] - hold], frames[frames.shape[0] - hold:].clone()
        for frame in ready:
            self.frames_out += 1
            yield frame

    def finish(self) -> Iterator[torch.Tensor]:
        """Yield the frames held back after the last batch."""
        if self._tail is not None:
            for frame in self._tail:
                self.frames_out += 1
                yield frame
        self._tail = None


def crossfade(earlier: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """Linear cross-fade over ``k`` frames from ``earlier`` to ``later`` (both ``[k, ...]``): frame ``j`` is
    ``(1 - w) * earlier + w * later`` with ``w = (j + 1) / (k + 1)``."""
    k = earlier.shape[0]
    w = torch.arange(1, k + 1, dtype=torch.float32, device=later.device) / (k + 1)
    w = w.reshape((k,) + (1,) * (later.dim() - 1))
    mixed = earlier.float() * (1 - w) + later.float() * w
    if not later.dtype.is_floating_point:
        mixed = mixed.round().clamp(torch.iinfo(later.dtype).min, torch.iinfo(later.dtype).max)
    return mixed.to(later.dtype)


def noise_seed(seed: int, frame: int) -> int:
    """The seed of the latent noise of the latent frame that ends at clip frame ``frame`` (a fixed mix of both)."""
    return (int(seed) * 0x100000001B3 + 0x9E3779B97F4A7C15 * (int(frame) + 1)) % (2**63 - 1)


def clip_noise(seed: int, start: int, num_frames: int, latent_hw: tuple[int, int], channels: int,
               temporal_factor: int = 4) -> torch.Tensor:
    """Standard normal latent noise ``(t', h', w', channels)`` for the batch of ``num_frames`` frames at ``start``,
    keyed by position in the clip rather than by batch.

    Latent frame 0 of a batch covers its first frame, latent frame ``j >= 1`` the ``temporal_factor`` frames ending at
    ``start + 4j``; each is drawn from :func:`noise_seed` of that last frame. So the noise depends only on the seed
    and where the frames are: whichever rank (group) restores a batch draws the same noise, and when the overlap is
    ``4m + 1`` (batch starts 4 frames apart) the latent frames two batches share see the same noise, which makes the
    two restorations of the shared frames agree more closely before they are cross-faded.
    """
    padded = causal_frame_count(num_frames, temporal_factor)
    frames = []
    for j in range(1 + (padded - 1) // temporal_factor):
        generator = torch.Generator().manual_seed(noise_seed(seed, start + temporal_factor * j))
        frames.append(torch.randn(tuple(latent_hw) + (channels,), generator=generator, dtype=torch.float32))
    return torch.stack(frames)
