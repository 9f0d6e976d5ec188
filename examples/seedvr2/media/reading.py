"""Reading video and image files (PyAV), in two passes, and the names of outputs.

:func:`probe_media` decodes the whole stream once without keeping any frame, so every problem (a damaged stream, a
truncated file that decodes fewer frames than its container declares, a frame size that changes) is found before any
model runs; then :func:`iter_frames` decodes again lazily, one ``uint8 [h, w, 3]`` frame at a time, so memory does not
grow with the clip. Images (png, jpg, ...) go through the same path, since FFmpeg opens them as one-frame containers.
Writing is :mod:`.writing`, the model's working size :mod:`.geometry`.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Iterator, Optional

import numpy as np

__all__ = [
    "MediaError",
    "DecoderOutOfMemory",
    "EncoderOutOfMemory",
    "Media",
    "MediaInfo",
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "MIN_SIDE",
    "probe_media",
    "iter_frames",
    "read_media",
    "same_file",
    "default_output_path",
]

MIN_SIDE = 16
MAX_SIDE = 16384
DIVISOR = 16
#: hook for inputs from someone else (serve, ``restore --untrusted-input``): when set, opens every input in place of
#: ``av.open`` (see :mod:`.untrusted`: the container found by content, referencing demuxers refused)
INPUT_OPENER: Optional[Callable[[str], Any]] = None
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv")
_IMAGE_DEMUXERS = ("image2", "png_pipe", "jpeg_pipe", "bmp_pipe", "webp_pipe", "tiff_pipe", "jpegls_pipe")
DEFAULT_FPS = Fraction(25)
DEFAULT_CRF = 16  # H.264 constant rate factor: visually near-lossless; 0 is lossless (in YUV 4:2:0)


class MediaError(ValueError):
    """An input or output file that cannot be used; the message is one line meant for the user."""


class DecoderOutOfMemory(MemoryError):
    """FFmpeg could not allocate memory or start its decoding threads (ENOMEM / EAGAIN): the process is short of
    memory or of its address-space limit; the file itself may be fine (it is not reported as damaged)."""


class EncoderOutOfMemory(MemoryError):
    """The H.264 encoder could not start: with the settings the writer gives it (checked sizes, yuv420p, a CRF in
    range) libx264 fails to open only when it cannot allocate its buffers or start its threads (FFmpeg then says
    "Generic error in an external library"), so this is memory, not an output container that refuses the stream."""


@dataclass(frozen=True)
class MediaInfo:
    """What :func:`probe_media` found: the frames that decode, what the container declares, and what is lost.

    ``time_base`` is the video stream's (frame ``pts`` are in it; None for images); ``dropped`` names what the
    conversion to 8-bit RGB loses (an alpha channel, bits beyond 8); ``notes`` are warnings for the user (a partial
    input accepted with ``allow_partial=True``, what was dropped).
    """

    path: str
    num_frames: int
    declared_frames: Optional[int]
    height: int
    width: int
    fps: Fraction
    is_image: bool
    pixel_format: str
    time_base: Optional[Fraction]
    has_audio: bool
    dropped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    frame_pts: tuple = field(default=(), repr=False)  # each decodable frame's pts in time_base (video inputs)


@dataclass
class Media:
    """Decoded frames ``uint8 [t, h, w, 3]`` (RGB), the frame rate, and whether the source was a still image."""

    frames: np.ndarray
    fps: Fraction
    is_image: bool
    info: Optional[MediaInfo] = field(default=None, repr=False)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])


# ---- reading ------------------------------------------------------------------------------------------------------


def _open_input(path: str):
    import av

    if not os.path.exists(path):
        raise MediaError(f"input file not found: {path}")
    if os.path.isdir(path):
        raise MediaError(f"input is a directory, not a video or image file: {path}")
    if os.path.getsize(path) == 0:
        raise MediaError(f"input file is empty: {path}")
    try:
        container = av.open(path) if INPUT_OPENER is None else INPUT_OPENER(path)
    except av.FFmpegError as exc:
        _raise_if_short_of_memory(exc, f"opening {path}")
        raise MediaError(f"not a readable video or image: {path} ({_ffmpeg_reason(exc)})") from None
    if not container.streams.video:
        container.close()
        raise MediaError(f"no video stream in {path}")
    return container


def probe_media(path: str | os.PathLike, allow_partial: bool = False) -> MediaInfo:
    """Decode every frame of the first video stream of ``path`` once, keeping none, and describe the input.

    Raises :class:`MediaError` for a missing or empty file, a file FFmpeg cannot open, a file without a video stream,
    a stream that fails to decode or decodes to zero frames, a frame size that changes mid-stream, and, unless
    ``allow_partial``, a stream that decodes fewer frames than its container declares or that breaks off with a
    decoding error (a truncated or damaged file: restoring it would silently write a shorter video).
    """
    import av

    path = os.fspath(path)
    with _open_input(path) as container:
        stream = container.streams.video[0]
        declared = int(stream.frames) if stream.frames and stream.frames > 0 else None
        is_image = container.format.name in _IMAGE_DEMUXERS
        fps = _stream_fps(stream)
        has_audio = bool(container.streams.audio)
        count, size, pix_fmt, broken, pts = 0, None, "", None, []
        try:
            for frame in container.decode(stream):
                pts.append(frame.pts)
                if size is None:
                    size, pix_fmt = (frame.height, frame.width), frame.format.name
                elif (frame.height, frame.width) != size:
                    raise MediaError(
                        f"frame size changes mid-stream in {path} (frame {count} is {frame.width}x{frame.height}, "
                        f"the first was {size[1]}x{size[0]}); not supported"
                    )
                count += 1
        except av.FFmpegError as exc:
            _raise_if_short_of_memory(exc, f"decoding frame {count} of {path}")
            if count == 0:
                raise MediaError(f"cannot decode the video stream of {path} ({_ffmpeg_reason(exc)})") from None
            broken = _ffmpeg_reason(exc)
        time_base = Fraction(stream.time_base) if stream.time_base is not None and not is_image else None
    if count == 0:
        raise MediaError(f"no frames could be decoded from {path}")
    notes = []
    short = declared is not None and count < declared
    if short or broken:
        what = (f"only {count} of the {declared} frames its container declares decode" if short
                else f"decoding stops with an error after frame {count} ({broken})")
        if not allow_partial:
            raise MediaError(
                f"{path}: {what}; the file is truncated or damaged and the output would be shorter than the input. "
                f"Pass --allow-partial-input to restore the {count} frames that decode"
            )
        notes.append(f"WARNING: {path}: {what}; restoring those {count} frames (--allow-partial-input)")
    dropped = dropped_by_rgb24(pix_fmt)
    if dropped:
        notes.append(f"note: {path} is {pix_fmt}; converting to 8-bit RGB drops {' and '.join(dropped)}")
    return MediaInfo(
        path=path, num_frames=count, declared_frames=declared, height=size[0], width=size[1], fps=fps,
        is_image=is_image and count == 1, pixel_format=pix_fmt, time_base=time_base, has_audio=has_audio,
        dropped=tuple(dropped), notes=tuple(notes),
        frame_pts=tuple(pts) if time_base is not None and None not in pts else (),
    )


def dropped_by_rgb24(pix_fmt: str) -> list[str]:
    """What converting frames of pixel format ``pix_fmt`` to 8-bit RGB loses: ``"the alpha channel"``, ``"N-bit
    depth (kept 8 bits)"``; empty for 8-bit formats without alpha (and for names FFmpeg does not know)."""
    import av

    try:
        fmt = av.VideoFormat(pix_fmt)
    except (ValueError, av.FFmpegError):
        return []
    dropped = []
    if any(c.is_alpha for c in fmt.components):
        dropped.append("the alpha channel")
    bits = max((c.bits for c in fmt.components), default=8)
    if bits > 8:
        dropped.append(f"{bits}-bit depth (kept 8 bits)")
    return dropped


def iter_frames(
    info: MediaInfo, keep: Optional[Callable[[int], bool]] = None
) -> Iterator[tuple[int, Optional[np.ndarray], Optional[int]]]:
    """Decode ``info.path`` again lazily: ``(index, rgb24 uint8 [h, w, 3], pts)`` for its ``info.num_frames`` frames.

    Frames for which ``keep(index)`` is false are decoded but not converted (``None`` is yielded instead), which is
    how a rank skips the frames of batches other ranks restore. ``pts`` is in ``info.time_base`` (None for images).
    Raises :class:`MediaError` if the file now yields fewer frames than the probe counted (it changed meanwhile).
    """
    import av

    index = 0
    with _open_input(info.path) as container:
        stream = container.streams.video[0]
        try:
            for frame in container.decode(stream):
                if index >= info.num_frames:
                    break
                wanted = keep is None or keep(index)
                yield index, (frame.to_ndarray(format="rgb24") if wanted else None), (
                    None if info.time_base is None else frame.pts)
                index += 1
        except av.FFmpegError as exc:
            _raise_if_short_of_memory(exc, f"decoding frame {index} of {info.path}")
            if index < info.num_frames:
                raise MediaError(
                    f"{info.path}: decoding failed at frame {index} of {info.num_frames} ({_ffmpeg_reason(exc)})"
                ) from None
    if index < info.num_frames:
        raise MediaError(f"{info.path} changed while it was read: {index} frames decode now, {info.num_frames} before")


def read_media(path: str | os.PathLike, allow_partial: bool = False) -> Media:
    """Every frame of ``path`` (a video or an image) as RGB ``uint8 [t, h, w, 3]``; see :func:`probe_media` for the
    checks. Holds the whole clip in memory: for long videos use :func:`iter_frames`."""
    info = probe_media(path, allow_partial=allow_partial)
    frames = np.stack([frame for _, frame, _ in iter_frames(info)])
    return Media(frames=frames, fps=info.fps, is_image=info.is_image, info=info)


def _stream_fps(stream) -> Fraction:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate is not None and rate > 0:
            return Fraction(rate)
    return DEFAULT_FPS


def _ffmpeg_reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


def _raise_if_short_of_memory(exc: BaseException, doing: str) -> None:
    """Raise :class:`DecoderOutOfMemory` for an FFmpeg failure that is memory exhaustion, not a bad file."""
    if getattr(exc, "errno", None) in (errno.ENOMEM, errno.EAGAIN):
        raise DecoderOutOfMemory(f"FFmpeg could not allocate memory or start its decoder threads while {doing} "
                                 f"({_ffmpeg_reason(exc)})") from None


# ---- output paths -------------------------------------------------------------------------------------------------


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same file: equal after resolving links, or one inode (a hard link)."""
    a, b = os.fspath(a), os.fspath(b)
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def default_output_path(input_path: str | os.PathLike) -> str:
    """``<input>_restored.<ext>`` beside the input: the input's extension when it can be written (mp4/mov/mkv, png,
    jpg), else ``.mp4`` for videos and ``.png`` for other images (decided by the caller for stills)."""
    base, ext = os.path.splitext(os.fspath(input_path))
    if ext.lower() not in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS:
        ext = ".mp4"
    return f"{base}_restored{ext}"
