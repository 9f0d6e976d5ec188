"""The on-disk store of a restore's finished temporal batches, kept beside its output so that a killed run resumes.

A store is a folder ``<output>.seedvr2-batches/`` holding:

* ``manifest.json``: the store's format, the version that wrote it and the settings that shape the output (see
  :mod:`.resume`), written once when the store is created;
* for each finished temporal batch ``k``, ``frames-<k>.bin``: the frames the cross-fade released when batch ``k`` was
  added (final output frames, 8-bit, in clip order), and ``tail-<k>.bin``: the frames it held back for the next batch
  (the batch's last ``overlap`` frames before the cross-fade: the blend state). The noise position of the next batch
  is its start in the clip, written in the header. Every batch's tail is kept, so that a damaged batch costs only
  itself and the batches after it: the store holds the clip's frames once, plus one overlap a batch (with the
  default 21-frame batches and overlap 5: 5 frames for every 16, 31 % more).

Every file is written atomically: to a temporary name, then renamed; a run killed mid-write leaves
at most a temporary file, which is ignored and removed. Each file starts with a JSON header giving its frames' count,
shape and one CRC-32 per frame; a file whose length or any checksum disagrees is not trusted (its batch is restored
again). The folder is read as untrusted input (``serve`` keeps it in a job's folder of its state folder, which
others may write): a link (the folder or a file in it) is never followed, a file that is not a regular one or whose
header claims frames of another size than the run's (:attr:`BatchStore.frame_shape`) is not trusted, and nothing is
read beyond what its header claims. Plain data and files only: no torch, no model, no collective.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["STORE_FORMAT", "STORE_SUFFIX", "MANIFEST", "StoreError", "BatchRecord", "store_path", "write_atomic",
           "write_frames_file", "read_frames_file", "read_small_file", "BatchStore", "store_bytes"]

#: bumped whenever the files' layout or meaning changes: a store of another format is refused by name
STORE_FORMAT = 1
STORE_SUFFIX = ".seedvr2-batches"
MANIFEST = "manifest.json"
#: the name of the temporary output file of the run that keeps the batches (removed by the run that resumes them)
PARTIAL = "partial-output.txt"
_MAGIC = b"SVR2BAT1"
_TMP = ".tmp-"
#: a manifest, a header or a noted file name is a few KiB; anything much larger is not one
_MAX_TEXT = 1 << 20


class StoreError(ValueError):
    """A stored file cannot be trusted (truncated, a bad checksum, not a store file)."""


@dataclass(frozen=True)
class BatchRecord:
    """What a finished batch left: its index, where the next batch starts (its noise position), how many output
    frames were final after it (``frames_out``), and the frames themselves (``final``: released by the cross-fade;
    ``tail``: held back for the next batch), ``[n, h, w, 3]`` uint8 each."""

    index: int
    next_start: int
    frames_out: int
    final: np.ndarray
    tail: np.ndarray


def store_path(output: str) -> str:
    """The store's folder beside ``output``: ``<output>.seedvr2-batches``."""
    head, name = os.path.split(os.path.abspath(output))
    return os.path.join(head, name + STORE_SUFFIX)


def store_bytes(frames: int, height: int, width: int, overlap: int, batches: int) -> int:
    """The most bytes a store of a ``frames``-frame clip of ``height x width`` in ``batches`` temporal batches holds:
    every frame once, a tail of ``overlap`` frames a batch, and the headers."""
    return (frames + overlap * batches) * height * width * 3 + 4096 * (batches + 1)


def write_atomic(path: str, parts: list) -> None:
    """Write ``parts`` (bytes-like) to ``path`` as one file that appears complete or not at all (a temporary name,
    then a rename).

    Not synced to the disk: a killed process's writes survive it (they are the kernel's), which is what the store is
    for; after a power cut a file the disk lost part of fails its checksum and its batch is restored again."""
    tmp = f"{path}{_TMP}{os.getpid()}"
    try:
        if os.path.lexists(tmp):  # never written through a link or a file someone left under that name
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _frames_parts(frames: np.ndarray, header: dict) -> list:
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    if frames.ndim != 4:
        raise ValueError(f"frames must be [n, h, w, c] uint8, got shape {list(frames.shape)}")
    rows = [memoryview(frame).cast("B") for frame in frames]  # the frames' own bytes, not copies
    header = dict(header, frames=len(rows), shape=list(frames.shape[1:]), crc32=[zlib.crc32(r) for r in rows])
    text = json.dumps(header, sort_keys=True).encode()
    return [_MAGIC, struct.pack("<I", len(text)), text, *rows]


def write_frames_file(path: str, frames: np.ndarray, header: dict) -> None:
    """``frames [n, h, w, c]`` uint8 and ``header`` (JSON-able) to ``path``, atomically, with a CRC-32 per frame."""
    write_atomic(path, _frames_parts(frames, header))


def _open_regular(path: str):
    """``path`` opened for reading without following a link: a binary file object and its size; FileNotFoundError
    when absent, :class:`StoreError` when it is a link or not a regular file."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{name} is a link (never followed)") from None
        raise StoreError(f"{name} cannot be opened ({exc.strerror or exc})") from None
    f = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        f.close()
        raise StoreError(f"{name} is not a regular file")
    return f, info.st_size


def read_small_file(path: str, limit: int = _MAX_TEXT) -> bytes:
    """A short file (a manifest, a noted name, a job's record), never through a link, at most ``limit`` bytes (1 MiB
    by default); FileNotFoundError when absent, :class:`StoreError` naming what is wrong otherwise."""
    f, size = _open_regular(path)
    with f:
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise StoreError(f"{os.path.basename(path)} is over {limit} bytes")
    return data


def read_frames_file(path: str, frame_shape: Optional[tuple] = None,
                     max_frames: Optional[int] = None) -> tuple[dict, np.ndarray]:
    """(header, frames) of a file :func:`write_frames_file` wrote; :class:`StoreError` naming what is wrong when the
    file is a link or not a regular file, truncated, longer than its header says, its frames are not ``frame_shape``
    or more than ``max_frames`` (when given), or a frame's checksum disagrees. Reads no more than the header claims."""
    name = os.path.basename(path)
    f, file_size = _open_regular(path)
    with f:
        lead = f.read(len(_MAGIC) + 4)
        if len(lead) < len(_MAGIC) + 4 or not lead.startswith(_MAGIC):
            raise StoreError(f"{name} is not a stored batch (truncated or another file)")
        (size,) = struct.unpack_from("<I", lead, len(_MAGIC))
        if size > _MAX_TEXT:
            raise StoreError(f"{name}'s header is damaged")
        try:
            header = json.loads(f.read(size))
            count, shape, sums = int(header["frames"]), tuple(int(v) for v in header["shape"]), list(header["crc32"])
        except (ValueError, KeyError, TypeError):
            raise StoreError(f"{name}'s header is damaged") from None
        if count < 0 or any(v < 0 for v in shape):
            raise StoreError(f"{name}'s header is damaged")
        if frame_shape is not None and count and shape != tuple(frame_shape):
            raise StoreError(f"{name} holds frames of shape {list(shape)}, this run's are {list(frame_shape)}")
        if max_frames is not None and count > max_frames:
            raise StoreError(f"{name} holds {count} frames, a batch has at most {max_frames}")
        frame_bytes = int(np.prod(shape)) if shape else 0
        start = len(_MAGIC) + 4 + size
        body_bytes = file_size - start
        if body_bytes != count * frame_bytes or len(sums) != count:
            raise StoreError(f"{name} holds {max(body_bytes, 0)} bytes of frames, its header says "
                             f"{count * frame_bytes}")
        body = f.read(count * frame_bytes)
    if len(body) != count * frame_bytes:
        raise StoreError(f"{name} holds {len(body)} bytes of frames, its header says {count * frame_bytes}")
    rows = [body[i * frame_bytes:(i + 1) * frame_bytes] for i in range(count)]
    for i, row in enumerate(rows):
        if zlib.crc32(row) != sums[i]:
            raise StoreError(f"frame {i} of {name} fails its checksum")
    frames = np.frombuffer(body, dtype=np.uint8).reshape((count,) + shape) if count else np.zeros(
        (0,) + shape, dtype=np.uint8)
    return header, frames


class BatchStore:
    """The store folder of one output: created, read, added to batch by batch, removed when the output is done."""

    def __init__(self, directory: str, frame_shape: Optional[tuple] = None, max_frames: Optional[int] = None) -> None:
        self.directory = directory
        # what this run's batches hold (None: not checked): a stored file that claims otherwise is not trusted
        self.frame_shape, self.max_frames = frame_shape, max_frames
        self.full = False  # set when a write found the disk full: no more batches are kept
        # the manifest of a store not created yet: created with the first batch, so a run that keeps none leaves none
        self.pending: Optional[dict] = None

    # ---- the folder -------------------------------------------------------------------------------------------
    def exists(self) -> bool:
        """Whether a store is there: a folder (not a link to one) holding a manifest (a regular file, not a link)."""
        try:
            return (stat.S_ISDIR(os.lstat(self.directory).st_mode)
                    and stat.S_ISREG(os.lstat(os.path.join(self.directory, MANIFEST)).st_mode))
        except OSError:
            return False

    def read_manifest(self) -> dict:
        """The manifest; :class:`StoreError` when it is unreadable (a store of no known kind)."""
        try:
            manifest = json.loads(read_small_file(os.path.join(self.directory, MANIFEST)))
        except (OSError, ValueError) as exc:
            raise StoreError(f"{MANIFEST} cannot be read ({exc})") from None
        if not isinstance(manifest, dict):
            raise StoreError(f"{MANIFEST} is not a store manifest")
        return manifest

    def create(self, manifest: dict) -> None:
        """Start an empty store with ``manifest``. The folder is claimed, never replaced: ``FileExistsError`` when
        something took its name since this run read it (another run writing the same output keeps its batches there,
        and they are left to it)."""
        os.mkdir(self.directory)
        write_atomic(os.path.join(self.directory, MANIFEST), [json.dumps(manifest, indent=1, sort_keys=True).encode()])

    def remove(self) -> None:
        """Remove the folder and everything in it (nothing when absent); a link or a file under its name is removed
        itself, never followed."""
        try:
            if not stat.S_ISDIR(os.lstat(self.directory).st_mode):
                os.unlink(self.directory)
                return
        except OSError:
            return
        shutil.rmtree(self.directory, ignore_errors=True)

    def note_partial(self, path: str) -> None:
        """Record the temporary output file this run writes (its base name), for a resumed run to remove."""
        write_atomic(os.path.join(self.directory, PARTIAL), [os.path.basename(path).encode()])

    def remove_noted_partial(self, output_directory: str) -> None:
        """Remove the temporary output file a killed run noted (nothing when none was noted or it is gone)."""
        try:
            name = os.fsdecode(read_small_file(os.path.join(self.directory, PARTIAL)))
        except (OSError, StoreError):
            return
        if name and os.path.basename(name) == name and ".partial" in name:
            try:
                os.unlink(os.path.join(output_directory, name))
            except OSError:
                pass

    def clear_temporaries(self) -> None:
        """Remove the temporary files a run killed mid-write left."""
        for name in self._names():
            if _TMP in name:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except OSError:
                    pass

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.directory))
        except OSError:
            return []

    def _path(self, kind: str, index: int) -> str:
        return os.path.join(self.directory, f"{kind}-{index:06d}.bin")

    # ---- batches ----------------------------------------------------------------------------------------------
    def write_batch(self, record: BatchRecord) -> None:
        """Keep ``record``: its final frames, then its tail. Raises OSError as the file system does (the caller
        handles a full disk, see :meth:`disk_full`)."""
        if self.pending is not None:
            self.create(self.pending)
            self.pending = None
        header = {"index": record.index, "next_start": record.next_start, "frames_out": record.frames_out}
        write_frames_file(self._path("frames", record.index), record.final, dict(header, kind="frames"))
        write_frames_file(self._path("tail", record.index), record.tail, dict(header, kind="tail"))

    def drop_from(self, index: int) -> None:
        """Remove the files of batches ``index`` and later (after a resume point: they are restored again)."""
        for name in self._names():
            kind, _, rest = name.partition("-")
            if kind in ("frames", "tail") and rest.endswith(".bin") and rest[:-4].isdigit() and int(rest[:-4]) >= index:
                os.unlink(os.path.join(self.directory, name))

    def finished(self, plan_length: int) -> tuple[int, list[str]]:
        """How many leading batches are kept whole (their frames files and the last one's tail all intact), and one
        note per file found damaged (a batch that is restored again)."""
        notes: list[str] = []
        done = total = 0
        for index in range(plan_length):
            try:
                header, final = self._read(self._path("frames", index))
            except FileNotFoundError:
                break
            except StoreError as exc:
                notes.append(str(exc))
                break
            if header.get("index") != index:
                notes.append(f"{os.path.basename(self._path('frames', index))} names batch {header.get('index')}")
                break
            total += len(final)
            if header["frames_out"] != total:  # each batch's count of final frames adds up to the next's
                notes.append(f"{os.path.basename(self._path('frames', index))} says {header['frames_out']} frames "
                             f"are final after it, its batches hold {total}")
                break
            done = index + 1
        # the resume point needs the tail of its last batch (missing when the run was killed between the two files)
        while done:
            try:
                self._read(self._path("tail", done - 1))
                break
            except FileNotFoundError:
                done -= 1
            except StoreError as exc:
                notes.append(str(exc))
                done -= 1
        return done, notes

    def _read(self, path: str) -> tuple[dict, np.ndarray]:
        header, frames = read_frames_file(path, self.frame_shape, self.max_frames)
        if not isinstance(header, dict) or not all(
                isinstance(header.get(key), int) and not isinstance(header.get(key), bool) and 0 <= header[key] < 2**31
                for key in ("index", "next_start", "frames_out")):
            raise StoreError(f"{os.path.basename(path)}'s header is damaged")
        return header, frames

    def read_batch(self, index: int, tail: bool = False) -> BatchRecord:
        """Batch ``index``'s kept frames (and its tail when ``tail``; else an empty one)."""
        header, final = self._read(self._path("frames", index))
        held = self._read(self._path("tail", index))[1] if tail else final[:0]
        return BatchRecord(index=int(header["index"]), next_start=int(header["next_start"]),
                           frames_out=int(header["frames_out"]), final=final, tail=held)

    @staticmethod
    def disk_full(exc: BaseException) -> bool:
        """Whether ``exc`` says the disk (or the user's quota) is full."""
        return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)

    def free_bytes(self) -> Optional[int]:
        """Free bytes on the store's file system (None when it cannot be told)."""
        try:
            return shutil.disk_usage(os.path.dirname(self.directory) or ".").free
        except OSError:
            return None
