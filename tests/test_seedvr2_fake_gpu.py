"""SeedVR2 on a fake GPU (winsp.testing.fake_gpu): the released 3B and 7B DiTs at full width and depth, the VAE in
each mode, the restore pipeline's per-batch step and ``--shard-weights``, in bf16 on fake CUDA tensors, every rank of
P. Each run must show no device sync in compute, no device mismatch and the same collectives on every rank
(``report.check()``), bf16 on every data collective and the expected output on every rank.

The whole matrix runs in CI's fake-GPU step (``-m fake_gpu``; none of it is ``slow``): both models x 720p x 21 and
1080p x 61 frames x P = 1, 2, 4, 8, ranks with no window, every VAE mode at 720p x 21 on 2 and 4 ranks (replicated
and tiled also on 1), the pipeline's per-batch step in each VAE mode at 2. The tiled mode runs the CLI's 256-pixel
tiles (28 tiles at 720p, every one encoded and decoded on each rank: the heaviest case) on 1 rank here and on 2 in
the pipeline's step, and 512-pixel ones (6 tiles) at 2 and 4 ranks: it never uses the group, so every rank runs the
same ops, and P only multiplies the time. benchmarks/README.md has the run's time (``.ci/run`` runs it with
pytest-xdist, a worker a core).
Needs the CUDA build of torch (no GPU); skipped on a CPU-only build.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.fake_gpu, pytest.mark.timeout(1800)]


def _run(fn, world: int, *args, **kwargs):
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(fn, world, *args, **kwargs)  # check=True: raises on any problem, naming it
    for trace in report.ranks.values():
        assert trace.error is None, trace.error
        assert trace.device_syncs_in_compute() == [] and trace.mismatches == []
    return report


def _data_collectives(report, dtype=torch.bfloat16):
    return [c for c in report.ranks[0].collectives if c.dtype == dtype]


# ---- the DiT ------------------------------------------------------------------------------------------------------

DIT_MATRIX = [(m, c, p) for m in ("3b", "7b") for c in ("720p", "1080p") for p in (1, 2, 4, 8)]


def _check_dit(model: str, clip_name: str, world: int, **kwargs):
    from examples.seedvr2.memory.fake_gpu_runs import CLIPS, dit_rank

    t, h, w = CLIPS[clip_name].latent
    report = _run(dit_rank, world, model, (t, h, w), **kwargs)
    for trace in report.ranks.values():
        assert trace.result == ((t * h * w, 16), torch.bfloat16)
    if world > 1:
        assert _data_collectives(report), "SP over several ranks moves bf16 rows"
    return report


@pytest.mark.parametrize("model,clip,world", DIT_MATRIX)
def test_released_dit_runs_on_every_rank(model, clip, world):
    _check_dit(model, clip, world)


@pytest.mark.parametrize("model", ["3b", "7b"])
def test_released_dit_with_ranks_that_hold_no_window(model):
    """A 4x4 latent is one window (post-patch 1x2x2): at P = 4 three ranks hold nothing, and still send zero tensors of
    their peers' dtype and size to every collective."""
    from examples.seedvr2.memory.fake_gpu_runs import dit_rank

    report = _run(dit_rank, 4, model, (1, 4, 4))
    assert all(t.result == ((16, 16), torch.bfloat16) for t in report.ranks.values())


def test_shard_weights_gathers_each_block_on_every_rank():
    """``--shard-weights``: each block's flat byte buffer is all-gathered before it runs, on every rank alike."""
    report = _check_dit("3b", "720p", 2, shard_weights=True)
    gathers = [c for c in report.ranks[0].collectives if c.op.startswith("all_gather") and c.dtype == torch.uint8]
    assert len(gathers) >= 32, report.summary()  # one per block at least (the 3B has 32)


# ---- the VAE ------------------------------------------------------------------------------------------------------

# The tiled mode never uses the group (every rank tiles the whole clip alone, the same ops on each): the CLI's
# 256-pixel tiles (28 tiles at 720p) on one rank, here and in the pipeline's step at 2; 512 (6 tiles) at 2 and 4
VAE_MATRIX = ([("replicated", 1, 256), ("tiled", 1, 256)]
              + [(m, p, 512 if m == "tiled" else 256) for m in ("replicated", "height", "wavefront", "tiled")
                 for p in (2, 4)])


def _check_vae(mode: str, world: int, clip_name: str = "720p", tile_size: int = 256):
    from examples.seedvr2.memory.fake_gpu_runs import CLIPS, vae_rank

    clip = CLIPS[clip_name]
    report = _run(vae_rank, world, mode, clip, tile_size=tile_size)
    t, h, w = clip.latent
    for trace in report.ranks.values():
        assert trace.result == ((1, 16, t, h, w), torch.bfloat16, (1, 3, 4 * (t - 1) + 1, clip.height, clip.width),
                                torch.bfloat16)
    if mode in ("height", "wavefront") and world > 1:
        assert report.ranks[0].collectives, f"the {mode} VAE over {world} ranks communicates"
    return report


@pytest.mark.parametrize("mode,world,tile", VAE_MATRIX)
def test_vae_modes_run_on_every_rank(mode, world, tile):
    _check_vae(mode, world, tile_size=tile)


def test_height_sharded_vae_holds_less_per_rank_than_replicated():
    replicated = _check_vae("replicated", 1).peak_bytes()
    height = _check_vae("height", 2).peak_bytes()
    assert height < 0.75 * replicated


# ---- the pipeline's per-batch step --------------------------------------------------------------------------------

@pytest.mark.parametrize("vae_mode", ["height", "wavefront", "tiled", "replicated"])
def test_restore_step_runs_on_every_rank(vae_mode):
    """Encode, one DiT step and decode of a host clip (the CLI's per-batch compute) with no host read on the way."""
    from examples.seedvr2.memory.fake_gpu_runs import CLIPS, pipeline_rank

    clip = CLIPS["720p"]
    report = _run(pipeline_rank, 2, "3b", clip, vae_mode)
    for trace in report.ranks.values():
        assert trace.result == ((3, clip.frames, clip.height, clip.width), torch.float32)
