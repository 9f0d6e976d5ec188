"""The sequence-parallel group: the only place in winsp that talks to ``torch.distributed``.

Everything above this file (redistribution, text reduction, spatial sharding, gradient sync, the runtime) calls these
few methods, so model code never touches collectives and a single-rank run never touches ``torch.distributed``.

The collectives that run inside a model's forward are ``torch.library`` custom ops (``winsp::all_reduce_sum``,
``winsp::all_to_all_rows``, ``winsp::all_gather_rows``) with static split sizes: torch.compile traces them as single
opaque nodes, without a graph break, and autograd knows their backward. Each backward is the exact adjoint of its
forward, with every rank's copy of a replicated value counted as that rank's own (winsp's gradient convention, see
:mod:`winsp.runtime.gradients`): an all-reduce's backward is an all-reduce, an all-to-all's the reverse all-to-all, and
an all-gather's a reduce-scatter.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from winsp.comm.mesh import sp_process_group

__all__ = ["SPGroup", "PendingRows", "init_world_from_env", "shutdown_world", "abort_world", "world_rank_and_size",
           "new_subgroup", "send_tensor", "recv_tensor", "collective_timeout", "COLLECTIVE_TIMEOUT_ENV",
           "unresponsive_ranks"]

#: environment variable: seconds a collective (or point-to-point transfer) may wait for a peer before it fails
COLLECTIVE_TIMEOUT_ENV = "WINSP_COLLECTIVE_TIMEOUT"


def _process_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    # the stubs type the name as GroupName, a NewType of str that older torch releases do not export
    return _resolve_process_group(name)  # type: ignore[arg-type]


def _all_reduce_sum_eager(x: Tensor, group) -> Tensor:
    import torch.distributed as dist

    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


@torch.library.custom_op("winsp::all_reduce_sum", mutates_args=())
def _all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    return _all_reduce_sum_eager(x, _process_group(group_name))


@_all_reduce_sum.register_fake
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_setup(ctx, inputs, output) -> None:
    ctx.group_name = inputs[1]


def _all_reduce_backward(ctx, grad: Tensor):
    # Every rank's copy of the output is its own; each copy depends on every rank's input, so the gradient of one
    # rank's input is the sum over ranks of the gradients of their copies.
    return torch.ops.winsp.all_reduce_sum(grad, ctx.group_name), None


_all_reduce_sum.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


def _all_to_all_rows_eager(x: Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group) -> Tensor:
    import torch.distributed as dist

    out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(output_split_sizes), list(input_split_sizes), group=group)
    return out


@torch.library.custom_op("winsp::all_to_all_rows", mutates_args=())
def _all_to_all_rows(x: Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                     group_name: str) -> Tensor:
    return _all_to_all_rows_eager(x, output_split_sizes, input_split_sizes, _process_group(group_name))


@_all_to_all_rows.register_fake
def _(x: Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str) -> Tensor:
    return x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))


def _all_to_all_setup(ctx, inputs, output) -> None:
    _, ctx.out_splits, ctx.in_splits, ctx.group_name = inputs


def _all_to_all_backward(ctx, grad: Tensor):
    back = torch.ops.winsp.all_to_all_rows(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group_name)
    return back, None, None, None


_all_to_all_rows.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def _all_gather_rows_eager(x: Tensor, sizes: list[int], group) -> Tensor:
    import torch.distributed as dist

    # One all-to-all in which every rank sends its whole block to every rank: uneven sizes (0 included) need no
    # padding and gloo runs it.
    world = len(sizes)
    out = x.new_empty((sum(sizes),) + tuple(x.shape[1:]))
    send = x.contiguous().repeat((world,) + (1,) * (x.dim() - 1))
    dist.all_to_all_single(out, send, list(sizes), [x.shape[0]] * world, group=group)
    return out


@torch.library.custom_op("winsp::all_gather_rows", mutates_args=())
def _all_gather_rows(x: Tensor, sizes: list[int], group_name: str) -> Tensor:
    return _all_gather_rows_eager(x, sizes, _process_group(group_name))


@_all_gather_rows.register_fake
def _(x: Tensor, sizes: list[int], group_name: str) -> Tensor:
    return x.new_empty((sum(sizes),) + tuple(x.shape[1:]))


def _all_gather_setup(ctx, inputs, output) -> None:
    x, ctx.sizes, ctx.group_name = inputs
    ctx.rows = x.shape[0]


def _all_gather_backward(ctx, grad: Tensor):
    # Reduce-scatter: every rank's copy of the gathered tensor holds this rank's rows, so this rank's rows receive the
    # sum over ranks of the gradient of their block. Rank d sends block r of its gradient to rank r (one all-to-all);
    # the P blocks that arrive are summed.
    world, rows = len(ctx.sizes), ctx.rows
    received = torch.ops.winsp.all_to_all_rows(grad.contiguous(), [rows] * world, list(ctx.sizes), ctx.group_name)
    return received.view((world, rows) + tuple(grad.shape[1:])).sum(0), None, None


_all_gather_rows.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)


class SPGroup:
    """A window-SP process group, or a single rank when ``group`` is None and ``world_size`` is 1.

    Args:
        group: a ``torch.distributed`` process group (a subgroup the caller built, or the default world via
            ``torch.distributed.group.WORLD``), a 1-D ``DeviceMesh`` or one named dimension of a larger one
            (``mesh["sp"]``; :mod:`winsp.comm.mesh`), or None for a single rank.
    """

    def __init__(self, group=None) -> None:
        if group is not None and not _is_process_group(group):
            group = sp_process_group(group)
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
        else:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "an SP process group was given but torch.distributed is not initialised; call "
                    "torch.distributed.init_process_group first (or pass group=None for a single rank)"
                )
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the SP process group it was given")

    @classmethod
    def world(cls) -> "SPGroup":
        """The default process group if torch.distributed is initialised with more than one rank, else single-rank."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist.group.WORLD)
        return cls(None)

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def __repr__(self) -> str:
        return f"SPGroup(rank={self.rank}, size={self.size})"

    # ---- collectives (no-ops at one rank) -------------------------------------------------------------

    @property
    def name(self) -> str:
        """The process group's registered name (what the traceable collectives take)."""
        return self.group.group_name

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the group, as a new tensor (differentiable; its backward is an all-reduce)."""
        if self.is_single:
            return tensor
        if _eager(tensor):
            return _all_reduce_sum_eager(tensor, self.group)
        return torch.ops.winsp.all_reduce_sum(tensor, self.name)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place (eager, not differentiable; for gradient buffers) and return it."""
        if self.is_single:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_to_all_single(
        self, tensor: torch.Tensor, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int]
    ) -> torch.Tensor:
        """One variable-split all-to-all along dim 0: send ``input_split_sizes[d]`` rows to rank d.

        Differentiable (the backward is the reverse all-to-all) and traceable; at one rank, the input itself.
        """
        if self.is_single:
            return tensor
        outs, ins = [int(c) for c in output_split_sizes], [int(c) for c in input_split_sizes]
        if _eager(tensor):
            return _all_to_all_rows_eager(tensor, outs, ins, self.group)
        return torch.ops.winsp.all_to_all_rows(tensor.contiguous(), outs, ins, self.name)

    def start_all_to_all_single(
        self, tensor: torch.Tensor, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], *,
        out: torch.Tensor | None = None,
    ) -> "PendingRows":
        """:meth:`all_to_all_single` started in the background: compute on, then ``wait()`` for its output.

        Every rank must start it at the same point of its collective sequence. It overlaps only in eager code
        without gradients (inference); when autograd records or torch.compile traces, the exchange runs at once
        (the custom op) and ``wait()`` just returns it. ``out``: a contiguous ``[sum(output_split_sizes), ...]``
        tensor to receive into (a slice of a larger buffer saves copying the rows afterwards); not differentiable.
        """
        outs, ins = [int(c) for c in output_split_sizes], [int(c) for c in input_split_sizes]
        if out is not None:
            shape = (sum(outs),) + tuple(tensor.shape[1:])
            if tuple(out.shape) != shape or out.dtype != tensor.dtype or not out.is_contiguous():
                raise ValueError(f"start_all_to_all_single: out must be a contiguous {tensor.dtype} tensor of shape "
                                 f"{list(shape)}, got {out.dtype} {list(out.shape)}"
                                 + ("" if out.is_contiguous() else " (not contiguous)"))
        if self.is_single or not _eager(tensor):
            received = self.all_to_all_single(tensor, outs, ins)
            return PendingRows(received if out is None else out.copy_(received))
        import torch.distributed as dist

        send = tensor.contiguous()
        if out is None:
            out = send.new_empty((sum(outs),) + tuple(send.shape[1:]))
        work = dist.all_to_all_single(out, send, outs, ins, group=self.group, async_op=True)
        return PendingRows(out, work, send)

    def start_all_gather(self, chunk: torch.Tensor) -> "PendingRows":
        """Start concatenating every rank's equal-sized 1-D ``chunk`` (rank order) in the background; ``wait()`` for
        the ``[size * len(chunk)]`` result. Eager and not differentiable (for gathering sharded weights); every rank
        must start it at the same point of its collective sequence. At one rank, the chunk itself."""
        if chunk.dim() != 1:
            raise ValueError(f"start_all_gather: the chunk must be 1-D, got shape {list(chunk.shape)}")
        if self.is_single:
            return PendingRows(chunk)
        import torch.distributed as dist

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        send = chunk.contiguous()
        out = send.new_empty(self.size * send.shape[0])
        work = gather(out, send, group=self.group, async_op=True)
        return PendingRows(out, work, send)

    def all_gather_rows(self, tensor: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along dim 0; rank r holds ``sizes[r]`` rows (may differ, may be 0).

        Differentiable and traceable (``winsp::all_gather_rows``): the backward is a reduce-scatter, so this rank's
        rows receive the sum over ranks of the gradient of their block. At one rank, the input itself.
        """
        if len(sizes) != self.size:
            raise ValueError(f"all_gather_rows: {len(sizes)} sizes given for a group of {self.size} ranks")
        if tensor.shape[0] != sizes[self.rank]:
            raise ValueError(
                f"all_gather_rows: rank {self.rank} holds {tensor.shape[0]} rows but sizes says {sizes[self.rank]}"
            )
        if self.is_single:
            return tensor
        if _eager(tensor):
            return _all_gather_rows_eager(tensor, [int(s) for s in sizes], self.group)
        return torch.ops.winsp.all_gather_rows(tensor, [int(s) for s in sizes], self.name)

    def all_gather_ints(self, values: Sequence[int], device: torch.device | str = "cpu") -> list[list[int]]:
        """Every rank's ``values`` (the same count on every rank), one list per rank, in one eager collective (for
        checks that every rank must reach the same verdict on, e.g. the dtypes of attention's inputs). ``device``:
        where the backend takes tensors (CUDA for NCCL)."""
        if self.is_single:  # nothing to gather: the host values themselves (no tensor to read back)
            return [[int(v) for v in values]]
        row = torch.tensor([list(values)], dtype=torch.int64, device=device)
        return _all_gather_rows_eager(row, [1] * self.size, self.group).cpu().tolist()

    def assert_same_ints(self, values: Sequence[int], device: torch.device | str, message: str) -> None:
        """Check that every rank passes the same ``values`` without reading anything back to the host: one small
        all-gather on ``device`` and a device-side assertion (``torch._assert_async``) that fails on every rank at
        once when they differ (on CUDA the assertion's text is not shown; ``message`` is where the CPU shows it).
        For checks inside a forward, where a host read would stall the GPU."""
        if self.is_single:
            return
        row = torch.tensor([list(values)], dtype=torch.int64).to(device)
        table = _all_gather_rows_eager(row, [1] * self.size, self.group)
        torch._assert_async((table == table[:1]).all(), message)

    # ---- point-to-point and subgroups (eager; for pipelines such as the VAE's temporal wavefront) -------------

    def global_rank(self, rank: int) -> int:
        """The world rank of this group's ``rank``."""
        if self.is_single:
            return rank
        import torch.distributed as dist

        return dist.get_global_rank(self.group, rank)

    def isend(self, tensor: torch.Tensor, dst: int):
        """Start sending ``tensor`` (contiguous, its shape known to the receiver) to group rank ``dst``; returns
        the work handle to ``wait()`` on (keep ``tensor`` alive until then). On this group: send on
        :meth:`point_to_point`'s group when this one also runs collectives."""
        import torch.distributed as dist

        return dist.isend(tensor, self.global_rank(dst), group=self.group)

    def recv_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``tensor`` (contiguous, the sender's shape and dtype) from group rank ``src``; returns it."""
        import torch.distributed as dist

        dist.recv(tensor, self.global_rank(src), group=self.group)
        return tensor

    def point_to_point(self) -> "SPGroup":
        """A twin of this group (the same ranks) for point-to-point messages, made at the first call and kept.

        Collective: every member calls it, at the same point of the program, the first time. Sends and receives on
        a group that also runs collectives make the ranks' operation counts on it differ (a rank that sends nothing
        counts fewer), and PyTorch's collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) then reports the
        group's next collective as a mismatch between ranks; on the twin only messages travel."""
        if self.is_single:
            return self
        key = ("point-to-point", self.name)
        cached = _SUBGROUPS.get(key)
        if cached is None:
            import torch.distributed as dist

            members = [self.global_rank(r) for r in range(self.size)]
            whole_world = self.size == dist.get_world_size()
            cached = _SUBGROUPS[key] = SPGroup(dist.new_group(members, use_local_synchronization=not whole_world))
        return cached

    def subgroup(self, ranks: Sequence[int]) -> "SPGroup":
        """The group of this group's ``ranks`` (which must include this rank), created once and cached.

        Only the members call it (a group-local rendezvous), so disjoint subgroups can be made by their own
        members in any order."""
        ranks = tuple(int(r) for r in ranks)
        if self.rank not in ranks:
            raise ValueError(f"subgroup: rank {self.rank} is not among the members {list(ranks)}")
        if len(ranks) == self.size and ranks == tuple(range(self.size)):
            return self
        if len(ranks) == 1:
            return SPGroup(None)
        key = (self.name, ranks)
        cached = _SUBGROUPS.get(key)
        if cached is None:
            import torch.distributed as dist

            members = [self.global_rank(r) for r in ranks]
            cached = _SUBGROUPS[key] = SPGroup(dist.new_group(members, use_local_synchronization=True))
        return cached


class PendingRows:
    """The output of a collective that may still be in flight (:meth:`SPGroup.start_all_to_all_single`)."""

    def __init__(self, output: torch.Tensor, work=None, keep_alive: torch.Tensor | None = None) -> None:
        self._output, self._work, self._keep_alive = output, work, keep_alive

    def wait(self) -> torch.Tensor:
        """Block until the collective has finished; returns its output (again on later calls)."""
        if self._work is not None:
            self._work.wait()
            self._work = self._keep_alive = None
        return self._output


_SUBGROUPS: dict = {}


def _is_process_group(group) -> bool:
    from torch.distributed import ProcessGroup

    return isinstance(group, ProcessGroup)


def _eager(tensor: torch.Tensor) -> bool:
    """Whether a collective can skip its custom op: not traced, and no gradient to record. (The custom op's
    first call imports the tracing machinery, seconds of one-time cost that an inference run need not pay.)"""
    return not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and tensor.requires_grad)


def world_rank_and_size() -> tuple[int, int]:
    """(rank, size) in the default process group, or (0, 1) when torch.distributed is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def new_subgroup(ranks) -> object:
    """A ``torch.distributed`` subgroup of the world ``ranks`` (collective: every rank must call it, in the same
    order, for every subgroup)."""
    import torch.distributed as dist

    return dist.new_group(list(ranks))


# ---- point-to-point (world ranks) -------------------------------------------------------------------------------

_HEADER = 10  # int64 words: ndim, up to 8 dims, dtype code
_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.bool)


def _comm_device() -> torch.device:
    import torch.distributed as dist

    # "fake": the fake process group of winsp.testing.fake_gpu, which stands for NCCL when it fakes a GPU
    backend = dist.get_backend()
    if backend == "nccl" or (backend == "fake" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_tensor(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Send ``tensor`` (any shape up to 8 dims, a common dtype) to world rank ``dst``; it receives it with
    :func:`recv_tensor` without knowing its shape (a small header goes first). ``group``: the process group to send
    on (a point-to-point twin, see :meth:`SPGroup.point_to_point`; default: the world)."""
    import torch.distributed as dist

    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dims (at most {_HEADER - 2})")
    device = _comm_device()
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = tensor.dim()
    header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    header[-1] = _DTYPES.index(tensor.dtype)
    dist.send(header.to(device), dst, group=group)
    dist.send(tensor.contiguous().to(device), dst, group=group)


def recv_tensor(src: int, group=None) -> torch.Tensor:
    """The tensor world rank ``src`` sent with :func:`send_tensor` (on the backend's device), on ``group``."""
    import torch.distributed as dist

    device = _comm_device()
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    header = header.cpu()
    ndim = int(header[0])
    out = torch.empty(tuple(int(v) for v in header[1:1 + ndim]), dtype=_DTYPES[int(header[-1])], device=device)
    dist.recv(out, src, group=group)
    return out


# ---- launch -----------------------------------------------------------------------------------------------------

def collective_timeout(default_s: float | None = None):
    """How long a collective may wait for a peer: ``$WINSP_COLLECTIVE_TIMEOUT`` seconds when set, else ``default_s``
    (None: torch's own default, 30 minutes on gloo) as a ``datetime.timedelta`` (or None). A value that is not a
    positive number of seconds is a ``ValueError`` naming the variable."""
    import datetime
    import math
    import os

    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not text:
        return None if default_s is None else datetime.timedelta(seconds=default_s)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}={text!r} must be a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def init_world_from_env(device_type: str = "cpu", *, timeout_s: float | None = None) -> tuple[int, int, bool]:
    """Join the world a launcher (``torchrun``) describes in ``WORLD_SIZE`` / ``RANK``; returns (rank, size, started).

    With ``WORLD_SIZE`` unset or 1 nothing is initialised. Otherwise the default process group is started unless it
    already is, on the backend ``device_type`` names (NCCL for ``"cuda"``, gloo for anything else; the machine is not
    inspected); ``started`` says whether this call started it (and so should
    :func:`shutdown_world` it). Its collectives time out after :func:`collective_timeout` (``timeout_s``, unless
    ``$WINSP_COLLECTIVE_TIMEOUT`` says otherwise): a peer that stops answering (stuck, or stopped) makes them fail
    after that long instead of hanging. A world that torchrun starts again after a failure (``--max-restarts``) joins
    through store keys of its own attempt (see :func:`_restart_store`).
    """
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, False
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    timeout = collective_timeout(timeout_s)
    options: dict = {} if timeout is None else {"timeout": timeout}
    store = _restart_store(timeout)
    if store is not None:
        options.update(store=store, rank=int(os.environ["RANK"]), world_size=world)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, **options)
    if backend == "gloo":
        # gloo connects every pair of ranks inside init; a rank that refused its input at once and exited would
        # break a peer still connecting ("connection closed by peer"). Meeting once first makes a refusal reach
        # every rank as itself. (NCCL connects at the first collective, so it needs no such meeting.)
        dist.barrier()
    return dist.get_rank(), dist.get_world_size(), True


def _restart_store(timeout):
    """Under torchrun's agent store on one machine, a client of that store whose keys are this attempt's alone
    (``TORCHELASTIC_RESTART_COUNT``); None otherwise (``env://`` as usual).

    torchrun (c10d rendezvous, ``--standalone`` too) keeps one store for all its attempts, and a world it starts again
    after a failure (``--max-restarts``) would find the previous world's keys there: gloo's ranks would connect to the
    dead ranks' addresses ("Connection refused", pytorch/pytorch#135712, #167288). On one machine every rank has the
    same restart count; across machines the agents count apart, so this is left to torch
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` there gives every attempt a store of its own)."""
    import datetime
    import os

    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("TORCHELASTIC_RESTART_COUNT") is None:
        return None
    if env.get("LOCAL_WORLD_SIZE") != env.get("WORLD_SIZE"):
        return None
    import torch.distributed as dist

    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                           timeout=timeout or datetime.timedelta(minutes=30))
    return dist.PrefixStore(f"winsp/attempt/{env['TORCHELASTIC_RESTART_COUNT']}", client)


def shutdown_world(timeout_s: float = 10.0) -> None:
    """Tear down the default process group if one is running, after the ranks meet once.

    Without the meeting a rank that finishes first closes its connections while a peer's transport may still be
    using them (gloo then aborts that peer's process at exit). The ranks meet through the group's store, not the
    backend (so on any backend, and whatever state a failed collective left the transport in), and each waits at most
    ``timeout_s``: if a peer never arrives (it failed, or is stuck), the group is torn down anyway. (gloo's
    ``monitored_barrier`` bounds only rank 0's wait: a peer of a stuck rank 0 waited forever.)
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_world_size() > 1:
            _meet_through_store(timeout_s)
    except Exception:  # noqa: BLE001 - a peer (or the store's host) is gone, or late: nothing left to wait for
        pass
    finally:
        dist.destroy_process_group()


_MEETINGS = [0]  # meetings this process held, so that each has its own key in a store that outlives a group


def _meet_through_store(timeout_s: float) -> None:
    """Every rank of the default group adds one to a counter in the group's store; the last to arrive says so, and
    the others wait for that at most ``timeout_s`` (the store raises when it passes)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    _MEETINGS[0] += 1
    key = f"winsp/shutdown/{_MEETINGS[0]}"
    if store.add(key, 1) == dist.get_world_size():
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))


def unresponsive_ranks(wait_s: float = 3.0) -> list[int] | None:
    """After a collective failed: the ranks of the default group that do not answer a roll call within ``wait_s``
    (stuck, stopped or gone), or None when it cannot be held (no group, or its store does not answer).

    Each rank that calls this checks in through the group's store and waits for the others; a rank stuck in a
    computation, stopped (SIGSTOP) or dead never checks in, so the survivors can name it."""
    import datetime
    import time

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = _get_default_store()
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        rank, size = dist.get_rank(), dist.get_world_size()
        store.set(f"winsp/roll_call/{rank}", "1")
        deadline = time.monotonic() + wait_s
        missing = list(range(size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"winsp/roll_call/{r}"])]
            if missing:
                time.sleep(0.1)
        return missing
    except Exception:  # noqa: BLE001 - the store's host is the stuck one, or gone
        return None


def abort_world() -> None:
    """Tear down the default process group at once, without meeting the other ranks: for a rank that failed while
    its peers may be blocked in a collective with it. Its connections close, so a peer's pending gloo operation with
    it fails promptly (instead of waiting out the group's timeout) and that peer can exit too."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
