"""Choosing how to run a restore so that it fits the memory it is given: the fastest settings whose estimate fits.

The settings that decide memory are the temporal batch (``--batch-frames``, with its ``--overlap``), the VAE mode
(``--vae-parallel``) and, when tiled, the tile size (``--vae-tile``). Whatever the user pinned stays; the rest is
searched from the fastest to the most frugal: larger temporal batches first (fewer frames computed twice in the
cross-fades, more temporal context), then for each batch the VAE mode: with several ranks ``wavefront`` (exact, the
ranks run consecutive causal chunks, with the height split too where the cost model finds it faster), then ``height``
(exact, the frame split over all ranks: the smallest exact footprint); with one rank ``replicated``; then ``tiled``
with the largest tile that fits (approximate). The first candidate whose estimate fits is used.

Pure functions of numbers: the caller supplies the estimate (``need``) and the usable bytes (see
:mod:`.limits`), which keeps this testable without models or limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

__all__ = ["RunSettings", "PinnedSettings", "MemoryFit", "candidate_settings", "fit_settings", "tile_overlap",
           "BATCH_CANDIDATES", "TILE_CANDIDATES"]

#: temporal batch lengths tried, longest first (all 4n+1)
BATCH_CANDIDATES = (33, 29, 25, 21, 17, 13, 9, 5, 1)
#: square VAE tile sizes tried in pixels, largest first
TILE_CANDIDATES = (1024, 768, 512, 384, 256, 192, 128, 96, 64)
_TILE_OVERLAP = 64


def tile_overlap(tile: int) -> int:
    """The blend overlap of a ``tile``-pixel VAE tile: 64 pixels, or a quarter of a small tile (multiple of 8)."""
    return min(_TILE_OVERLAP, (tile // 4) // 8 * 8)


@dataclass(frozen=True)
class RunSettings:
    """One way to run: temporal batch and overlap, VAE mode, and (tiled only) the tile size in pixels."""

    batch_frames: int
    overlap: int
    vae_parallel: str
    vae_tile: Optional[int] = None

    def flags(self) -> str:
        """The command-line flags that pin these settings."""
        text = f"--batch-frames {self.batch_frames} --overlap {self.overlap} --vae-parallel {self.vae_parallel}"
        return text + (f" --vae-tile {self.vae_tile}" if self.vae_tile is not None else "")

    def describe(self) -> str:
        vae = f"VAE tiled {self.vae_tile}px" if self.vae_parallel == "tiled" else f"VAE {self.vae_parallel}"
        return f"batch {self.batch_frames} frames (overlap {self.overlap}), {vae}"


@dataclass(frozen=True)
class PinnedSettings:
    """What the user fixed on the command line (None: free to choose)."""

    batch_frames: Optional[int] = None
    overlap: Optional[int] = None
    vae_parallel: Optional[str] = None
    vae_tile: Optional[int] = None

    @property
    def anything(self) -> bool:
        return any(v is not None for v in (self.batch_frames, self.overlap, self.vae_parallel, self.vae_tile))


@dataclass(frozen=True)
class MemoryFit:
    """The outcome of :func:`fit_settings`: the settings chosen (None: nothing among the allowed ones fits), their
    estimated need, and the first settings of the unrestricted search that fit (a suggestion for pinned flags)."""

    chosen: Optional[RunSettings]
    need: Optional[int]
    first_need: int
    first: RunSettings
    suggestion: Optional[RunSettings] = None
    suggestion_need: Optional[int] = None
    smallest_need: Optional[int] = None

    @property
    def changed(self) -> bool:
        """Whether the chosen settings differ from the first (fastest) allowed candidate."""
        return self.chosen is not None and self.chosen != self.first


def _overlap_for(batch: int, default_overlap: int) -> int:
    return min(default_overlap, batch - 4) if batch >= 5 else 0


def candidate_settings(
    num_frames: int, latent_height: int, sp_size: int, pinned: PinnedSettings, *, default_batch: int,
    default_overlap: int, frame_size: tuple[int, int],
) -> Iterator[RunSettings]:
    """Every allowed setting, fastest first (see the module docstring).

    Batches longer than ``default_batch`` are not tried (the default is the speed/quality choice); batches longer than
    the clip are tried once (they are all the whole clip). A tile is tried only when smaller than the frame's longer
    side; ``wavefront`` and ``height`` only when ``sp_size > 1`` (``height`` when every rank gets a latent row),
    ``replicated`` only at one rank (a pinned mode is tried whatever the ranks).
    """
    if pinned.batch_frames is not None:
        batches = [pinned.batch_frames]
    else:
        batches, seen = [], set()
        for batch in BATCH_CANDIDATES:
            if batch > default_batch:
                continue
            effective = min(batch, num_frames)
            if effective in seen:
                continue
            seen.add(effective)
            batches.append(batch)
    if pinned.vae_parallel is not None:
        modes = [pinned.vae_parallel]
    else:
        # several ranks: the wavefront (exact, the fastest) first; one rank: the whole VAE
        modes = (["wavefront"] + (["height"] if sp_size <= latent_height else []) if sp_size > 1
                 else ["replicated"]) + ["tiled"]
    if pinned.vae_tile is not None:
        tiles = [pinned.vae_tile]
    else:
        tiles = [t for t in TILE_CANDIDATES if t < max(frame_size)] or [TILE_CANDIDATES[-1]]
    for batch in batches:
        overlap = pinned.overlap if pinned.overlap is not None else _overlap_for(batch, default_overlap)
        if overlap >= batch:
            continue
        for mode in modes:
            if mode == "tiled":
                for tile in tiles:
                    yield RunSettings(batch, overlap, mode, tile)
            else:
                yield RunSettings(batch, overlap, mode)


def fit_settings(
    candidates: Callable[[PinnedSettings], Iterator[RunSettings]], pinned: PinnedSettings,
    need: Callable[[RunSettings], int], usable: Optional[int],
) -> MemoryFit:
    """The first candidate (respecting ``pinned``) whose ``need`` fits ``usable`` bytes (None: no limit known, the
    first candidate). When none fits and something was pinned, the unrestricted search gives a suggestion."""
    first: Optional[RunSettings] = None
    first_need = 0
    smallest = None
    for settings in candidates(pinned):
        bytes_needed = need(settings)
        smallest = bytes_needed if smallest is None else min(smallest, bytes_needed)
        if first is None:
            first, first_need = settings, bytes_needed
        if usable is None or bytes_needed <= usable:
            return MemoryFit(settings, bytes_needed, first_need, first)
    if first is None:
        raise ValueError("no setting is allowed by the pinned flags")
    suggestion = suggestion_need = None
    if pinned.anything:
        for settings in candidates(PinnedSettings()):
            bytes_needed = need(settings)
            if usable is not None and bytes_needed <= usable:
                suggestion, suggestion_need = settings, bytes_needed
                break
    return MemoryFit(None, None, first_need, first, suggestion, suggestion_need, smallest)
