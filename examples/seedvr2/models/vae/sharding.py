"""Height-sharded VAE runs: every rank of a window-SP group encodes or decodes one band of rows.

The band split is chosen in latent rows (:func:`winsp.comm.spatial.band_sizes`, uneven heights allowed: bands differ
by at most one latent row) and scaled by 2 at each resolution level, so a band is always 8 pixel rows per latent
row and every stride-2 convolution starts on an even row. Inside the model (see :mod:`.context`):

* a 3x3 convolution takes one halo row from each neighbouring band (zeros at the frame's top and bottom);
  the downsampler's extra bottom row of padding is likewise a halo row, so only the last band sees zeros;
* group norms combine every band's float64 count, mean and variance, gathered in one small collective
  (statistics stay per frame);
* a halo exchange moves only the halo rows (one all-to-all) and leaves the band in its layout, so the
  convolution that follows reads it without another copy;
* the bottleneck attention gathers the normalised full-height frame for its keys and values, while the
  queries (and the output) stay in the band;
* up-/downsampling shuffles and 1x1 convolutions are local.

So every band computes exactly what the whole frame would, and the result gathered to every rank equals the
single-device result up to float32 rounding (summation order of the norms and convolutions).

Bands thinner than a halo are impossible here because each rank holds at least one latent row (= one row at
every level); a latent height smaller than the number of ranks raises ``ValueError``.

The entry points take the full tensor on every rank (the SP ranks hold the same clip) and return the full
result on every rank; pass ``gather=False`` to keep only this rank's band. Temporal chunking
(``vae.set_temporal_chunking``) applies inside each rank as usual; to spread the chunks over the ranks
instead (or as well), see :mod:`.wavefront`. Nothing here calls ``torch.distributed``:
all communication goes through :class:`winsp.comm.group.SPGroup` via :mod:`winsp.comm.spatial`.
"""

from __future__ import annotations

import torch

from winsp.comm.group import SPGroup
from winsp.comm.spatial import band_sizes, distributed_group_norm, gather_bands, halo_exchange, take_band

from .model import CausalVideoVAE, moments_to_latent

__all__ = ["RowBands", "latent_row_bands", "encode_sharded", "decode_sharded"]

_ROWS = 3  # the height dim of [b, c, t, h, w]


class RowBands:
    """This rank's band of a [b, c, t, h, w] activation at any resolution level (implements ``HeightBands``)."""

    def __init__(self, group: SPGroup, latent_sizes: list[int]) -> None:
        if len(latent_sizes) != group.size:
            raise ValueError(f"RowBands: {len(latent_sizes)} band sizes for a group of {group.size} ranks")
        if min(latent_sizes) < 1:
            raise ValueError(f"RowBands: every rank needs at least one latent row, got bands {latent_sizes}")
        self.group = group
        self.latent_sizes = list(latent_sizes)
        self.parts = group.size

    def sizes_for(self, x: torch.Tensor) -> list[int]:
        """Every rank's band size at the resolution level of ``x`` (inferred from this rank's row count)."""
        local, mine = x.shape[_ROWS], self.latent_sizes[self.group.rank]
        if local % mine:
            raise ValueError(
                f"rank {self.group.rank}: {local} rows is not a whole multiple of its {mine} latent rows"
            )
        return [s * (local // mine) for s in self.latent_sizes]

    def pad_rows(self, x: torch.Tensor, top: int, bottom: int) -> torch.Tensor:
        return halo_exchange(x, _ROWS, top, bottom, self.group, self.sizes_for(x))

    def group_norm(self, x, num_groups, weight, bias, eps):  # noqa: D102 - see HeightBands
        return distributed_group_norm(x, num_groups, weight, bias, eps, self.group, independent_dims=(2,))

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return gather_bands(x, _ROWS, self.group, self.sizes_for(x))


def latent_row_bands(latent_height: int, group: SPGroup) -> list[int]:
    """Latent rows per rank for a frame of ``latent_height`` latent rows (``ValueError`` if a rank gets none)."""
    if latent_height < group.size:
        raise ValueError(
            f"cannot shard a latent height of {latent_height} rows over {group.size} ranks: every rank needs "
            f"at least one latent row (use fewer ranks, a taller frame, or the 'tiled' mode)"
        )
    return band_sizes(latent_height, group.size)


def encode_sharded(
    vae: CausalVideoVAE, video: torch.Tensor, group: SPGroup, *, sample: bool = False,
    generator: torch.Generator | None = None, gather: bool = True,
) -> torch.Tensor:
    """``vae.encode(video)`` with the frame height split over ``group``; ``video`` is the full clip on every rank.

    With ``sample=True`` each rank draws its own noise from ``generator``: seed it identically on every rank
    for identical latents.
    """
    vae.validate_video(video)
    factor = vae.config.spatial_downsample_factor
    sizes = latent_row_bands(video.shape[_ROWS] // factor, group)
    band = take_band(video, _ROWS, [s * factor for s in sizes], group.rank)
    moments = vae.encode_moments(band, bands=RowBands(group, sizes))
    if gather:
        moments = gather_bands(moments, _ROWS, group, sizes)
    return moments_to_latent(moments, sample=sample, generator=generator)


def decode_sharded(
    vae: CausalVideoVAE, latent: torch.Tensor, group: SPGroup, *, gather: bool = True
) -> torch.Tensor:
    """``vae.decode(latent)`` with the frame height split over ``group``; ``latent`` is full on every rank."""
    vae.validate_latent(latent)
    factor = vae.config.spatial_downsample_factor
    sizes = latent_row_bands(latent.shape[_ROWS], group)
    band = take_band(latent, _ROWS, sizes, group.rank)
    video = vae.decode(band, bands=RowBands(group, sizes))
    if gather:
        video = gather_bands(video, _ROWS, group, [s * factor for s in sizes])
    return video
