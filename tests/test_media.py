"""Video/image I/O, the resize/crop geometry, and the wavelet colour fix (examples/seedvr2/media/, color_fix.py)."""

from __future__ import annotations

import errno
import os
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

av = pytest.importorskip("av")

from examples.seedvr2.media.color_fix import wavelet_color_fix, wavelet_lowpass  # noqa: E402
from examples.seedvr2.media import (  # noqa: E402
    DecoderOutOfMemory,
    MediaError,
    MediaWriter,
    center_crop,
    default_output_path,
    frames_to_model,
    h264_frame_size,
    iter_frames,
    model_to_frames,
    parse_resolution,
    plan_geometry,
    probe_media,
    read_media,
    resize_frames,
    same_file,
    write_media,
)
from tests.media_files import write_clip_with_audio, write_truncated_faststart  # noqa: E402


def smooth_clip(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """Frames with smooth colour ramps that move over time: codec-friendly, so round trips are near-lossless."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    frames = []
    for i in range(t):
        phase = rng.uniform(0, 2 * np.pi, 3)
        r = 128 + 60 * np.sin(x / w * np.pi + phase[0] + i * 0.3)
        g = 128 + 60 * np.sin(y / h * np.pi + phase[1])
        b = 128 + 60 * np.cos((x + y) / (h + w) * np.pi + phase[2])
        frames.append(np.stack([r, g, b], -1))
    return np.clip(np.round(np.stack(frames)), 0, 255).astype(np.uint8)


# ---- round trips --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fps", [Fraction(25), Fraction(24000, 1001), Fraction(12)])
def test_mp4_round_trip_keeps_frames_size_fps(tmp_path, fps):
    clip = smooth_clip(5, 32, 48)
    path = tmp_path / "clip.mp4"
    write_media(path, clip, fps)
    media = read_media(path)
    assert media.frames.shape == clip.shape
    assert media.fps == fps
    assert not media.is_image
    assert np.abs(media.frames.astype(int) - clip.astype(int)).mean() < 3.0
    # the stream really is H.264
    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.name == "h264"


def test_mp4_odd_size_is_padded_by_one_edge_pixel_in_yuv420p(tmp_path):
    clip = smooth_clip(3, 33, 47)
    path = tmp_path / "odd.mp4"
    write_media(path, clip, Fraction(30))
    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.pix_fmt == "yuv420p"  # what common players accept
    media = read_media(path)
    assert media.frames.shape == (3, 34, 48, 3) and h264_frame_size(33, 47) == (34, 48)
    assert np.abs(media.frames[:, :33, :47].astype(int) - clip.astype(int)).mean() < 3.0
    # the extra row / column repeat the edge
    assert np.abs(media.frames[:, 33].astype(int) - media.frames[:, 32].astype(int)).mean() < 3.0
    assert np.abs(media.frames[:, :, 47].astype(int) - media.frames[:, :, 46].astype(int)).mean() < 3.0


def test_png_round_trip_is_lossless(tmp_path):
    image = smooth_clip(1, 32, 48)
    path = tmp_path / "image.png"
    write_media(path, image)
    media = read_media(path)
    assert media.is_image and media.num_frames == 1
    np.testing.assert_array_equal(media.frames, image)


def test_jpeg_reads_as_one_frame_image(tmp_path):
    image = smooth_clip(1, 32, 48)
    path = tmp_path / "image.jpg"
    write_media(path, image)
    media = read_media(path)
    assert media.is_image and media.frames.shape == image.shape
    assert np.abs(media.frames.astype(int) - image.astype(int)).mean() < 4.0


def test_single_frame_mp4_is_a_video_not_an_image(tmp_path):
    path = tmp_path / "one.mp4"
    write_media(path, smooth_clip(1, 32, 32), Fraction(10))
    media = read_media(path)
    assert media.num_frames == 1 and not media.is_image and media.fps == 10


def test_writing_many_frames_to_png_is_refused_and_leaves_nothing(tmp_path):
    path = tmp_path / "x.png"
    with pytest.raises(MediaError, match="5 frames"):
        write_media(path, smooth_clip(5, 16, 16))
    assert os.listdir(tmp_path) == []


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    from examples.seedvr2.media import writing as media_mod

    real_write = media_mod.MediaWriter.write
    calls = []

    def dies_on_second(self, frame, pts=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("encoder died")
        return real_write(self, frame, pts)

    monkeypatch.setattr(media_mod.MediaWriter, "write", dies_on_second)
    with pytest.raises(RuntimeError, match="encoder died"):
        write_media(tmp_path / "out.mp4", smooth_clip(2, 16, 16))
    assert os.listdir(tmp_path) == []


# ---- bad inputs ---------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(MediaError, match="not found"):
        read_media(tmp_path / "nope.mp4")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.mp4"
    path.write_bytes(b"")
    with pytest.raises(MediaError, match="input file is empty"):
        read_media(path)


def test_not_a_media_file(tmp_path):
    path = tmp_path / "notes.mp4"
    path.write_text("this is not a video\n" * 20)
    with pytest.raises(MediaError, match="not a readable video or image"):
        read_media(path)


def test_truncated_video_is_an_error(tmp_path):
    good = tmp_path / "good.mp4"
    write_media(good, smooth_clip(5, 32, 48), Fraction(25))
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(good.read_bytes()[:200])
    with pytest.raises(MediaError):
        read_media(bad)


def test_short_decode_is_refused_naming_both_counts(tmp_path):
    """The first half of a faststart mp4: the container declares 40 frames, fewer decode. Refused, unless the user
    accepts a partial input, which is then reported as a warning."""
    half = write_truncated_faststart(tmp_path / "half.mp4", smooth_clip(40, 32, 48, seed=3))
    write_media(tmp_path / "full.mp4", smooth_clip(40, 32, 48, seed=3), Fraction(24))
    with pytest.raises(MediaError, match=r"only \d+ of the 40 frames its container declares") as exc:
        probe_media(half)
    assert "--allow-partial-input" in str(exc.value)
    info = probe_media(half, allow_partial=True)
    assert 0 < info.num_frames < 40 and info.declared_frames == 40
    assert any("WARNING" in n and f"{info.num_frames} frames" in n for n in info.notes)
    assert sum(1 for _ in iter_frames(info)) == info.num_frames
    full = probe_media(tmp_path / "full.mp4")
    assert (full.num_frames, full.declared_frames, full.notes) == (40, 40, ())


@pytest.mark.parametrize("pix_fmt,dropped", [("rgba", "alpha"), ("rgb48be", "16-bit"), ("rgba64be", "alpha")])
def test_alpha_and_16_bit_inputs_say_what_is_dropped(tmp_path, pix_fmt, dropped):
    path = tmp_path / "in.png"
    with av.open(str(path), "w", format="image2", options={"update": "1"}) as c:
        s = c.add_stream("png")
        s.width, s.height, s.pix_fmt = 24, 20, pix_fmt
        c.mux(s.encode(av.VideoFrame.from_ndarray(smooth_clip(1, 20, 24)[0], format="rgb24").reformat(format=pix_fmt)))
        c.mux(s.encode(None))
    info = probe_media(path)
    assert any(dropped in n for n in info.notes), info.notes
    assert read_media(path).frames.shape == (1, 20, 24, 3)


def test_plain_8_bit_input_has_no_notes(tmp_path):
    path = tmp_path / "in.png"
    write_media(path, smooth_clip(1, 16, 16))
    assert probe_media(path).notes == ()


def test_lazy_frames_skip_conversion_of_unwanted_frames(tmp_path):
    path = tmp_path / "clip.mp4"
    clip = smooth_clip(7, 16, 32)
    write_media(path, clip, Fraction(10))
    info = probe_media(path)
    got = list(iter_frames(info, keep=lambda i: i % 3 == 0))
    assert [i for i, _, _ in got] == list(range(7))
    assert [f is not None for _, f, _ in got] == [i % 3 == 0 for i in range(7)]
    assert all(pts is not None for _, _, pts in got)


class _DecoderStarved:
    """A container whose decoder fails with ``code`` after ``good`` frames, as FFmpeg does when it cannot allocate
    memory or start its threads (an address-space limit); everything else is the real container's."""

    def __init__(self, container, good: int, code: int) -> None:
        self._c, self._good, self._code = container, good, code

    def __getattr__(self, name):
        return getattr(self._c, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._c.__exit__(*exc)

    def decode(self, stream):
        for i, frame in enumerate(self._c.decode(stream)):
            if i == self._good:
                raise av.FFmpegError(self._code, os.strerror(self._code))
            yield frame


@pytest.mark.parametrize("code", [errno.EAGAIN, errno.ENOMEM])
def test_decoder_short_of_memory_is_out_of_memory_not_a_damaged_file(tmp_path, monkeypatch, code):
    """Under a low memory limit FFmpeg fails with EAGAIN / ENOMEM: that is reported as memory (the CLI's
    out-of-memory error), not as a truncated file or a decoding error of the input."""
    from examples.seedvr2.media import reading as media

    path = tmp_path / "clip.mp4"
    write_media(path, smooth_clip(6, 16, 32), Fraction(10))
    info = probe_media(path)
    real_open = media._open_input
    monkeypatch.setattr(media, "_open_input", lambda p: _DecoderStarved(real_open(p), 2, code))
    with pytest.raises(DecoderOutOfMemory, match=r"could not allocate memory or start its decoder threads while "
                                                 r"decoding frame 2 of .*clip\.mp4"):
        probe_media(path)
    with pytest.raises(DecoderOutOfMemory, match="decoding frame 2 of"):
        list(iter_frames(info))
    from examples.seedvr2.cli import is_out_of_memory

    assert is_out_of_memory(DecoderOutOfMemory("x"))
    monkeypatch.setattr(media, "_open_input", lambda p: _DecoderStarved(real_open(p), 2, errno.EINVAL))
    with pytest.raises(MediaError, match="decoding failed at frame 2 of 6"):  # a real decoding error stays one
        list(iter_frames(info))


#: opens a MediaWriter under a real address-space limit: what the process maps plus ``argv[2]`` MiB, too little for
#: libx264's buffers and threads; prints the exception's type and message
_STARVED_WRITER = """
import resource, sys
import av, numpy as np  # FFmpeg's libraries mapped before the limit
from examples.seedvr2.media import MediaWriter
with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
limit = mapped + int(sys.argv[2]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    with MediaWriter(sys.argv[1], 512, 512) as writer:
        writer.write(np.zeros((512, 512, 3), np.uint8))
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_an_encoder_short_of_memory_is_out_of_memory_not_a_container_that_refuses_a_stream(tmp_path):
    """Under a low ``RLIMIT_AS`` libx264 cannot start (FFmpeg: "Generic error in an external library"): the writer
    says the encoder is short of memory (the CLI's out-of-memory error), leaves no file, and does not blame the
    container or suggest another one."""
    import subprocess
    import sys

    from examples.seedvr2.cli import is_out_of_memory
    from examples.seedvr2.media import EncoderOutOfMemory

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _STARVED_WRITER, str(tmp_path / "o.mp4"), "8"], cwd=repo,
                          env=dict(os.environ, PYTHONPATH=repo), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("EncoderOutOfMemory the H.264 encoder could not allocate its buffers or start its "
                                  "threads for 512x512 ("), done.stdout + done.stderr
    assert os.listdir(tmp_path) == []
    assert is_out_of_memory(EncoderOutOfMemory("x"))


def _audio_packets(path) -> list[bytes]:
    with av.open(str(path)) as c:
        return [bytes(p) for p in c.demux(c.streams.audio[0]) if p.size]


@pytest.mark.parametrize("ext", [".mp4", ".mkv"])
def test_writer_copies_audio_untouched_and_keeps_timing(tmp_path, ext):
    src = tmp_path / "src.mp4"
    write_clip_with_audio(src, smooth_clip(24, 32, 48), Fraction(12))
    info = probe_media(src)
    assert info.has_audio
    out = tmp_path / f"out{ext}"
    with MediaWriter(out, info.height, info.width, info.fps, time_base=info.time_base, audio_from=str(src)) as w:
        for _, frame, pts in iter_frames(info):
            w.write(255 - frame, pts)
    assert _audio_packets(out) == _audio_packets(src)  # the coded audio, byte for byte
    with av.open(str(src)) as a, av.open(str(out)) as b:
        ta = [f.time for f in a.decode(video=0)]
        tb = [f.time for f in b.decode(video=0)]
    assert len(ta) == len(tb) == 24
    steps_a, steps_b = np.diff(ta), np.diff(tb)
    np.testing.assert_allclose(steps_b, steps_a, atol=2e-3)  # same spacing (a container may shift the start)


def test_variable_frame_timing_is_kept(tmp_path):
    src = tmp_path / "vfr.mkv"
    gaps = [0, 1, 3, 4, 8, 9, 15]  # in 1/30 s
    with av.open(str(src), "w") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = 32, 16, "yuv420p"
        s.codec_context.time_base = Fraction(1, 30)
        for pts, frame in zip(gaps, smooth_clip(len(gaps), 16, 32)):
            f = av.VideoFrame.from_ndarray(frame, format="rgb24")
            f.pts, f.time_base = pts, Fraction(1, 30)
            c.mux(s.encode(f))
        c.mux(s.encode(None))
    info = probe_media(src)
    out = tmp_path / "out.mp4"
    with MediaWriter(out, info.height, info.width, info.fps, time_base=info.time_base) as w:
        for _, frame, pts in iter_frames(info):
            w.write(frame, pts)
    with av.open(str(out)) as c:
        times = [f.time for f in c.decode(video=0)]
    np.testing.assert_allclose(np.array(times) - times[0], np.array(gaps) / 30, atol=2e-3)


def test_writer_refuses_wrong_frames_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        with MediaWriter(tmp_path / "o.mp4", 16, 16) as w:
            w.write(np.zeros((16, 18, 3), np.uint8))
    with pytest.raises(MediaError, match="no frame"):
        with MediaWriter(tmp_path / "o.png", 16, 16):
            pass
    assert os.listdir(tmp_path) == []


def test_same_file_sees_links(tmp_path):
    a = tmp_path / "a.mp4"
    a.write_bytes(b"x")
    os.symlink(a, tmp_path / "sym.mp4")
    os.link(a, tmp_path / "hard.mp4")
    assert same_file(a, tmp_path / "sym.mp4") and same_file(a, tmp_path / "hard.mp4")
    assert same_file(a, tmp_path / "sub" / ".." / "a.mp4")
    assert not same_file(a, tmp_path / "b.mp4")


def test_default_output_path_sits_beside_the_input():
    assert default_output_path("/v/clip.mov") == "/v/clip_restored.mov"
    assert default_output_path("/v/clip.webm") == "/v/clip_restored.mp4"
    assert default_output_path("pic.PNG") == "pic_restored.PNG"


def test_audio_only_file_has_no_video_stream(tmp_path):
    path = tmp_path / "tone.wav"
    with av.open(str(path), "w") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        c.mux(s.encode(frame))
        c.mux(s.encode(None))
    with pytest.raises(MediaError, match="no video stream"):
        read_media(path)


# ---- geometry -----------------------------------------------------------------------------------------------------


def test_parse_resolution():
    assert parse_resolution("1280x720") == (720, 1280)
    assert parse_resolution("48X32") == (32, 48)
    for bad in ("1280", "axb", "12x34x56", ""):
        with pytest.raises(MediaError, match="WIDTHxHEIGHT"):
            parse_resolution(bad)


def test_geometry_multiples_of_16_need_no_crop():
    g = plan_geometry((360, 640), resolution=(720, 1280))
    assert g.resized == (720, 1280) and g.output == (720, 1280) and g.work == (720, 1280)


def test_geometry_crops_to_multiples_of_16_and_keeps_requested_output():
    g = plan_geometry((720, 1280), resolution=(1080, 1920))
    assert g.output == (1080, 1920) and g.work == (1072, 1920)
    g = plan_geometry((33, 47), scale=2.0)
    assert g.output == (66, 94) and g.work == (64, 80)


def test_geometry_other_aspect_covers_then_crops():
    g = plan_geometry((480, 640), resolution=(720, 1280))  # 4:3 into 16:9: scale to width, crop height
    assert g.resized == (960, 1280) and g.output == (720, 1280)


def test_geometry_scale_default_is_identity():
    g = plan_geometry((32, 48))
    assert g.input == g.resized == g.output == g.work == (32, 48)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_geometry_rejects_nonsensical_scale(scale):
    with pytest.raises(MediaError, match="--scale"):
        plan_geometry((32, 48), scale=scale)


def test_geometry_rejects_tiny_and_huge_outputs():
    with pytest.raises(MediaError, match="under the minimum of 16"):
        plan_geometry((32, 48), scale=0.25)
    with pytest.raises(MediaError, match="under the minimum of 16"):
        plan_geometry((32, 48), resolution=(15, 64))
    with pytest.raises(MediaError, match="over the maximum"):
        plan_geometry((32, 48), scale=1000.0)


def test_geometry_hints_follow_the_input():
    """The --scale hints are computed from the input, and the sizes at the hint are allowed."""
    with pytest.raises(MediaError, match=r"the input is 48x32: use --scale 341\.33 or less"):
        plan_geometry((32, 48), scale=1000.0)
    assert plan_geometry((32, 48), scale=341.33).output == (10923, 16384)
    with pytest.raises(MediaError, match=r"the input is 192x128: use --scale 0\.13 or more"):
        plan_geometry((128, 192), scale=0.1)
    assert plan_geometry((128, 192), scale=0.13).output == (17, 25)
    assert plan_geometry((128, 192), scale=0.2).output == (26, 38)
    assert plan_geometry((32, 32), scale=300).output == (9600, 9600)


def test_output_directory_check_and_atomic_output_refuse_a_directory_without_new_files(tmp_path):
    from examples.seedvr2.media import atomic_output, check_output_directory

    check_output_directory(tmp_path / "o.mp4")
    assert os.listdir(tmp_path) == []  # the probe file is gone
    with pytest.raises(MediaError, match="does not exist"):
        check_output_directory(tmp_path / "nope" / "o.mp4")
    with pytest.raises(MediaError, match="cannot write to the output directory /proc"):
        check_output_directory("/proc/o.mp4")
    with pytest.raises(MediaError, match="cannot write to the output directory /proc"):  # not an OSError traceback
        with atomic_output("/proc/o.mp4"):
            pass


@settings(max_examples=300, deadline=None)
@given(
    in_h=st.integers(1, 4000), in_w=st.integers(1, 4000),
    out_h=st.integers(16, 4000), out_w=st.integers(16, 4000),
)
def test_geometry_invariants(in_h, in_w, out_h, out_w):
    g = plan_geometry((in_h, in_w), resolution=(out_h, out_w))
    assert g.output == (out_h, out_w)  # exactly what was asked
    for work, out, resized in zip(g.work, g.output, g.resized):
        assert work % 16 == 0 and out - 16 < work <= out  # the largest multiple of 16 inside the output
        assert resized >= out  # the resize covers the output, so the crop never pads
    # aspect ratio kept by the resize (to rounding)
    assert abs(g.resized[0] / g.resized[1] - in_h / in_w) <= (1 / g.resized[1]) * (1 + in_h / in_w) + 1e-9


def test_center_crop_offsets_round_like_torchvision():
    x = torch.arange(10.0).reshape(1, 10).expand(10, 10)  # column index as value
    assert center_crop(x, (10, 7))[0].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # round(1.5) == 2
    assert center_crop(x, (10, 5))[0].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]  # round(2.5) == 2 (banker's)
    with pytest.raises(ValueError, match="larger"):
        center_crop(x, (11, 5))


def test_resize_is_antialiased_bicubic():
    x = torch.rand(3, 2, 40, 60)
    assert resize_frames(x, (40, 60)) is x
    expected = torch.nn.functional.interpolate(x, size=(20, 30), mode="bicubic", antialias=True)
    torch.testing.assert_close(resize_frames(x, (20, 30)), expected)
    # a constant image stays constant (filter taps sum to one)
    c = torch.full((1, 1, 17, 23), 0.3)
    torch.testing.assert_close(resize_frames(c, (50, 31)), torch.full((1, 1, 50, 31), 0.3))


def test_frames_to_model_and_back():
    clip = smooth_clip(2, 32, 48)
    g = plan_geometry((32, 48))
    x = frames_to_model(clip, g)
    assert x.shape == (3, 2, 32, 48) and x.dtype == torch.float32
    torch.testing.assert_close(x, torch.from_numpy(clip).permute(3, 0, 1, 2).float() / 255 * 2 - 1)
    np.testing.assert_array_equal(model_to_frames(x, g), clip)
    # out of range values are clipped, not wrapped
    assert model_to_frames(torch.full((3, 1, 32, 48), 5.0), g).min() == 255
    # processing at a cropped size and writing at the requested size
    g = plan_geometry((32, 48), resolution=(40, 70))
    x = frames_to_model(clip, g)
    assert x.shape == (3, 2, 32, 64)
    assert model_to_frames(x, g).shape == (2, 40, 70, 3)


# ---- colour fix ---------------------------------------------------------------------------------------------------


def test_color_fix_with_itself_is_identity():
    x = torch.rand(4, 3, 40, 56) * 2 - 1
    torch.testing.assert_close(wavelet_color_fix(x, x), x, atol=1e-6, rtol=0)


def test_color_fix_removes_a_colour_cast_and_keeps_detail():
    reference = torch.rand(2, 3, 48, 64) * 2 - 1
    cast = torch.tensor([0.3, -0.2, 0.1]).view(1, 3, 1, 1)
    restored = reference + cast  # same detail, shifted colours
    torch.testing.assert_close(wavelet_color_fix(restored, reference), reference, atol=1e-5, rtol=0)


def test_color_fix_transfers_low_frequencies_only():
    h = w = 160
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    detail = 0.3 * torch.sin(2 * torch.pi * x / 6) * torch.sin(2 * torch.pi * y / 7)  # fine texture
    content = detail + (0.002 * x - 0.001 * y - 0.2)  # texture on one smooth ramp
    style = -0.003 * x + 0.002 * y + 0.1  # another smooth ramp, no texture
    fixed = wavelet_color_fix(content, style)
    # away from the borders (the 5-level pyramid reaches 31 pixels) the result is the content's texture on the
    # style's ramp: linear ramps pass the symmetric low-pass unchanged and the texture is filtered out of it
    inner = (slice(32, -32), slice(32, -32))
    torch.testing.assert_close(fixed[inner], (detail + style)[inner], atol=0.01, rtol=0)
    assert (fixed - content)[inner].abs().mean() > 0.1  # it really moved the colours


def test_lowpass_keeps_constants_and_smooths_noise():
    c = torch.full((1, 3, 20, 30), 0.7)
    torch.testing.assert_close(wavelet_lowpass(c), c)
    noise = torch.randn(1, 1, 64, 64)
    assert wavelet_lowpass(noise).std() < 0.2 * noise.std()


def test_color_fix_shape_mismatch():
    with pytest.raises(ValueError, match="matching shapes"):
        wavelet_color_fix(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 9))


def test_stream_that_decodes_to_zero_frames(tmp_path, monkeypatch):
    """A container whose video stream yields no frame at all (FFmpeg can produce such files) is refused."""
    path = tmp_path / "empty.mp4"
    write_media(path, smooth_clip(1, 16, 16), Fraction(25))
    real_open = av.open

    class NoFrames:
        def __init__(self, inner):
            self.inner = inner
            self.streams, self.format = inner.streams, inner.format

        def decode(self, *args, **kwargs):
            return iter(())

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()

    monkeypatch.setattr(av, "open", lambda *a, **k: NoFrames(real_open(*a, **k)))
    with pytest.raises(MediaError, match="no frames could be decoded"):
        read_media(path)


def test_written_files_get_normal_permissions(tmp_path):
    path = tmp_path / "x.png"
    write_media(path, smooth_clip(1, 16, 16))
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask


def test_shipped_samples_are_the_generated_clip():
    """examples/seedvr2/assets/sample.{mp4,png} are demo.sample_frames(9, 64, 96) (frame 4 for the png)."""
    from examples.seedvr2.models.demo import sample_frames

    assets = os.path.join(os.path.dirname(__file__), "..", "examples", "seedvr2", "assets")
    frames = sample_frames(9, 64, 96).numpy()
    png = read_media(os.path.join(assets, "sample.png"))
    np.testing.assert_array_equal(png.frames[0], frames[4])
    mp4 = read_media(os.path.join(assets, "sample.mp4"))
    assert mp4.frames.shape == frames.shape and mp4.fps == 8
    assert np.abs(mp4.frames.astype(int) - frames.astype(int)).mean() < 4.0
    assert os.path.getsize(os.path.join(assets, "sample.mp4")) < 50_000
