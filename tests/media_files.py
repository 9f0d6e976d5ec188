"""Test input files made with PyAV: a clip with an AAC audio track, and the first half of a faststart mp4."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np

__all__ = ["write_clip_with_audio", "write_truncated_faststart"]


def write_clip_with_audio(path, frames: np.ndarray, fps: Fraction = Fraction(24)) -> str:
    """H.264 video of ``frames`` (uint8 [t, h, w, 3]) plus a mono AAC tone as long as the video, muxed together."""
    t, h, w = frames.shape[:3]
    with av.open(str(path), "w") as c:
        video = c.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = w, h, "yuv420p"
        audio = c.add_stream("aac", rate=8000)
        for frame in frames:
            c.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        n = int(8000 * t / fps)
        samples = (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / 8000)).astype(np.float32)[None]
        for k in range(0, n, 1024):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, k:k + 1024]), format="fltp",
                                               layout="mono")
            chunk.sample_rate, chunk.pts = 8000, k
            c.mux(audio.encode(chunk))
        c.mux(audio.encode(None))
        c.mux(video.encode(None))
    return str(path)


def write_truncated_faststart(path, frames: np.ndarray, fps: int = 24) -> str:
    """The first half of a faststart mp4 of ``frames``: its container still declares every frame, fewer decode.
    Short GOPs without B-frames, so the frames before the cut still decode."""
    full = f"{path}.full.mp4"
    with av.open(full, "w", options={"movflags": "faststart"}) as c:
        s = c.add_stream("libx264", rate=fps)
        s.height, s.width, s.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        s.options = {"g": "4", "bf": "0"}
        for frame in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        c.mux(s.encode(None))
    with open(full, "rb") as f:
        data = f.read()
    import os

    os.remove(full)
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    return str(path)
