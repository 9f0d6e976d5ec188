"""Run code as every rank of a GPU job without a GPU, and check what would break there.

With the CUDA build of torch (no GPU needed), a ``FakeTensorMode`` makes ``cuda`` tensors that have shapes, dtypes
and devices but no values, and a fake process group (``init_process_group("fake", ...)``) accepts collectives
without sending anything. :func:`run_fake_gpu` runs ``fn(rank, world_size, *args, **kwargs)`` that way once for each
rank (one after the other, in this process), records what each rank does, and checks across ranks:

- **collectives**: every rank of a group issues the same sequence of collectives with the same op and dtype; an
  all-reduce (or broadcast, reduce-scatter, all-gather) has the same number of elements on every rank; an all-to-all's
  splits agree (what rank r sends to rank d is what d expects from r); a row all-gather's sizes agree with what each
  rank holds. (NCCL hangs or corrupts memory on each of these; gloo forgives some.)
- **host syncs**: no ``.item()``/``.tolist()`` of a device tensor, no ``nonzero`` or boolean-mask indexing of one
  (any op whose output shape depends on device values), no device-to-host copy, no ``torch.cuda.synchronize()``
  inside compute. Planning (a :func:`winsp.utils.phases.planning_phase` block) may read host values.
- **device mismatches**: no op mixes a CPU tensor (other than a 0-dim scalar) with a CUDA one.

It also measures each rank's **peak of live device bytes** (every fake CUDA storage from its creation until it is
freed: weights, activations, saved tensors, the collectives' output buffers; not the caching allocator's rounding,
nor CUDA context, cuBLAS workspace or NCCL's own buffers).

CPU tensors stay real tensors (with values), so planning on the host runs as it does on a GPU machine; a CPU tensor
that enters a CUDA op is refused as a device mismatch (0-dim CPU scalars excepted, as CUDA allows them). Meta tensors
stay real too (a module built on "meta" runs its initialisers for real, without values, until ``to_empty``).

API (stable)::

    report = run_fake_gpu(fn, world_size, *args, ranks=None, check=True, **kwargs)
        # fn(rank, world_size, *args, **kwargs) runs inside the fake GPU for each rank in ``ranks`` (default: all);
        # build modules on "meta" then .to_empty(device="cuda"), or on the host then .to("cuda", dtype) (some
        # initialisers, e.g. trunc_normal_, read values and fail on a fake device); .to(dtype) works on fake ones.
        # Returns a FakeGpuReport; with check=True (the default) raises FakeGpuError naming each problem (rank,
        # phase, layer, collective).
    report.ranks[r]: RankTrace      # .collectives, .host_syncs, .transfers, .mismatches, .peak_bytes,
                                    # .peak_layer, .stage_peaks, .device_ops (aten ops on the device, by phase),
                                    # .result (fn's return value), .error (the violation that stopped it)
    report.problems() -> list[str]  # every violation and cross-rank disagreement, one line each
    report.check()                  # raise FakeGpuError if problems() is not empty
    report.peak_bytes() -> int      # the largest per-rank peak
    report.summary() -> str         # one line a rank: collectives, syncs, peak
    fake_gpu(rank, world_size)      # context manager: the same for one rank in the caller's code; yields its RankTrace
    layer_names(module, prefix)     # name a module tree for messages (otherwise roots are named by their class)
    with measure("dit"): ...        # inside fn: the peak of live device bytes in the block -> trace.stage_peaks
    host_values(t)                  # a device tensor copied from a host integer tensor: those values (or None)

    from winsp.utils.phases import planning_phase, plans
    with planning_phase("what"): ...  # mark planning (host reads allowed); everything else is compute
    @plans                            # the same for every call of a function

``torch.compile``d functions (FlexAttention's included) run eagerly on the fake GPU: compile cannot trace under its
recording mode. FSDP2 (``fully_shard``, on a ``DeviceMesh`` of device type ``"cuda"``) runs: its DTensor parameters
dispatch through their own subclass, so the ops on their local shards and FSDP's all-gathers are recorded and checked
like any other, and the CUDA streams and events it makes are stand-ins (:mod:`winsp.testing.fake_streams`: they order
nothing, since nothing runs; ``synchronize`` on them is a host sync). Not supported: ``backward()``. On torch 2.14 the
fake mode installs a stand-in CUDA device guard that reports 8 devices, and the autograd engine, before it runs a
graph with CUDA nodes, asks CUDA's hooks whether each of them has a primary context
(``GraphTask::stash_current_streams``); those check the index against the real device count, 0 without a driver, and
raise ``hasPrimaryContext expects a valid device index``. Run the forward under ``torch.no_grad()`` or inference mode.

The fake GPU acts on the calling thread (torch's dispatch modes are per thread): work a function hands to other
threads runs on the real (absent) device and fails there.

A stopping violation (a read of a device value, which a fake tensor does not have, or a device mismatch) raises
:class:`FakeGpuError` inside ``fn`` at the op, naming the layer; :func:`run_fake_gpu` catches it for that rank,
records it, runs the next rank, and reports all of them together.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from winsp.testing.fake_streams import fake_stream_api
from winsp.utils.phases import current_phase, set_phase_observer

__all__ = ["run_fake_gpu", "fake_gpu", "measure", "host_values", "FakeGpuError", "FakeGpuReport", "RankTrace",
           "Collective", "HostSync", "Transfer", "Mismatch", "layer_names", "cuda_build_available"]


class FakeGpuError(AssertionError):
    """The fake GPU found something that breaks (or stalls) a real GPU run; the message names where."""


def cuda_build_available() -> bool:
    """Whether this torch is a CUDA build (fake CUDA tensors need one; a GPU does not)."""
    return torch.backends.cuda.is_built() and torch.version.cuda is not None


# ---- what is recorded ---------------------------------------------------------------------------------------------

@dataclass
class Collective:
    """One collective as a rank issued it. ``numel``: elements this rank sends (its input); ``in_splits`` /
    ``out_splits``: rows sent to / received from each group rank (all-to-all), or each rank's rows (row all-gather,
    ``out_splits`` only); ``row_numel``: elements a row; ``group``: the global ranks of its process group."""

    index: int
    op: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    numel: int
    group: tuple[int, ...]
    layer: str
    phase: str
    in_splits: tuple[int, ...] | None = None
    out_splits: tuple[int, ...] | None = None
    row_numel: int = 0
    aten: str = ""

    def describe(self) -> str:
        splits = "" if self.in_splits is None and self.out_splits is None else (
            f" in_splits={list(self.in_splits or ())} out_splits={list(self.out_splits or ())}")
        return (f"collective #{self.index} {self.op} ({self.aten}) of {self.dtype} {list(self.shape)}{splits} on "
                f"group {list(self.group)} at {self.layer} ({self.phase})")


@dataclass
class HostSync:
    """A read of tensor values on the host: ``kind`` says which (``item``, ``data-dependent shape``,
    ``device-to-host copy``, ``synchronize``, ``host read``); ``device`` the tensor's."""

    kind: str
    op: str
    device: str
    layer: str
    phase: str
    what: str = ""

    @property
    def is_device_sync(self) -> bool:
        return self.kind != "host read"

    def describe(self) -> str:
        planning = f" in planning {self.what!r}" if self.what else ""
        return f"{self.kind} ({self.op}) of a {self.device} tensor at {self.layer} ({self.phase}{planning})"


@dataclass
class Transfer:
    """A host-to-device copy (planning should make them, in one place)."""

    op: str
    shape: tuple[int, ...]
    layer: str
    phase: str


@dataclass
class Mismatch:
    """An op that mixed devices."""

    op: str
    devices: tuple[str, ...]
    layer: str
    phase: str
    message: str

    def describe(self) -> str:
        return f"device mismatch in {self.op} ({', '.join(self.devices)}) at {self.layer} ({self.phase})"


@dataclass
class RankTrace:
    """Everything one rank did on the fake GPU."""

    rank: int
    world_size: int
    collectives: list[Collective] = field(default_factory=list)
    host_syncs: list[HostSync] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    peak_bytes: int = 0
    peak_layer: str = ""
    peak_phase: str = ""
    #: aten ops on device tensors, by phase (views included): a rough count of kernel launches
    device_ops: dict[str, int] = field(default_factory=dict)
    live_bytes: int = 0
    stage_peaks: dict[str, int] = field(default_factory=dict)  # peak live bytes inside each measure(name) block
    result: Any = None
    error: str | None = None  # what stopped the rank (a violation it could not run past), and where
    error_recorded: bool = False  # the stop is the last recorded sync or mismatch

    def violations(self) -> list[str]:
        """This rank's own problems: device syncs and mismatches in compute, and what stopped it (with where)."""
        out = [f"rank {self.rank}: {s.describe()}" for s in self.host_syncs
               if s.phase == "compute" and s.is_device_sync]
        out += [f"rank {self.rank}: {m.describe()}" for m in self.mismatches]
        if self.error is not None:
            if self.error_recorded and out:
                out[-1] += f": {self.error}"
            else:
                out.append(f"rank {self.rank}: {self.error}")
        return out

    def device_syncs_in_compute(self) -> list[HostSync]:
        return [s for s in self.host_syncs if s.phase == "compute" and s.is_device_sync]


# ---- naming layers ------------------------------------------------------------------------------------------------

_NAMES: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def layer_names(module: torch.nn.Module, prefix: str | None = None) -> None:
    """Name ``module`` and its submodules for the fake GPU's messages: ``prefix.child.0.attn`` (``prefix`` defaults
    to the class name). Modules first seen in a forward without a name are named so, from their outermost module."""
    root = type(module).__name__ if prefix is None else prefix
    for name, sub in module.named_modules():
        _NAMES[sub] = f"{root}.{name}" if name else root


class _Layers:
    """The stack of modules whose forward is running (global module hooks)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self._handles: list = []

    def install(self) -> None:
        from torch.nn.modules import module as nn_module

        self._handles = [nn_module.register_module_forward_pre_hook(self._pre),
                         nn_module.register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module, args) -> None:
        name = _NAMES.get(module)
        if name is None:
            if not self.stack:
                layer_names(module)
                name = _NAMES[module]
            else:
                name = f"{self.stack[-1]}.<{type(module).__name__}>"
        self.stack.append(name)

    def _post(self, module, args, output) -> None:
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else "(outside any module)"


# ---- the recording mode -------------------------------------------------------------------------------------------

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "winsp", "_dtensor")
_PRIM_DEVICE = torch.ops.prim.device.default
_NO_WAIT = ("wait_tensor",)  # waits are not collectives of their own


def _group_of(value) -> tuple[int, ...]:
    """The global ranks of a process group given as a ScriptObject, a ProcessGroup or a registered name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        if isinstance(value, str):
            pg = _resolve_process_group(value)  # type: ignore[arg-type]
        elif isinstance(value, dist.ProcessGroup):
            pg = value
        else:
            pg = dist.ProcessGroup.unbox(value)
        return tuple(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - an unknown group is still recorded, under its repr
        return (-1,)


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tensors, lists, tuples and dicts of them; every op on the fake GPU
    passes through here, so a plain walk rather than pytree's general one)."""
    out: list[torch.Tensor] = []
    _collect_tensors(tree, out)
    return out


def _collect_tensors(x, out: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect_tensors(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _collect_tensors(v, out)


_FAKE_TENSOR: list[type] = []  # torch's FakeTensor class, imported at first use (torch._subclasses is heavy)


def _is_fake(t: torch.Tensor) -> bool:
    if not _FAKE_TENSOR:
        from torch._subclasses.fake_tensor import FakeTensor

        _FAKE_TENSOR.append(FakeTensor)
    return isinstance(t, _FAKE_TENSOR[0])


def _has_wrapper_subclass(tensors: list[torch.Tensor]) -> bool:
    from torch._subclasses.fake_tensor import _check_for_subclass

    return _check_for_subclass(tensors)


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape[1:]:
        n *= int(s)
    return n


class _Recorder(TorchDispatchMode):
    """Sits above the FakeTensorMode: records collectives, syncs, transfers and storages; runs ops whose tensors are
    all real CPU tensors for real (so host planning has values)."""

    supports_higher_order_operators = True  # flex_attention and friends pass through to the fake mode

    def __init__(self, trace: RankTrace, layers: _Layers) -> None:
        super().__init__()
        self.trace = trace
        self.layers = layers
        self.planning_what: list[str] = []
        self._live: dict[int, int] = {}
        self.fake_mode: Any = None
        self.stages: list[list] = []  # open measure() blocks: [name, peak]

    # the phase observer (winsp.utils.phases)
    def enter_planning(self, what: str) -> None:
        self.planning_what.append(what)

    def exit_planning(self, what: str) -> None:
        if self.planning_what:
            self.planning_what.pop()

    @property
    def phase(self) -> str:
        return current_phase()

    @property
    def layer(self) -> str:
        return self.layers.current

    # memory
    def _track(self, out) -> None:
        for t in _tensors(out):
            if t.device.type != "cuda":
                continue
            try:
                storage = t.untyped_storage()
            except Exception:  # noqa: BLE001 - sparse or otherwise storage-less
                continue
            key = id(storage)
            if key in self._live:
                self._resize(key, storage.nbytes())  # resized in place (FSDP frees unsharded parameters so)
            else:
                self._live[key] = storage.nbytes()
                self.trace.live_bytes += self._live[key]
                weakref.finalize(storage, self._free, key)
        self._note_peak()

    def resized(self, storage) -> None:
        """A storage's ``resize_`` (FSDP2 frees and re-allocates its unsharded parameters so, outside any op)."""
        key = id(storage)
        if key in self._live:
            self._resize(key, storage.nbytes())
            self._note_peak()

    def _resize(self, key: int, size: int) -> None:
        """A live storage's new size."""
        self.trace.live_bytes += size - self._live[key]
        self._live[key] = size

    def _note_peak(self) -> None:
        for open_stage in self.stages:
            open_stage[1] = max(open_stage[1], self.trace.live_bytes)
        if self.trace.live_bytes > self.trace.peak_bytes:
            self.trace.peak_bytes = self.trace.live_bytes
            self.trace.peak_layer, self.trace.peak_phase = self.layer, self.phase

    def _free(self, key: int) -> None:
        size = self._live.pop(key, 0)
        self.trace.live_bytes -= size

    # the ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors((args, kwargs))
        if _has_wrapper_subclass(tensors):
            # a DTensor (FSDP2's parameters) or another wrapper subclass: its own dispatch unwraps it and sends the
            # ops on its local tensors back through here, where they are recorded (the fake mode does the same)
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            try:
                out = func(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - translated into what it means on a GPU
                raise self._translate(func, tensors, e) from e
            self._track(out)
            return out
        if func is _PRIM_DEVICE:  # a fake tensor's .device asked from C++: answered by the fake mode, nothing to record
            return func(*args, **kwargs)
        namespace = func.namespace
        if namespace in _COLLECTIVE_NAMESPACES and func._opname not in _NO_WAIT:
            self._collective(func, args, kwargs)
        elif namespace == "aten":
            self._aten_before(func, args, kwargs)
        if self._runs_real(func, tensors, kwargs):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if self.fake_mode is not None and not all(_is_fake(t) for t in tensors):
            # real host tensors entering a device op become fake ones (without the fake mode's constant folding,
            # which would run the op for real, on a device this machine has not)
            args, kwargs = tree_map_only(torch.Tensor, self._to_fake, (args, kwargs))
        try:
            out = func(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - translated into what it means on a GPU
            raise self._translate(func, tensors, e) from e
        self._track(out)
        self._aten_after(func, tensors, out)
        if func.namespace == "aten" and any(t.device.type == "cuda" for t in tensors):
            phase = self.phase
            self.trace.device_ops[phase] = self.trace.device_ops.get(phase, 0) + 1
        return out

    def _to_fake(self, t: torch.Tensor) -> torch.Tensor:
        if _is_fake(t):
            return t
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return self.fake_mode.from_tensor(t, static_shapes=True)

    @staticmethod
    def _runs_real(func, tensors: list[torch.Tensor], kwargs) -> bool:
        """Ops on real host tensors run for real (planning reads their values), and so do ops on real meta tensors
        alone (a module built on "meta" before ``to_empty``: no values, no device, nothing to record or check)."""
        if func.namespace in _COLLECTIVE_NAMESPACES:
            return False
        kinds = set()
        for t in tensors:
            if _is_fake(t):
                return False
            kinds.add(t.device.type)
        device = kwargs.get("device")
        if device is not None:
            kinds.add(torch.device(device).type)
        return kinds <= {"cpu"} or kinds == {"meta"}

    def _stop(self, message: str, recorded: bool) -> FakeGpuError:
        self.trace.error, self.trace.error_recorded = message, recorded
        return FakeGpuError(f"rank {self.trace.rank}: {message}")

    def _translate(self, func, tensors: list[torch.Tensor], error: Exception) -> Exception:
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
            FakeTensorDeviceMismatchError,
        )

        if isinstance(error, FakeGpuError):
            return error
        op = str(func)
        devices = tuple(sorted({str(t.device) for t in tensors}))
        device = next((d for d in devices if d.startswith("cuda")), devices[0] if devices else "?")
        if device == "cpu" and any(_is_fake(t) for t in tensors):
            device = "cpu (copied from the device)"
        phase, layer = self.phase, self.layer
        what = self.planning_what[-1] if self.planning_what and phase == "planning" else ""
        if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
            kind = "item" if isinstance(error, DataDependentOutputException) else "data-dependent shape"
            sync = HostSync(kind, op, device, layer, phase, what)
            self.trace.host_syncs.append(sync)
            if phase == "planning":
                return self._stop(f"{sync.describe()}: planning reads host tensors only (a value computed on the "
                                  "device is a device sync, and a fake tensor has no value)", recorded=False)
            return self._stop("compute must not read device values (read host tensors in planning)", recorded=True)
        if isinstance(error, FakeTensorDeviceMismatchError) or "same device" in str(error):
            m = Mismatch(op, devices, layer, phase, str(error).splitlines()[0])
            self.trace.mismatches.append(m)
            return self._stop(f"a host tensor entered device compute ({m.message}); make it in planning and move it "
                              "to the device there", recorded=True)
        return error

    def _aten_before(self, func, args, kwargs) -> None:
        name = func._opname
        if name == "_local_scalar_dense" and args and isinstance(args[0], torch.Tensor) and not _is_fake(args[0]):
            phase = self.phase
            what = self.planning_what[-1] if self.planning_what and phase == "planning" else ""
            self.trace.host_syncs.append(HostSync("host read", str(func), str(args[0].device), self.layer, phase,
                                                  what))

    def _aten_after(self, func, tensors: list[torch.Tensor], out) -> None:
        name = func._opname
        if name not in ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"):
            return
        outs = _tensors(out)
        if not outs or not tensors:
            return
        src = tensors[1] if name == "copy_" and len(tensors) > 1 else tensors[0]
        dst = tensors[0] if name == "copy_" else outs[0]
        phase = self.phase
        if src.device.type == "cuda" and dst.device.type == "cpu":
            what = self.planning_what[-1] if self.planning_what and phase == "planning" else ""
            self.trace.host_syncs.append(HostSync("device-to-host copy", str(func), str(src.device), self.layer,
                                                  phase, what))
        elif src.device.type == "cpu" and dst.device.type == "cuda" and src.dim() > 0:
            self.trace.transfers.append(Transfer(str(func), tuple(src.shape), self.layer, phase))
            if (name == "_to_copy" and not _is_fake(src) and not src.is_floating_point()
                    and src.numel() <= _KEPT_VALUES_NUMEL):
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                with unset_fake_temporarily():
                    _HOST_VALUES[dst] = src.detach().clone()

    def _collective(self, func, args, kwargs) -> None:
        c = _describe_collective(func, args, kwargs)
        c.index, c.layer, c.phase = len(self.trace.collectives), self.layer, self.phase
        self.trace.collectives.append(c)


def _describe_collective(func, args, kwargs) -> Collective:
    """Normalise the c10d, functional-collective and winsp collectives to one record."""
    ns, name = func.namespace, func._opname
    a = list(args)
    first = next(iter(_tensors(a)), None)
    dtype = None if first is None else first.dtype
    shape = () if first is None else tuple(int(s) for s in first.shape)
    numel = 0 if first is None else int(first.numel())
    c = Collective(0, name, dtype, shape, numel, (-1,), "", "", aten=f"{ns}.{name}")
    group_arg = None
    if ns == "winsp":
        group_arg = a[-1]
        if name == "all_to_all_rows":  # (x, output_split_sizes, input_split_sizes, group_name)
            c.op, c.out_splits, c.in_splits = "all_to_all", tuple(a[1]), tuple(a[2])
        elif name == "all_gather_rows":  # (x, sizes, group_name)
            c.op, c.out_splits = "all_gather_rows", tuple(a[1])
        elif name == "all_reduce_sum":
            c.op = "all_reduce"
    elif ns == "_c10d_functional":
        group_arg = a[-1]
        if name == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name)
            c.op, c.out_splits, c.in_splits = "all_to_all", tuple(a[1]), tuple(a[2])
        elif name.startswith("all_gather"):
            c.op = "all_gather"
        elif name.startswith("reduce_scatter"):
            c.op = "reduce_scatter"
        elif name.startswith("all_reduce"):
            c.op = "all_reduce"
        elif name == "broadcast":
            c.op = "broadcast"
    elif ns == "c10d":
        for v in a:
            if isinstance(v, torch.ScriptObject) or isinstance(v, dist.ProcessGroup):
                group_arg = v
                break
        if name == "alltoall_base_":  # (output, input, pg, output_split_sizes, input_split_sizes, ...)
            inp = a[1]
            dtype, shape, numel = inp.dtype, tuple(int(s) for s in inp.shape), int(inp.numel())
            c.dtype, c.shape, c.numel = dtype, shape, numel
            c.op, c.out_splits, c.in_splits = "all_to_all", tuple(a[3]), tuple(a[4])
        elif name.startswith("allreduce"):
            c.op = "all_reduce"
        elif name.startswith("allgather") or name.startswith("_allgather"):
            c.op = "all_gather"
            if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
                inp = _tensors(a[1])[0]
                c.dtype, c.shape, c.numel = inp.dtype, tuple(int(s) for s in inp.shape), int(inp.numel())
            elif name == "allgather_":  # (output_tensors, input_tensors, pg, ...)
                inp = _tensors(a[1])[0]
                c.dtype, c.shape, c.numel = inp.dtype, tuple(int(s) for s in inp.shape), int(inp.numel())
        elif name.startswith("reduce_scatter") or name.startswith("_reduce_scatter"):
            c.op = "reduce_scatter"
            inp = _tensors(a[1])[0] if len(a) > 1 and _tensors(a[1]) else first
            if inp is not None:
                c.dtype, c.shape, c.numel = inp.dtype, tuple(int(s) for s in inp.shape), int(inp.numel())
        elif name.startswith("broadcast"):
            c.op = "broadcast"
        elif name in ("send", "recv_", "recv_any_source_"):
            c.op = name.rstrip("_")
        elif name == "barrier":
            c.op = "barrier"
    c.group = _group_of(group_arg) if group_arg is not None else (-1,)
    if first is not None and first.dim() > 0:
        c.row_numel = _row_numel(first if ns != "c10d" or name != "alltoall_base_" else a[1])
    return c


# ---- the CUDA runtime, faked --------------------------------------------------------------------------------------

_CUDA_RNG_STATE = torch.zeros(16, dtype=torch.uint8)  # a Philox state's size: seed and offset


@contextlib.contextmanager
def _fake_cuda_runtime(recorder: _Recorder, capability: tuple[int, int]) -> Iterator[None]:
    """``torch.cuda`` queries that code asks before choosing a kernel answer as on one GPU; ``synchronize`` is
    recorded as a host sync; the generator's state can be saved and restored (its values mean nothing here)."""
    cuda = torch.cuda

    def host_sync(what: str) -> None:
        recorder.trace.host_syncs.append(HostSync("synchronize", what, "cuda:0", recorder.layer, recorder.phase))

    fakes = {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
             "set_device": lambda device: None, "get_device_capability": lambda device=None: capability,
             "synchronize": lambda device=None: host_sync("torch.cuda.synchronize"),
             # torch.random.fork_rng saves and restores the device's generator: a state of the right kind, kept
             "get_rng_state": lambda device="cuda": _CUDA_RNG_STATE.clone(),
             "set_rng_state": lambda state, device="cuda": None,
             # streams and events order device work, and nothing runs here (FSDP2 makes its own; fake_streams.py)
             **fake_stream_api(host_sync)}
    saved = {name: getattr(cuda, name) for name in fakes}
    for name, value in fakes.items():
        setattr(cuda, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cuda, name, value)


@contextlib.contextmanager
def _seen_storage_resizes(recorder: _Recorder) -> Iterator[None]:
    """``UntypedStorage.resize_`` is no op the recorder sees; FSDP2 frees each block's gathered weights with it."""
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        recorder.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _swappable_fake_parameters(fake_mode) -> Iterator[None]:
    """``module.to(...)``, ``.cuda()`` and ``.to_empty(...)`` swap a fake parameter for its converted copy, and
    ``torch.utils.swap_tensors`` refuses a tensor that is weakly referenced; the fake mode's memo of the tensors it
    made holds such a reference (to the tensor it converted and to the one it made). The memo is a cache: the two
    tensors' entries are dropped before the swap."""
    import torch.utils as torch_utils

    original = torch_utils.swap_tensors

    def swap_tensors(t1, t2):
        memo = fake_mode.fake_tensor_converter.tensor_memo
        for key, value in list(memo.items()):
            if key is t1 or key is t2 or value is t1 or value is t2:
                del memo[key]
        return original(t1, t2)

    torch_utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch_utils.swap_tensors = original


_ACTIVE = [0]  # fake GPUs open in this process
_KEPT_VALUES_NUMEL = 1 << 20
#: a device tensor copied from a host integer tensor -> the host values it was copied from (plans' index tensors)
_HOST_VALUES = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def host_values(tensor: torch.Tensor) -> torch.Tensor | None:
    """The values of a fake device tensor that was copied from a host integer tensor (index tensors, split sizes,
    ``cu_seqlens``: what planning moves to the device), as a CPU tensor; None for any other (a fake tensor has no
    values of its own). Valid while nothing wrote into the device tensor after the copy. For checks in tests."""
    return _HOST_VALUES.get(tensor)
_RECORDERS: list[_Recorder] = []  # the open fake GPUs' recorders, innermost last


@contextlib.contextmanager
def measure(name: str) -> Iterator[None]:
    """Inside :func:`fake_gpu` / :func:`run_fake_gpu`: record the peak of live device bytes during the block (what
    was live at its start included) as ``trace.stage_peaks[name]`` (the larger one when a name repeats)."""
    if not _RECORDERS:
        raise RuntimeError("measure() works inside a fake GPU (winsp.testing.fake_gpu.fake_gpu or run_fake_gpu)")
    recorder = _RECORDERS[-1]
    entry: list = [name, recorder.trace.live_bytes]
    recorder.stages.append(entry)
    try:
        yield
    finally:
        recorder.stages.remove(entry)
        peaks = recorder.trace.stage_peaks
        peaks[name] = max(peaks.get(name, 0), int(entry[1]))


@contextlib.contextmanager
def _eager_compile() -> Iterator[None]:
    """torch.compile does not trace under a (non-infra) dispatch mode such as the recorder, so on the fake GPU a
    function compiled with ``torch.compile`` runs eagerly, and FlexAttention's eager path does not compile its own
    call. A function compiled while the fake GPU is open still compiles, at its first call outside it."""
    import torch.nn.attention.flex_attention as flex_attention

    original = torch.compile

    def compile_eagerly_here(model: Any = None, **options: Any) -> Any:
        if model is None:
            return lambda fn: compile_eagerly_here(fn, **options)
        compiled: list = []

        def run(*args, **kwargs):
            if _ACTIVE[0]:
                return model(*args, **kwargs)
            if not compiled:
                compiled.append(original(model, **options))
            return compiled[0](*args, **kwargs)

        return run

    flag = flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    torch.compile = compile_eagerly_here
    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        _ACTIVE[0] -= 1
        torch.compile = original
        flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = flag


def _forget_process_groups() -> None:
    """Tear down the fake world and winsp's cache of subgroups made in it (the next rank makes its own)."""
    from winsp.comm import group as group_mod

    if dist.is_initialized():
        dist.destroy_process_group()
    group_mod._SUBGROUPS.clear()


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, who: str) -> Iterator[None]:
    """A fake default process group (``init_process_group("fake")``: collectives accepted, no data moved) of
    ``world_size`` ranks as ``rank``, torn down after with winsp's cache of subgroups made in it. ``who`` names the
    caller in the refusal when a process group is running already. Works on the CPU build of torch too."""
    import sys

    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(f"{who}: a process group is already initialised in this process; {who} starts its own "
                           f"fake world of {world_size} rank(s)")
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]"; each fake rank would add one more
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    sys.excepthook = hook
    try:
        yield
    finally:
        _forget_process_groups()


@contextlib.contextmanager
def fake_gpu(rank: int = 0, world_size: int = 1, *, capability: tuple[int, int] = (9, 0)) -> Iterator[RankTrace]:
    """Run the block as ``rank`` of ``world_size`` on a fake GPU; yields the :class:`RankTrace` it fills.

    A fake default process group of ``world_size`` ranks is started (and torn down after); ``torch.cuda`` answers
    as one device of compute ``capability``. Violations that stop the block raise :class:`FakeGpuError`."""
    if not cuda_build_available():
        raise RuntimeError("the fake GPU needs the CUDA build of torch (pip install torch with CUDA; no GPU needed); "
                           f"this torch {torch.__version__} is CPU-only")
    from torch._subclasses.fake_tensor import FakeTensorMode

    trace = RankTrace(rank, world_size)
    layers = _Layers()
    recorder = _Recorder(trace, layers)
    with fake_process_group(rank, world_size, "fake_gpu"):
        previous = set_phase_observer(recorder)
        layers.install()
        _RECORDERS.append(recorder)
        try:
            fake_mode = recorder.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            with (fake_mode, recorder, _fake_cuda_runtime(recorder, capability),
                  _swappable_fake_parameters(fake_mode), _seen_storage_resizes(recorder), _eager_compile()):
                yield trace
        finally:
            _RECORDERS.remove(recorder)
            layers.remove()
            set_phase_observer(previous)


# ---- running every rank, and the checks across ranks --------------------------------------------------------------

@dataclass
class FakeGpuReport:
    """Each rank's :class:`RankTrace` (``ranks[r]``), and the checks across them."""

    world_size: int
    ranks: dict[int, RankTrace]

    def problems(self) -> list[str]:
        out: list[str] = []
        for r in sorted(self.ranks):
            out += self.ranks[r].violations()
        if all(t.error is None for t in self.ranks.values()):
            out += _cross_rank_problems(self.ranks)
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise FakeGpuError(f"{len(problems)} problem(s) on the fake GPU ({self.world_size} ranks):\n  "
                               f"{shown}{more}")

    def peak_bytes(self) -> int:
        return max((t.peak_bytes for t in self.ranks.values()), default=0)

    def summary(self) -> str:
        lines = []
        for r in sorted(self.ranks):
            t = self.ranks[r]
            syncs = len(t.device_syncs_in_compute())
            lines.append(f"rank {r}: {len(t.collectives)} collectives, {t.device_ops.get('compute', 0)} device ops "
                         f"and {syncs} device syncs in compute, "
                         f"{len(t.mismatches)} mismatches, {len(t.transfers)} host-to-device copies, peak "
                         f"{_human(t.peak_bytes)} at {t.peak_layer} ({t.peak_phase})")
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def run_fake_gpu(fn: Callable[..., Any], world_size: int, *args: Any, ranks: Sequence[int] | None = None,
                 check: bool = True, capability: tuple[int, int] = (9, 0), **kwargs: Any) -> FakeGpuReport:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on a fake GPU for each rank in ``ranks`` (default: all), one
    after the other, and check them against each other (module docstring). Returns the :class:`FakeGpuReport`;
    raises :class:`FakeGpuError` listing every problem when ``check`` (collectives are compared only when every
    member of a group ran). An exception of ``fn`` that is not a fake-GPU finding propagates, naming the rank."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    chosen = list(range(world_size)) if ranks is None else [int(r) for r in ranks]
    bad = [r for r in chosen if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} are outside a world of {world_size}")
    traces: dict[int, RankTrace] = {}
    for r in chosen:
        with fake_gpu(r, world_size, capability=capability) as trace:
            try:
                trace.result = fn(r, world_size, *args, **kwargs)
            except FakeGpuError as e:
                if trace.error is None:
                    trace.error = str(e)
                trace.error += "\n" + _user_frames(e)
            except Exception as e:
                raise RuntimeError(f"rank {r} of {world_size} on the fake GPU raised {type(e).__name__}: {e}") from e
        traces[r] = trace
    report = FakeGpuReport(world_size, traces)
    if check:
        report.check()
    return report


def _user_frames(error: BaseException, keep: int = 4) -> str:
    """The innermost frames of ``error`` outside torch and this file: where in the caller's code it happened."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/torch/" not in f.filename and not f.filename.endswith("fake_gpu.py")]
    return "".join(f"    at {f.filename}:{f.lineno} in {f.name}: {f.line}\n" for f in frames[-keep:]).rstrip()


def _cross_rank_problems(traces: dict[int, RankTrace]) -> list[str]:
    """Collectives that differ between the members of a group (module docstring)."""
    out: list[str] = []
    groups: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
    for r, t in traces.items():
        for c in t.collectives:
            if c.op in ("send", "recv"):
                continue
            groups.setdefault(c.group, {}).setdefault(r, []).append(c)
    for group, by_rank in groups.items():
        members = list(group) if group != (-1,) else sorted(by_rank)
        if any(m not in traces for m in members):
            continue  # not every member ran: nothing to compare against
        seqs = {m: by_rank.get(m, []) for m in members}
        counts = {m: len(s) for m, s in seqs.items()}
        n = min(counts.values())
        for i in range(n):
            problem = _compare(group, members, {m: seqs[m][i] for m in members})
            if problem:
                out.append(problem)
                break  # later collectives are out of step anyway
        else:
            if len(set(counts.values())) > 1:
                longest = max(counts, key=lambda m: counts[m])
                extra = seqs[longest][n]
                out.append(f"group {list(group)}: ranks issue different numbers of collectives ({counts}); the first "
                           f"unmatched is rank {longest}'s {extra.describe()}")
    return out


def _compare(group: tuple[int, ...], members: list[int], calls: dict[int, Collective]) -> str | None:
    ref = calls[members[0]]
    where = f"collective #{ref.index} of group {list(group)}"
    ops = {m: c.op for m, c in calls.items()}
    if len(set(ops.values())) > 1:
        return f"{where}: ranks issue different collectives: " + _each(calls, lambda c: f"{c.op} at {c.layer}")
    dtypes = {m: c.dtype for m, c in calls.items()}
    if len(set(dtypes.values())) > 1:
        return (f"{where} ({ref.op} at {ref.layer}): dtypes differ between ranks (NCCL hangs or corrupts): "
                + _each(calls, lambda c: f"{c.dtype} {list(c.shape)}"))
    if ref.op in ("all_reduce", "broadcast", "reduce_scatter", "all_gather"):
        if len({c.numel for c in calls.values()}) > 1:
            return (f"{where} ({ref.op} at {ref.layer}): element counts differ between ranks: "
                    + _each(calls, lambda c: f"{c.numel} {list(c.shape)}"))
    if ref.op == "all_to_all":
        size = len(members)
        for m, c in calls.items():
            if c.in_splits is None or c.out_splits is None or len(c.in_splits) != size or len(c.out_splits) != size:
                return f"{where} (all_to_all at {ref.layer}): rank {m} gave splits for a group of another size"
        for i, src in enumerate(members):
            for j, dst in enumerate(members):
                sent = calls[src].in_splits[j] * calls[src].row_numel  # type: ignore[index]
                expected = calls[dst].out_splits[i] * calls[dst].row_numel  # type: ignore[index]
                if sent != expected:
                    return (f"{where} (all_to_all at {ref.layer}): rank {src} sends {calls[src].in_splits[j]} rows "  # type: ignore[index]
                            f"of {calls[src].row_numel} to rank {dst}, which expects {calls[dst].out_splits[i]} "  # type: ignore[index]
                            f"rows of {calls[dst].row_numel} from it")
        for m, c in calls.items():
            if c.shape and sum(c.in_splits) != c.shape[0]:  # type: ignore[arg-type]
                return (f"{where} (all_to_all at {ref.layer}): rank {m}'s input splits {list(c.in_splits or ())} do "
                        f"not add up to its {c.shape[0]} rows")
    if ref.op == "all_gather_rows":
        sizes = {c.out_splits for c in calls.values()}
        if len(sizes) > 1:
            return f"{where} (all_gather_rows at {ref.layer}): ranks disagree on the sizes: " + _each(
                calls, lambda c: str(list(c.out_splits or ())))
        for i, m in enumerate(members):
            c = calls[m]
            if c.out_splits is not None and c.shape and c.out_splits[i] != c.shape[0]:
                return (f"{where} (all_gather_rows at {ref.layer}): rank {m} holds {c.shape[0]} rows but the sizes "
                        f"say {c.out_splits[i]}")
        if len({c.row_numel for c in calls.values()}) > 1:
            return f"{where} (all_gather_rows at {ref.layer}): row widths differ: " + _each(
                calls, lambda c: str(list(c.shape)))
    return None


def _each(calls: dict[int, Collective], show: Callable[[Collective], str]) -> str:
    return "; ".join(f"rank {m}: {show(c)}" for m, c in calls.items())
