"""Temporal batches of long clips: the plan, the lazy batcher, the cross-fade, per-batch seeds, and the pipeline's
``restore_stream`` (single process; the multi-rank layouts are in tests/test_cli.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from examples.seedvr2.restore.temporal import (
    TemporalBatch,
    TemporalBlender,
    check_batching,
    clip_noise,
    crossfade,
    noise_seed,
    plan_temporal_batches,
    temporal_batches,
)


def test_plan_of_a_40_frame_clip():
    plan = plan_temporal_batches(40, 9, 2)
    assert [(b.start, b.stop, b.blend) for b in plan] == [(0, 9, 0), (7, 16, 2), (14, 23, 2), (21, 30, 2),
                                                          (28, 37, 2), (35, 40, 2)]
    assert plan_temporal_batches(5, 21, 4) == (TemporalBatch(0, 0, 5, 0),)
    assert plan_temporal_batches(1, 1, 0) == (TemporalBatch(0, 0, 1, 0),)


@pytest.mark.parametrize("num_frames,batch_frames,overlap",
                         [(t, b, k) for t in (1, 2, 5, 9, 10, 23, 40) for b in (1, 5, 9, 13) for k in range(0, b, 3)])
def test_lazy_batcher_follows_the_plan_and_covers_every_frame(num_frames, batch_frames, overlap):
    plan = plan_temporal_batches(num_frames, batch_frames, overlap)
    frames = (torch.tensor([float(i)]) for i in range(num_frames))
    got = list(temporal_batches(frames, batch_frames, overlap))
    assert [b for b, _ in got] == list(plan)
    for batch, clip in got:
        assert clip[:, 0].tolist() == list(range(batch.start, batch.stop))
        assert batch.num_frames > batch.blend  # every batch brings a new frame
    covered = sorted(set(itertools.chain.from_iterable(range(b.start, b.stop) for b in plan)))
    assert covered == list(range(num_frames))


def test_batches_with_skipped_frames_are_none():
    frames = [torch.zeros(1) if i < 9 else None for i in range(16)]
    got = list(temporal_batches(frames, 9, 2))
    assert got[0][1] is not None and got[1][1] is None


@pytest.mark.parametrize("batch_frames,overlap", [(8, 0), (0, 0), (-3, 0), (9, 9), (9, -1), (5, 7), (True, 0)])
def test_bad_batching_is_refused(batch_frames, overlap):
    with pytest.raises(ValueError, match="--batch-frames|--overlap"):
        check_batching(batch_frames, overlap)


@pytest.mark.parametrize("num_frames,batch_frames,overlap", [(40, 9, 2), (17, 5, 4), (30, 13, 0), (3, 9, 4)])
def test_blending_batches_cut_from_one_clip_gives_the_clip_back(num_frames, batch_frames, overlap):
    """When overlapping batches agree on their shared frames, the cross-fade returns exactly those frames."""
    clip = torch.randn(num_frames, 3, 2, 2)
    blender = TemporalBlender()
    out = []
    for batch in plan_temporal_batches(num_frames, batch_frames, overlap):
        out += list(blender.push(batch, clip[batch.start:batch.stop], overlap))
    out += list(blender.finish())
    torch.testing.assert_close(torch.stack(out), clip)


def test_crossfade_moves_linearly_from_the_earlier_to_the_later_batch():
    earlier, later = torch.zeros(3, 1), torch.full((3, 1), 8.0)
    assert crossfade(earlier, later)[:, 0].tolist() == [2.0, 4.0, 6.0]
    assert crossfade(earlier.to(torch.uint8), later.to(torch.uint8))[:, 0].tolist() == [2, 4, 6]
    # the two batches of a 2-frame overlap: weights 1/3, 2/3 of the later one
    blender = TemporalBlender()
    plan = plan_temporal_batches(7, 5, 2)
    out = list(blender.push(plan[0], torch.zeros(5, 1), 2)) + list(blender.push(plan[1], torch.full((4, 1), 3.0), 2))
    out += list(blender.finish())
    assert torch.stack(out)[:, 0].tolist() == [0, 0, 0, 1, 2, 3, 3]


def test_blender_refuses_out_of_order_batches():
    plan = plan_temporal_batches(20, 9, 2)
    blender = TemporalBlender()
    with pytest.raises(ValueError, match="in order"):
        list(blender.push(plan[1], torch.zeros(9, 1), 2))


def test_noise_seeds_differ_by_frame_and_seed():
    seeds = {noise_seed(666, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert noise_seed(1, 5) != noise_seed(2, 5)


def test_clip_noise_is_keyed_by_position_so_aligned_batches_share_it():
    """Batches 16 frames apart (overlap 5 with 21-frame batches): the shared latent frames get the same noise."""
    a = clip_noise(7, 0, 21, (2, 3), 16)
    b = clip_noise(7, 16, 21, (2, 3), 16)
    assert a.shape == b.shape == (6, 2, 3, 16)
    torch.testing.assert_close(b[0], a[4])  # both end at clip frame 16
    torch.testing.assert_close(b[1], a[5])  # frames 17..20
    assert not torch.equal(clip_noise(8, 0, 21, (2, 3), 16), a)
    assert clip_noise(7, 0, 1, (2, 3), 16).shape == (1, 2, 3, 16)  # an image


# ---- the pipeline over a stream -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_pipeline():
    from examples.seedvr2.models.demo import demo_models, demo_text_embeds
    from examples.seedvr2.pipeline import SeedVR2Pipeline

    dit, vae = demo_models()
    return SeedVR2Pipeline(dit, vae), demo_text_embeds()


def _clip(t: int, h: int = 16, w: int = 32) -> torch.Tensor:
    from examples.seedvr2.models.demo import sample_frames

    return sample_frames(t, h, w).permute(3, 0, 1, 2).float() / 127.5 - 1  # [3, t, h, w]


def test_stream_of_one_batch_equals_the_whole_clip_restore(demo_pipeline):
    pipe, txt = demo_pipeline
    video = _clip(7)
    whole = pipe.restore(video, txt, noise=clip_noise(3, 0, 7, (2, 4), 16))
    streamed = torch.stack(list(pipe.restore_stream(iter(video.transpose(0, 1)), txt, batch_frames=9, overlap=4,
                                                    seed=3)), dim=1)
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=1e-5)


def test_stream_of_many_batches_equals_its_batches_blended(demo_pipeline):
    """Streaming is exactly: restore every planned batch on its own (own seed), then cross-fade in pixels."""
    pipe, txt = demo_pipeline
    video = _clip(19)
    streamed = torch.stack(list(pipe.restore_stream(iter(video.transpose(0, 1)), txt, batch_frames=9, overlap=3,
                                                    seed=5)))
    assert streamed.shape == (19, 3, 16, 32)
    blender, expected = TemporalBlender(), []
    for batch in plan_temporal_batches(19, 9, 3):
        out = pipe.restore(video[:, batch.start:batch.stop], txt,
                           noise=clip_noise(5, batch.start, batch.num_frames, (2, 4), 16))
        expected += list(blender.push(batch, out.transpose(0, 1), 3))
    expected += list(blender.finish())
    torch.testing.assert_close(streamed, torch.stack(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # the default run's budget
def test_stream_memory_does_not_grow_with_the_clip(demo_pipeline):
    """Peak live tensor bytes of a 160-frame stream is within 1.3x of a 40-frame one (same batch settings)."""
    from examples.seedvr2.models.vae.memory import peak_tensor_bytes

    pipe, txt = demo_pipeline
    peaks = {}
    for frames in (40, 160):
        source = (_clip(1)[:, 0] * 0 + (i % 7) / 7 for i in range(frames))  # made lazily, inside the measurement
        with torch.no_grad(), peak_tensor_bytes() as m:
            count = sum(1 for _ in pipe.restore_stream(source, txt, batch_frames=17, overlap=4))
        assert count == frames
        peaks[frames] = m.peak
    assert peaks[160] <= 1.3 * peaks[40], peaks
