"""``python -m examples.seedvr2 serve``: the HTTP process. It starts the ranks (:mod:`.ranks`), checks each job before
accepting it (``restore``'s own checks and memory estimate), queues it (:mod:`.jobs`) and hands the jobs to the
ranks one at a time from a dispatcher thread; the API is :mod:`.app`'s. SIGTERM drains: no new jobs, the running one
finishes or is cancelled after ``--drain-timeout`` (and queued again in the state folder), then the process exits 0.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

from .jobs import Job, JobStore
from .options import UsageError, check_restore_flags, job_flags, parse_serve, restore_args
from .ranks import RankPool, StartError

__all__ = ["Server", "Refused", "main"]

PROG = "python -m examples.seedvr2 serve"
#: seconds between attempts to start the ranks again when a restart failed
RETRY_S = 10.0


class Refused(Exception):
    """A job not accepted: the HTTP status and the one-line reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def log(line: str) -> None:
    print(f"serve: {line}", file=sys.stderr, flush=True)


class Server:
    """The queue, the ranks and the dispatcher between them."""

    def __init__(self, config, state_dir: str, pool: RankPool) -> None:
        self.config, self.pool = config, pool
        self.store = JobStore(state_dir, config.max_queue, config.max_results, int(config.max_results_mb * 2**20))
        self.health = "ok"
        self.draining = False
        self.current: Optional[Job] = None
        self.interrupting = False
        self.frames_restored = 0
        self.restore_seconds = 0.0
        self.last_fps = 0.0
        self._thread = threading.Thread(target=self._dispatch, name="dispatcher", daemon=True)

    # ---- accepting jobs --------------------------------------------------------------------------------------

    def check(self, job_id: str, input_path: str, name: str, options: dict, upload: bool) -> Job:
        """The job for ``input_path`` with ``options`` after restore's checks of the file and the options and the
        memory estimate against the ranks' memory; :class:`Refused` otherwise. Runs ``restore``'s own code."""
        try:
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
        if not self.store.add(job):
            raise Refused(429, f"the queue is full ({self.config.max_queue} jobs waiting, --max-queue); try again "
                               f"later")

    # ---- running them ----------------------------------------------------------------------------------------

    def start(self) -> None:
        if self.store.requeued:
            log(f"{self.store.requeued} unfinished job(s) from {self.store.root} queued again")
        self._thread.start()

    def _dispatch(self) -> None:
        while not self.draining:
            if not self.pool.can_restart and not self.pool.alive():  # under torchrun, a world that went down idle
                log("error: the world went down; exiting (exit code 1) so that torchrun can start it again")
                os._exit(1)
            if self.health == "down":
                self._start_again()
                continue
            job = self.store.next(timeout=0.2)
            if job is None:
                continue
            if self.draining:
                self.store.requeue(job)
                break
            self.current = job
            started = time.perf_counter()
            try:
                outcome = self.pool.run(job.id, job.input, job.output, job.flags,
                                        os.path.join(self.store.folder(job.id), "cancel"),
                                        functools.partial(self.store.progress, job))
            except StartError as exc:  # the ranks died and did not come back
                if not self.pool.can_restart:
                    self.store.requeue(job)
                    log(f"error: {exc}; exiting (exit code 1)")
                    os._exit(1)
                self.health = "down"
                log(f"error: the ranks could not be started again: {exc}")
                self.store.finish(job, "failed", f"the ranks failed and could not be started again: {exc}")
                self.current = None
                continue
            if not self.pool.can_restart and not self.pool.alive():  # under torchrun: torchrun restarts the world
                error = None if outcome.error is None else _public(outcome.error, job.input, job.name,
                                                                    self.store.folder(job.id))
                self.store.finish(job, "failed", error)
                log("error: the world went down; exiting (exit code 1) so that torchrun can start it again")
                os._exit(1)
            seconds = time.perf_counter() - started
            if outcome.state == "cancelled" and self.interrupting and not job.cancel_requested:
                self.store.requeue(job)  # stopped by the drain: the next server on this state folder runs it
            else:
                error = None if outcome.error is None else _public(outcome.error, job.input, job.name,
                                                                    self.store.folder(job.id))
                self.store.finish(job, outcome.state, error)
            if outcome.state == "done":
                self.frames_restored += job.frames
                self.restore_seconds += seconds
                self.last_fps = job.frames / seconds if seconds > 0 else 0.0
            self.current = None

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

    def drain(self, on_drained) -> None:
        """Stop taking jobs; let the running one finish for ``--drain-timeout`` seconds, then cancel it; stop the
        ranks; call ``on_drained``. Runs on its own thread."""
        self.draining = True
        log("SIGTERM: draining (no new jobs)")
        self.pool.announce_drain()
        deadline = time.monotonic() + self.config.drain_timeout
        while self.current is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        job = self.current
        if job is not None:
            log(f"drain timeout: cancelling job {job.id} (queued again for the next server on this state folder)")
            self.interrupting = True
            open(os.path.join(self.store.folder(job.id), "cancel"), "w").close()
        self._thread.join()
        self.pool.stop()
        self.health = "stopped"
        on_drained()


def _import_the_checks() -> None:
    """Import what accepting a job runs (restore's checks and memory estimate) now, not on the first upload."""
    from ..cli import restore  # noqa: F401
    from ..media import reading  # noqa: F401
    from ..memory import fit, limits  # noqa: F401
    from ..restore import pipeline  # noqa: F401


def _public(message: str, input_path: str, name: str, folder: str) -> str:
    """``message`` with the server's paths of a job replaced by the client's file name and 'the result'."""
    message = message.replace(input_path, name)
    for result in ("result.mp4", "result.png"):
        message = message.replace(os.path.join(folder, result), "the result")
    return message.replace(folder + os.sep, "")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``serve``; returns the exit code (0 after a drain, 2 for a mistake or ranks that fail)."""
    argv = list(sys.argv[2:] if argv is None else argv)
    from ..cli.launcher import LAUNCHED_ENV, LaunchError, check_ranks, gpu_count

    world = int(os.environ.get("WORLD_SIZE") or 1)
    torchrun = world > 1 and not os.environ.get(LAUNCHED_ENV)
    rank = int(os.environ.get("RANK") or 0) if torchrun else 0
    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        print(f"{PROG}: error: serve needs the serve extra ({exc.name} is missing): pip install -e \".[serve]\"",
              file=sys.stderr)
        return 2
    try:
        config = parse_serve(argv, check_restore=False)  # restore's own flags: while the ranks start (torch)
        if torchrun:
            if config.ranks not in (1, world):
                raise UsageError(f"--ranks {config.ranks} under torchrun's {world} ranks: leave --ranks out")
            config.ranks = world
            if rank != 0:
                from .world import follow

                return follow(config.restore_flags, config.drain_timeout)
        else:
            check_ranks(str(config.ranks), gpu_count(), os.cpu_count() or 1)
        sock = _bind(config.host, config.port)
    except (UsageError, LaunchError) as exc:
        if rank == 0:
            print(f"{PROG}: error: {exc} (see {PROG} --help)", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    temporary = config.state_dir is None
    state_dir = tempfile.mkdtemp(prefix="seedvr2-serve-") if temporary else config.state_dir
    os.makedirs(state_dir, exist_ok=True)
    if torchrun:
        from .world import WorldPool

        pool = WorldPool(config.restore_flags, log)
    else:
        pool = RankPool(config.ranks, config.restore_flags, log=log)
    try:
        pool.launch()
        try:
            check_restore_flags(config.restore_flags)
            _import_the_checks()
        except UsageError as exc:
            pool.stop()
            print(f"{PROG}: error: {exc} (see {PROG} --help)", file=sys.stderr)
            return 2
        log(f"started {config.ranks} rank(s); loading the weights")
        try:
            pool.wait_ready()
        except StartError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
        server = Server(config, state_dir, pool)
        http = _http_server(uvicorn.Config(create_app(server), log_level="warning", timeout_graceful_shutdown=5),
                            server)
        server.start()
        host, port = sock.getsockname()[:2]
        log(f"listening on http://{host}:{port} ({config.ranks} rank(s) ready, state in {state_dir})")
        http.run(sockets=[sock])
        if not server.draining:  # uvicorn stopped for another reason: stop the ranks all the same
            server.draining = True
            pool.stop()
        log("stopped")
        return 0
    finally:
        if pool.alive():  # only on the way out of an unexpected error: no rank outlives the server
            pool._end(grace=0.0)
        sock.close()
        if temporary:
            shutil.rmtree(state_dir, ignore_errors=True)


def _http_server(config, server: Server):
    """uvicorn's server, whose first SIGTERM / SIGINT drains (see :meth:`Server.drain`) instead of stopping at once;
    a second SIGINT stops at once."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if server.draining:
                if sig == signal.SIGINT:
                    self.force_exit = self.should_exit = True
                return
            threading.Thread(target=server.drain, args=(self._drained,), daemon=True).start()

        def _drained(self) -> None:
            self.should_exit = True

    return Draining(config)
