"""A job's record (``STATE_DIR/jobs/<id>/job.json``) read as untrusted input.

The state folder may have been written by anyone who can write there (an older server, a full disk that truncated a
write, a person): a record is used only when it is a regular file of sane size, every field has its type and range,
its id is the server's own format (32 hex digits) and names its folder. Its paths are never read from it: the input
and the result are rebuilt from the id and a fixed set of file names, and the job's ``restore`` flags are rebuilt
from its options, so that nothing in a record can point the server outside the folder or add a flag. A folder that
fails is moved aside (:func:`set_aside`), never deleted, since it may hold a result someone wants.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import Optional

from ..restore.batch_store import StoreError, read_small_file

__all__ = ["STATES", "FINISHED", "BadRecord", "Job", "is_job_id", "read_record", "set_aside", "unfinished_upload",
           "INPUT_NAMES", "RESULT_NAMES", "SET_ASIDE"]

STATES = ("queued", "running", "done", "failed", "cancelled")
FINISHED = ("done", "failed", "cancelled")
ID = re.compile(r"[0-9a-f]{32}")
INPUT_NAMES = tuple("input" + ext for ext in (".mp4", ".mkv", ".avi", ".png", ".jpg", ".webp", ".bmp"))
RESULT_NAMES = ("result.mp4", "result.png")
#: the folder, beside ``jobs/``, that holds what failed the checks
SET_ASIDE = "set-aside"
#: a record is a few hundred bytes; anything much larger is not one
MAX_RECORD_BYTES = 1 << 20
MAX_TEXT = 4096


class BadRecord(ValueError):
    """A job folder or record that fails a check: the one-line reason."""


def is_job_id(text: object) -> bool:
    return isinstance(text, str) and ID.fullmatch(text) is not None


def _number(raw: dict, key: str, optional: bool) -> None:
    value = raw.get(key)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise BadRecord(f"{key} is {value!r}, not a time")


def _count(raw: dict, key: str) -> None:
    value = raw.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10**9:
        raise BadRecord(f"{key} is {value!r}, not a count")


def _text(raw: dict, key: str, optional: bool) -> None:
    value = raw.get(key)
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise BadRecord(f"{key} is not a short text")


def _flag(raw: dict, key: str) -> None:
    if not isinstance(raw.get(key, False), bool):
        raise BadRecord(f"{key} is {raw.get(key)!r}, not true or false")


@dataclass
class Job:
    """One restoration: where its files are, the ``restore`` flags it adds, and how far it got."""

    id: str
    state: str
    created: float
    input: str  # the file restored: the upload in the job's folder, or an allowed server path
    output: str
    flags: list
    options: dict
    name: str  # the name the client gave the file (shown back, never used as a path)
    input_is_upload: bool = True
    frames: int = 0
    frames_done: int = 0
    # the frames the last run of the job took from its kept batches (it continued after them), and the temporal
    # batches its ranks computed, every run of it counted (a run that was killed mid-batch included)
    frames_reused: int = 0
    batches_computed: int = 0
    started: Optional[float] = None
    finished: Optional[float] = None
    error: Optional[str] = None
    cancel_requested: bool = False
    sequence: int = 0
    client: Optional[str] = None  # who submitted it, with --client-tokens (only that client sees it)

    def status(self) -> dict:
        """What ``GET /v1/restorations/{id}`` answers."""
        now = time.time()
        eta = None
        restored = self.frames_done - self.frames_reused  # in this run: the reused frames cost no time
        if self.state == "running" and self.started is not None and restored > 0:
            elapsed = now - self.started
            eta = round(elapsed / restored * (self.frames - self.frames_done), 2)
        return {
            "id": self.id, "state": self.state, "name": self.name, "options": self.options,
            "created": self.created, "started": self.started, "finished": self.finished,
            "progress": {"frames_done": self.frames_done, "frames": self.frames,
                         "fraction": round(self.frames_done / self.frames, 4) if self.frames else 0.0,
                         "eta_seconds": eta, "frames_reused": self.frames_reused,
                         "batches_computed": self.batches_computed},
            "error": self.error, "cancel_requested": self.cancel_requested,
            "result": f"/v1/restorations/{self.id}/result" if self.state == "done" else None,
        }


def validate(raw: object, folder: str, name: str) -> dict:
    """The record ``raw`` (parsed JSON) of the folder ``folder`` named ``name``, checked, its paths rebuilt from the
    folder and its flags from its options: the keyword arguments of :class:`.jobs.Job`; :class:`BadRecord` else."""
    from .options import JOB_OPTIONS, UsageError, job_flags

    if not isinstance(raw, dict):
        raise BadRecord("the record is not a JSON object")
    fields = set(Job.__dataclass_fields__)
    unknown = set(raw) - fields
    if unknown:
        raise BadRecord(f"unknown field {sorted(unknown)[0]!r}")
    missing = {"id", "state", "created", "input", "output", "options", "name"} - set(raw)
    if missing:
        raise BadRecord(f"no {sorted(missing)[0]!r} field")
    if raw["id"] != name:
        raise BadRecord(f"its id {raw['id']!r} is not its folder's name")
    if raw["state"] not in STATES:
        raise BadRecord(f"state {raw['state']!r} is none of {', '.join(STATES)}")
    _number(raw, "created", optional=False)
    for key in ("started", "finished"):
        _number(raw, key, optional=True)
    for key in ("frames", "frames_done", "frames_reused", "batches_computed", "sequence"):
        _count(raw, key)
    if raw.get("frames_reused", 0) > raw.get("frames", 0):
        raise BadRecord(f"frames_reused is {raw['frames_reused']}, more than its {raw.get('frames', 0)} frames")
    for key in ("input_is_upload", "cancel_requested"):
        _flag(raw, key)
    _text(raw, "name", optional=False)
    _text(raw, "error", optional=True)
    _text(raw, "client", optional=True)
    options = raw["options"]
    if not isinstance(options, dict) or not set(options) <= set(JOB_OPTIONS) or not all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) and len(str(v)) <= 64
            for v in options.values()):
        raise BadRecord("options are not the job options of this server")
    try:
        flags = job_flags(options)
    except (UsageError, ValueError) as exc:
        raise BadRecord(f"options: {exc}") from None
    paths = {}
    for key, allowed in (("input", INPUT_NAMES), ("output", RESULT_NAMES)):
        value = raw[key]
        base = os.path.basename(value) if isinstance(value, str) else None
        if base not in allowed:
            raise BadRecord(f"{key} {value!r} is not one of the job's own files")
        paths[key] = os.path.join(folder, base)
    return {**raw, **paths, "flags": flags}


def read_record(folder: str, name: str) -> dict:
    """``folder/job.json`` opened without following a link, bounded, parsed and :func:`validate`-d."""
    try:
        data = read_small_file(os.path.join(folder, "job.json"), MAX_RECORD_BYTES)
    except StoreError as exc:  # a link, not a regular file, too long
        raise BadRecord(str(exc)) from None
    except OSError as exc:
        raise BadRecord(f"job.json cannot be opened ({exc.strerror or exc})") from None
    try:
        raw = json.loads(data)
    except ValueError as exc:
        raise BadRecord(f"job.json is not JSON ({exc})") from None
    return validate(raw, folder, name)


def unfinished_upload(folder: str) -> bool:
    """Whether ``folder`` is what an upload the server never finished leaves: no record, only an input file."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    inputs = (*INPUT_NAMES, "input.upload")
    return "job.json" not in names and all(
        n in inputs and stat.S_ISREG(os.lstat(os.path.join(folder, n)).st_mode) for n in names)


def set_aside(jobs_root: str, name: str) -> str:
    """Move ``jobs_root/name`` (a folder, a file or a link, never followed) into the set-aside folder beside
    ``jobs_root``; returns where it went (or why it could not move)."""
    target_dir = os.path.join(os.path.dirname(jobs_root), SET_ASIDE)
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, f"{time.strftime('%Y%m%d-%H%M%S')}-{name}")
    try:
        os.rename(os.path.join(jobs_root, name), target)
    except OSError as exc:
        return f"nowhere: {exc.strerror or exc}"
    return target
