"""A video's frame size is checked from its container's headers before FFmpeg opens it (issue 49): opening an H.264
mp4 or mkv already decodes a frame, so a check after the open came after the decode's memory.

The files are real ones written here with PyAV (mp4 with the index at the end and at the front, mov, mkv, webm, avi;
with and without audio); the refusal is measured in a fresh process by its peak resident memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

av = pytest.importorskip("av")

from examples.seedvr2.media import untrusted  # noqa: E402
from examples.seedvr2.media.video_header import frame_sizes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(path, codec: str, fmt: str, width: int, height: int, frames: int = 2, audio: str = "",
          options: dict | None = None) -> str:
    with av.open(str(path), "w", format=fmt, options=options or {}) as c:
        s = c.add_stream(codec, rate=24)
        s.width, s.height, s.pix_fmt = width, height, "yuvj420p" if codec == "mjpeg" else "yuv420p"
        a = c.add_stream(audio, rate=48000) if audio else None
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
            c.mux(s.encode(frame.reformat(format=s.pix_fmt)))
        c.mux(s.encode(None))
        if a is not None:
            c.mux(a.encode(None))
    return str(path)


CASES = {  # name: (codec, format, width, height, audio, options)
    "mp4": ("libx264", "mp4", 64, 48, "aac", None),
    "mp4_faststart": ("libx264", "mp4", 48, 32, "", {"movflags": "faststart"}),
    "mov": ("mpeg4", "mov", 80, 32, "", None),
    "mkv": ("ffv1", "matroska", 96, 40, "mp2", None),
    "webm": ("libvpx", "webm", 64, 48, "libopus", None),
    "avi": ("mjpeg", "avi", 64, 48, "mp2", None),
}


def _sizes(path: str):
    kind, _ = untrusted.sniff_file(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return frame_sizes(fd, kind.demuxer)
    finally:
        os.close(fd)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_container_says_its_frame_size_from_its_headers(tmp_path, case):
    codec, fmt, width, height, audio, options = CASES[case]
    path = write(tmp_path / f"clip.{fmt}", codec, fmt, width, height, audio=audio, options=options)
    sizes = _sizes(path)
    assert sizes and set(sizes) == {(width, height)}, sizes
    with av.open(path) as c:  # what FFmpeg reads agrees
        assert (c.streams.video[0].codec_context.width, c.streams.video[0].codec_context.height) == (width, height)


def test_an_mp4_cut_before_its_index_or_garbage_after_a_header_is_refused_when_a_cap_is_set(tmp_path, monkeypatch):
    path = write(tmp_path / "clip.mp4", "libx264", "mp4", 64, 48, frames=30)  # the index (moov) at the end
    with open(path, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[:len(data) // 2])
    junk = tmp_path / "junk.mkv"
    junk.write_bytes(b"\x1a\x45\xdf\xa3" + b"\xff" * 64)
    assert _sizes(str(cut)) is None and _sizes(str(junk)) is None
    monkeypatch.setattr(untrusted, "max_pixels", 10**6)
    for bad in (cut, junk):
        with pytest.raises(untrusted.UntrustedMedia, match="headers do not say its frame size") as refused:
            untrusted.check_file(str(bad), "upload")
        assert refused.value.status == 422
    assert untrusted.check_file(path).demuxer == "mov"


_MEASURE = textwrap.dedent("""
    import json, sys
    from examples.seedvr2.media import untrusted

    def peak():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    small, big = sys.argv[1], sys.argv[2]
    untrusted.install(10**6)
    untrusted.open_container(small).close()  # FFmpeg's own start-up, not counted
    before = peak()
    try:
        untrusted.open_container(big).close()
        said = None
    except untrusted.UntrustedMedia as exc:
        said = [str(exc), exc.status]
    print(json.dumps({"said": said, "grew": peak() - before}))
""")


@pytest.mark.parametrize("fmt", ["mp4", "matroska", "avi"])
def test_a_video_whose_frames_exceed_the_cap_is_refused_before_ffmpeg_decodes_one(tmp_path, fmt):
    codec = "mjpeg" if fmt == "avi" else "libx264"
    small = write(tmp_path / f"small.{fmt}", codec, fmt, 64, 48)
    big = write(tmp_path / f"big.{fmt}", codec, fmt, 4096, 4096, frames=1)  # a 24 MiB yuv420p frame, a 4 KiB file
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", _MEASURE, small, big], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    import json

    result = json.loads(run.stdout.strip().splitlines()[-1])
    message, status = result["said"]
    assert status == 413 and "4096x4096" in message and "--max-pixels" in message, message
    assert result["grew"] < 8 * 2**20, result  # opening it with FFmpeg first grew the peak by about 40 MB
