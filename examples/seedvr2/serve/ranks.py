"""The server's ranks: N worker processes (:mod:`.worker`) started as ``restore --ranks N`` starts its ranks.

:class:`RankPool` starts them with the launcher's environment (loopback rendezvous, one GPU a rank, the CPU cores
shared), waits until every rank has loaded the weights, hands each job to all of them (one JSON line on each stdin)
and collects their answers. A rank that dies (or a job that breaks the process group) fails the running job with one
line; the pool then stops the other ranks (SIGTERM, SIGKILL after :data:`KILL_S`) and starts fresh ones, so the next
job runs on a healthy world (the server then runs the job again: it continues after its kept batches). Nothing here
imports torch.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..cli import launcher

__all__ = ["RankPool", "Outcome", "StartError", "remove_stale_workdirs", "WORKDIR_PREFIX"]

#: the ranks' temporary folder: ``<tmp>/seedvr2-serve-ranks-<server pid>-<random>`` (removed when the pool stops,
#: and by the next server when the one that made it is gone)
WORKDIR_PREFIX = "seedvr2-serve-ranks-"

#: seconds the ranks get to leave after SIGTERM before SIGKILL
KILL_S = 5.0
#: seconds the other ranks get to answer once one answered that its job broke the process group (an allocation that
#: failed on it: it leaves without meeting them, and they fail in their next collective); then they are stopped
BROKEN_GRACE_S = 10.0


class StartError(RuntimeError):
    """The ranks could not start (the weights do not load, a rank died while loading): one line."""


@dataclass
class Outcome:
    """What a job came to: done / failed / cancelled, the one-line error, and whether the ranks were restarted."""

    state: str
    error: Optional[str] = None
    restarted: bool = False
    peaks: dict = field(default_factory=dict)
    died: bool = False  # a rank died (killed, or exited) mid-job: the job can go on after its kept batches


#: the events of a running job the server follows (see :mod:`.worker`)
PROGRESS_EVENTS = ("progress", "resumed", "batch")


def take_event(rank: int, event: dict, job_id: str, answers: dict[int, dict],
               on_event: Callable[[dict], None]) -> None:
    """One rank's event about the job ``job_id``: progress, resume and batch events go to ``on_event``, the rank's
    final answer into ``answers`` (events of other jobs are ignored)."""
    if event.get("id") != job_id:
        return
    if event.get("event") in PROGRESS_EVENTS:
        on_event(event)
    elif event.get("event") == "done":
        answers[rank] = event


def ranks_answers(answers: dict[int, dict], peaks: dict) -> list[dict]:
    """Every rank's final answer in rank order, each rank's peak memory recorded in ``peaks``."""
    for rank, answer in answers.items():
        peaks[rank] = float(answer.get("peak_bytes") or 0)
    return [answers[r] for r in sorted(answers)]


def job_outcome(ordered: Sequence[dict], restarted: bool = False) -> Outcome:
    """What the ranks' final answers (rank order) make of the job: cancelled, done, or failed with the first error."""
    if all(a.get("cancelled") for a in ordered):
        return Outcome("cancelled", restarted=restarted)
    if all(a.get("code") == 0 for a in ordered):
        return Outcome("done", restarted=restarted)
    errors = [a["error"] for a in ordered if a.get("error")]
    return Outcome("failed", errors[0] if errors else "the restore failed (no message)", restarted=restarted)


def remove_stale_workdirs(log=None) -> list[str]:
    """Remove the ranks' temporary folders that servers no longer running left (one killed with SIGKILL cannot
    remove its own); returns what was removed."""
    removed = []
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(WORKDIR_PREFIX):
            continue
        pid = name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(root, name)
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue  # its server runs (or the name is not one this code makes)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed and log is not None:
        log(f"removed {len(removed)} temporary folder(s) of servers that are gone: {', '.join(removed)}")
    return removed


def _death(rank: int, code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"rank {rank} was killed by {name}{hint}; the ranks were restarted"
    return f"rank {rank} exited with code {code}; the ranks were restarted"


class RankPool:
    """N warm ranks. ``restore_flags`` are the server's model, weight, memory and SP flags of ``restore``."""

    can_restart = True  # the pool starts its ranks itself (under torchrun, see .world, it cannot)

    def __init__(self, ranks: int, restore_flags: Sequence[str], log=None) -> None:
        self.ranks, self.flags = ranks, list(restore_flags)
        self.log = log or (lambda line: print(f"serve: {line}", file=sys.stderr, flush=True))
        self.procs: list[subprocess.Popen] = []
        self.events: "queue.Queue[tuple[int, Optional[dict]]]" = queue.Queue()
        self.usable: Optional[int] = None  # the smallest usable memory of any rank after loading
        self.device = "cpu"
        self.peaks: dict[int, float] = {}
        self.restarts = 0
        self.restarting = False
        self._workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")

    # ---- start and stop --------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 3600.0) -> None:
        """Start the ranks and wait until each has loaded the weights; :class:`StartError` otherwise."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the rank processes (they load the weights meanwhile; :meth:`wait_ready` waits for them)."""
        cpus = os.cpu_count() or 1
        port = launcher.free_port()
        marker = os.path.join(self._workdir, "failed")
        self.events = queue.Queue()
        self.procs = []
        for rank in range(self.ranks):
            env = launcher.rank_environment(os.environ, rank, self.ranks, port, marker, cpus)
            proc = subprocess.Popen([sys.executable, "-m", "examples.seedvr2.serve.worker", *self.flags], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                    preexec_fn=launcher._prepare_rank)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(rank, proc), daemon=True).start()

    def wait_ready(self, timeout_s: float = 3600.0) -> None:
        """Wait until every rank has loaded the weights; :class:`StartError` (every rank stopped) otherwise."""
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.ranks:
            try:
                rank, event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise StartError(f"the ranks did not load the weights within {timeout_s:.0f}s") from None
            if event is None or event.get("event") == "failed":
                error = (event or {}).get("error") or _death(rank, self._wait_code(rank)).split(";")[0]
                self.stop()
                raise StartError(error)
            if event.get("event") == "ready":
                ready[rank] = event
        usable = [e["usable"] for e in ready.values() if e.get("usable") is not None]
        self.usable = min(usable) if usable else None
        self.device = ready[0].get("device", "cpu")
        self.peaks = {rank: float(e.get("peak_bytes") or 0) for rank, e in ready.items()}

    def stop(self) -> None:
        """Ask the ranks to leave (quit line, then SIGTERM, then SIGKILL); wait for all of them."""
        for proc in self.procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write(json.dumps({"quit": True}) + "\n")
                    proc.stdin.flush()
            except OSError:
                pass
        self._end(grace=KILL_S)
        self.cleanup()

    def cleanup(self) -> None:
        """Remove the ranks' temporary folder (their partial outputs' records and markers)."""
        shutil.rmtree(self._workdir, ignore_errors=True)

    def announce_drain(self) -> None:
        """Nothing to say: the pool's ranks get no signal of their own (it stops them)."""

    def _end(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for sig, wait in ((signal.SIGTERM, KILL_S), (signal.SIGKILL, 30.0)):
            alive = [p for p in self.procs if p.poll() is None]
            for p in alive:
                try:
                    p.send_signal(sig)
                except OSError:
                    pass
            deadline = time.monotonic() + wait
            while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
                time.sleep(0.05)
        for p in self.procs:
            for stream in (p.stdin, p.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass

    def restart(self) -> None:
        """Stop every rank at once and start fresh ones (reloading the weights)."""
        self.restarting = True
        try:
            self._end(grace=0.0)
            self.restarts += 1
            self.start()
        finally:
            self.restarting = False

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    # ---- jobs ------------------------------------------------------------------------------------------------

    def run(self, job_id: str, input_path: str, output: str, flags: Sequence[str], cancel_path: str,
            on_event: Callable[[dict], None]) -> Outcome:
        """Restore one job on every rank; returns when every rank answered, or one died (then restarts them)."""
        line = json.dumps({"id": job_id, "input": input_path, "output": output, "flags": list(flags),
                           "cancel": cancel_path}) + "\n"
        for rank, proc in enumerate(self.procs):
            try:
                assert proc.stdin is not None
                proc.stdin.write(line)
                proc.stdin.flush()
            except (OSError, ValueError):
                return self._after_death(rank)
        answers: dict[int, dict] = {}
        broken_since: Optional[float] = None
        while len(answers) < self.ranks:
            try:
                rank, event = self.events.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.poll() is not None and r not in answers]
                if dead:
                    return self._after_death(dead[0])
                if broken_since is not None and time.monotonic() - broken_since > BROKEN_GRACE_S:
                    break  # the others are stopped with the restart
                continue
            if event is None:
                if rank in answers:  # it answered, then left: its job broke the process group (see below)
                    continue
                return self._after_death(rank)
            take_event(rank, event, job_id, answers, on_event)
            if broken_since is None and any(a.get("broken") for a in answers.values()):
                broken_since = time.monotonic()
        ordered = ranks_answers(answers, self.peaks)
        restarted = False
        if any(a.get("broken") for a in ordered):
            self.restart()
            restarted = True
        return job_outcome(ordered, restarted)

    def _after_death(self, rank: int) -> Outcome:
        code = self._wait_code(rank)
        message = _death(rank, code)
        self.log(f"error: {message}")
        self.restart()
        return Outcome("failed", message, restarted=True, died=True)

    def _wait_code(self, rank: int) -> int:
        proc = self.procs[rank]
        try:
            return proc.wait(timeout=KILL_S)
        except subprocess.TimeoutExpired:
            return 1

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        events = self.events
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                try:
                    events.put((rank, json.loads(line)))
                except ValueError:
                    continue
        except (OSError, ValueError):
            pass
        events.put((rank, None))
