"""Where a restore's time goes on this rank: wall and CPU seconds per named stage, for the per-stage profile.

The pipeline and the command line mark their stages (``with stage_clock.stage("encode"): ...``); nothing is recorded
unless profiling was switched on (:func:`enable`), so the marks cost a function call when it is off. The command
line switches it on when ``SEEDVR2_PROFILE`` names a directory and then writes this rank's figures there as
``rank<N>.json`` (see ``benchmarks/bench_restore_profile.py``, which reads them).

Recorded per stage: wall seconds, CPU seconds of the thread that ran it (a rank's busy time, which also holds on a
loaded machine) and of the whole process (all its intra-op threads, and the background threads meanwhile), the
number of times it ran, and, with ``comm=True``, the part of its wall time spent inside the
group's collectives and receives (a rank waiting for its peers). Stages run by the background reader or writer
threads are recorded with a ``bg`` prefix (``bg read``, ``bg write``): they overlap the compute stages.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Iterable, Iterator, Optional, TypeVar

__all__ = ["PROFILE_ENV", "StageClock", "enable", "disable", "active", "stage", "timed_iter", "add_wait",
           "write_profile"]

#: names a directory: the command line writes each rank's stage figures there
PROFILE_ENV = "SEEDVR2_PROFILE"


class StageClock:
    """Sums of wall / thread-CPU / collective seconds and counts per stage name (thread-safe), plus named instants
    (epoch seconds) such as when ``main`` was entered."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.comm: dict[str, float] = {}
        self.process_cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.instants: dict[str, float] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # the stage this thread is in (for the collective clock)

    def add(self, name: str, wall: float, cpu: float, comm: float = 0.0, process_cpu: float = 0.0) -> None:
        with self._lock:
            self.wall[name] = self.wall.get(name, 0.0) + wall
            self.cpu[name] = self.cpu.get(name, 0.0) + cpu
            self.process_cpu[name] = self.process_cpu.get(name, 0.0) + process_cpu
            self.comm[name] = self.comm.get(name, 0.0) + comm
            self.calls[name] = self.calls.get(name, 0) + 1

    def mark(self, instant: str) -> None:
        self.instants[instant] = time.time()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            name = f"bg {name}"
        outer = getattr(self._local, "comm", None)
        self._local.comm = 0.0
        wall0, cpu0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
        try:
            yield
        finally:
            comm = self._local.comm
            self.add(name, time.perf_counter() - wall0, time.thread_time() - cpu0, comm,
                     time.process_time() - process0)
            self._local.comm = None if outer is None else outer + comm

    def count_comm(self, seconds: float) -> None:
        """Add ``seconds`` spent in a collective to the stage this thread is in (if any)."""
        if getattr(self._local, "comm", None) is not None:
            self._local.comm += seconds

    def as_dict(self) -> dict:
        return {"wall": dict(self.wall), "cpu": dict(self.cpu), "process_cpu": dict(self.process_cpu),
                "comm": dict(self.comm), "calls": dict(self.calls), "instants": dict(self.instants)}


T = TypeVar("T")
_END = object()
_ACTIVE: Optional[StageClock] = None
_WRAPPED: list[tuple[object, str, object]] = []
#: the group methods that block on other ranks (timed as collective waits with ``comm=True``)
_BLOCKING = ("all_reduce_sum", "all_reduce_sum_", "all_to_all_single", "all_gather_rows", "recv_")


def enable(comm: bool = False) -> StageClock:
    """Start recording into a fresh clock (``comm``: also time every blocking group operation); returns it."""
    global _ACTIVE
    disable()
    _ACTIVE = StageClock()
    if comm:
        _wrap_collectives(_ACTIVE)
    return _ACTIVE


def disable() -> None:
    """Stop recording and undo the collective timing."""
    global _ACTIVE
    _ACTIVE = None
    while _WRAPPED:
        cls, name, original = _WRAPPED.pop()
        setattr(cls, name, original)


def active() -> Optional[StageClock]:
    return _ACTIVE


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Time the enclosed block as stage ``name`` when profiling is on; a no-op otherwise."""
    clock = _ACTIVE
    if clock is None:
        yield
        return
    with clock.stage(name):
        yield


def timed_iter(items: Iterable[T], name: str) -> Iterator[T]:
    """``items``, each ``next`` timed as stage ``name`` when profiling is on."""
    iterator = iter(items)
    while True:
        with stage(name):
            item = next(iterator, _END)
        if item is _END:
            return
        yield item


def add_wait(name: str, seconds: float) -> None:
    """Record ``seconds`` of waiting (wall, no CPU) as stage ``name`` when profiling is on."""
    if _ACTIVE is not None:
        _ACTIVE.add(name, seconds, 0.0, seconds)


def _timed(clock: StageClock, original, stage_name: Optional[str]):
    """``original`` with its wall time counted as communication (and, given ``stage_name``, run as that stage)."""

    def timed(*args, **kwargs):
        with stage(stage_name) if stage_name is not None else nullcontext():
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.count_comm(time.perf_counter() - start)

    return timed


def _wrap_collectives(clock: StageClock) -> None:
    from winsp.comm import group as group_module
    from winsp.comm import temporal

    targets = [(group_module.SPGroup, name, None) for name in _BLOCKING] + [(group_module.PendingRows, "wait", None)]
    # finished batches on their way to the writer
    targets += [(temporal, name, "batch transfer") for name in ("send_tensor", "recv_tensor")]
    for owner, name, stage_name in targets:
        original = getattr(owner, name)
        _WRAPPED.append((owner, name, original))
        setattr(owner, name, _timed(clock, original, stage_name))


def write_profile(directory: str, rank: int, extra: Optional[dict] = None) -> str:
    """Write the active clock's figures (and ``extra``) to ``directory/rank<rank>.json``; returns the path."""
    clock = _ACTIVE
    data = clock.as_dict() if clock is not None else {}
    data.update(extra or {}, rank=rank)
    path = os.path.join(directory, f"rank{rank}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path
