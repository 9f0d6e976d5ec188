"""The planner's CPU twin: trace a stage on fake CPU tensors and predict the process's peak RSS.

The fake-GPU trace (:mod:`winsp.testing.fake_gpu`) needs fake CUDA tensors; on the CPU the same idea works with a
``FakeTensorMode`` whose tensors are CPU ones, except that planning reads host values: so every planning phase
(:func:`winsp.utils.phases.planning_phase`) runs with the fake mode lifted (real tensors, real values), and compute runs
on fake tensors, whose storages are counted from creation until freed. The prediction is the process's resident set
before the stage (Python, torch, the libraries: measured, not assumed) plus the traced peak of live fake bytes.

One kernel's own buffer is counted, because it dominates a small CPU VAE: torch's native float 3-D convolution on the
CPU (``slow_conv3d``, which torch picks over oneDNN for small inputs) unfolds its input into a
``(C_in * kT * kH * kW) x (output positions)`` matrix per sample for the length of the call (measured: a 16-channel
3x3x3 convolution over 5 x 144 x 256 raises the peak by 327 MiB, of which 304 MiB is that matrix; a 1x1x1 one does not
unfold, nor does a 128-channel one, which goes to oneDNN). It is added to the live bytes at the op, not kept.

What it cannot see: other memory kernels allocate inside themselves (oneDNN scratch buffers), the allocator's cached
free blocks, and pages of real planning tensors. A check on computed values read on the host (a boolean) is taken to
pass; any other host read of a computed value stops the trace. With ``world_size > 1`` it runs as ``rank`` of a fake
process group (collectives accepted, no data moved), as one rank of a gloo run. ``benchmarks/cpu_twin_check.py`` and
``python -m examples.seedvr2 plan --device cpu`` set it against measured peak RSS (figures in benchmarks/README.md).
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

__all__ = ["CpuTrace", "cpu_twin", "current_rss", "trace_on_cpu", "unfold_bytes"]


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


def _uses_onednn(x, weight, stride, dilation, groups: int) -> bool:
    """Whether torch sends a float32 CPU convolution to oneDNN (no unfolded copy) rather than its native kernel: the
    rule of ATen's ``ConvParams::use_mkldnn`` (``Convolution.cpp``) for float CPU tensors."""
    n, c, d0, d1 = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    strided, dilated = any(v != 1 for v in stride), any(v != 1 for v in dilation)
    worth = (strided or dilated or n >= 16 or weight.shape[-1] != 1 or weight.shape[-2] != 1
             or torch.get_num_threads() > 1)
    large = groups > 1 or (weight.shape[-1] > 3 and weight.shape[-2] > 3) or n > 1 or n * c * d0 * d1 > 20480
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and worth and large


def unfold_bytes(func, args, out) -> int:
    """The bytes of the unfolded input that torch's native 3-D convolution on the CPU (``slow_conv3d``) allocates for
    the length of the call (0 for every other op): float32 5-D inputs, not transposed, with a kernel larger than 1x1x1,
    that torch does not send to oneDNN (:func:`_uses_onednn`: small inputs, e.g. fewer than 20,480 rows of
    batch x channels x frames x height). bf16, 2-D and oneDNN convolutions do not unfold."""
    if func is not torch.ops.aten.convolution.default:
        return 0
    x, weight = args[0], args[1]
    stride, dilation = args[3], args[5]
    transposed, groups = args[6], args[8]
    if x.dim() != 5 or transposed or x.dtype != torch.float32 or x.device.type != "cpu":
        return 0
    kernel = weight.shape[2] * weight.shape[3] * weight.shape[4]
    if kernel == 1 or _uses_onednn(x, weight, stride, dilation, groups):
        return 0
    return out.shape[0] * weight.shape[1] * kernel * out.shape[2] * out.shape[3] * out.shape[4] * x.element_size()


class _Counter(TorchDispatchMode):
    """Counts the storages of fake tensors an op returns, until they are freed."""

    def __init__(self, trace: CpuTrace) -> None:
        super().__init__()
        self.trace = trace
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            if args[0].constant is not None:
                # a small tensor made from Python values in compute (a host read on the CPU, where there is no device
                # to wait for): the fake mode kept its value
                return args[0].constant.item()
            if args[0].dtype == torch.bool:
                # a check on computed values (``if bool((count <= 0).any()): raise``; free on the CPU): the twin
                # traces a run whose checks pass
                return False
        if func is torch.ops.aten.mkldnn_convolution.default and isinstance(args[0], FakeTensor):
            # oneDNN asked for by name (a band of rows that gets the whole frame's kernel) has no fake kernel: the
            # same convolution's shapes
            x, weight, bias, padding, stride, dilation, groups = args
            out = torch.ops.aten.convolution.default(x, weight, bias, stride, padding, dilation, False,
                                                     [0] * len(stride), groups)
        else:
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
        scratch = unfold_bytes(func, args, out)
        self.trace.peak_bytes = max(self.trace.peak_bytes, self.trace.live_bytes + scratch)
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
def _fake_world(rank: int, world_size: int) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks (none at one rank), torn down after with winsp's cache of
    subgroups made in it. The twin runs one rank as all of them: a gather of host integers that every rank must agree
    on (:meth:`winsp.comm.group.SPGroup.all_gather_ints`, e.g. the dtypes of attention's inputs on CPU ranks) answers
    with this rank's values for every rank (its result is read on the host, which fake tensors cannot)."""
    if world_size == 1:
        yield
        return
    from winsp.comm import group as group_mod
    from winsp.testing.fake_gpu import fake_process_group

    with fake_process_group(rank, world_size, "cpu_twin"):
        gather_ints = group_mod.SPGroup.all_gather_ints
        group_mod.SPGroup.all_gather_ints = lambda self, values, device="cpu": [[int(v) for v in values]] * self.size
        try:
            yield
        finally:
            group_mod.SPGroup.all_gather_ints = gather_ints  # type: ignore[method-assign]


@contextlib.contextmanager
def cpu_twin(rank: int = 0, world_size: int = 1) -> Iterator[CpuTrace]:
    """Run the block on fake CPU tensors (planning on real ones) as ``rank`` of ``world_size``; yields the
    :class:`CpuTrace` it fills. Build the models inside the block (their weights count)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from winsp.utils.phases import set_phase_observer

    trace = CpuTrace(baseline_rss=current_rss())
    with _fake_world(rank, world_size):
        previous = set_phase_observer(_RealPlanning())
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), _Counter(trace):
                yield trace
        finally:
            set_phase_observer(previous)


def trace_on_cpu(fn: Callable[[], Any], rank: int = 0, world_size: int = 1) -> CpuTrace:
    """``fn()`` (which builds what it runs) under :func:`cpu_twin`."""
    with cpu_twin(rank, world_size) as trace:
        trace.result = fn()
    return trace
