"""Writing video and image files without losing data: :class:`MediaWriter` encodes frames as they come, keeps the
input's frame timing, copies the input's audio packets untouched, and appears under its name only when complete
(:func:`atomic_output`: a temporary file, removed on a stop, published without replacing anything).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
import threading
from fractions import Fraction
from typing import Iterator, Optional

import numpy as np

from . import reading
from .launch_record import record_partial
from .reading import (
    DEFAULT_CRF,
    DEFAULT_FPS,
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    EncoderOutOfMemory,
    MediaError,
    _ffmpeg_reason,
)

__all__ = [
    "MediaWriter",
    "write_media",
    "h264_frame_size",
    "atomic_output",
    "check_output_directory",
    "remove_partial_outputs",
    "output_kind",
]

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


class OutputTaken(MediaError):
    """The output appeared while this run worked on it (another run, or a file created there): it was kept, and this
    run's output was not written."""


def publish_no_replace(tmp: str, path: str) -> None:
    """Move ``tmp`` to ``path`` atomically unless ``path`` exists; :class:`MediaError` naming ``path`` if it does.

    ``renameat2(RENAME_NOREPLACE)`` where the kernel and file system have it (Linux 3.15+, most local file systems);
    else a hard link (refused by the kernel when the name exists) and the temporary name removed; else (a file system
    without hard links) the name claimed with ``O_EXCL`` and then replaced, which keeps every file that existed
    before the claim."""
    taken = OutputTaken(f"the output {path} appeared while this run was working on it (another run writing the same "
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
            opener = reading.INPUT_OPENER
            source = self._stack.enter_context(
                av.open(self.audio_from) if opener is None else opener(self.audio_from))
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
