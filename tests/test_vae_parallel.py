"""Spatial parallelism of the causal video VAE: winsp.comm.spatial collectives, height-sharded and tiled runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.seedvr2.models.vae.memory import peak_tensor_bytes
from examples.seedvr2.models.vae.sharding import decode_sharded, encode_sharded
from examples.seedvr2.models.vae.tiling import decode_tiled, encode_tiled
from tests.helpers import random_video, tiny_vae
from winsp.comm.group import SPGroup
from winsp.comm.spatial import (
    band_offsets,
    band_sizes,
    distributed_group_norm,
    distributed_mean_var,
    gather_bands,
    halo_exchange,
    take_band,
)
from winsp.testing import RankError, run_ranks

TIMEOUT = 120.0


# ---- winsp.comm.spatial at one rank --------------------------------------------------------------------------------


def test_band_sizes_cover_and_balance():
    assert band_sizes(10, 3) == [4, 3, 3]
    assert band_sizes(2, 3) == [1, 1, 0]
    assert band_offsets([4, 3, 3]) == [0, 4, 7]
    with pytest.raises(ValueError, match="parts"):
        band_sizes(4, 0)


def test_single_rank_helpers_are_local():
    group = SPGroup(None)
    x = torch.randn(2, 8, 3, 5, 4, dtype=torch.float64)
    padded = halo_exchange(x, 3, 1, 2, group, [5])
    assert padded.shape[3] == 8
    assert torch.equal(padded[:, :, :, 1:6], x) and padded[:, :, :, :1].abs().sum() == 0
    assert padded[:, :, :, 6:].abs().sum() == 0
    assert gather_bands(x, 3, group, [5]) is x
    weight, bias = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    ours = distributed_group_norm(x, 4, weight, bias, 1e-6, group, independent_dims=(2,))
    frames = x.transpose(1, 2).reshape(6, 8, 5, 4)
    ref = F.group_norm(frames, 4, weight, bias, 1e-6).reshape(2, 3, 8, 5, 4).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


def test_mean_var_is_stable_under_a_large_offset():
    x = torch.randn(1, 4096, dtype=torch.float64) * 1e-3 + 1e4
    mean, var = distributed_mean_var(x.float(), [1], SPGroup(None))
    assert abs(var.item() - x.float().double().var(correction=0).item()) < 1e-9


# ---- winsp.comm.spatial across ranks ------------------------------------------------------------------------------


def _spatial_rank(rank: int, world: int, sizes: list[int]) -> dict:
    group = SPGroup.world()
    g = torch.Generator().manual_seed(7)
    full = torch.randn(2, 8, 3, sum(sizes), 6, generator=g)
    weight, bias = torch.randn(8, generator=g), torch.randn(8, generator=g)
    band = take_band(full, 3, sizes, rank).contiguous()
    out = {}
    padded = halo_exchange(band, 3, 1, 1, group, sizes)
    ref = F.pad(full, (0, 0, 1, 1))
    start = band_offsets(sizes)[rank]
    out["halo"] = (padded - ref[:, :, :, start:start + sizes[rank] + 2]).abs().max().item()
    padded_bottom = halo_exchange(band, 3, 0, 1, group, sizes)
    out["halo_bottom"] = (padded_bottom - ref[:, :, :, start + 1:start + sizes[rank] + 2]).abs().max().item()
    out["gather"] = (gather_bands(band, 3, group, sizes) - full).abs().max().item()
    norm = distributed_group_norm(band, 4, weight, bias, 1e-6, group, independent_dims=(2,))
    frames = full.transpose(1, 2).reshape(6, 8, sum(sizes), 6)
    ref_norm = F.group_norm(frames, 4, weight, bias, 1e-6).reshape(2, 3, 8, sum(sizes), 6).transpose(1, 2)
    out["norm"] = (norm - take_band(ref_norm, 3, sizes, rank)).abs().max().item()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("sizes", [[3, 2], [2, 1, 3]])
def test_spatial_collectives_match_full_tensor(sizes):
    for result in run_ranks(_spatial_rank, len(sizes), sizes, timeout=TIMEOUT):
        assert result["halo"] == 0.0 and result["halo_bottom"] == 0.0 and result["gather"] == 0.0
        assert result["norm"] < 2e-6


def _thin_band_rank(rank: int, world: int) -> None:
    group = SPGroup.world()
    sizes = [2, 1, 2]
    halo_exchange(torch.zeros(1, sizes[rank]), 1, 2, 0, group, sizes)


@pytest.mark.multirank
def test_halo_thicker_than_a_band_is_refused():
    with pytest.raises(RankError, match="rank 1 holds 1 rows"):
        run_ranks(_thin_band_rank, 3, timeout=TIMEOUT)


# ---- height-sharded VAE --------------------------------------------------------------------------------------


def _sharded_vae_rank(rank: int, world: int, frames: int, height: int, width: int, chunk) -> dict:
    torch.set_num_threads(1)
    vae = tiny_vae()
    vae.set_temporal_chunking(chunk)
    video = random_video(frames, height, width)
    group = SPGroup.world()
    latent_whole = vae.encode(video)
    latent_sharded = encode_sharded(vae, video, group)
    decoded_whole = vae.decode(latent_whole)
    decoded_sharded = decode_sharded(vae, latent_whole, group)
    band = decode_sharded(vae, latent_whole, group, gather=False)
    return {
        "encode": (latent_sharded - latent_whole).abs().max().item(),
        "decode": (decoded_sharded - decoded_whole).abs().max().item(),
        "latent_shape": tuple(latent_sharded.shape),
        "band_rows": band.shape[3],
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    "world, frames, height, chunk",
    [(2, 5, 40, None), (3, 9, 56, 4)],  # latent heights 5 -> bands [3, 2]; 7 -> [3, 2, 2]
)
def test_height_sharded_equals_whole_frame(world, frames, height, chunk):
    results = run_ranks(_sharded_vae_rank, world, frames, height, 24, chunk, timeout=TIMEOUT)
    latent_rows = height // 8
    for rank, result in enumerate(results):
        assert result["encode"] < 1e-5, result
        assert result["decode"] < 1e-5, result
        assert result["latent_shape"][3] == latent_rows
        assert result["band_rows"] == 8 * band_sizes(latent_rows, world)[rank]


def _too_many_ranks(rank: int, world: int) -> None:
    encode_sharded(tiny_vae(), random_video(1, 16, 16), SPGroup.world())


@pytest.mark.multirank
def test_height_sharding_refuses_bands_without_rows():
    with pytest.raises(RankError, match="latent height of 2 rows over 3 ranks"):
        run_ranks(_too_many_ranks, 3, timeout=TIMEOUT)


# ---- tiled VAE -----------------------------------------------------------------------------------------------


def test_tiles_covering_the_frame_reproduce_it_exactly():
    vae = tiny_vae()
    video = random_video(5, 32, 40)
    whole = vae.encode(video)
    tiled = encode_tiled(vae, video, tile_size=64, overlap=16)  # one tile covers the frame
    assert (tiled - whole).abs().max().item() <= 1e-6  # the tile is a copy: equal to rounding, maybe not to the bit


def test_tiled_encode_approaches_whole_frame_as_tiles_grow_and_saves_memory():
    vae = tiny_vae()
    video = random_video(1, 96, 96)
    with peak_tensor_bytes() as whole_peak:
        latent = vae.encode(video)
    with peak_tensor_bytes() as tiled_peak:
        small = encode_tiled(vae, video, tile_size=48, overlap=16)
    large = encode_tiled(vae, video, tile_size=80, overlap=32)
    assert small.shape == large.shape == latent.shape
    # Tiles see only part of the frame (their own norm statistics, attention and zero-padded edges), so they
    # deviate; the deviation shrinks as tiles cover more of the frame. (Random weights make the bottleneck
    # attention mix the whole frame strongly, so the absolute deviation here is larger than with trained weights.)
    dev_small, dev_large = (small - latent).abs().mean().item(), (large - latent).abs().mean().item()
    assert 0 < dev_large < dev_small
    assert tiled_peak.peak < 0.6 * whole_peak.peak


def test_tiled_decode_has_the_whole_frame_shape_and_saves_memory():
    vae = tiny_vae()
    latent = torch.randn(1, 16, 1, 12, 12, generator=torch.Generator().manual_seed(3))
    with peak_tensor_bytes() as whole_peak:
        decoded = vae.decode(latent)
    with peak_tensor_bytes() as tiled_peak:
        tiled = decode_tiled(vae, latent, tile_size=48, overlap=16)
    assert tiled.shape == decoded.shape and torch.isfinite(tiled).all()
    assert 0 < (tiled - decoded).abs().mean().item() < decoded.abs().mean().item()
    assert tiled_peak.peak < 0.6 * whole_peak.peak


def test_tiling_arguments_are_validated():
    vae = tiny_vae()
    video = random_video(1, 32, 32)
    with pytest.raises(ValueError, match="tile_size"):
        encode_tiled(vae, video, tile_size=20, overlap=8)
    with pytest.raises(ValueError, match="overlap"):
        encode_tiled(vae, video, tile_size=32, overlap=32)


# ---- modes by name -------------------------------------------------------------------------------------------


def _runner_rank(rank: int, world: int) -> float:
    from examples.seedvr2.models.vae import make_vae_runner

    torch.set_num_threads(1)
    vae = tiny_vae()
    video = random_video(1, 24, 16)
    runner = make_vae_runner("height", vae, group=SPGroup.world())
    latent = runner.encode(video)
    return max((latent - vae.encode(video)).abs().max().item(),
               (runner.decode(latent) - vae.decode(latent)).abs().max().item())


@pytest.mark.multirank
def test_height_runner_by_name():
    assert max(run_ranks(_runner_rank, 2, timeout=TIMEOUT)) < 1e-5


def test_runner_modes_by_name():
    from examples.seedvr2.models.vae import make_vae_runner

    vae = tiny_vae()
    video = random_video(1, 16, 16)
    whole = make_vae_runner("replicated", vae)
    assert torch.equal(whole.encode(video), vae.encode(video))
    tiled = make_vae_runner("tiled", vae, tile_size=16, overlap=8)
    assert tiled.decode(tiled.encode(video)).shape == video.shape
    with pytest.raises(ValueError, match="unknown VAE mode 'width'"):
        make_vae_runner("width", vae)
    with pytest.raises(ValueError, match="needs the window-SP group"):
        make_vae_runner("height", vae)
    with pytest.raises(ValueError, match="overlap"):
        make_vae_runner("tiled", vae, tile_size=16, overlap=16)
