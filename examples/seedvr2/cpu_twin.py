"""The planner's CPU twin: trace a stage on fake CPU tensors and predict the process's peak RSS.

The fake-GPU trace (:mod:`winsp.testing.fake_gpu`) needs fake CUDA tensors; on the CPU the same idea works with a
``FakeTensorMode`` whose tensors are CPU ones, except that planning reads host values: so every planning phase
(:func:`winsp.utils.phases.planning_phase`) runs with the fake mode lifted (real tensors, real values), and compute runs
on fake tensors, whose storages are counted from creation until freed. The prediction is the process's resident set
before the stage (Python, torch, the libraries: measured, not assumed) plus the traced peak of live fake bytes.

What it cannot see: memory a kernel allocates inside itself (a CPU convolution's unfolded input, oneDNN scratch
buffers), the allocator's cached free blocks, and pages of real planning tensors. ``benchmarks/cpu_twin_check.py``
sets it against measured peak RSS (figures in benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CpuTrace", "cpu_twin", "current_rss"]


def current_rss() -> int:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class CpuTrace:
    live_bytes: int = 0
    peak_bytes: int = 0
    baseline_rss: int = 0
    result: Any = None

    @property
    def predicted_rss(self) -> int:
        return self.baseline_rss + self.peak_bytes


class _Counter(TorchDispatchMode):
    """Counts the storages of fake tensors an op returns, until they are freed."""

    def __init__(self, trace: CpuTrace) -> None:
        super().__init__()
        self.trace = trace
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor) \
                and args[0].constant is not None:
            # a small tensor made from Python values in compute (a host read on the CPU, where there is no device
            # to wait for): the fake mode kept its value
            return args[0].constant.item()
        out = func(*args, **(kwargs or {}))

        for t in tree_flatten(out)[0]:
            if not isinstance(t, FakeTensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._live:
                continue
            self._live[key] = storage.nbytes()
            self.trace.live_bytes += storage.nbytes()
            weakref.finalize(storage, self._free, key)
        self.trace.peak_bytes = max(self.trace.peak_bytes, self.trace.live_bytes)
        return out

    def _free(self, key: int) -> None:
        self.trace.live_bytes -= self._live.pop(key, 0)


class _RealPlanning:
    """Phase observer: planning runs with the fake mode lifted (host values are real)."""

    def __init__(self) -> None:
        self._stack: list = []

    def enter_planning(self, what: str) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        ctx = unset_fake_temporarily()
        ctx.__enter__()
        self._stack.append(ctx)

    def exit_planning(self, what: str) -> None:
        if self._stack:
            self._stack.pop().__exit__(None, None, None)


@contextlib.contextmanager
def cpu_twin() -> Iterator[CpuTrace]:
    """Run the block on fake CPU tensors (planning on real ones); yields the :class:`CpuTrace` it fills. Build the
    models inside the block (their weights count)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from winsp.utils.phases import set_phase_observer

    trace = CpuTrace(baseline_rss=current_rss())
    previous = set_phase_observer(_RealPlanning())
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _Counter(trace):
            yield trace
    finally:
        set_phase_observer(previous)


def trace_on_cpu(fn: Callable[[], Any]) -> CpuTrace:
    """``fn()`` (which builds what it runs) under :func:`cpu_twin`."""
    with cpu_twin() as trace:
        trace.result = fn()
    return trace
