"""``serve`` under torchrun: the ranks are torchrun's, rank 0 serves HTTP, and jobs travel through the process group.

Every rank runs the same :func:`.worker.serve_jobs` loop as a rank of ``serve --ranks N``; what differs is how jobs
and answers travel. Rank 0 runs the loop on a thread of the HTTP process (:class:`WorldPool`, the same interface as
:class:`.ranks.RankPool`), and at least every :data:`HEARTBEAT_S` seconds shares a message with every rank (one
all-gather of bytes through winsp's world group): a job, ``quit``, or nothing (which keeps an idle world inside the
collective timeout). After each job every rank shares its answer the same way, so rank 0 has every rank's line.

torchrun owns the processes: the other ranks ignore SIGTERM (rank 0 drains, then tells them to quit), and a rank
that dies takes the world down with it; rank 0 then records the running job as failed and exits 1, so that torchrun
(``--max-restarts``) starts the world again, and with the same ``--state-dir`` the queue goes on. Every rank reads
the job's input: across machines the state folder (and ``--allow-paths``) must be on a shared file system.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
from typing import Callable, Iterator, Optional, Sequence

from .ranks import Outcome, StartError, job_outcome, ranks_answers, take_event
from .worker import is_stop

__all__ = ["WorldPool", "follow", "HEARTBEAT_S"]

#: the longest an idle world waits between two shared messages
HEARTBEAT_S = 1.0


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
            self.log(f"error: the world failed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
        finally:
            self.events.put((0, None))
            if self._rank is not None:
                self._rank.launch.close(failed=ended == "broken")

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, job_id: str, input_path: str, output: str, flags: Sequence[str], cancel_path: str,
            on_progress: Callable[[int, int], None]) -> Outcome:
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
                                         f"restarts it)")
            take_event(rank, event, job_id, answers, on_progress)
        return job_outcome(ranks_answers(answers, self.peaks))

    def restart(self) -> None:
        raise StartError("under torchrun the ranks are torchrun's to restart (--max-restarts)")

    def stop(self) -> None:
        if self.alive():
            self.jobs.put({"quit": True})
            assert self._thread is not None
            self._thread.join(timeout=60)

    def _end(self, grace: float) -> None:
        self.stop()


def follow(restore_flags: Sequence[str]) -> int:
    """A rank other than 0 under torchrun: the jobs rank 0 shares, until it says quit."""
    from .worker import Rank, serve_jobs

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains and then says quit
    rank = Rank(restore_flags, None)
    ended = "broken"
    try:
        device_of = lambda: rank.launch.device  # noqa: E731
        ended = serve_jobs(rank, _jobs_from_rank0(device_of),
                           lambda message: _share_unless_broken(message, device_of()))
        return 0 if ended == "quit" else 2
    except Exception as exc:  # noqa: BLE001 - rank 0 or a peer went away: leave (torchrun restarts the world)
        print(f"serve: rank {rank.launch.rank}: stopped: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}",
              file=sys.stderr)
        return 2
    finally:
        rank.launch.close(failed=ended == "broken")
