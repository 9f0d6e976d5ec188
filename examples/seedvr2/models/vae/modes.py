"""VAE execution modes by name, for a pipeline that picks one from its configuration.

* ``"replicated"``: every rank runs the full frame itself (the single-device path).
* ``"height"``: the frame height is split over the window-SP group (:mod:`.sharding`); exact, memory per
  rank shrinks with the group size, result gathered to every rank.
* ``"tiled"``: overlapping spatial tiles on one device (:mod:`.tiling`); approximate, bounded memory.
* ``"wavefront"``: the group's ranks run consecutive causal chunks at once, combined with height sharding as
  :func:`.wavefront.choose_split` decides for the clip (:mod:`.wavefront`); exact (bit for bit when no height is
  split), memory per rank that of one chunk (over the band's rows when height is split too).

Temporal chunking (``vae.set_temporal_chunking``) is orthogonal and applies inside every mode (the wavefront
distributes its chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from winsp.comm.group import SPGroup

from .model import CausalVideoVAE
from .sharding import decode_sharded, encode_sharded
from .tiling import check_tiling, decode_tiled, encode_tiled
from .wavefront import decode_wavefront, encode_wavefront

__all__ = ["VAE_MODES", "VAERunner", "make_vae_runner"]

VAE_MODES = ("replicated", "height", "tiled", "wavefront")


@dataclass
class VAERunner:
    """Encodes and decodes with ``vae`` in one execution mode (build with :func:`make_vae_runner`)."""

    vae: CausalVideoVAE
    mode: str
    group: SPGroup | None = None
    tile_size: int | tuple[int, int] = 256
    overlap: int | tuple[int, int] = 64

    def encode(
        self, video: torch.Tensor, *, sample: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        if self.mode == "height":
            return encode_sharded(self.vae, video, self.group, sample=sample, generator=generator)
        if self.mode == "wavefront":
            return encode_wavefront(self.vae, video, self.group, sample=sample, generator=generator)
        if self.mode == "tiled":
            return encode_tiled(self.vae, video, tile_size=self.tile_size, overlap=self.overlap,
                                sample=sample, generator=generator)
        return self.vae.encode(video, sample=sample, generator=generator)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        if self.mode == "height":
            return decode_sharded(self.vae, latent, self.group)
        if self.mode == "wavefront":
            return decode_wavefront(self.vae, latent, self.group)
        if self.mode == "tiled":
            return decode_tiled(self.vae, latent, tile_size=self.tile_size, overlap=self.overlap)
        return self.vae.decode(latent)


def make_vae_runner(
    mode: str, vae: CausalVideoVAE, *, group: SPGroup | None = None, tile_size: int | tuple[int, int] = 256,
    overlap: int | tuple[int, int] = 64,
) -> VAERunner:
    """A :class:`VAERunner` for ``mode`` (one of :data:`VAE_MODES`); ``"height"`` and ``"wavefront"`` need the SP
    ``group``."""
    if mode not in VAE_MODES:
        raise ValueError(f"unknown VAE mode {mode!r}; choose one of {VAE_MODES}")
    if mode in ("height", "wavefront") and group is None:
        raise ValueError(f"VAE mode {mode!r} needs the window-SP group (group=SPGroup(...))")
    if mode == "tiled":
        check_tiling(vae, tile_size, overlap)
    return VAERunner(vae=vae, mode=mode, group=group, tile_size=tile_size, overlap=overlap)
