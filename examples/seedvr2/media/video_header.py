"""A video's frame sizes read from its container's own headers, before FFmpeg opens it.

Opening an mp4 or mkv of H.264 with FFmpeg (``avformat_find_stream_info``, which PyAV's ``av.open`` always runs)
already decodes a frame to learn the stream's parameters, with any ``probesize`` / ``analyzeduration``: a frame of the
size the file says is allocated before any size check after the open could refuse it. So :func:`frame_sizes` reads
the sizes the headers declare, from the file's bytes alone:

- mp4 / mov: each track's ``tkhd`` width and height and its ``stsd`` visual sample entries' (``moov`` found by
  walking the top-level boxes, wherever it lies);
- mkv / webm: each ``TrackEntry``'s ``Video`` ``PixelWidth`` and ``PixelHeight``;
- avi: the main header's ``avih`` width and height and each video stream's ``strf`` (``BITMAPINFOHEADER``).

The walk reads box and element headers only (a bounded number of them), never the media data.
"""

from __future__ import annotations

import os
import struct
from typing import Callable, Iterator, Optional

__all__ = ["frame_sizes"]

#: box / element headers read at most for one file (a hostile file cannot make the walk long)
MAX_ITEMS = 20000
#: bytes read at most of one leaf header (tkhd, stsd, avih, strf, a Video element)
MAX_LEAF = 64 * 1024

_Read = Callable[[int, int], bytes]


def frame_sizes(fd: int, demuxer: str) -> Optional[list[tuple[int, int]]]:
    """The ``(width, height)`` every video header of the file open as ``fd`` declares (``demuxer``: ``mov``,
    ``matroska`` or ``avi``); None when its headers could not be read (truncated, or not where the format puts them),
    an empty list when they declare no video."""
    size = os.fstat(fd).st_size
    count = [0]

    def read(at: int, n: int) -> bytes:
        count[0] += 1
        if count[0] > MAX_ITEMS:
            raise _Unreadable
        return os.pread(fd, max(0, min(n, size - at)), at) if 0 <= at < size else b""

    walk = {"mov": _mov, "matroska": _matroska, "avi": _avi}.get(demuxer)
    if walk is None:
        return None
    try:
        return walk(read, size)
    except (_Unreadable, struct.error, IndexError, ValueError):
        return None


class _Unreadable(Exception):
    """Headers cut short or too many of them."""


# ---- mp4 / mov: ISO base media boxes --------------------------------------------------------------------------------

def _boxes(read: _Read, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """``(type, body start, body end)`` of the boxes between ``start`` and ``end``."""
    at = start
    while at + 8 <= end:
        head = read(at, 16)
        if len(head) < 8:
            raise _Unreadable
        length, kind = struct.unpack(">I4s", head[:8])
        body = at + 8
        if length == 1:
            length, body = struct.unpack(">Q", head[8:16])[0], at + 16
        elif length == 0:
            length = end - at
        if length < body - at or at + length > end:
            raise _Unreadable
        yield kind, body, at + length
        at += length


def _child(read: _Read, start: int, end: int, kind: bytes) -> Optional[tuple[int, int]]:
    return next(((s, e) for k, s, e in _boxes(read, start, end) if k == kind), None)


def _mov(read: _Read, size: int) -> Optional[list[tuple[int, int]]]:
    moov = _child(read, 0, size, b"moov")
    if moov is None:
        return None
    sizes = []
    for kind, start, end in _boxes(read, *moov):
        if kind != b"trak":
            continue
        mdia = _child(read, start, end, b"mdia")
        hdlr = _child(read, *mdia, b"hdlr") if mdia else None
        if hdlr is None or read(hdlr[0] + 8, 4) != b"vide":
            continue
        tkhd = _child(read, start, end, b"tkhd")
        if tkhd is not None:
            body = read(tkhd[0], min(tkhd[1] - tkhd[0], MAX_LEAF))
            at = 4 + (32 if body[0] == 1 else 20) + 8 + 8 + 36  # version, times and ids, reserved ... matrix
            width, height = struct.unpack(">II", body[at:at + 8])
            sizes.append((width >> 16, height >> 16))
        where = mdia
        for name in (b"minf", b"stbl", b"stsd"):
            where = _child(read, *where, name) if where else None
        if where is not None:
            for _, entry, _end in _boxes(read, where[0] + 8, where[1]):  # after version, flags and entry_count
                width, height = struct.unpack(">HH", read(entry + 24, 4))  # a VisualSampleEntry's
                sizes.append((width, height))
    return sizes


# ---- mkv / webm: EBML elements --------------------------------------------------------------------------------------

_SEGMENT, _TRACKS, _TRACK_ENTRY, _VIDEO, _CLUSTER = 0x18538067, 0x1654AE6B, 0xAE, 0xE0, 0x1F43B675
_PIXEL_WIDTH, _PIXEL_HEIGHT = 0xB0, 0xBA


def _vint(data: bytes, at: int, keep_marker: bool) -> tuple[int, int, bool]:
    """(value, length, all value bits set: an unknown size) of the EBML variable-length integer at ``at``."""
    first = data[at]
    if first == 0:
        raise _Unreadable
    length = 9 - first.bit_length()
    value = first if keep_marker else first & (0xFF >> length)
    for byte in data[at + 1:at + length]:
        value = (value << 8) | byte
    if at + length > len(data):
        raise _Unreadable
    unknown = not keep_marker and value == (1 << (7 * length)) - 1
    return value, length, unknown


def _elements(read: _Read, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(id, data start, data end)`` of the elements between ``start`` and ``end`` (an unknown size runs to
    ``end``)."""
    at = start
    while at < end:
        head = read(at, 12)
        ident, n, _ = _vint(head, 0, True)
        length, m, unknown = _vint(head, n, False)
        body = at + n + m
        stop = end if unknown else body + length
        if stop > end:
            raise _Unreadable
        yield ident, body, stop
        at = stop


def _matroska(read: _Read, size: int) -> Optional[list[tuple[int, int]]]:
    segment = next(((s, e) for i, s, e in _elements(read, 0, size) if i == _SEGMENT), None)
    if segment is None:
        return None
    for ident, start, end in _elements(read, *segment):
        if ident == _CLUSTER:  # media before the tracks: not where the format puts them
            return None
        if ident != _TRACKS:
            continue
        sizes = []
        for entry, e_start, e_end in _elements(read, start, end):
            for video, v_start, v_end in _elements(read, e_start, e_end) if entry == _TRACK_ENTRY else ():
                if video == _VIDEO:
                    sizes.append(_pixels(read(v_start, min(v_end - v_start, MAX_LEAF))))
        return sizes
    return None


def _pixels(data: bytes) -> tuple[int, int]:
    found = {}
    for ident, start, end in _elements(lambda at, n: data[at:at + n], 0, len(data)):
        if ident in (_PIXEL_WIDTH, _PIXEL_HEIGHT):
            found[ident] = int.from_bytes(data[start:end], "big")
    if len(found) != 2:
        raise _Unreadable
    return found[_PIXEL_WIDTH], found[_PIXEL_HEIGHT]


# ---- avi: RIFF chunks -----------------------------------------------------------------------------------------------

def _chunks(read: _Read, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    at = start
    while at + 8 <= end:
        kind, length = struct.unpack("<4sI", read(at, 8))
        if at + 8 + length > end:
            raise _Unreadable
        yield kind, at + 8, at + 8 + length
        at += 8 + length + (length & 1)


def _avi(read: _Read, size: int) -> Optional[list[tuple[int, int]]]:
    riff = read(0, 12)
    end = min(size, 8 + struct.unpack("<I", riff[4:8])[0])
    hdrl = next(((s, e) for k, s, e in _chunks(read, 12, end) if k == b"LIST" and read(s, 4) == b"hdrl"), None)
    if hdrl is None:
        return None
    sizes = []
    for kind, start, stop in _chunks(read, hdrl[0] + 4, hdrl[1]):
        if kind == b"avih":
            sizes.append(struct.unpack("<II", read(start + 32, 8)))
        elif kind == b"LIST" and read(start, 4) == b"strl":
            found = {k: (s, e) for k, s, e in _chunks(read, start + 4, stop)}
            if b"strh" in found and b"strf" in found and read(found[b"strh"][0], 4) == b"vids":
                width, height = struct.unpack("<ii", read(found[b"strf"][0] + 4, 8))
                sizes.append((abs(width), abs(height)))
    return sizes
