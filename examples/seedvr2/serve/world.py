"""``serve`` under torchrun: the ranks are torchrun's, rank 0 serves HTTP, and jobs travel through the process group.

Every rank runs the same :func:`.worker.serve_jobs` loop as a rank of ``serve --ranks N``; what differs is how jobs
and answers travel. Rank 0 runs the loop on a thread of the HTTP process (:class:`WorldPool`, the same interface as
:class:`.ranks.RankPool`), and at least every :data:`HEARTBEAT_S` seconds shares a message with every rank (one
all-gather of bytes through winsp's world group): a job, ``quit``, or nothing (which keeps an idle world inside the
collective timeout). After each job every rank shares its answer the same way, so rank 0 has every rank's line.

torchrun owns the processes, and its SIGTERM reaches every rank at once, both when it is stopped (rank 0 then
drains) and when it stops the world because a rank died (to start it again). The other ranks tell the two apart
through the process group's store: rank 0 marks its drain there (:data:`DRAIN_KEY`), and a rank that got SIGTERM
stays for rank 0's ``quit`` while that mark is there (at most the drain timeout and :data:`DRAIN_MARGIN_S`), and
leaves within :data:`RANK0_WAIT_S` seconds when it is not; before it is ready (joining the world, loading the
weights) it leaves at once. Its jobs run on a thread, so that the signal is handled while that thread is blocked in a
collective. A rank that dies takes the world down with it; rank 0 then records the running job as failed and exits
1, so that torchrun (``--max-restarts``) starts the world again, and with the same ``--state-dir`` the queue goes on
(a job rank 0 was running when it died itself is queued again). Every rank reads the job's input: across machines
the state folder (and ``--allow-paths``) must be on a shared file system.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

from .ranks import Outcome, StartError, job_outcome, ranks_answers, take_event
from .worker import is_stop

__all__ = ["WorldPool", "follow", "HEARTBEAT_S", "DRAIN_KEY", "RANK0_WAIT_S", "DRAIN_MARGIN_S"]

#: the longest an idle world waits between two shared messages
HEARTBEAT_S = 1.0
#: the key in the process group's store (this attempt's: see winsp.comm.group) by which rank 0 says it drains
DRAIN_KEY = "seedvr2/serve/draining"
#: seconds a rank that got SIGTERM waits for rank 0's drain mark before it leaves (torchrun signals all at once)
RANK0_WAIT_S = 5.0
#: seconds beyond the drain timeout a rank waits for rank 0's ``quit`` once rank 0 drains (its job's last batch)
DRAIN_MARGIN_S = 30.0
#: the signals that stop a rank (SIGINT: a Ctrl-C reaches every process of the terminal's group)
STOPS = (signal.SIGTERM, signal.SIGINT)


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _exception_line(exc: BaseException) -> str:
    """An exception as one line for the log: its type and its first 200 characters, whitespace folded."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _rank0_drains() -> bool:
    """Whether rank 0 marked its drain in the store (False when the store or the group is gone)."""
    try:
        return bool(_store().check([DRAIN_KEY]))
    except Exception:  # noqa: BLE001 - no group yet or any more, or torchrun's store is gone: no drain to wait for
        return False


def share(text: str, device) -> list[str]:
    """Every rank's ``text`` (UTF-8), in rank order: two all-gathers (the lengths, then the padded bytes)."""
    from winsp.comm.group import SPGroup

    world = SPGroup.world()
    data = list(text.encode())
    lengths = [row[0] for row in world.all_gather_ints([len(data)], device=device)]
    rows = world.all_gather_ints(data + [0] * (max(max(lengths), 1) - len(data)), device=device)
    return [bytes(row[:n]).decode() for row, n in zip(rows, lengths, strict=True)]


class _Answers:
    """Where rank 0's loop sends a message: to every rank's answers after a job, the others' gathered."""

    def __init__(self, events: "queue.Queue", device_of: Callable[[], object]) -> None:
        self.events, self.device_of = events, device_of

    def send(self, **message) -> None:  # progress lines: rank 0's alone, straight to the server
        self.events.put((0, message))

    def answer(self, message: dict) -> None:
        if message.get("event") == "progress" or message.get("broken"):  # broken: see _share_unless_broken
            self.events.put((0, message))
            return
        for rank, text in enumerate(share(json.dumps(message), self.device_of())):
            self.events.put((rank, json.loads(text)))


def _share_unless_broken(message: dict, device) -> None:
    """A rank's answer to every rank, unless its job broke the process group (an allocation failed mid-run: the rank
    left the others in a collective and said why on stderr); sharing it then would meet them in a collective that
    is not theirs. It leaves, and the world goes down (torchrun restarts it)."""
    if not message.get("broken"):
        share(json.dumps(message), device)


def _jobs_from_rank0(device_of: Callable[[], object], mine: Optional["queue.Queue"] = None) -> Iterator[dict]:
    """The jobs rank 0 shares: on rank 0 from ``mine`` (nothing for :data:`HEARTBEAT_S`: an empty message)."""
    while True:
        text = ""
        if mine is not None:
            try:
                text = json.dumps(mine.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                pass
        shared = share(text, device_of())[0]
        if shared:
            yield json.loads(shared)


class WorldPool:
    """Rank 0's side: the loop on a thread, jobs handed to it, the answers of every rank back (see the module)."""

    can_restart = False

    def __init__(self, restore_flags: Sequence[str], log) -> None:
        self.flags, self.log = list(restore_flags), log
        self.events: "queue.Queue" = queue.Queue()
        self.jobs: "queue.Queue" = queue.Queue()
        self.ranks = 0
        self.usable: Optional[int] = None
        self.device = "cpu"
        self.peaks: dict[int, float] = {}
        self.restarts = 0
        self.restarting = False
        self._thread: Optional[threading.Thread] = None
        self._rank = None

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rank0", daemon=True)
        self._thread.start()

    def wait_ready(self) -> None:
        ready: dict[int, dict] = {}
        while True:
            rank, event = self.events.get()
            if event is None or event.get("event") == "failed":
                raise StartError((event or {}).get("error") or "rank 0 failed while loading the weights")
            if event.get("event") == "ready":
                ready[rank] = event
                self.ranks = int(event["world"])
                if len(ready) == self.ranks:
                    break
        usable = [e["usable"] for e in ready.values() if e.get("usable") is not None]
        self.usable = min(usable) if usable else None
        self.device = ready[0].get("device", "cpu")
        self.peaks = {rank: float(e.get("peak_bytes") or 0) for rank, e in ready.items()}

    def _loop(self) -> None:
        from .worker import Rank, serve_jobs

        ended = "broken"
        try:
            answers = _Answers(self.events, lambda: self._rank.launch.device)
            self._rank = Rank(self.flags, answers)
            ended = serve_jobs(self._rank, _jobs_from_rank0(lambda: self._rank.launch.device, self.jobs),
                               answers.answer)
        except Exception as exc:  # noqa: BLE001 - a peer gone: the world is down (torchrun restarts it)
            self.log(f"error: the world failed: {_exception_line(exc)}")
        finally:
            self.events.put((0, None))
            if self._rank is not None:
                self._rank.launch.close(failed=ended == "broken")

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, job_id: str, input_path: str, output: str, flags: Sequence[str], cancel_path: str,
            on_event: Callable[[dict], None]) -> Outcome:
        if not self.alive():
            raise StartError("the world is down (torchrun restarts it)")
        self.jobs.put({"id": job_id, "input": input_path, "output": output, "flags": list(flags),
                       "cancel": cancel_path})
        answers: dict[int, dict] = {}
        while len(answers) < self.ranks:
            rank, event = self.events.get()
            if event is None:  # rank 0's own line first when it says why (it ran out of memory, say)
                said = [a["error"] + "; " for a in answers.values() if a.get("error") and not is_stop(a["error"])]
                return Outcome("failed", f"{''.join(said[:1]) or 'a rank failed and '}the world went down (torchrun "
                                         f"restarts it)", died=True)
            take_event(rank, event, job_id, answers, on_event)
        return job_outcome(ranks_answers(answers, self.peaks))

    def restart(self) -> None:
        raise StartError("under torchrun the ranks are torchrun's to restart (--max-restarts)")

    def stop(self) -> None:
        if self.alive():
            self.jobs.put({"quit": True})
            assert self._thread is not None
            self._thread.join(timeout=60)

    def announce_drain(self) -> None:
        """Mark the drain in the store, so that the other ranks, signalled too, stay for it (see the module)."""
        try:
            _store().set(DRAIN_KEY, "1")
        except Exception as exc:  # noqa: BLE001 - the world is down: nobody to stay
            self.log(f"note: could not tell the other ranks about the drain ({type(exc).__name__})")

    def _end(self, grace: float) -> None:
        self.stop()


def follow(restore_flags: Sequence[str], drain_timeout: float) -> int:
    """A rank other than 0 under torchrun: the jobs rank 0 shares, until it says quit. The jobs run on a thread; this
    one handles SIGTERM / SIGINT as the module says."""
    outcome: dict = {"code": 2}
    signalled: list[tuple[int, float]] = []
    for stop in STOPS:
        signal.signal(stop, lambda signum, frame: signalled.append((signum, time.monotonic())))
    thread = threading.Thread(target=_follow, args=(restore_flags, outcome), name="jobs", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
        if signalled and thread.is_alive():
            signum, since = signalled[0]
            wait, why = _leave_after(outcome.get("ready", False), drain_timeout)
            if time.monotonic() - since >= wait:
                print(f"serve: rank {os.environ.get('RANK', '?')}: stopped by {signal.Signals(signum).name} ({why})",
                      file=sys.stderr, flush=True)
                os._exit(128 + signum)  # its sockets close: a peer's collective with it fails at once
    return outcome["code"]


def _leave_after(ready: bool, drain_timeout: float) -> tuple[float, str]:
    """How long after a stop signal a rank other than 0 leaves, and why then (see the module)."""
    if not ready:
        return 0.0, "during start-up"
    if _rank0_drains():
        return drain_timeout + DRAIN_MARGIN_S, "rank 0 drained but did not end the world in time"
    return RANK0_WAIT_S, "rank 0 is not draining: the world is being stopped"


def _follow(restore_flags: Sequence[str], outcome: dict) -> None:
    """The jobs thread of :func:`follow`: ``outcome`` gets ``ready`` once the warm-up worked, and ``code``."""
    from .worker import Rank, serve_jobs

    try:
        rank = Rank(restore_flags, None)  # joins the world
    except Exception as exc:  # noqa: BLE001 - rank 0 or a peer is gone already (torchrun restarts the world)
        print(f"serve: rank {os.environ.get('RANK', '?')}: stopped while joining the world: {_exception_line(exc)}",
              file=sys.stderr)
        return
    ended = "broken"
    try:
        device_of = lambda: rank.launch.device  # noqa: E731

        def answer(message: dict) -> None:
            if message.get("event") == "ready":
                outcome["ready"] = True
            _share_unless_broken(message, device_of())

        ended = serve_jobs(rank, _jobs_from_rank0(device_of), answer)
        outcome["code"] = 0 if ended == "quit" else 2
    except Exception as exc:  # noqa: BLE001 - rank 0 or a peer went away: leave (torchrun restarts the world)
        print(f"serve: rank {rank.launch.rank}: stopped: {_exception_line(exc)}", file=sys.stderr)
    finally:
        rank.launch.close(failed=ended == "broken")
