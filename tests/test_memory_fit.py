"""Choosing the settings of a restore that fit the memory (``examples.seedvr2.memory.fit``): order and pinning."""

from __future__ import annotations

from examples.seedvr2.memory.fit import (
    PinnedSettings,
    RunSettings,
    candidate_settings,
    fit_settings,
    tile_overlap,
)


def candidates(num_frames=40, latent_height=90, sp_size=1, frame_size=(720, 1280)):
    def make(pinned):
        return candidate_settings(num_frames, latent_height, sp_size, pinned, default_batch=21, default_overlap=5,
                                  frame_size=frame_size)
    return make


def test_larger_batches_first_then_wavefront_height_tiled_largest_tile_first():
    order = list(candidates(sp_size=2)(PinnedSettings()))
    assert [s.batch_frames for s in order[:11]] == [21] * 11
    assert [(s.vae_parallel, s.vae_tile) for s in order[:4]] == [("wavefront", None), ("height", None),
                                                                  ("tiled", 1024), ("tiled", 768)]
    assert order[11] == RunSettings(17, 5, "wavefront")
    single = list(candidates(sp_size=1)(PinnedSettings()))
    assert single[0] == RunSettings(21, 5, "replicated")
    assert "wavefront" not in {s.vae_parallel for s in single}
    batches = list(dict.fromkeys(s.batch_frames for s in order))
    assert batches == [21, 17, 13, 9, 5, 1]
    assert {s.overlap for s in order if s.batch_frames == 5} == {1}  # an overlap must leave new frames
    assert {s.overlap for s in order if s.batch_frames == 1} == {0}


def test_height_needs_several_ranks_and_a_latent_row_each():
    assert "height" not in {s.vae_parallel for s in candidates(sp_size=1)(PinnedSettings())}
    assert "height" not in {s.vae_parallel for s in candidates(sp_size=4, latent_height=3)(PinnedSettings())}


def test_a_short_clip_tries_each_effective_batch_once_and_tiles_smaller_than_the_frame():
    order = list(candidates(num_frames=9, frame_size=(144, 256))(PinnedSettings()))
    assert list(dict.fromkeys(s.batch_frames for s in order)) == [21, 5, 1]  # 21, 17, 13, 9 are all the 9 frames
    assert [s.vae_tile for s in order if s.vae_parallel == "tiled" and s.batch_frames == 21] == [192, 128, 96, 64]


def test_tile_overlap_is_64_or_a_quarter_of_a_small_tile():
    assert [tile_overlap(t) for t in (1024, 256, 192, 128, 96, 64, 16)] == [64, 64, 48, 32, 24, 16, 0]


def _need(settings: RunSettings) -> int:
    """A made-up memory model: 10 per frame, VAE replicated or wavefront 100, height 50, tiled the tile in units of
    10 pixels."""
    vae = {"replicated": 100, "wavefront": 100, "height": 50}.get(settings.vae_parallel)
    vae = vae or (settings.vae_tile or 0) // 10
    return 10 * settings.batch_frames + vae


def test_the_first_candidate_that_fits_is_chosen():
    fit = fit_settings(candidates(sp_size=2), PinnedSettings(), _need, usable=10**9)
    assert fit.chosen == RunSettings(21, 5, "wavefront") and not fit.changed
    fit = fit_settings(candidates(sp_size=1), PinnedSettings(), _need, usable=290)
    assert fit.chosen == RunSettings(21, 5, "tiled", 768) and fit.changed and fit.need == 210 + 76
    assert fit.first_need == 310
    fit = fit_settings(candidates(sp_size=2), PinnedSettings(), _need, usable=260)
    assert fit.chosen == RunSettings(21, 5, "height")


def test_no_limit_known_runs_the_fastest():
    fit = fit_settings(candidates(), PinnedSettings(), _need, usable=None)
    assert fit.chosen == RunSettings(21, 5, "replicated")


def test_pinned_settings_that_do_not_fit_get_a_suggestion():
    pinned = PinnedSettings(vae_parallel="replicated")
    fit = fit_settings(candidates(), pinned, _need, usable=150)
    # replicated at a batch of 5 frames (150) fits: the pin is kept and the batch shrinks
    assert fit.chosen == RunSettings(5, 1, "replicated")
    pinned = PinnedSettings(batch_frames=21, vae_parallel="replicated")
    fit = fit_settings(candidates(), pinned, _need, usable=240)
    assert fit.chosen is None and fit.first == RunSettings(21, 5, "replicated")
    assert fit.suggestion == RunSettings(21, 5, "tiled", 256) and fit.suggestion_need == 235
    assert fit.suggestion.flags() == "--batch-frames 21 --overlap 5 --vae-parallel tiled --vae-tile 256"


def test_nothing_fits():
    fit = fit_settings(candidates(), PinnedSettings(), _need, usable=5)
    assert fit.chosen is None and fit.suggestion is None and fit.first_need == 310
