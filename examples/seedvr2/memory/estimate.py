"""What one rank adds in memory while restoring one temporal batch, by part: the estimate the command checks against
the usable memory before it allocates anything (:mod:`.fit` chooses the settings that fit it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..restore.pipeline import causal_frame_count

__all__ = ["MemoryEstimate", "estimate_restore_bytes", "vae_work_area", "heap_area"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak bytes one rank adds while restoring one temporal batch, by part (``overhead``: what a run adds
    whatever its size: codec buffers, thread pools, allocator arenas, the process group's buffers)."""

    vae: int
    dit: int
    frames: int
    overhead: int = 0

    @property
    def total(self) -> int:
        return self.vae + self.dit + self.frames + self.overhead


# The constants below are fitted to the peak resident memory of real command-line runs on the CPU (fp32, demo
# weights) by ``benchmarks/calibrate_memory.py`` (non-negative least squares of the relative error over 45 runs, with
# one float32 frame copy and the DiT term fixed, then scaled by 1.10 so that no run is under-estimated by more than
# 10 %; the table is in benchmarks/README.md). Peak RSS is well above the peak of live tensors: CPU 3D convolutions
# unfold their input (vol2col, 27 x channels per pixel) and the allocator keeps freed blocks.
#: VAE bytes per pixel of the area one rank's VAE works on at once (the frame, its band, or a tile), in units of the
#: first level's channels x element size, by padded batch length (1 frame, 5 frames, 9 or more: chunks of 4 frames),
#: while the activations are heap blocks (see below). The one-frame figure is not in the calibration grid (a
#: conservative guess, 0.57 x the five-frame one).
_VAE_UNITS_ONE_FRAME, _VAE_UNITS_FIVE, _VAE_UNITS_CHUNKED = 95.0, 165.0, 205.0
#: the same units for the area beyond :func:`heap_area`: there the large activations are mapped blocks that go back
#: to the system when freed, and the peak is what is alive at once, about a fifth of the heap figure. Fitted on the
#: replicated VAE at 1280x720 (5 and 9 frames) and 1920x1080 (5 frames), where the figure per pixel still grows
#: (21 at 720p, 33 at 1080p for 5 frames): set so that 720p is over-estimated by at most 31 % and 1080p not under;
#: the nine-frame figure scaled like the five-frame one, the one-frame figure too (guesses).
_VAE_LIVE_UNITS_ONE_FRAME, _VAE_LIVE_UNITS_FIVE, _VAE_LIVE_UNITS_CHUNKED = 22.0, 37.0, 66.0
#: glibc's largest mmap threshold (64-bit): an allocation above it is mapped and unmapped when freed; below it comes
#: from the heap, which keeps freed space for reuse, so small activations stay resident after they die
_HEAP_BLOCK_BYTES = 32 * 2**20
#: tiled only: more VAE bytes per tile pixel and padded frame, same units (every tile carries all the batch's frames)
_VAE_TILED_UNITS_PER_FRAME = 6.3
#: DiT activations per token, in units of the model width x element size (attention inputs/outputs, MLP hidden
#: states, residuals; the window attention itself is local). A coarse upper figure.
_DIT_UNITS_PER_TOKEN = 16.0
#: float32 copies of the batch's frames alive at once beyond the VAE's (the decoded output at least); negligible at
#: the grid's small sizes, so fixed at one copy from the code (times the 1.10 scale) rather than fitted
_FRAME_COPIES = 1.1
#: bytes a run adds whatever its size (codec buffers, thread pools, allocator arenas), and more on each rank of a
#: process group (gloo buffers and threads)
_OVERHEAD_BYTES, _GROUP_OVERHEAD_BYTES = 121 * 2**20, 39 * 2**20


def heap_area(vae_channels: int, element_bytes: int, chunk_frames: int) -> int:
    """Pixels up to which the VAE's first-level activations (``vae_channels`` x ``chunk_frames`` per pixel) are
    smaller than glibc's largest mmap threshold: below it the allocator's heap keeps what dies (peak resident memory
    grows with every activation), above it the peak is what is alive at once."""
    return max(1, _HEAP_BLOCK_BYTES // (vae_channels * element_bytes * chunk_frames))


def vae_work_area(height: int, width: int, vae_parallel: str, sp_size: int = 1,
                  tile: Optional[tuple[int, int]] = None, spatial_factor: int = 8, *, frames: int = 1) -> int:
    """Pixels one rank's VAE works on at once: the frame (replicated), its band of rows with one latent row of halo on
    each side (height-sharded), or one tile (tiled); the wavefront works on one chunk of the frame, or of the band
    when its split (for a clip of ``frames`` frames) shards the height too."""
    parts = sp_size
    if vae_parallel == "wavefront" and sp_size > 1:
        from ..models.vae.wavefront import split_for_clip

        parts = split_for_clip(sp_size, frames, max(1, height // spatial_factor)).height
    if vae_parallel in ("height", "wavefront") and parts > 1:
        rows = math.ceil(height / spatial_factor / parts) + 2
        return min(height, rows * spatial_factor) * width
    if vae_parallel == "tiled" and tile is not None:
        return min(height, tile[0]) * min(width, tile[1])
    return height * width


def estimate_restore_bytes(
    *, frames: int, height: int, width: int, vae_channels: int, dit_width: int, element_bytes: int = 4,
    vae_parallel: str = "replicated", sp_size: int = 1, tile: Optional[tuple[int, int]] = None,
    tile_overlap: Optional[int] = None, patch: tuple[int, int, int] = (1, 2, 2), spatial_factor: int = 8,
    temporal_factor: int = 4,
) -> MemoryEstimate:
    """Peak bytes one rank adds restoring ``frames`` frames of ``height x width`` (the working size) with a VAE whose
    first level has ``vae_channels`` channels (temporal chunks of 4 frames) and a DiT of ``dit_width``.

    An estimate from the shapes only, made before anything is allocated so that a request can be fitted to the memory
    it may use (see :mod:`.fit`) or refused with a message instead of dying in the allocator. Calibrated
    against peak RSS (see the constants above); the VAE part follows the area one rank's VAE works on
    (:func:`vae_work_area`). ``tile_overlap`` is accepted for the callers' convenience (a tile's memory is its size).
    """
    del tile_overlap
    padded = causal_frame_count(frames, temporal_factor)
    kind = 0 if padded == 1 else 1 if padded <= 5 else 2
    heap_units = (_VAE_UNITS_ONE_FRAME, _VAE_UNITS_FIVE, _VAE_UNITS_CHUNKED)[kind]
    live_units = (_VAE_LIVE_UNITS_ONE_FRAME, _VAE_LIVE_UNITS_FIVE, _VAE_LIVE_UNITS_CHUNKED)[kind]
    area = vae_work_area(height, width, vae_parallel, sp_size, tile, spatial_factor, frames=padded)
    small = min(area, heap_area(vae_channels, element_bytes, min(padded, 1 + temporal_factor)))
    vae = (heap_units * small + live_units * (area - small)) * vae_channels * element_bytes
    if vae_parallel == "tiled":
        vae += _VAE_TILED_UNITS_PER_FRAME * padded * vae_channels * area * element_bytes
    latent_frames = 1 + (padded - 1) // temporal_factor
    tokens = math.ceil(latent_frames / patch[0]) * math.ceil(height / spatial_factor / patch[1]) * math.ceil(
        width / spatial_factor / patch[2])
    dit = _DIT_UNITS_PER_TOKEN * math.ceil(tokens / sp_size) * dit_width * element_bytes
    frame_bytes = _FRAME_COPIES * 3 * padded * height * width * 4
    overhead = _OVERHEAD_BYTES + (_GROUP_OVERHEAD_BYTES if sp_size > 1 else 0)
    return MemoryEstimate(vae=int(vae), dit=int(dit), frames=int(frame_bytes), overhead=overhead)


# ---- the pipeline -------------------------------------------------------------------------------------------------
