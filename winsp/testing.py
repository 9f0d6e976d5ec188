"""Run a function on several CPU ranks (gloo, one process a rank) with a deadline.

Used by winsp's own multi-rank tests and offered to users who test their own models: a deadlock
becomes a ``TimeoutError`` naming the ranks that did not finish, instead of a hung test session.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "RankError"]


class RankError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, out) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        )
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        out.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` spawned gloo processes.

    ``fn`` must be importable (a module-level function) and its result picklable. Returns the
    results in rank order. Raises :class:`RankError` with the first failing rank's traceback, or
    ``TimeoutError`` naming the ranks still running after ``timeout`` seconds (all are killed).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, kwargs, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if failures:
                    break
                pending = sorted(set(range(world_size)) - set(results) - set(failures))
                detail = "".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items()))
                raise TimeoutError(
                    f"ranks {pending} of {world_size} did not finish within {timeout:.0f}s "
                    f"(deadlock or a rank stuck in a collective){detail}"
                )
            try:
                rank, ok, payload = out.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and i not in results and i not in failures]
                for i in dead:
                    failures[i] = f"process exited with code {procs[i].exitcode} without reporting"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                # Peers of a failed rank usually block in a collective; give them a moment, then stop.
                deadline = min(deadline, time.monotonic() + 10.0)
        if failures:
            first = min(failures)
            raise RankError(f"rank {first} of {world_size} failed:\n{failures[first]}")
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
