"""The server's jobs: their states, their files, the queue, and what survives a restart.

Each job is a folder ``STATE_DIR/jobs/<id>/`` holding ``job.json`` (rewritten atomically at every change of state),
the input (an upload, or the copy of a server file), the result, and while the job runs its finished temporal batches
(``result.mp4.seedvr2-batches/``, see :mod:`examples.seedvr2.restore.batch_store`). A server started again on the
same state folder keeps the finished jobs and puts every job that had not finished back in the queue, in the order
they came; each continues after its kept batches. The kept batches go when the job finishes (done, failed or
cancelled) or is deleted.
Finished jobs beyond ``max_results``, or whose files exceed ``max_bytes`` together, are evicted oldest first (the
newest finished job stays, whatever its size).

The state folder is read as untrusted input (:mod:`.job_records`): a record is used only when every field checks,
its id is the server's own format and names its folder, and its paths are rebuilt from the id; anything else is
moved aside into ``STATE_DIR/set-aside/`` with one log line, never deleted and never followed outside. A write that
fails (a full disk, an I/O error) fails that job with its one-line reason; the queue goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import time
import uuid
from dataclasses import asdict
from typing import Callable, Optional

from ..restore.batch_store import BatchStore, store_path, write_atomic
from .job_records import FINISHED, STATES, BadRecord, Job, is_job_id, read_record, set_aside, unfinished_upload

__all__ = ["Job", "JobStore", "STATES", "FINISHED", "RecordError"]


class RecordError(OSError):
    """A job's record could not be written (a full disk, an I/O error): the one line said to its client."""

    def __str__(self) -> str:
        return str(self.strerror)


class JobStore:
    """Jobs by id, the FIFO queue of queued ones, persisted under ``root`` (thread-safe)."""

    def __init__(self, root: str, max_queue: int, max_results: int, max_bytes: int,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.log = log or (lambda line: None)
        self.root = os.path.join(root, "jobs")
        os.makedirs(self.root, exist_ok=True)
        self.max_queue, self.max_results, self.max_bytes = max_queue, max_results, max_bytes
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Condition()
        self._sequence = 0
        self.requeued = self._load()

    # ---- persistence -----------------------------------------------------------------------------------------

    def folder(self, job_id: str) -> str:
        if not is_job_id(job_id):
            raise ValueError(f"{job_id!r} is not a job id of this server")
        return os.path.join(self.root, job_id)

    def _save(self, job: Job) -> None:
        """Write ``job.json`` atomically (never through a link someone left in the folder); :class:`RecordError`."""
        try:
            write_atomic(os.path.join(self.folder(job.id), "job.json"), [json.dumps(asdict(job)).encode()])
        except OSError as exc:
            raise RecordError(exc.errno, f"the server could not write job {job.id}'s record "
                                         f"({exc.strerror or exc})") from None

    def _load(self) -> int:
        """Read the jobs a previous server left; the unfinished ones are queued again. Returns how many."""
        requeued = 0
        for name in sorted(os.listdir(self.root)):
            folder = os.path.join(self.root, name)
            try:
                if not is_job_id(name) or not stat.S_ISDIR(os.lstat(folder).st_mode):
                    raise BadRecord("not a job folder of this server")
                if unfinished_upload(folder):
                    shutil.rmtree(folder, ignore_errors=True)
                    self.log(f"removed jobs/{name}: an upload that never finished (no record, no result)")
                    continue
                job = Job(**read_record(folder, name))
            except BadRecord as exc:
                self.log(f"set aside jobs/{name!r}: {exc} (moved to {set_aside(self.root, name)})")
                continue
            for leftover in os.listdir(folder):  # partial results of a server that was killed, a cancel of its own
                if ((leftover.startswith(".") and ".partial" in leftover) or leftover == "cancel"
                        or leftover.startswith("job.json.tmp")):  # write_atomic's temporary (and older servers')
                    os.unlink(os.path.join(folder, leftover))
            if job.state in FINISHED:
                self._drop_kept(job)  # a server stopped as the job finished
            else:  # its kept batches stay: it continues after them
                job.state, job.frames_done, job.started, job.cancel_requested = "queued", 0, None, False
                if os.path.lexists(job.output):
                    os.unlink(job.output)
                self._save(job)
                requeued += 1
            self.jobs[job.id] = job
            self._sequence = max(self._sequence, job.sequence)
        return requeued

    # ---- the queue -------------------------------------------------------------------------------------------

    def new_id(self) -> str:
        job_id = uuid.uuid4().hex
        os.makedirs(self.folder(job_id))
        return job_id

    def queued(self) -> list[Job]:
        with self.lock:
            return sorted((j for j in self.jobs.values() if j.state == "queued"), key=lambda j: j.sequence)

    def queue_full(self) -> bool:
        return len(self.queued()) >= self.max_queue

    def add(self, job: Job) -> bool:
        """Queue ``job``; False (nothing kept) when the queue is full."""
        with self.lock:
            if self.queue_full():
                return False
            self._sequence += 1
            job.sequence = self._sequence
            self._save(job)  # RecordError: not queued (the client is told why)
            self.jobs[job.id] = job
            self.lock.notify_all()
            return True

    def discard(self, job_id: str) -> None:
        """Remove a job's folder that never made it into the queue (refused upload)."""
        shutil.rmtree(self.folder(job_id), ignore_errors=True)

    def next(self, timeout: float) -> Optional[Job]:
        """The oldest queued job, marked running; None after ``timeout`` seconds without one."""
        with self.lock:
            if not self.queued():
                self.lock.wait(timeout)
            waiting = self.queued()
            if not waiting:
                return None
            job = waiting[0]
            job.state, job.started, job.frames_done, job.frames_reused = "running", time.time(), 0, 0
            try:
                self._save(job)
            except RecordError as exc:
                self._fail(job, exc)
                return None
            return job

    def progress(self, job: Job, done: int, total: int) -> None:
        with self.lock:
            job.frames_done, job.frames = done, total

    def resumed(self, job: Job, reused: int, total: int) -> None:
        """The job's run took ``reused`` frames from its kept batches (0: it starts at its first frame)."""
        with self.lock:
            job.frames_reused, job.frames_done, job.frames = reused, reused, total

    def batch_started(self, job: Job) -> None:
        """The ranks compute one more of the job's temporal batches: counted, and the record saved (so that the
        count survives a killed server)."""
        with self.lock:
            job.batches_computed += 1
            try:
                self._save(job)
            except RecordError as exc:
                self.log(str(exc))

    def _drop_kept(self, job: Job) -> None:
        """Remove the job's kept batches (its folder's own store: a link there is removed, never followed) and the
        partial results a killed rank left."""
        BatchStore(store_path(job.output)).remove()
        self.clear_partials(job)

    def clear_partials(self, job: Job) -> None:
        """Remove the partial results a killed rank left in the job's folder (called while no rank runs it)."""
        folder = self.folder(job.id)
        for leftover in os.listdir(folder) if os.path.isdir(folder) else ():
            if leftover.startswith(".") and ".partial" in leftover:
                try:
                    os.unlink(os.path.join(folder, leftover))
                except OSError:
                    pass

    def finish(self, job: Job, state: str, error: Optional[str] = None) -> None:
        with self.lock:
            job.state, job.error, job.finished = state, error, time.time()
            if state == "done":
                job.frames_done = job.frames
            elif os.path.lexists(job.output):
                os.remove(job.output)
            self._drop_kept(job)
            if os.path.lexists(os.path.join(self.folder(job.id), "cancel")):  # its ranks have seen it
                os.unlink(os.path.join(self.folder(job.id), "cancel"))
            try:
                self._save(job)
            except RecordError as exc:
                self._fail(job, exc)
            self._evict()

    def _fail(self, job: Job, exc: OSError) -> None:
        """``job`` failed because its record could not be written: said in memory (its client sees it), logged,
        its result removed (a result without a record would be lost at the next start anyway) (lock held)."""
        job.state, job.error, job.finished = "failed", str(exc), time.time()
        self.log(f"job {job.id} failed: {exc}")
        self._drop_kept(job)
        try:
            if os.path.lexists(job.output):
                os.remove(job.output)
            self._save(job)
        except OSError:
            pass

    def requeue(self, job: Job) -> None:
        """Put a running job back (the server stopped before it finished): it runs again after a restart, after its
        kept batches."""
        with self.lock:
            job.state, job.started, job.frames_done, job.cancel_requested = "queued", None, 0, False
            if os.path.lexists(job.output):
                os.remove(job.output)
            try:
                self._save(job)
            except RecordError as exc:
                self._fail(job, exc)

    def cancel(self, job: Job) -> None:
        """A queued job is cancelled at once; a running one is asked to stop (at its next batch boundary)."""
        with self.lock:
            if job.state == "queued":
                job.state, job.finished = "cancelled", time.time()
                self._drop_kept(job)  # a job queued again after a fault may have kept batches
            elif job.state == "running":
                job.cancel_requested = True
                try:
                    open(os.path.join(self.folder(job.id), "cancel"), "w").close()
                except OSError as exc:
                    self.log(f"job {job.id}: cannot ask the ranks to cancel it ({exc.strerror or exc})")
            try:
                self._save(job)
            except RecordError as exc:
                self.log(str(exc))

    def delete(self, job: Job) -> None:
        """Remove a finished job and its files."""
        with self.lock:
            self.jobs.pop(job.id, None)
            shutil.rmtree(self.folder(job.id), ignore_errors=True)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {state: sum(1 for j in self.jobs.values() if j.state == state) for state in STATES}

    def _bytes(self, job: Job) -> int:
        total = 0
        for root, _, files in os.walk(self.folder(job.id)):
            total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
        return total

    def _evict(self) -> None:
        """Drop the oldest finished jobs while there are more than ``max_results`` or their files exceed
        ``max_bytes`` (the newest is kept whatever its size: its client has yet to fetch it) (lock held)."""
        finished = sorted((j for j in self.jobs.values() if j.state in FINISHED), key=lambda j: j.finished or 0)
        sizes = {j.id: self._bytes(j) for j in finished}
        while len(finished) > self.max_results or (len(finished) > 1
                                                    and sum(sizes[j.id] for j in finished) > self.max_bytes):
            oldest = finished.pop(0)
            self.jobs.pop(oldest.id, None)
            shutil.rmtree(self.folder(oldest.id), ignore_errors=True)
