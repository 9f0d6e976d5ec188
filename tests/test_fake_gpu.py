"""The fake-GPU harness (winsp.testing.fake_gpu) refuses each fault that breaks a real GPU run, naming where.

Each fault is injected into an otherwise clean two-block model run as 3 ranks: a float32 zero tensor on an empty
rank's all-reduce while its peers send bf16, an ``.item()`` in a block, a CPU tensor in the forward, an all-to-all
split off by one, plus boolean-mask indexing, a device-to-host copy, and collectives in a different order. The clean
run passes, so each refusal is the fault's. Needs the CUDA build of torch (no GPU); skipped on a CPU-only build.
"""

from __future__ import annotations

import pytest
import torch

from winsp.comm.group import SPGroup
from winsp.utils.phases import current_phase, planning_phase

pytestmark = [pytest.mark.fake_gpu, pytest.mark.timeout(300)]

WORLD = 3
ROWS = (3, 0, 2)  # rank 1 holds no rows: the "empty rank"


class Block(torch.nn.Module):
    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16, device="cuda", dtype=torch.bfloat16)
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if self.fault == "item":
            y = y * y.float().abs().sum().item()
        elif self.fault == "cpu tensor":
            y = y + torch.ones(y.shape, dtype=y.dtype)
        elif self.fault == "mask":
            y = y[y > 0].view(-1, 16)
        elif self.fault == "to host":
            y = y + y.float().mean().cpu().to(y.dtype)
        elif self.fault == "synchronize":
            torch.cuda.synchronize()
        return y


class Net(torch.nn.Module):
    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block(fault)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _rank(rank: int, world: int, fault: str | None = None, faulty_rank: int = 1) -> dict:
    with planning_phase("row counts"):
        rows = torch.tensor(ROWS)  # a host tensor: planning may read it
        mine = int(rows[rank].item())
        counts = rows.tolist()
        phase = current_phase()
    net = Net(fault if rank == faulty_rank else None)
    x = torch.randn(mine, 16, device="cuda", dtype=torch.bfloat16)
    group = SPGroup.world()
    with torch.no_grad():
        y = net(x)
        # the replicated-text pattern: every rank adds its partial; an empty rank must add zeros of its peers' dtype
        if mine == 0:
            dtype = torch.float32 if (fault == "float32 zeros" and rank == faulty_rank) else y.dtype
            partial = torch.zeros(4, 16, device="cuda", dtype=dtype)
        else:
            partial = y.sum(0, keepdim=True).expand(4, 16).contiguous()
        total = group.all_reduce_sum(partial)
        # every rank sends all its rows to rank 0
        send = [mine if d == 0 else 0 for d in range(world)]
        recv = list(counts) if rank == 0 else [0] * world
        if fault == "split off by one" and rank == faulty_rank:
            recv = [c + 1 if i == 2 else c for i, c in enumerate(recv)]
        gathered = group.all_to_all_single(y, recv, send)
        if fault == "order" and rank == faulty_rank:
            gathered = group.all_to_all_single(y, recv, send)
        group.all_reduce_sum(total)
        if fault == "one more" and rank == faulty_rank:
            group.all_reduce_sum(total)
    return {"phase": phase, "gathered": tuple(gathered.shape), "device": str(total.device)}


def test_a_clean_run_passes_and_is_recorded():
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(_rank, WORLD)
    assert report.problems() == []
    for r, trace in report.ranks.items():
        assert trace.result["phase"] == "planning" and trace.result["device"] == "cuda:0"
        ops = [c.op for c in trace.collectives]
        assert ops == ["all_reduce", "all_to_all", "all_reduce"], ops
        assert {c.dtype for c in trace.collectives} == {torch.bfloat16}
        a2a = trace.collectives[1]
        assert a2a.in_splits == tuple(ROWS[r] if d == 0 else 0 for d in range(WORLD))
        assert a2a.group == (0, 1, 2)
        # the planning reads were seen, and are planning's
        reads = [s for s in trace.host_syncs if s.kind == "host read"]
        assert reads and all(s.phase == "planning" and s.what == "row counts" for s in reads)
        assert trace.device_syncs_in_compute() == [] and trace.mismatches == []
        assert trace.device_ops["compute"] >= 2 * 2  # two Linear layers of two ops at least (matmul, bias)
        # weights: two 16x16 bf16 Linear layers (512 + 32 bytes each) are live at the peak, at least
        assert trace.peak_bytes >= 2 * (16 * 16 * 2 + 16 * 2)
    assert report.ranks[0].result["gathered"] == (sum(ROWS), 16)


@pytest.mark.parametrize("fault, expected", [
    ("float32 zeros", ["collective #0", "all_reduce", "dtypes differ", "rank 1: torch.float32",
                       "rank 0: torch.bfloat16"]),
    ("item", ["rank 1:", "item", "Net.blocks.1", "(compute)", "must not read device values"]),
    ("cpu tensor", ["rank 1:", "device mismatch", "Net.blocks.1", "cpu", "cuda:0"]),
    ("split off by one", ["collective #1", "all_to_all", "rank 2 sends 2 rows", "expects 3 rows"]),
    ("mask", ["rank 2:", "data-dependent shape", "Net.blocks.1"]),
    ("to host", ["rank 2:", "device-to-host copy", "Net.blocks.1", "(compute)"]),
    ("synchronize", ["rank 1:", "synchronize", "Net.blocks.1", "(compute)"]),
    ("one more", ["different numbers of collectives", "rank 1's collective #3 all_reduce"]),
    ("order", ["collective #2", "ranks issue different collectives", "rank 1: all_to_all", "rank 0: all_reduce"]),
])
def test_each_fault_is_refused_naming_where(fault, expected):
    from winsp.testing.fake_gpu import FakeGpuError, run_fake_gpu

    # the empty rank is rank 1; the mask and host-copy faults need rows, so they go to rank 2
    faulty = 2 if fault in ("mask", "to host") else (0 if fault == "split off by one" else 1)
    with pytest.raises(FakeGpuError) as info:
        run_fake_gpu(_rank, WORLD, fault, faulty)
    message = str(info.value)
    for part in expected:
        assert part in message, (part, message)


def test_planning_may_not_read_device_values():
    from winsp.testing.fake_gpu import FakeGpuError, run_fake_gpu

    def fn(rank, world):
        x = torch.ones(3, device="cuda")
        with planning_phase("a bad plan"):
            return int(x.sum().item())

    with pytest.raises(FakeGpuError, match="planning reads host tensors only"):
        run_fake_gpu(fn, 1)


def test_an_error_of_the_function_names_the_rank():
    from winsp.testing.fake_gpu import run_fake_gpu

    def fn(rank, world):
        if rank == 1:
            raise KeyError("blocks.7")
        return rank

    with pytest.raises(RuntimeError, match=r"rank 1 of 2 on the fake GPU raised KeyError"):
        run_fake_gpu(fn, 2)


def test_collectives_on_subgroups_are_compared_within_the_group():
    """Two disjoint pairs run different collectives: fine; within a pair a dtype differs: refused."""
    from winsp.testing.fake_gpu import FakeGpuError, run_fake_gpu

    def fn(rank, world, bad):
        group = SPGroup.world()
        pair = group.subgroup([0, 1] if rank < 2 else [2, 3])
        dtype = torch.float16 if bad and rank == 3 else torch.bfloat16
        n = 4 if rank < 2 else 6
        with torch.no_grad():
            pair.all_reduce_sum(torch.zeros(n, device="cuda", dtype=dtype))

    report = run_fake_gpu(fn, 4, False)
    assert {tuple(c.group) for t in report.ranks.values() for c in t.collectives} == {(0, 1), (2, 3)}
    with pytest.raises(FakeGpuError, match=r"group \[2, 3\].*dtypes differ"):
        run_fake_gpu(fn, 4, True)


def test_peak_counts_freed_memory_out():
    from winsp.testing.fake_gpu import fake_gpu

    with fake_gpu() as trace:
        a = torch.empty(1 << 20, device="cuda", dtype=torch.uint8)
        del a
        b = torch.empty(1 << 19, device="cuda", dtype=torch.uint8)
        assert trace.live_bytes == 1 << 19
        del b
    assert trace.peak_bytes == 1 << 20


def test_measure_records_a_stage_peak():
    from winsp.testing.fake_gpu import fake_gpu, measure

    with fake_gpu() as trace:
        weights = torch.empty(1000, device="cuda", dtype=torch.uint8)
        with measure("step"):
            a = torch.empty(3000, device="cuda", dtype=torch.uint8)
            del a
            b = torch.empty(500, device="cuda", dtype=torch.uint8)
        with measure("step"):  # a repeated name keeps the larger peak
            pass
        del weights, b
    assert trace.stage_peaks == {"step": 4000}
    with pytest.raises(RuntimeError, match="inside a fake GPU"):
        with measure("outside"):
            pass


def test_torch_distributed_collectives_are_recorded_alike():
    """Collectives issued straight through torch.distributed (as FSDP2 and other libraries do) and the functional
    ones are recorded and compared too: here an all-gather whose input size differs on one rank."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from winsp.testing.fake_gpu import FakeGpuError, run_fake_gpu

    def fn(rank, world, bad):
        n = 5 if bad and rank == 1 else 4
        x = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(world * n, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(x, out)
        funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
        dist.all_to_all_single(out, out.clone(), [n] * world, [n] * world)

    report = run_fake_gpu(fn, 2, False)
    ops = [(c.op, c.numel, c.dtype) for c in report.ranks[0].collectives]
    assert ops == [("all_gather", 4, torch.bfloat16), ("reduce_scatter", 8, torch.bfloat16),
                   ("all_reduce", 4, torch.bfloat16), ("all_to_all", 8, torch.bfloat16)], ops
    with pytest.raises(FakeGpuError, match=r"collective #0 .*all_gather.*element counts differ.*rank 1: 5"):
        run_fake_gpu(fn, 2, True)


def test_point_to_point_messages_travel_on_the_device():
    """send_tensor on the fake GPU sends from the device, as on NCCL (its header included): no host copy."""
    from winsp.comm.group import send_tensor
    from winsp.testing.fake_gpu import run_fake_gpu

    def fn(rank, world):
        if rank == 0:
            send_tensor(torch.zeros(3, 4, device="cuda", dtype=torch.bfloat16), 1)

    trace = run_fake_gpu(fn, 2).ranks[0]
    assert [(c.op, c.dtype) for c in trace.collectives] == [("send", torch.int64), ("send", torch.bfloat16)]
    assert trace.device_syncs_in_compute() == []
