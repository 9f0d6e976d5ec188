"""Media from someone else: opened as data, never as a list of paths to follow.

FFmpeg picks a demuxer by probing a file's bytes and name, and some demuxers read other files the input names: HLS
playlists and ``concat`` lists open their segments (local paths and ``file:`` URLs included), ``image2`` expands a
pattern into a sequence of files. A file a client sent (or a file under ``--allow-paths`` that someone else may
write) is therefore opened only as one of the container formats the command line documents, found by its first bytes
(:func:`sniff`), with that demuxer forced (:func:`open_container`); any other content, and every referencing demuxer,
is refused by name. Special files (FIFOs, devices) are refused before they are opened for reading, so a read never
blocks on them. Image sizes are read from the file's header and checked (:data:`max_pixels`) before anything is
decoded, and a video's frame sizes from its container's headers (:mod:`.video_header`) before FFmpeg opens it (whose
open already decodes a frame of an mp4 or mkv), then again as FFmpeg reads them.

:func:`install` makes :mod:`.reading` (and the audio source :mod:`.writing` copies) open every input this way
(the server and its ranks call it at start-up; so does ``restore --untrusted-input``);
:func:`open_allowed` opens a server file once, its symlinks resolved by the open itself and the file actually opened
checked against the allowed folder, so that the server copies from that very handle.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from typing import Optional

from .video_header import frame_sizes

__all__ = ["Kind", "sniff", "sniff_file", "check_file", "open_container", "install", "open_allowed", "UntrustedMedia",
           "REFUSED_DEMUXERS", "header_size", "max_pixels"]

#: demuxers that open other files or URLs named inside the input; never used for an input, whatever its bytes
REFUSED_DEMUXERS = frozenset({"hls", "applehttp", "concat", "image2", "image2pipe", "ffmetadata", "tee", "dash",
                              "mpd", "rtsp", "sdp", "rtp", "data", "lavfi", "subfile", "imf", "smoothstreaming"})
#: pixels a frame of an input may have (set by :func:`install`; None: no cap)
max_pixels: Optional[int] = None
#: bytes read to recognise a file and its image header
HEAD_BYTES = 64 * 1024


class UntrustedMedia(ValueError):
    """An input refused before it is decoded: one line, and the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 415) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Kind:
    """A recognised container: FFmpeg's demuxer for it, the extension the server stores it under, an image or not."""

    demuxer: str
    extension: str
    is_image: bool


KINDS = {"mov": Kind("mov", ".mp4", False), "matroska": Kind("matroska", ".mkv", False),
         "avi": Kind("avi", ".avi", False), "png": Kind("png_pipe", ".png", True),
         "jpeg": Kind("jpeg_pipe", ".jpg", True), "webp": Kind("webp_pipe", ".webp", True),
         "bmp": Kind("bmp_pipe", ".bmp", True)}
#: the top-level boxes an ISO base media file (mp4, mov) may start with
_ISO_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot")
ACCEPTED = "mp4, mov, mkv, webm, avi, png, jpg, webp or bmp"


def sniff(head: bytes) -> Optional[Kind]:
    """The container ``head`` (a file's first bytes) starts, or None when it is none of :data:`KINDS`."""
    if len(head) >= 8 and head[4:8] in _ISO_BOXES:
        return KINDS["mov"]
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return KINDS["matroska"]
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return KINDS["avi"]
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return KINDS["webp"]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return KINDS["png"]
    if head.startswith(b"\xff\xd8\xff"):
        return KINDS["jpeg"]
    if head.startswith(b"BM") and len(head) >= 26:
        return KINDS["bmp"]
    return None


def header_size(kind: Kind, head: bytes) -> Optional[tuple[int, int]]:
    """An image's ``(width, height)`` read from its header bytes (None when the header does not say it here)."""
    try:
        if kind.demuxer == "png_pipe" and head[12:16] == b"IHDR":
            return struct.unpack(">II", head[16:24])
        if kind.demuxer == "bmp_pipe":
            width, height = struct.unpack("<ii", head[18:26])
            return abs(width), abs(height)
        if kind.demuxer == "webp_pipe":
            chunk = head[12:16]
            if chunk == b"VP8X":
                return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
            if chunk == b"VP8L":
                bits = int.from_bytes(head[21:25], "little")
                return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
            if chunk == b"VP8 ":
                width, height = struct.unpack("<HH", head[26:30])
                return width & 0x3FFF, height & 0x3FFF
        if kind.demuxer == "jpeg_pipe":
            return _jpeg_size(head)
    except struct.error:
        return None
    return None


def _jpeg_size(head: bytes) -> Optional[tuple[int, int]]:
    at = 2
    while at + 9 < len(head):
        if head[at] != 0xFF:
            return None
        marker = head[at + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            at += 2
            continue
        length = struct.unpack(">H", head[at + 2:at + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", head[at + 5:at + 9])
            return width, height
        at += 2 + length
    return None


def _check_pixels(width: int, height: int, name: str) -> None:
    if max_pixels is not None and width * height > max_pixels:
        raise UntrustedMedia(f"{name} is {width}x{height} ({width * height} pixels a frame); this server decodes at "
                             f"most {max_pixels} (--max-pixels)", status=413)


def _regular_fd(path: str) -> int:
    """``path`` opened for reading without blocking on a FIFO or device; :class:`UntrustedMedia` unless it is a
    regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UntrustedMedia(f"{path} is not a regular file (a FIFO, a device or a socket)", status=422)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sniff_file(path: str, name: Optional[str] = None) -> tuple[Kind, bytes]:
    """The :class:`Kind` of the regular file ``path`` (called ``name`` in messages) and its first bytes;
    :class:`UntrustedMedia` otherwise."""
    try:
        fd = _regular_fd(path)
    except FileNotFoundError:
        raise UntrustedMedia(f"input file not found: {name or path}", status=422) from None
    try:
        head = os.pread(fd, HEAD_BYTES, 0)
    finally:
        os.close(fd)
    kind = sniff(head)
    if kind is None:
        what = "a playlist or list of files" if head.lstrip().startswith((b"#EXTM3U", b"ffconcat", b"file ")) else \
            "not a video or image this server reads"
        raise UntrustedMedia(f"{name or path} is {what}: by its content it must be {ACCEPTED}")
    return kind, head


def check_file(path: str, name: Optional[str] = None) -> Kind:
    """The :class:`Kind` of ``path`` (called ``name`` in messages) after the checks that need no decoding: a regular
    file, a known container by its bytes, an image's size from its header, a video's frame sizes from its container's
    headers, within :data:`max_pixels`;
    :class:`UntrustedMedia` otherwise."""
    name = name or path
    kind, head = sniff_file(path, name)
    if kind.is_image:
        size = header_size(kind, head)
        if size is None:
            raise UntrustedMedia(f"{name}: its image header does not say its size", status=422)
        _check_pixels(*size, name)
    elif max_pixels is not None:
        fd = _regular_fd(path)
        try:
            sizes = frame_sizes(fd, kind.demuxer)
        finally:
            os.close(fd)
        if sizes is None:
            raise UntrustedMedia(f"{name}: its container's headers do not say its frame size where the format puts "
                                 f"them (cut short, or not a {kind.extension[1:]} file)", status=422)
        for width, height in sizes:
            _check_pixels(width, height, name)
    return kind


def open_container(path: str):
    """``path`` opened by PyAV as the container its bytes say, with that demuxer forced (never a referencing one),
    after the header checks; the container, or :class:`UntrustedMedia`."""
    import av

    kind = check_file(path)
    container = av.open(path, format=kind.demuxer, options={"enable_drefs": "0", "protocol_whitelist": "file"})
    try:
        if container.format.name in REFUSED_DEMUXERS:  # never: the demuxer is forced; checked all the same
            raise UntrustedMedia(f"{path}: the {container.format.name} demuxer is refused")
        for stream in container.streams.video:
            _check_pixels(stream.codec_context.width, stream.codec_context.height, path)
    except BaseException:
        container.close()
        raise
    return container


def _opener(path: str):
    from .reading import MediaError

    try:
        return open_container(path)
    except UntrustedMedia as exc:
        raise MediaError(str(exc)) from None


def install(pixels: Optional[int] = None) -> None:
    """Make :mod:`.reading` open every input with :func:`open_container` (in this process), decoding at most
    ``pixels`` a frame."""
    global max_pixels
    from . import reading

    max_pixels = pixels
    reading.INPUT_OPENER = _opener


def open_allowed(root: str, relative: str) -> tuple[int, str]:
    """The file ``relative`` under the folder ``root`` opened once for reading: its descriptor and its real path.

    The open itself resolves the symlinks; the file it opened (``/proc/self/fd``) must lie under ``root``'s real path
    and be a regular file (a FIFO is opened without blocking and refused). Read the content from the descriptor:
    replacing the path afterwards changes nothing. :class:`UntrustedMedia` (403, 404 or 422) otherwise.
    """
    if "\0" in relative:
        raise UntrustedMedia("the path holds a NUL character", status=400)
    base = os.path.realpath(root)
    outside = UntrustedMedia(f"{relative} is outside the folder this server may read (--allow-paths)", status=403)
    if os.path.commonpath([base, os.path.realpath(os.path.join(base, relative))]) != base:
        raise outside  # said before the open (which would tell whether such a file exists)
    try:
        fd = os.open(os.path.join(base, relative), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UntrustedMedia(f"input file not found: {relative}", status=422) from None
    except OSError as exc:
        raise UntrustedMedia(f"cannot open {relative}: {exc.strerror or exc}", status=422) from None
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.commonpath([base, real]) != base:  # a link swapped in since: what was opened counts
            raise outside
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UntrustedMedia(f"{relative} is not a regular file (a folder, a FIFO, a device or a socket)",
                                 status=422)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, real
