"""The server: it checks each job before accepting it (``restore``'s own checks and memory estimate), queues it
(:mod:`.jobs`) and hands the jobs to the ranks (:mod:`.ranks`) one at a time from a dispatcher thread. The HTTP API
is :mod:`.app`'s, the process around them :mod:`.process`'s. A dead rank is restarted even while idle; a job whose
files cannot be written fails alone, and the dispatcher goes on.

A job keeps its finished temporal batches in its folder (as ``restore`` does beside its output), so a fault costs it
the batch in progress alone: when a rank dies mid-job the ranks are restarted and the job runs again at once,
continuing after its kept batches (it fails only when its ranks die twice in a row without finishing a batch: then
the job itself is the likely cause); a job a drain stopped, or whose server was killed, is queued again and continues
the same way on the next server on the state folder.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Optional

from .jobs import Job, JobStore, RecordError
from .options import UsageError, job_flags, restore_args
from .ranks import Outcome, RankPool, StartError

__all__ = ["Server", "Refused", "log", "DECODES"]

#: seconds between attempts to start the ranks again when a restart failed
RETRY_S = 10.0
#: job checks (each decodes its input once) that run at once; more wait their turn
DECODES = 2
#: test-only, a path: when that file exists the dispatcher thread dies at its next turn, from an error its loop does
#: not catch (as a bug in the loop itself would kill it), so that a test sees what ``/v1/health`` says then. Never set
#: it outside a test.
TEST_KILL_DISPATCHER_ENV = "SEEDVR2_SERVE_TEST_KILL_DISPATCHER"
#: a job whose ranks die this many times in a row without finishing a temporal batch fails (else it goes on)
DEATHS_WITHOUT_PROGRESS = 2


class Refused(Exception):
    """A job not accepted: the HTTP status and the one-line reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def log(line: str) -> None:
    print(f"serve: {line}", file=sys.stderr, flush=True)


class _KilledForATest(BaseException):
    """What kills the dispatcher under :data:`TEST_KILL_DISPATCHER_ENV` (a BaseException: its loop catches Exception
    only)."""


class Server:
    """The queue, the ranks and the dispatcher between them."""

    def __init__(self, config, state_dir: str, pool: RankPool) -> None:
        self.config, self.pool = config, pool
        self.store = JobStore(state_dir, config.max_queue, config.max_results, int(config.max_results_mb * 2**20),
                              log=log)
        self.decodes = threading.BoundedSemaphore(DECODES)
        self.health = "ok"
        self.draining = False
        self.current: Optional[Job] = None
        self.interrupting = False
        self.frames_restored = 0
        self.frames_reused = 0
        self.restore_seconds = 0.0
        self.last_fps = 0.0
        self._thread = threading.Thread(target=self._dispatch, name="dispatcher", daemon=True)

    # ---- accepting jobs --------------------------------------------------------------------------------------

    def check(self, job_id: str, input_path: str, name: str, options: dict, upload: bool) -> Job:
        """The job for ``input_path`` with ``options`` after restore's checks of the file and the options and the
        memory estimate against the ranks' memory; :class:`Refused` otherwise. Runs ``restore``'s own code."""
        try:
            with self.decodes:
                return self._check(job_id, input_path, name, options, upload)
        except Refused as exc:  # the client's name for its file, never where the server keeps it
            raise Refused(exc.status, _public(exc.message, input_path, name, self.store.folder(job_id))) from None

    def _check(self, job_id: str, input_path: str, name: str, options: dict, upload: bool) -> Job:
        import torch

        from .. import cli
        from ..media import MediaError, probe_media
        from ..memory.limits import MemoryLimit

        try:
            flags = job_flags(options)
        except (UsageError, ValueError) as exc:
            raise Refused(400, str(exc)) from None
        try:
            info = probe_media(input_path, allow_partial=True)  # its kind; restore's own probe follows
        except MediaError as exc:
            raise Refused(422, str(exc)) from None
        output = os.path.join(self.store.folder(job_id), "result.png" if info.is_image else "result.mp4")
        try:
            args = restore_args(input_path, output, [*self.config.restore_flags, *flags])
        except UsageError as exc:
            raise Refused(400, str(exc)) from None
        launch = cli.Launch(0, self.config.ranks, torch.device(self.pool.device))
        try:
            prepared = cli._prepare(args, launch, cli.StageProgress(cli.STAGES, enabled=False))
            pinned, sp_size, output, demo, dtype, _, info, geometry, _ = prepared
            height, width = geometry.output
            if info.num_frames > self.config.max_frames:
                raise Refused(413, f"the input has {info.num_frames} frames; this server takes at most "
                                   f"{self.config.max_frames} (--max-frames)")
            if height * width > self.config.max_pixels:
                raise Refused(413, f"the output would be {width}x{height} ({height * width} pixels a frame); this "
                                   f"server takes at most {self.config.max_pixels} (--max-pixels)")
            usable = self.pool.usable
            limit = MemoryLimit(usable, "the ranks' free memory with the weights loaded")
            cli.plan_memory(args, pinned, geometry, info.num_frames, dtype, sp_size, launch.device, demo, limit,
                            weights_loaded=True)
        except (MediaError, cli.InputError) as exc:
            raise Refused(422, " ".join(str(exc).split())) from None
        shown = {k: v for k, v in options.items() if v is not None and v != ""}
        return Job(id=job_id, state="queued", created=time.time(), input=input_path, output=output, flags=flags,
                   options=shown, name=name, input_is_upload=upload, frames=info.num_frames)

    def submit(self, job: Job) -> None:
        if self.draining:
            raise Refused(503, "the server is shutting down and takes no new jobs")
        try:
            added = self.store.add(job)
        except RecordError as exc:
            raise Refused(507, str(exc)) from None
        if not added:
            raise Refused(429, f"the queue is full ({self.config.max_queue} jobs waiting, --max-queue); try again "
                               f"later")
        log(f"job {job.id} queued: {job.name!r}, {job.frames} frame(s), options {job.options}")

    # ---- running them ----------------------------------------------------------------------------------------

    def start(self) -> None:
        if self.store.requeued:
            log(f"{self.store.requeued} unfinished job(s) from {self.store.root} queued again")
        self._thread.start()

    def dispatcher_alive(self) -> bool:
        return self._thread.is_alive()

    def _dispatch(self) -> None:
        kill = os.environ.get(TEST_KILL_DISPATCHER_ENV)
        while not self.draining:
            if kill and os.path.exists(kill):
                log("error: the dispatcher is killed (test-only SEEDVR2_SERVE_TEST_KILL_DISPATCHER)")
                raise _KilledForATest(kill)
            job = self.current
            try:
                self._dispatch_one()
            except Exception as exc:  # noqa: BLE001 - a bug or a failed write: that job fails, the queue goes on
                job = self.current or job
                log(f"error: the dispatcher met {type(exc).__name__}: {exc}")
                if job is not None and job.state not in ("done", "failed", "cancelled"):
                    try:
                        self.store.finish(job, "failed", f"internal error: {type(exc).__name__}: {exc}")
                    except Exception:  # noqa: BLE001 - said in memory at least; the queue goes on
                        job.state, job.error = "failed", f"internal error: {type(exc).__name__}: {exc}"
                self.current = None

    def _dispatch_one(self) -> None:
        """One turn of the dispatcher: restart dead ranks, or run the next job (or wait a moment for one)."""
        if not self.pool.can_restart and not self.pool.alive():  # under torchrun, a world that went down idle
            log("error: the world went down; exiting (exit code 1) so that torchrun can start it again")
            os._exit(1)
        if self.health == "down":
            self._start_again()
            return
        job = self.store.next(timeout=0.2)
        if job is None:
            if self.pool.can_restart and not self.pool.alive() and not self.draining:
                log("error: a rank died while idle; starting the ranks again")
                self.health = "down"
            return
        if self.draining:
            self.store.requeue(job)
            return
        self.current = job
        log(f"job {job.id} started")
        started = time.perf_counter()
        try:
            outcome = self._run_resuming(job)
        except StartError as exc:  # the ranks died and did not come back
            if not self.pool.can_restart:
                self.store.requeue(job)
                log(f"error: {exc}; exiting (exit code 1)")
                os._exit(1)
            self.health = "down"
            log(f"error: the ranks could not be started again: {exc}")
            self.store.finish(job, "failed", f"the ranks failed and could not be started again: {exc}")
            log(f"job {job.id} failed: {job.error}")
            self.current = None
            return
        # under torchrun: the world went down (its thread may not have ended yet), torchrun restarts it
        if not self.pool.can_restart and (outcome.died or not self.pool.alive()):
            if job.frames_done > job.frames_reused and not job.cancel_requested:
                # it finished a batch since it (re)started: the next world goes on after its kept batches
                log(f"job {job.id}: {outcome.error}; queued again: it goes on after its kept batches "
                    f"({job.frames_done} of {job.frames} frames) when the world starts again")
                self.store.requeue(job)
            else:  # nothing finished (the job itself may be the cause): it fails, as any job would
                error = None if outcome.error is None else _public(outcome.error, job.input, job.name,
                                                                    self.store.folder(job.id))
                self.store.finish(job, "failed", error)
            log("error: the world went down; exiting (exit code 1) so that torchrun can start it again")
            os._exit(1)
        seconds = time.perf_counter() - started
        if ((outcome.state == "cancelled" and self.interrupting) or (outcome.died and self.draining)) \
                and not job.cancel_requested:
            log(f"job {job.id} queued again at its batch boundary ({job.frames_done} of {job.frames} frames kept)")
            self.store.requeue(job)  # stopped by the drain: the next server on this state folder continues it
        else:
            error = None if outcome.error is None else _public(outcome.error, job.input, job.name,
                                                                self.store.folder(job.id))
            self.store.finish(job, outcome.state, error)
            said = {"done": f"done: {job.frames} frame(s) in {time.perf_counter() - started:.1f}s",
                    "cancelled": "cancelled", "failed": f"failed: {job.error}"}
            log(f"job {job.id} {said.get(job.state, job.state)}")
        if outcome.state == "done" and job.state == "done":
            self.frames_restored += job.frames
            self.restore_seconds += seconds
            restored = job.frames - job.frames_reused  # this run's own frames (the reused ones cost no time)
            self.last_fps = restored / seconds if seconds > 0 else 0.0
        self.current = None

    def _run_resuming(self, job: Job) -> Outcome:
        """Run ``job`` on the ranks; while a rank dies mid-job (the pool restarts the ranks), run it again: it goes on
        after its kept batches, unless it was cancelled, the server drains, or its ranks died
        :data:`DEATHS_WITHOUT_PROGRESS` times in a row without finishing a batch."""
        strikes = 0
        while True:
            self.store.clear_partials(job)  # a killed rank's (its kept batches stay)
            self.store.resumed(job, 0, job.frames)  # until this run's ranks say where it starts
            outcome = self.pool.run(job.id, job.input, job.output, job.flags,
                                    os.path.join(self.store.folder(job.id), "cancel"),
                                    functools.partial(self._on_event, job))
            if not outcome.died or not self.pool.can_restart or job.cancel_requested or self.draining:
                if outcome.died and job.cancel_requested:
                    return Outcome("cancelled", restarted=True)
                return outcome
            strikes = 0 if job.frames_done > job.frames_reused else strikes + 1
            if strikes >= DEATHS_WITHOUT_PROGRESS:
                return Outcome("failed", f"{outcome.error} (its ranks died {strikes} times in a row without "
                                         f"finishing a batch of it)", restarted=True, died=True)
            log(f"job {job.id}: {outcome.error}; it goes on after its kept batches ({job.frames_done} of "
                f"{job.frames} frames)")

    def _on_event(self, job: Job, event: dict) -> None:
        """A running job's event from rank 0 (see :mod:`.worker`): its progress, the frames it reused, a batch."""
        kind = event.get("event")
        if kind == "progress":
            self.store.progress(job, int(event["frames"]), int(event["total"]))
        elif kind == "resumed":
            reused = int(event["frames"])
            self.store.resumed(job, reused, int(event["total"]))
            if reused:
                self.frames_reused += reused
                log(f"job {job.id} resumed: {reused} of {job.frames} frames reused from its kept batches")
        elif kind == "batch":
            self.store.batch_started(job)

    def _start_again(self) -> None:
        try:
            self.pool.restart()
            self.health = "ok"
            log("the ranks are running again")
        except StartError as exc:
            log(f"error: the ranks could not be started again: {exc}; retrying in {RETRY_S:.0f}s")
            deadline = time.monotonic() + RETRY_S
            while time.monotonic() < deadline and not self.draining:
                time.sleep(0.2)

    def cancel(self, job: Job) -> None:
        self.store.cancel(job)
        log(f"job {job.id} cancel asked ({'at once' if job.state == 'cancelled' else 'at its next batch'})")

    def drain(self, on_drained) -> None:
        """Stop taking jobs; let the running one finish for ``--drain-timeout`` seconds, then stop it at its next
        batch boundary (queued again, its finished batches kept); stop the ranks; call ``on_drained``. Runs on its own
        thread."""
        self.draining = True
        log("SIGTERM: draining (no new jobs)")
        self.pool.announce_drain()
        deadline = time.monotonic() + self.config.drain_timeout
        while self.current is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        job = self.current
        if job is not None:
            log(f"drain timeout: stopping job {job.id} at its next batch boundary (queued again for the next server on "
                f"this state folder, after its finished batches)")
            self.interrupting = True
            open(os.path.join(self.store.folder(job.id), "cancel"), "w").close()
        self._thread.join()
        self.pool.stop()
        self.health = "stopped"
        on_drained()


def _public(message: str, input_path: str, name: str, folder: str) -> str:
    """``message`` with the server's paths of a job replaced by the client's file name and 'the result'."""
    message = message.replace(input_path, name)
    for result in ("result.mp4", "result.png"):
        message = message.replace(os.path.join(folder, result), "the result")
    return message.replace(folder + os.sep, "")


