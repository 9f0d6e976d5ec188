"""Tiled VAE runs on one device: overlapping spatial tiles, each encoded or decoded on its own, then blended.

Peak activation memory follows the tile instead of the frame. The price is accuracy: a tile's group norms
take statistics over the tile only, its bottleneck attention sees the tile only, and its convolutions see
zero padding at tile edges, so the result deviates from the whole-frame one (the height-sharded mode, which
exchanges halos and statistics, does not). Overlaps are blended with linear ramps to hide the seams.

``tile_size`` and ``overlap`` are in pixels for both directions (multiples of the spatial factor, 8), as an
int (square) or an (height, width) pair. Temporal chunking applies inside each tile as usual.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from winsp.utils.compile import planning
from winsp.utils.phases import plans

from .model import CausalVideoVAE, moments_to_latent

__all__ = ["encode_tiled", "decode_tiled", "tile_starts", "check_tiling"]


def _pair(value: int | tuple[int, int], name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return pair  # type: ignore[return-value]


def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Starts of tiles of length ``tile`` covering ``[0, size)``, stepping ``tile - overlap``; the last tile is
    pushed back to end at ``size`` (so its overlap may be larger)."""
    if tile >= size:
        return [0]
    starts = list(range(0, size - tile, tile - overlap))
    if starts[-1] != size - tile:
        starts.append(size - tile)
    return starts


def _ramp(length: int, start: int, size: int, overlap: int) -> torch.Tensor:
    """Blend weights of a tile along one axis: rising over ``overlap`` where another tile precedes it, falling
    where another follows, 1 elsewhere (and at the frame's own edges)."""
    weight = torch.ones(length, dtype=torch.float64)
    if overlap > 0:
        rise = torch.arange(1, overlap + 1, dtype=torch.float64) / (overlap + 1)
        if start > 0:
            weight[:overlap] = torch.minimum(weight[:overlap], rise)
        if start + length < size:
            weight[length - overlap:] = torch.minimum(weight[length - overlap:], rise.flip(0))
    return weight


@dataclass(frozen=True)
class _Tile:
    """One tile: its input window (top, left, height, width) and output offset, with its blend weights."""

    top: int
    left: int
    size: tuple[int, int]
    out_top: int
    out_left: int
    weight: torch.Tensor  # [th, tw] float64 on the run's device


@planning
@plans
def _plan_tiles(h: int, w: int, tile: tuple[int, int], overlap: tuple[int, int], scale: tuple[int, int],
                device: torch.device) -> tuple[list[_Tile], torch.Tensor, tuple[int, int]]:
    """The tiles of an ``h x w`` input, their blend weights and the weights' sum over the output (float64), built on
    the host (they depend on shapes only) and moved to ``device`` here, once; plus the output's (height, width)."""
    num, den = scale
    out_h, out_w = h * num // den, w * num // den
    weight_sum = torch.zeros((out_h, out_w), dtype=torch.float64)
    tiles = []
    for top in tile_starts(h, tile[0], overlap[0]):
        for left in tile_starts(w, tile[1], overlap[1]):
            th, tw = min(tile[0], h - top) * num // den, min(tile[1], w - left) * num // den
            o_top, o_left = top * num // den, left * num // den
            wy = _ramp(th, o_top, out_h, overlap[0] * num // den)
            wx = _ramp(tw, o_left, out_w, overlap[1] * num // den)
            weight = wy[:, None] * wx[None, :]
            weight_sum[o_top:o_top + th, o_left:o_left + tw] += weight
            tiles.append(_Tile(top, left, (th, tw), o_top, o_left, weight))
    tiles = [dataclasses.replace(t, weight=t.weight.to(device)) for t in tiles]
    return tiles, weight_sum.to(device), (out_h, out_w)


def _run_tiles(
    x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], *, tile: tuple[int, int],
    overlap: tuple[int, int], in_unit: int, out_unit: int,
) -> torch.Tensor:
    """Apply ``fn`` to overlapping tiles of ``x``'s last two dims and blend the outputs (scaled by
    ``out_unit / in_unit``). ``tile`` and ``overlap`` are in input elements."""
    h, w = x.shape[-2:]
    tiles, weight_sum, out_hw = _plan_tiles(h, w, tile, overlap, (out_unit, in_unit), x.device)
    out = None
    for t in tiles:
        part = fn(x[..., t.top:t.top + tile[0], t.left:t.left + tile[1]])
        th, tw = t.size
        if tuple(part.shape[-2:]) != (th, tw):
            raise ValueError(f"a tile at ({t.top}, {t.left}) gave {tuple(part.shape[-2:])}, expected {(th, tw)}")
        if out is None:
            out = part.new_zeros(part.shape[:-2] + out_hw)
        out[..., t.out_top:t.out_top + th, t.out_left:t.out_left + tw] += part * t.weight.to(part.dtype)
    return out / weight_sum.to(out.dtype)


def check_tiling(vae: CausalVideoVAE, tile_size, overlap) -> tuple[tuple[int, int], tuple[int, int]]:
    """(tile, overlap) as (height, width) pairs; ``ValueError`` unless multiples of the spatial factor with
    0 <= overlap < tile."""
    factor = vae.config.spatial_downsample_factor
    tile, over = _pair(tile_size, "tile_size"), _pair(overlap, "overlap")
    for t, o in zip(tile, over, strict=True):
        if t < factor or t % factor:
            raise ValueError(f"tile_size {tile_size!r} must be a positive multiple of {factor} pixels")
        if o < 0 or o % factor or o >= t:
            raise ValueError(
                f"overlap {overlap!r} must be a multiple of {factor} pixels, >= 0 and smaller than tile_size {t}"
            )
    return tile, over


def encode_tiled(
    vae: CausalVideoVAE, video: torch.Tensor, *, tile_size: int | tuple[int, int] = 256,
    overlap: int | tuple[int, int] = 64, sample: bool = False, generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``vae.encode(video)`` tile by tile (approximate; see the module docstring)."""
    tile, over = check_tiling(vae, tile_size, overlap)
    vae.validate_video(video)
    moments = _run_tiles(video, vae.encode_moments, tile=tile, overlap=over,
                         in_unit=vae.config.spatial_downsample_factor, out_unit=1)
    return moments_to_latent(moments, sample=sample, generator=generator)


def decode_tiled(
    vae: CausalVideoVAE, latent: torch.Tensor, *, tile_size: int | tuple[int, int] = 256,
    overlap: int | tuple[int, int] = 64,
) -> torch.Tensor:
    """``vae.decode(latent)`` tile by tile (approximate; see the module docstring)."""
    tile, over = check_tiling(vae, tile_size, overlap)
    vae.validate_latent(latent)
    factor = vae.config.spatial_downsample_factor
    latent_tile = (tile[0] // factor, tile[1] // factor)
    latent_over = (over[0] // factor, over[1] // factor)
    return _run_tiles(latent, vae.decode, tile=latent_tile, overlap=latent_over, in_unit=1, out_unit=factor)
