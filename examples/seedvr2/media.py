"""Video and image files in and out (PyAV), and the geometry that turns an input into the model's working size.

Reading is two passes: :func:`probe_media` decodes the whole stream once without keeping any frame, so every problem
(a damaged stream, a truncated file that decodes fewer frames than its container declares, a frame size that changes)
is found before any model runs; then :func:`iter_frames` decodes again lazily, one ``uint8 [h, w, 3]`` frame at a
time, so memory does not grow with the clip. :class:`MediaWriter` encodes frames as they come, keeps the input's frame
timing, copies the input's audio packets untouched, and appears under its name only when complete. Images (png, jpg,
...) go through the same path, since FFmpeg opens them as one-frame containers.

Geometry ("exactly the requested size"). The user asks for an output size ``(H, W)`` (``--resolution WxH``, or
``--scale S`` = the input size times ``S``, rounded). The model needs sides that are multiples of 16, so:

1. the input is resized (bicubic, antialiased, as the reference) with its aspect ratio kept so that it *covers*
   ``H x W`` (when the aspect ratios agree this is the reference's "area" resize to ``H * W`` pixels), and the excess
   is centre-cropped away, giving exactly ``H x W``;
2. that frame is centre-cropped to the largest multiple of 16 on each side (the reference's divisible crop): the
   *working size* at which the VAE and DiT run;
3. the restored result is resized back to exactly ``H x W``. When ``H`` and ``W`` are already multiples of 16 (the
   common case: 720p, 1080p width, ...) steps 2 and 3 do nothing.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .launcher import record_partial

__all__ = [
    "MediaError",
    "DecoderOutOfMemory",
    "EncoderOutOfMemory",
    "Media",
    "MediaInfo",
    "MediaWriter",
    "Geometry",
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "MIN_SIDE",
    "probe_media",
    "iter_frames",
    "read_media",
    "write_media",
    "h264_frame_size",
    "same_file",
    "default_output_path",
    "atomic_output",
    "check_output_directory",
    "remove_partial_outputs",
    "check_scale",
    "output_kind",
    "parse_resolution",
    "plan_geometry",
    "resize_frames",
    "center_crop",
    "frames_to_model",
    "model_to_frames",
]

MIN_SIDE = 16
MAX_SIDE = 16384
DIVISOR = 16
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
        container = av.open(path)
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


# ---- writing ------------------------------------------------------------------------------------------------------


# Every temporary file atomic_output has open, so that a signal handler (on another thread) can remove them; the lock
# orders that removal against a file's creation and its final rename, and once closed no new one is created.
_PARTIALS_LOCK = threading.Lock()
_PARTIALS: set = set()
_PARTIALS_CLOSED = [False]


def _partial_name(path: str) -> tuple[str, str, str]:
    """(directory, prefix, suffix) of the temporary files beside ``path``: ``.<name>.<random>.partial<ext>``."""
    directory = os.path.dirname(os.path.abspath(path))
    base, ext = os.path.splitext(os.path.basename(path))
    return directory, f".{base}.", f".partial{ext}"


def check_output_directory(path: str | os.PathLike) -> None:
    """:class:`MediaError` unless a file can be created beside ``path``: its directory exists and accepts a new file
    (tried for real, since a read-only mount, ``chattr +i``, /proc or /sys refuse even root, whatever the mode bits
    say). Meant to run before anything is read or loaded."""
    path = os.fspath(path)
    directory, prefix, suffix = _partial_name(path)
    if not os.path.isdir(directory):
        raise MediaError(f"output directory does not exist: {directory}")
    try:
        fd, probe = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    except OSError as exc:
        raise MediaError(f"cannot write to the output directory {directory} ({_why_not_writable(exc)}); choose "
                         f"another -o") from None
    os.close(fd)
    record_partial(probe)
    with contextlib.suppress(OSError):
        os.remove(probe)


def _why_not_writable(exc: OSError) -> str:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):  # what /proc answers: the directory exists but takes no files
        return "it does not take new files"
    return exc.strerror or str(exc)


def remove_partial_outputs() -> list[str]:
    """Remove every temporary output file :func:`atomic_output` has open and refuse new ones from now on (for a
    process about to exit on a signal); returns the paths removed."""
    with _PARTIALS_LOCK:
        _PARTIALS_CLOSED[0] = True
        removed = []
        for tmp in sorted(_PARTIALS):
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
                removed.append(tmp)
        _PARTIALS.clear()
    return removed


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary path next to ``path`` (same extension); on success publish it as ``path``, else delete it.

    So a failed or interrupted run never leaves a partial output file under the requested name (and
    :func:`remove_partial_outputs` removes it when the process is stopped by a signal). Without ``overwrite`` the
    file is published without replacing anything (see :func:`publish_no_replace`): a file that appeared at ``path``
    meanwhile (another run's output, a file the user made) is kept and this one is refused with a
    :class:`MediaError` naming the path.
    """
    path = os.fspath(path)
    directory, prefix, suffix = _partial_name(path)
    if not os.path.isdir(directory):
        raise MediaError(f"output directory does not exist: {directory}")
    with _PARTIALS_LOCK:
        if _PARTIALS_CLOSED[0]:
            raise MediaError(f"not writing {path}: the process is stopping")
        try:
            fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
        except OSError as exc:
            raise MediaError(f"cannot write to the output directory {directory} ({_why_not_writable(exc)})") from None
        os.close(fd)
        _PARTIALS.add(tmp)
        record_partial(tmp)  # under --ranks: the launcher removes it should this process be killed
    try:
        yield tmp
        with _PARTIALS_LOCK:
            if tmp not in _PARTIALS:
                raise MediaError(f"not writing {path}: the process is stopping")
            os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp makes 0600; give the file the usual permissions
            if overwrite:
                os.replace(tmp, path)
            else:
                publish_no_replace(tmp, path)
            _PARTIALS.discard(tmp)
    except BaseException:
        with _PARTIALS_LOCK:
            _PARTIALS.discard(tmp)
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        raise


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2 = []  # the libc function, looked up once ([None] where there is none)


def _libc_renameat2():
    if not _renameat2:
        function = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                function = ctypes.CDLL(None, use_errno=True).renameat2
                function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            except (OSError, AttributeError):  # no libc symbol (glibc < 2.28, musl)
                function = None
        _renameat2.append(function)
    return _renameat2[0]


def publish_no_replace(tmp: str, path: str) -> None:
    """Move ``tmp`` to ``path`` atomically unless ``path`` exists; :class:`MediaError` naming ``path`` if it does.

    ``renameat2(RENAME_NOREPLACE)`` where the kernel and file system have it (Linux 3.15+, most local file systems);
    else a hard link (refused by the kernel when the name exists) and the temporary name removed; else (a file system
    without hard links) the name claimed with ``O_EXCL`` and then replaced, which keeps every file that existed
    before the claim."""
    taken = MediaError(f"the output {path} appeared while this run was working on it (another run writing the same "
                       f"-o, or a file created there meanwhile); it was kept, and this run's output was not written: "
                       f"pass --overwrite to replace it, or choose another -o")
    renameat2 = _libc_renameat2()
    if renameat2 is not None:
        import ctypes

        if renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(path), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise taken
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            raise OSError(code, os.strerror(code), path)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise taken from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
    else:
        os.remove(tmp)
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        raise taken from None
    os.replace(tmp, path)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def output_kind(path: str | os.PathLike) -> str:
    """``"image"`` or ``"video"`` from the output file's extension; :class:`MediaError` for anything else."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext in IMAGE_EXTENSIONS:
        return "image"
    if ext in VIDEO_EXTENSIONS:
        return "video"
    known = ", ".join(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)
    raise MediaError(f"unsupported output extension {ext or '(none)'!r} for {os.fspath(path)}; use one of {known}")


def h264_frame_size(height: int, width: int) -> tuple[int, int]:
    """The size H.264 frames are written at: yuv420p (what common players accept) needs even sides, so an odd side
    gets one more row/column, a copy of the edge."""
    return height + height % 2, width + width % 2


def _pad_to(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    extra_h, extra_w = size[0] - frame.shape[0], size[1] - frame.shape[1]
    if extra_h == 0 and extra_w == 0:
        return frame
    return np.pad(frame, ((0, extra_h), (0, extra_w), (0, 0)), mode="edge")


class MediaWriter:
    """Writes RGB ``uint8 [h, w, 3]`` frames to ``path`` one at a time; use as a context manager.

    Video (.mp4/.mov/.mkv): H.264 yuv420p (odd sides padded by one edge row/column, see :func:`h264_frame_size`);
    frames keep the ``pts`` they are given in ``time_base`` (the input's timing), or are spaced ``1/fps`` apart; the
    audio streams of ``audio_from`` are copied packet by packet, untouched and interleaved by time. Image (.png/.jpg):
    exactly one frame. The file appears under ``path`` only when the block ends without an exception, and only if
    nothing appeared there meanwhile unless ``overwrite`` (see :func:`atomic_output`). ``crf`` is the H.264 quality
    (0 lossless, default 16). A write that fails (a full disk, an I/O error) is a :class:`MediaError` naming the
    path, and the temporary file is removed.
    """

    def __init__(self, path: str | os.PathLike, height: int, width: int, fps: Fraction = DEFAULT_FPS, *,
                 time_base: Optional[Fraction] = None, audio_from: Optional[str] = None, crf: int = DEFAULT_CRF,
                 overwrite: bool = False) -> None:
        if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= 51:
            raise MediaError(f"--crf must be an integer from 0 (lossless) to 51, got {crf!r}")
        self.crf, self.overwrite = crf, overwrite
        self.path, self.kind = os.fspath(path), output_kind(path)
        self.size = (int(height), int(width))
        self.fps, self.time_base, self.audio_from = Fraction(fps), time_base, audio_from
        self.frames_written = 0
        self.coded_size = h264_frame_size(*self.size) if self.kind == "video" else self.size
        self._stack = contextlib.ExitStack()
        self._image: Optional[np.ndarray] = None
        self._audio: list = []  # (output stream, packet iterator, next packet) per copied audio stream

    def __enter__(self) -> "MediaWriter":
        tmp = self._stack.enter_context(atomic_output(self.path, overwrite=self.overwrite))
        self.partial_path = tmp  # resume hook (issue 48): the kept batches name it, so a resumed run removes it
        try:
            with self._write_errors():
                if self.kind == "video":
                    self._open_video(tmp)
                else:
                    self._tmp = tmp
        except BaseException:
            self._stack.__exit__(*_exc_info())
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            with self._write_errors():
                if exc_type is None:
                    self._finish()
                return bool(self._stack.__exit__(exc_type, exc, tb))  # closing the container flushes: may fail too
        except BaseException:
            self._stack.__exit__(*_exc_info())
            raise

    @contextlib.contextmanager
    def _write_errors(self):
        """A failed write (PyAV's ``OSError`` on a full disk, any I/O error) as one :class:`MediaError`."""
        try:
            yield
        except MediaError:
            raise
        except OSError as exc:  # PyAV's errors of the file system are OSErrors too
            raise MediaError(f"cannot write {self.path}: {exc.strerror or _ffmpeg_reason(exc)}") from None

    # ---- video ----
    def _open_video(self, tmp: str) -> None:
        import av

        container = self._stack.enter_context(av.open(tmp, "w"))
        self._container = container
        stream = container.add_stream("libx264", rate=self.fps.limit_denominator(1_000_000))
        stream.height, stream.width = self.coded_size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(self.crf), "preset": "medium"}
        if self.time_base is not None:
            stream.codec_context.time_base = self.time_base
        self._video = stream
        if self.audio_from is not None:
            source = self._stack.enter_context(av.open(self.audio_from))
            for in_stream in source.streams.audio:
                out_stream = container.add_stream_from_template(in_stream)
                self._audio.append([out_stream, in_stream, None])
            if self._audio:
                packets = source.demux([entry[1] for entry in self._audio])
                self._audio_packets = (p for p in packets if p.dts is not None)
        self._open_encoder(stream)
        try:
            container.start_encoding()
        except (av.FFmpegError, ValueError) as exc:
            codecs = ", ".join(entry[1].codec_context.name for entry in self._audio) or "none"
            raise MediaError(
                f"cannot write {self.path}: the container refuses a stream (input audio: {codecs}) "
                f"({_ffmpeg_reason(exc)}); try a .mkv output"
            ) from None

    def _open_encoder(self, stream) -> None:
        """Open the H.264 encoder before the container writes its header, so that an encoder that cannot start (short
        of memory, see :class:`EncoderOutOfMemory`) is not taken for a container that refuses a stream."""
        import av

        try:
            stream.codec_context.open()
        except av.FFmpegError as exc:
            if isinstance(exc, av.ExternalError) or getattr(exc, "errno", None) in (errno.ENOMEM, errno.EAGAIN):
                height, width = self.coded_size
                raise EncoderOutOfMemory(f"the H.264 encoder could not allocate its buffers or start its threads for "
                                         f"{width}x{height} ({_ffmpeg_reason(exc)})") from None
            raise MediaError(f"cannot write {self.path}: the H.264 encoder refuses its settings "
                             f"({_ffmpeg_reason(exc)})") from None

    def _mux_video(self, packets) -> None:
        for packet in packets:
            if packet.pts is not None and packet.time_base is not None:
                self._mux_audio_until(packet.pts * packet.time_base)
            self._container.mux(packet)

    def _mux_audio_until(self, seconds: Optional[Fraction]) -> None:
        """Copy audio packets up to ``seconds`` (all that remain for None), so audio and video stay interleaved."""
        if not self._audio:
            return
        for packet in self._audio_packets:
            out = next(e[0] for e in self._audio if e[1] is packet.stream)
            stamp = packet.pts * packet.time_base if packet.pts is not None else None
            packet.stream = out
            self._container.mux(packet)
            if seconds is not None and stamp is not None and stamp >= seconds:
                return

    def write(self, frame: np.ndarray, pts: Optional[int] = None) -> None:
        """Append one frame (``uint8 [h, w, 3]`` at the writer's size); ``pts`` in ``time_base`` when one was given."""
        frame = np.asarray(frame)
        if frame.dtype != np.uint8 or frame.shape != self.size + (3,):
            raise ValueError(f"frames must be uint8 {list(self.size + (3,))}, got {frame.dtype} {list(frame.shape)}")
        with self._write_errors():
            self._write(frame, pts)
        self.frames_written += 1

    def _write(self, frame: np.ndarray, pts: Optional[int]) -> None:
        if self.kind == "image":
            if self._image is not None:
                raise MediaError(f"cannot write more than one frame to the image file {self.path}; use a video "
                                 f"extension (.mp4)")
            self._image = frame
        else:
            import av

            video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(_pad_to(frame, self.coded_size)),
                                                     format="rgb24")
            if pts is not None and self.time_base is not None:
                video_frame.pts, video_frame.time_base = int(pts), self.time_base
            self._mux_video(self._video.encode(video_frame))

    def _finish(self) -> None:
        if self.kind == "image":
            if self._image is None:
                raise MediaError(f"no frame was written to {self.path}")
            _write_image(self._tmp, self._image)
        else:
            self._mux_video(self._video.encode(None))
            self._mux_audio_until(None)


def _exc_info():
    import sys

    return sys.exc_info()


def write_media(path: str | os.PathLike, frames: np.ndarray, fps: Fraction = DEFAULT_FPS, *,
                overwrite: bool = False) -> None:
    """Write ``uint8 [t, h, w, 3]`` frames: H.264 (libx264, yuv420p) for .mp4/.mov/.mkv, PNG or JPEG for one frame.

    The file appears atomically, without replacing a file already there unless ``overwrite`` (see
    :func:`atomic_output`); odd sides are padded by one edge row/column for H.264
    (see :func:`h264_frame_size`).
    """
    frames = _check_frames(frames)
    kind = output_kind(path)
    if kind == "image" and frames.shape[0] != 1:
        raise MediaError(
            f"cannot write {frames.shape[0]} frames to the image file {os.fspath(path)}; use a video extension (.mp4)"
        )
    with MediaWriter(path, frames.shape[1], frames.shape[2], fps, overwrite=overwrite) as writer:
        for frame in frames:
            writer.write(frame)


def _check_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must be uint8 [t>=1, h, w, 3], got {frames.dtype} {list(frames.shape)}")
    return np.ascontiguousarray(frames)


def _write_image(path: str, frame: np.ndarray) -> None:
    import av

    ext = os.path.splitext(path)[1].lower()
    codec, pix_fmt = ("png", "rgb24") if ext == ".png" else ("mjpeg", "yuvj444p")
    with av.open(path, "w", format="image2", options={"update": "1"}) as container:
        stream = container.add_stream(codec)
        stream.width, stream.height, stream.pix_fmt = frame.shape[1], frame.shape[0], pix_fmt
        container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))


# ---- geometry -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """How an ``input`` (h, w) becomes the ``work`` size the model sees and the exact ``output`` size written."""

    input: tuple[int, int]
    resized: tuple[int, int]  # after the aspect-keeping resize that covers the output size
    output: tuple[int, int]  # exactly what the user asked for
    work: tuple[int, int]  # output centre-cropped to multiples of 16


def parse_resolution(text: str) -> tuple[int, int]:
    """``"WxH"`` -> ``(H, W)``: two whole numbers joined by an ``x``; :class:`MediaError` for anything else (a ``*``
    or ``:`` between them, a sign, a fraction), so that a mistyped size is never read as another one."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if match is None:
        raise MediaError(f"--resolution must look like WIDTHxHEIGHT (e.g. 1280x720), got {text!r}")
    return int(match.group(2)), int(match.group(1))


def check_scale(scale) -> float:
    """``scale`` if it is a positive finite number (what ``--scale`` may be before any input is seen), else
    :class:`MediaError`. Whether the output it gives is allowed depends on the input (:func:`plan_geometry`)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise MediaError(f"--scale must be a positive finite number, got {scale!r}")
    return float(scale)


def plan_geometry(
    input_hw: tuple[int, int], resolution: tuple[int, int] | None = None, scale: float | None = None
) -> Geometry:
    """Plan the resize/crop for an input of ``input_hw``; ``resolution`` is ``(H, W)``; neither means scale 1.

    Raises :class:`MediaError` for a scale that is not a positive finite number, or an output side under 16 or
    over 16384 pixels.
    """
    if resolution is not None and scale is not None:
        raise MediaError("give either --resolution or --scale, not both")
    in_h, in_w = (int(v) for v in input_hw)
    if resolution is None:
        scale = 1.0 if scale is None else check_scale(scale)
        out_h, out_w = round(in_h * scale), round(in_w * scale)
    else:
        out_h, out_w = (int(v) for v in resolution)
    for name, side in (("height", out_h), ("width", out_w)):
        if side < MIN_SIDE:
            hint = ""
            if resolution is None:  # the size follows the input: say how much to scale it up
                needed = MIN_SIDE / min(in_h, in_w)
                hint = (f"; the input is {in_w}x{in_h}: use --scale {math.ceil(needed * 100) / 100:g} or more to "
                        f"upscale it (or --resolution WxH)")
            raise MediaError(f"output {name} {side} is under the minimum of {MIN_SIDE} pixels{hint}")
        if side > MAX_SIDE:
            hint = ""
            if resolution is None:
                allowed = math.floor(MAX_SIDE / max(in_h, in_w) * 100) / 100
                hint = f"; the input is {in_w}x{in_h}: use --scale {allowed:g} or less (or --resolution WxH)"
            raise MediaError(f"output {name} {side} is over the maximum of {MAX_SIDE} pixels{hint}")
    cover = max(out_h / in_h, out_w / in_w)
    resized = (max(out_h, round(in_h * cover)), max(out_w, round(in_w * cover)))
    work = (out_h - out_h % DIVISOR, out_w - out_w % DIVISOR)
    return Geometry(input=(in_h, in_w), resized=resized, output=(out_h, out_w), work=work)


def resize_frames(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic, antialiased resize of ``[..., h, w]`` float frames to ``size`` (the reference's area resize filter)."""
    size = (int(size[0]), int(size[1]))
    if tuple(video.shape[-2:]) == size:
        return video
    lead = video.shape[:-2]
    flat = video.reshape((-1, 1) + tuple(video.shape[-2:]))
    out = F.interpolate(flat, size=size, mode="bicubic", align_corners=False, antialias=True)
    return out.reshape(lead + size)


def center_crop(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Crop ``[..., h, w]`` to ``size`` around the centre (offsets rounded as torchvision's centre crop rounds)."""
    h, w = video.shape[-2:]
    ch, cw = int(size[0]), int(size[1])
    if ch > h or cw > w:
        raise ValueError(f"cannot centre-crop {h}x{w} to a larger {ch}x{cw}")
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return video[..., top : top + ch, left : left + cw]


def frames_to_model(frames: np.ndarray | torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """``uint8 [t, h, w, 3]`` -> float32 ``[3, t, H', W']`` in [-1, 1] at the working size (resize, clamp, crops)."""
    video = torch.as_tensor(np.asarray(frames)).permute(3, 0, 1, 2).float().div(255.0)  # [3, t, h, w] in [0, 1]
    video = resize_frames(video, geometry.resized).clamp(0.0, 1.0)
    video = center_crop(center_crop(video, geometry.output), geometry.work)
    return video.mul(2.0).sub(1.0)


def model_to_frames(video: torch.Tensor, geometry: Geometry) -> np.ndarray:
    """Float ``[3, t, H', W']`` in [-1, 1] at the working size -> ``uint8 [t, H, W, 3]`` at the output size."""
    video = resize_frames(video.float(), geometry.output)
    video = video.clamp(-1.0, 1.0).mul(0.5).add(0.5).mul(255.0).round()
    return video.to(torch.uint8).permute(1, 2, 3, 0).contiguous().numpy()
