"""The VAE's temporal wavefront (``examples.seedvr2.models.vae.wavefront``) against the single-rank chunked run.

Time-only splits run every chunk with the single-rank arithmetic, so they must agree bit for bit; splits that also
shard the height sum norm statistics and convolutions in another order and use the height-sharding tolerance.
Each case runs one process per rank (gloo); one spawn covers several clips to keep the suite fast.
"""

from __future__ import annotations

import pytest
import torch

from examples.seedvr2.models.vae.wavefront import (
    VAESplit,
    WaveStats,
    choose_split,
    clip_splits,
    decode_wavefront,
    describe_splits,
    encode_wavefront,
    split_cost,
    split_for_clip,
)
from tests.helpers import random_video, tiny_vae
from winsp.comm.group import SPGroup
from winsp.testing import RankError, run_ranks

TIMEOUT = 180.0
HEIGHT_TOL = 1e-5  # as tests/test_vae_parallel.py's height-sharded checks


def _wavefront_rank(rank: int, world: int, cases: list) -> list[dict]:
    """For each (split, frames, height, width): wavefront encode/decode vs this rank's own single-rank run."""
    torch.set_num_threads(1)
    vae = tiny_vae()
    vae.set_temporal_chunking(4)
    group = SPGroup.world()
    out = []
    for split, frames, height, width in cases:
        video = random_video(frames, height, width)
        split = None if split is None else VAESplit(*split)
        stats = WaveStats()
        latent = encode_wavefront(vae, video, group, split=split, stats=stats)
        whole_latent = vae.encode(video)
        decoded = decode_wavefront(vae, whole_latent, group, split=split, stats=stats)
        whole_decoded = vae.decode(whole_latent)
        local = decode_wavefront(vae, whole_latent, group, split=split, gather=False)
        g = torch.Generator().manual_seed(5)
        sampled = encode_wavefront(vae, video, group, split=split, sample=True, generator=g)
        ref_sampled = vae.encode(video, sample=True, generator=torch.Generator().manual_seed(5))
        out.append({
            "encode_equal": torch.equal(latent, whole_latent),
            "decode_equal": torch.equal(decoded, whole_decoded),
            "encode_err": (latent - whole_latent).abs().max().item(),
            "decode_err": (decoded - whole_decoded).abs().max().item(),
            "sample_err": (sampled - ref_sampled).abs().max().item(),
            "local_shape": tuple(local.shape), "sent": stats.sent, "received": stats.received,
        })
    return out


def _check(results, cases, exact):
    for rank, per_case in enumerate(results):
        for (split, frames, height, width), r in zip(cases, per_case):
            label = f"rank {rank}, split {split}, clip {frames}x{height}x{width}"
            if exact:
                assert r["encode_equal"] and r["decode_equal"], (label, r)
            else:
                assert r["encode_err"] <= HEIGHT_TOL and r["decode_err"] <= HEIGHT_TOL, (label, r)
            assert r["sample_err"] <= (0.0 if exact else HEIGHT_TOL), (label, r)


@pytest.mark.multirank
def test_wavefront_two_ranks_equals_single_rank_bitwise():
    # 13 frames: chunks of 5, 4, 4 (three chunks on two ranks); 5 frames: one chunk, the second rank idle
    cases = [((2, 1), 13, 24, 16), ((2, 1), 5, 16, 16)]
    results = run_ranks(_wavefront_rank, 2, cases, timeout=TIMEOUT)
    _check(results, cases, exact=True)
    # decode output chunks: 9 + 4 frames on rank 0 (chunks 0 and 2), 4 on rank 1
    assert results[0][0]["local_shape"][2] == 9 and results[1][0]["local_shape"][2] == 4
    assert results[1][1]["local_shape"][2] == 0  # no chunk: an empty block, still the gather's partner
    assert results[0][0]["sent"] > 0 and results[1][0]["received"] > 0


@pytest.mark.multirank
def test_wavefront_three_ranks_uneven_chunks_and_an_idle_rank():
    # 17 frames: 4 chunks on 3 ranks; 9 frames: 2 chunks, rank 2 gets none
    cases = [((3, 1), 17, 16, 16), ((3, 1), 9, 16, 16)]
    _check(run_ranks(_wavefront_rank, 3, cases, timeout=TIMEOUT), cases, exact=True)


@pytest.mark.multirank
def test_wavefront_time_by_height_on_four_ranks():
    # 2 x 2: latent height 3 -> bands of 2 and 1 latent rows (uneven), 5 chunks on 2 time ranks;
    # 4 x 1 on 9 frames: two of the four ranks get no chunk (bit for bit)
    cases = [((2, 2), 17, 24, 16), ((4, 1), 9, 16, 16)]
    results = run_ranks(_wavefront_rank, 4, cases, timeout=TIMEOUT)
    _check([r[:1] for r in results], cases[:1], exact=False)
    _check([r[1:] for r in results], cases[1:], exact=True)


@pytest.mark.multirank
@pytest.mark.large_world
def test_wavefront_six_ranks_three_by_two():
    cases = [((3, 2), 21, 32, 16), ((6, 1), 13, 16, 16)]
    results = run_ranks(_wavefront_rank, 6, cases, timeout=600)
    _check([r[:1] for r in results], cases[:1], exact=False)
    _check([r[1:] for r in results], cases[1:], exact=True)


def _subgroup_rank(rank: int, world: int) -> bool:
    """Two SP groups of two ranks (world ranks 0-1 and 2-3), each running its own clip as a wavefront."""
    from winsp.comm.group import new_subgroup

    torch.set_num_threads(1)
    groups = [new_subgroup([0, 1]), new_subgroup([2, 3])]
    group = SPGroup(groups[rank // 2])
    vae = tiny_vae()
    vae.set_temporal_chunking(4)
    video = random_video(13, 16, 16, seed=rank // 2)
    latent = encode_wavefront(vae, video, group, split=VAESplit(2, 1))
    return torch.equal(latent, vae.encode(video)) and torch.equal(
        decode_wavefront(vae, latent, group, split=VAESplit(2, 1)), vae.decode(latent))


@pytest.mark.multirank
def test_wavefront_inside_sp_subgroups():
    assert all(run_ranks(_subgroup_rank, 4, timeout=TIMEOUT))


def _runner_rank(rank: int, world: int) -> float:
    from examples.seedvr2.models.vae import make_vae_runner

    torch.set_num_threads(1)
    vae = tiny_vae()
    vae.set_temporal_chunking(4)
    video = random_video(9, 16, 16)
    runner = make_vae_runner("wavefront", vae, group=SPGroup.world())  # the split chosen by the cost model
    latent = runner.encode(video)
    return max((latent - vae.encode(video)).abs().max().item(),
               (runner.decode(latent) - vae.decode(latent)).abs().max().item())


@pytest.mark.multirank
def test_wavefront_runner_by_name():
    assert max(run_ranks(_runner_rank, 2, timeout=TIMEOUT)) <= HEIGHT_TOL


def _bad_split_rank(rank: int, world: int, split) -> None:
    encode_wavefront(tiny_vae(), random_video(5, 16, 16), SPGroup.world(), split=VAESplit(*split))


@pytest.mark.multirank
def test_wavefront_refuses_a_split_that_does_not_fit():
    with pytest.raises(RankError, match="does not match the group's 2 ranks"):
        run_ranks(_bad_split_rank, 2, (3, 1), timeout=TIMEOUT)
    with pytest.raises(RankError, match="latent height of 2 rows"):
        run_ranks(_bad_split_rank, 3, (1, 3), timeout=TIMEOUT)


def test_choose_split_balances_chunks_against_bands():
    eight = [5] + [4] * 7  # a 33-frame clip in chunks of 4
    # 17 / 33 frames on the busiest time rank plus the measured fill lose to even bands plus their halos
    assert choose_split(2, eight, 16) == VAESplit(1, 2)
    assert choose_split(2, eight, 3) == VAESplit(2, 1)  # 3 rows split 2 / 1: time wins
    assert choose_split(2, [5, 4, 4, 4, 4], 16) == VAESplit(1, 2)  # 13 / 8 frames: the height splits evenly
    assert choose_split(4, eight, 16).size == 4
    assert choose_split(3, [5], 1) == VAESplit(3, 1)  # nothing to split: no height without rows
    assert choose_split(4, [5], 16) == VAESplit(1, 4)  # one chunk: height only
    with pytest.raises(ValueError, match="world must be >= 1"):
        choose_split(0, eight, 16)
    assert split_for_clip(2, 33, 16) == VAESplit(1, 2)
    assert split_for_clip(1, 33, 16) == VAESplit(1, 1)


def test_split_cost_follows_the_fitted_constants():
    eight = [5] + [4] * 7
    # no overheads: the ideal shares; the constants add per extra rank of each kind
    none = dict(height_comm=0, height_halo=0, time_comm=0)
    assert split_cost(VAESplit(2, 1), eight, 16, **none) == pytest.approx(17 / 33)
    assert split_cost(VAESplit(1, 2), eight, 15, **none) == pytest.approx(8 / 15)
    assert split_cost(VAESplit(2, 2), eight, 16, height_comm=0.1, height_halo=0,
                      time_comm=0.2) == pytest.approx(17 / 66 + 0.3)
    # the halo term grows the busiest band's share by height_halo per edge (two at most) over its rows squared
    halo = dict(none, height_halo=0.5)
    assert split_cost(VAESplit(1, 2), eight, 16, **halo) == pytest.approx(0.5 * (1 + 0.5 / 64))
    assert split_cost(VAESplit(1, 4), eight, 16, **halo) == pytest.approx(0.25 * (1 + 0.5 * 2 / 16))
    assert split_cost(VAESplit(1, 8), eight, 16, **halo) == pytest.approx(0.125 * (1 + 0.5 * 2 / 4))
    assert split_cost(VAESplit(2, 1), eight, 16, **halo) == pytest.approx(17 / 33)  # no band, no halo
    # with no cost for time ranks a long clip goes to time ranks, with no cost for bands to bands
    assert choose_split(2, eight, 16, height_comm=0.05, height_halo=0, time_comm=0.0) == VAESplit(2, 1)
    assert choose_split(2, eight, 16, height_comm=0.0, height_halo=0, time_comm=0.05) == VAESplit(1, 2)
    # a costly halo sends a long clip of thin bands to time ranks, and leaves tall frames in bands
    assert choose_split(2, eight, 8, height_comm=0, height_halo=4.0, time_comm=0.02) == VAESplit(2, 1)
    assert choose_split(2, eight, 90, height_comm=0, height_halo=4.0, time_comm=0.02) == VAESplit(1, 2)


@pytest.mark.parametrize("frames, rows, world, expected", [
    (1, 90, 2, "height bands x2"),  # an image: one chunk
    (9, 90, 2, "height bands x2"),  # 720p x 9 frames (3 latent chunks): the case
    (21, 30, 2, "height bands x2"),  # 320x240, one batch of 21 frames
    (41, 3, 2, "time x2"),  # a long clip of 3 latent rows: bands of 2 and 1 rows
    (33, 8, 2, "time x2"),  # 33x64x96: 4-row bands measured 1.44-1.61x, the time ranks 1.77-1.83x
    (17, 12, 2, "height bands x2"),  # 17x96x128: 6-row bands measured 1.91-1.93x, the time ranks 1.63-1.85x
    (121, 90, 4, "height bands x4"),  # 23-row bands: the halo costs little
    (33, 30, 4, "time x height 2x2"),  # 8-row bands at 4 ranks would cost more than time ranks' fill
])
def test_clip_splits_short_long_and_images(frames, rows, world, expected):
    assert describe_splits(*clip_splits(world, frames, rows)) == expected


def test_decode_is_weighed_by_the_frames_it_outputs():
    # 5 latent frames decode to 1 + 4 x 4 = 17 frames; time ranks get 1 + 4 + 4 and 4 + 4: not 3 / 5 of the work
    encode, decode = clip_splits(2, 17, 3, temporal_chunk=4)
    assert decode == choose_split(2, [1, 4, 4, 4, 4], 3)
    assert describe_splits(VAESplit(1, 2), VAESplit(2, 1)) == "encode height bands x2, decode time x2"


def test_split_validation():
    with pytest.raises(ValueError, match="must be >= 1"):
        VAESplit(0, 2)
    assert VAESplit(2, 3).coords(4) == (1, 1) and VAESplit(2, 3).size == 6


def test_memory_area_follows_the_chosen_split():
    from examples.seedvr2.pipeline import vae_work_area

    # 41 frames of 3 latent rows on 2 ranks: time 2 x height 1, a rank works on whole frames; 21 frames of 16 rows:
    # the height is split
    assert vae_work_area(24, 96, "wavefront", 2, frames=41) == 24 * 96
    assert vae_work_area(128, 96, "wavefront", 2, frames=21) == vae_work_area(128, 96, "height", 2)
    assert vae_work_area(128, 96, "wavefront", 1, frames=33) == 128 * 96
