"""Distributed checkpoints (``torch.distributed.checkpoint``, DCP) that are data, not code, and whole.

torch 2.13's DCP loader runs pickled code from a checkpoint folder in two places:
``FileSystemReader.read_metadata`` reads ``.metadata`` with plain ``pickle.load`` (it has no ``weights_only``
option), and ``DefaultLoadPlanner.load_bytes`` reads every non-tensor value (a step count, an optimizer's
hyper-parameters) with ``torch.load(weights_only=False)``. A ``.metadata`` or ``.distcp`` file planted in the folder
runs its code on ``dcp.load``. Nor does anything tie a folder's files together: a ``.distcp`` shard swapped in from
another run of the same shapes loads silently.

:func:`save_checkpoint` and :func:`load_checkpoint` wrap ``dcp.save`` / ``dcp.load`` (same state dicts, same
resharding on load) and close both holes:

* The save writes a manifest, :data:`MANIFEST`, after every other file is complete: each file's name, size and
  SHA-256 (the ranks share the hashing). It is written under a temporary name and renamed into place, and an earlier
  manifest in the folder is removed before anything else is written, so a folder with a manifest holds a complete
  save.
* The load checks the manifest before torch opens any file of the folder: the folder must hold exactly the files it
  lists, each with its size and hash; else a :class:`CheckpointError` (a ``ValueError``) names the file, in one line,
  on every rank. The ranks share the hashing and agree on the outcome.
* It then reads ``.metadata`` through an unpickler that builds only DCP's own metadata classes, ``torch.Size``,
  dtypes, layouts and paths (checking its hash again on the very bytes it unpickles), and non-tensor values with
  ``torch.load(weights_only=True)``. So even a folder whose manifest was forged with it cannot run code here.

A folder written by plain ``dcp.save`` (or by anyone else) has no manifest and is refused: it is code to torch's
own loader (``dcp.load``), so load one only if you trust whoever wrote it. As for DCP itself, the folder must be on
storage every rank sees. Pure ``torch.distributed`` calls; no winsp state.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import pathlib
import pickle
import warnings
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "verify_checkpoint", "CheckpointError", "MANIFEST"]

#: the manifest's file name inside a checkpoint folder
MANIFEST = "winsp_manifest.json"
_FORMAT = "winsp-dcp-manifest"
_MANIFEST_LIMIT = 64 * 2**20  # bytes: a manifest lists files, it is never large
_CHUNK = 8 * 2**20


class CheckpointError(ValueError):
    """A checkpoint folder that is incomplete, altered or not written by :func:`save_checkpoint` (one line)."""


# ---- collectives (nothing without a process group) -----------------------------------------------------------------


def _world(group) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _barrier(group) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group)


def _gather(value, group) -> list:
    """Every rank's ``value`` (a list of plain data), on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [value]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


# ---- the manifest -------------------------------------------------------------------------------------------------


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return digest.hexdigest()
            digest.update(block)


def _files(path: str) -> list[str]:
    """The names in a checkpoint folder, less the manifest (a subfolder is refused: DCP writes none)."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot list the folder ({exc.strerror or exc})") from None
    files = []
    for name in names:
        if name == MANIFEST:
            continue
        if not os.path.isfile(os.path.join(path, name)) or os.path.islink(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path}: {name!r} is not a plain file (a checkpoint folder holds only "
                                  f"files)")
        files.append(name)
    return files


def _read_manifest(path: str) -> dict[str, tuple[int, str]]:
    """``{name: (size, sha256)}`` from the folder's manifest, checked for form."""
    where = os.path.join(path, MANIFEST)
    try:
        with open(where, "rb") as f:
            data = f.read(_MANIFEST_LIMIT + 1)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it was not written by winsp.save_checkpoint "
                              f"(or that save did not finish). torch's own dcp.load runs pickled code from such a "
                              f"folder: load it with it only if you trust whoever wrote it") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {MANIFEST} ({exc.strerror or exc})") from None
    try:
        if len(data) > _MANIFEST_LIMIT:
            raise ValueError("too large")
        manifest = json.loads(data)
        if manifest.get("format") != _FORMAT or manifest.get("version") != 1:
            raise ValueError("not a winsp manifest")
        files = {}
        for name, entry in manifest["files"].items():
            size, digest = entry["size"], entry["sha256"]
            if (not isinstance(name, str) or name in ("", ".", "..", MANIFEST) or "/" in name or "\\" in name
                    or not isinstance(size, int) or size < 0 or not isinstance(digest, str) or len(digest) != 64):
                raise ValueError(f"bad entry {name!r}")
            files[name] = (size, digest)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is damaged ({exc})") from None
    return files


def verify_checkpoint(path: str | os.PathLike, *, rank: int = 0, world: int = 1) -> list[str]:
    """The problems of a checkpoint folder against its manifest (empty: it is whole); ``rank`` of ``world`` hashes
    every ``world``-th file (the set of names is checked by every rank). Raises :class:`CheckpointError` for a
    folder without a readable manifest."""
    path = os.fspath(path)
    listed = _read_manifest(path)
    present = _files(path)
    problems = [f"checkpoint {path}: {name!r} is not in its manifest (not written by this save)"
                for name in present if name not in listed]
    problems += [f"checkpoint {path}: {name!r} is missing" for name in listed if name not in present]
    for name in sorted(set(listed) & set(present))[rank::world]:
        size, digest = listed[name]
        file = os.path.join(path, name)
        if os.path.getsize(file) != size:
            problems.append(f"checkpoint {path}: {name!r} has {os.path.getsize(file)} bytes, its manifest says {size} "
                            f"(truncated or replaced)")
        elif _sha256(file) != digest:
            problems.append(f"checkpoint {path}: {name!r} is not the file that was saved (its SHA-256 differs from "
                            f"the manifest's: replaced, e.g. by another run's, or damaged)")
    return problems


def _write_manifest(path: str, entries: dict[str, tuple[int, str]]) -> None:
    manifest = {"format": _FORMAT, "version": 1,
                "files": {name: {"size": size, "sha256": digest} for name, (size, digest) in sorted(entries.items())}}
    temporary = os.path.join(path, f".{MANIFEST}.tmp")
    with open(temporary, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(path, MANIFEST))
    try:  # the rename itself durable
        directory = os.open(path, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError:
        pass


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns that it assumes one process when no group is running: here that is what was asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# ---- save and load ------------------------------------------------------------------------------------------------


def save_checkpoint(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group=None) -> None:
    """``dcp.save(state_dict, checkpoint_id=path)`` on every rank of ``process_group`` (None: the default group, or
    one process), then the manifest (see the module docstring). Returns when the checkpoint is complete on disk."""
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    rank, world = _world(process_group)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        try:  # never a manifest beside files it does not describe, should this save not finish
            os.remove(os.path.join(path, MANIFEST))
        except FileNotFoundError:
            pass
    _barrier(process_group)
    with _one_process_is_meant():
        dcp.save(state_dict, checkpoint_id=path, process_group=process_group, no_dist=world == 1)
    _barrier(process_group)
    names = _files(path)
    mine = {name: (os.path.getsize(os.path.join(path, name)), _sha256(os.path.join(path, name)))
            for name in names[rank::world]}
    entries: dict[str, tuple[int, str]] = {}
    for part in _gather(mine, process_group):
        entries.update(part)
    if rank == 0:
        _write_manifest(path, entries)
    _barrier(process_group)


def load_checkpoint(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group=None) -> None:
    """Check the folder against its manifest, then ``dcp.load(state_dict, checkpoint_id=path)`` in place without
    running pickled code (see the module docstring). :class:`CheckpointError` on every rank when the folder is not
    whole."""
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    rank, world = _world(process_group)
    metadata = None
    try:
        mine = verify_checkpoint(path, rank=rank, world=world)
        if not mine:
            metadata = _read_metadata(path, _read_manifest(path))
    except CheckpointError as exc:
        mine = [str(exc)]
    problems = sorted({p for part in _gather(mine, process_group) for p in part})
    if problems:
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)
    reader, planner = _data_only_classes()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _one_process_is_meant():
            dcp.load(state_dict, storage_reader=reader(path, metadata), planner=planner(path),
                     process_group=process_group, no_dist=world == 1)
    except CheckpointException as exc:  # DCP gathers every rank's failure into one report of tracebacks
        failures = sorted(exc.failures.items())
        for _, (error, _) in failures:
            if isinstance(error, CheckpointError):
                raise error from None
        rank, (error, _) = failures[0]
        first = (str(error).strip().splitlines() or [""])[0]
        raise CheckpointError(f"checkpoint {path}: rank {rank} could not load it ({type(error).__name__}: "
                              f"{first})") from None


def _read_metadata(path: str, manifest: dict[str, tuple[int, str]]):
    """The folder's ``.metadata``, unpickled by :class:`_MetadataUnpickler` from the very bytes whose hash is checked
    against the manifest."""
    from torch.distributed.checkpoint.metadata import Metadata

    name = ".metadata"
    data = pathlib.Path(path, name).read_bytes()
    if name not in manifest or hashlib.sha256(data).hexdigest() != manifest[name][1]:
        raise CheckpointError(f"checkpoint {path}: {name!r} is not the file that was saved (it changed after the "
                              f"manifest was checked)")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - a refused class, or a damaged pickle
        raise CheckpointError(f"checkpoint {path}: {name!r} is not DCP metadata ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path}: {name!r} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


# ---- torch's reader and planner, without unpickling code ----------------------------------------------------------


def _allowed() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` pickle may name: DCP's own metadata classes and the torch values they hold."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
        if hasattr(metadata, name)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what :func:`_allowed` names, and torch's dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


@functools.lru_cache(maxsize=None)
def _data_only_classes() -> tuple[type, type]:
    """torch's file-system reader given the ``.metadata`` :func:`_read_metadata` read (hashed, and unpickled by
    :class:`_MetadataUnpickler`), and its default load planner reading non-tensor values with
    ``torch.load(weights_only=True)`` (made on first use: DCP is imported only by a checkpoint's save or load)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class DataOnlyReader(FileSystemReader):
        def __init__(self, path: str, metadata: Metadata) -> None:
            super().__init__(path)
            self._metadata = metadata

        def read_metadata(self) -> Metadata:  # no ``rank`` keyword: no fallback to per-rank metadata files
            storage_meta = getattr(self._metadata, "storage_meta", None) or StorageMeta()
            storage_meta.load_id = self.load_id
            self._metadata.storage_meta = storage_meta
            return self._metadata

    class DataOnlyPlanner(DefaultLoadPlanner):
        def __init__(self, path: str) -> None:
            super().__init__()
            self._folder = path

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise CheckpointError(f"checkpoint {self._folder}: the value of {read_item.dest_index.fqn!r} is not "
                                      f"plain data (loading it would run pickled code); refused") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return DataOnlyReader, DataOnlyPlanner
