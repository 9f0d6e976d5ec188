"""Window SP composed with FSDP2 on the fake GPU (winsp.testing.fake_gpu): a (dp, sp) DeviceMesh on fake CUDA, winsp
on ``mesh["sp"]`` for the activations, ``fully_shard`` over every rank for the weights (``winsp.shard_weights``), a
bf16 forward on every rank. The cross-rank check covers FSDP's all-gathers (same dtype and size on every rank of the
world group) as well as winsp's collectives (on each SP group).

FSDP2 makes CUDA streams and events at its first forward; the fake GPU stands in for them (winsp.testing.fake_streams:
they order nothing, since nothing runs, and a ``synchronize`` on them is reported as a host sync). Backward does not
run on fake CUDA tensors (see test_backward_stops_in_the_autograd_engine), so FSDP's reduce-scatters are not traced.

Needs the CUDA build of torch (no GPU); skipped on a CPU-only build.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import winsp
from examples.toy_windowed_block import ToyWindowedDiT

pytestmark = [pytest.mark.fake_gpu, pytest.mark.timeout(900)]

GRIDS, LENGTHS = [(3, 12, 20), (2, 8, 8)], [5, 3]
DIM, HEADS, LAYERS = 64, 2, 4


def _mesh(dp: int, sp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda", (dp, sp), mesh_dim_names=("dp", "sp"))


def _local_elements(model: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


def _toy_rank(rank: int, world: int, dp: int, sp: int, dim: int = DIM) -> dict:
    """The toy DiT on the request API: runtime on ``mesh["sp"]``, blocks and root sharded over every rank; built on
    meta and materialised after sharding, so each rank only ever holds its shard (as a sharded checkpoint load)."""
    mesh = _mesh(dp, sp)
    with torch.device("meta"):
        model = ToyWindowedDiT(dim=dim, heads=HEADS, layers=LAYERS, window=(2, 4, 4))
    total = sum(p.numel() for p in model.parameters())
    model.build_runtime(winsp.DiffusionParallelConfig(mesh=mesh["sp"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2: a root returning a view must not be modified in place
        winsp.shard_weights(model, mesh, blocks="blocks.*")
        model = model.to(torch.bfloat16).to_empty(device="cuda")
        local = _local_elements(model)  # before the forward: FSDP2 keeps the root's parameters gathered after it
        n = sum(t * h * w for t, h, w in GRIDS)
        vid = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16)
        txt = torch.randn(sum(LENGTHS), dim, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out = model(vid, txt, GRIDS, LENGTHS, torch.full((len(GRIDS),), 0.5, device="cuda"))
    return {"shape": tuple(out.shape), "dtype": out.dtype, "device": str(out.device), "local": local,
            "total": total, "sp": model.require_runtime().world_size}


def _hourglass_rank(rank: int, world: int, dp: int, sp: int) -> dict:
    """The hourglass made parallel by ``winsp.parallelize`` (its plan's meta dry run on sharded weights included),
    sharded by ``winsp.shard_weights`` over every rank, on fake CUDA in bf16."""
    from examples.hourglass import HourglassNet, parallelize

    mesh = _mesh(dp, sp)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = parallelize(HourglassNet(dropout=0.0), group=mesh["sp"])
        winsp.shard_weights(model, mesh)
        model = model.to("cuda", torch.bfloat16).eval()
        local = _local_elements(model)
        with torch.no_grad():
            out = model(torch.randn(1, 2, 8, 6, 3, dtype=torch.bfloat16).to("cuda"))
    return {"shape": tuple(out.shape), "dtype": out.dtype, "device": str(out.device), "local": local,
            "total": sum(p.numel() for p in HourglassNet(dropout=0.0).parameters()), "sp": sp}


def _rows_move_in_the_sp_group(trace, rank: int, sp: int, dtype=None) -> None:
    """winsp's all-to-alls (of ``dtype``, any when None) on ``rank`` stay in its SP group of the (dp, sp) mesh; none
    at ``sp`` = 1."""
    sp_ops = [c for c in trace.collectives if c.op == "all_to_all" and (dtype is None or c.dtype == dtype)]
    if sp == 1:
        assert not sp_ops, [c.describe() for c in sp_ops]
        return
    sp_group = tuple(range(rank // sp * sp, rank // sp * sp + sp))
    assert sp_ops and all(c.group == sp_group for c in sp_ops), [c.describe() for c in sp_ops]


def _check(report, dp: int, sp: int) -> None:
    world = dp * sp
    assert report.problems() == []
    results = [t.result for t in report.ranks.values()]
    assert len({(r["shape"], r["dtype"], r["device"]) for r in results}) == 1, results
    assert results[0]["dtype"] == torch.bfloat16 and results[0]["device"] == "cuda:0"
    assert all(r["sp"] == sp for r in results)
    # FSDP2 shards every parameter over every rank: each holds about 1 / world of the weights
    assert sum(r["local"] for r in results) == results[0]["total"]
    assert all(r["local"] < results[0]["total"] / world + results[0]["total"] / 10 for r in results), results
    everyone = tuple(range(world))
    for rank, trace in report.ranks.items():
        assert trace.device_syncs_in_compute() == [] and trace.mismatches == []
        gathers = [c for c in trace.collectives if c.op == "all_gather" and c.group == everyone]
        # one all-gather of the root's and each block's shard (bf16), on the world group
        assert len(gathers) >= 2 and {c.dtype for c in gathers} == {torch.bfloat16}, gathers
        _rows_move_in_the_sp_group(trace, rank, sp)


@pytest.mark.parametrize("dp,sp", [(2, 2), (1, 4)])
def test_toy_dit_with_fsdp2_over_a_dp_sp_mesh(dp, sp):
    from winsp.testing.fake_gpu import run_fake_gpu

    _check(run_fake_gpu(_toy_rank, dp * sp, dp, sp), dp, sp)


@pytest.mark.parametrize("dp,sp", [(2, 2), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_hourglass_with_fsdp2_over_a_dp_sp_mesh(dp, sp):
    from winsp.testing.fake_gpu import run_fake_gpu

    _check(run_fake_gpu(_hourglass_rank, dp * sp, dp, sp), dp, sp)


def _uneven_rank(rank: int, world: int, dp: int, sp: int) -> dict:
    """Rank 3 builds a wider model than its peers: its FSDP shards, and so its all-gathers, differ in size."""
    return _toy_rank(rank, world, dp, sp, dim=DIM + 16 if rank == 3 else DIM)


def test_fsdp_all_gathers_of_different_sizes_are_refused():
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(_uneven_rank, 4, 2, 2, check=False)
    problems = report.problems()
    assert problems and "all_gather" in problems[0] and "element counts differ" in problems[0], problems


def _linear_stack_rank(rank: int, world: int, layers: int, width: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from winsp.testing.fake_gpu import measure

    mesh = init_device_mesh("cuda", (world,))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model = model.to(torch.bfloat16).to_empty(device="cuda")
    with measure("built"):
        pass
    with torch.no_grad(), measure("forward"):
        model(torch.randn(16, width, device="cuda", dtype=torch.bfloat16))
    with measure("after"):
        pass
    return None


def test_fsdp_frees_each_gathered_layer_in_the_peak():
    """FSDP2 frees a layer's gathered weights by resizing their storage (no op): the peak counts the shards and about
    three whole layers (the running one, its all-gather buffer, the prefetched next), not the whole model."""
    from winsp.testing.fake_gpu import run_fake_gpu

    layers, width, world = 8, 1024, 4
    layer_bytes = width * width * 2
    report = run_fake_gpu(_linear_stack_rank, world, layers, width)
    for trace in report.ranks.values():
        r = dict(trace.stage_peaks)
        r["peak"] = r.pop("forward")
        assert r["built"] == layers * layer_bytes // world, r
        assert r["after"] - r["built"] < layer_bytes / 8, r  # the gathered weights are freed again
        assert r["peak"] <= r["built"] + 3.2 * layer_bytes < layers * layer_bytes, r


def _synchronizing_rank(rank: int, world: int) -> None:
    """An event's synchronize in compute (the host waits for the device): the stand-in reports it."""
    x = torch.randn(4, 4, device="cuda")
    stream = torch.cuda.Stream(priority=-1)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = x @ x
    event = stream.record_event()
    torch.cuda.current_stream().wait_event(event)  # orders device work only: nothing to report
    assert torch.cuda.current_stream() is not stream
    event.synchronize()
    return y.shape


def test_stream_and_event_stand_ins_report_host_syncs():
    from winsp.testing.fake_gpu import FakeGpuError, run_fake_gpu

    with pytest.raises(FakeGpuError, match=r"synchronize \(torch.cuda.Event.synchronize\)"):
        run_fake_gpu(_synchronizing_rank, 2)


def _backward_rank(rank: int, world: int) -> None:
    layer = torch.nn.Linear(8, 8).to("cuda")
    layer(torch.randn(4, 8, device="cuda")).sum().backward()


def test_backward_stops_in_the_autograd_engine():
    """Why no backward runs on the fake GPU (torch 2.14): FakeTensorMode registers a stand-in CUDA device guard that
    reports 8 devices; the autograd engine, seeing nodes on CUDA streams, stashes each device's current stream and
    asks CUDA's hooks whether device 0 has a primary context, and those check the index against the real device
    count (0 without a driver). This test fails once torch lifts that (then backward can be traced here)."""
    from winsp.testing.fake_gpu import run_fake_gpu

    with pytest.raises(RuntimeError, match="hasPrimaryContext expects a valid device index"):
        run_fake_gpu(_backward_rank, 1)


def _seedvr2_rank(rank: int, world: int, dp: int, sp: int, config, latent: tuple, shard_root: bool) -> dict:
    """SeedVR2's DiT: runtime on ``mesh["sp"]``, each block sharded over every rank with FSDP2, and the root too when
    ``shard_root`` (``winsp.shard_weights``); one bf16 Euler step on every rank."""
    from examples.seedvr2.models.dit import SeedVR2NaDiT
    from examples.seedvr2.memory.fake_gpu_runs import TEXT_TOKENS

    mesh = _mesh(dp, sp)
    with torch.device("meta"):
        dit = SeedVR2NaDiT(config)
    total = sum(p.numel() for p in dit.parameters())
    dit.build_runtime(winsp.DiffusionParallelConfig(mesh=mesh["sp"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # shard_root=False: the blocks only (the root's embeddings and output head stay whole on every rank), each
        # block resharded after its forward
        winsp.shard_weights(dit, mesh, blocks="blocks.*", shard_root=shard_root)
        dit = dit.to(torch.bfloat16).to_empty(device="cuda").eval()
        local = _local_elements(dit)
        cfg = dit.config
        t, h, w = latent
        vid = torch.randn(t * h * w, cfg.vid_in_channels, device="cuda", dtype=torch.bfloat16)
        txt = torch.randn(TEXT_TOKENS, cfg.txt_in_dim, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():  # the shapes are host tensors, as the pipeline passes them
            out = dit(vid, txt, torch.tensor([[t, h, w]]), torch.tensor([[TEXT_TOKENS]]),
                      torch.full((1,), 1000.0, device="cuda"))
    blocks = sum(p.numel() for p in dit.blocks.parameters())
    return {"shape": tuple(out.shape), "dtype": out.dtype, "device": str(out.device), "local": local,
            "total": total, "blocks": blocks, "sp": dit.require_runtime().world_size}


def _small_seedvr2():
    from examples.seedvr2.models.dit import NaDiTConfig

    return NaDiTConfig.seedvr2_at_size(vid_dim=128, txt_in_dim=64, heads=2, head_dim=64, num_layers=3, mm_layers=1,
                                       rope_dim=64)


def test_fsdp2_root_moves_seedvr2s_host_shape_tensors_to_the_device():
    """A fault the fake GPU found: FSDP2's root pre-forward moves every tensor argument to the device (as DDP does),
    so SeedVR2's host shape tensors arrive on the GPU and its planning reads them back, a device sync each forward.
    Refused here, naming the planning step."""
    from winsp.testing.fake_gpu import FakeGpuError, run_fake_gpu

    with pytest.raises(FakeGpuError, match=r"item .* at FSDPSeedVR2NaDiT \(planning in planning "
                                           r"'SeedVR2NaDiT._prepare'\)"):
        run_fake_gpu(_seedvr2_rank, 4, 2, 2, _small_seedvr2(), (3, 8, 12), True, ranks=[0])


def _check_seedvr2(report, dp: int, sp: int, latent: tuple) -> None:
    world = dp * sp
    assert report.problems() == []
    t, h, w = latent
    everyone = tuple(range(world))
    for rank, trace in report.ranks.items():
        r = trace.result
        assert (r["shape"], r["dtype"], r["device"], r["sp"]) == ((t * h * w, 16), torch.bfloat16, "cuda:0", sp)
        assert trace.device_syncs_in_compute() == [] and trace.mismatches == []
        # each rank holds the root's parameters whole and about 1 / world of the blocks'
        assert r["local"] <= r["total"] - r["blocks"] + r["blocks"] / world * 1.01, r
        gathers = [c for c in trace.collectives if c.op == "all_gather" and c.group == everyone]
        assert gathers and {c.dtype for c in gathers} == {torch.bfloat16}, gathers
        _rows_move_in_the_sp_group(trace, rank, sp, torch.bfloat16)


@pytest.mark.parametrize("dp,sp", [(2, 2), pytest.param(1, 4, marks=pytest.mark.slow)])
def test_seedvr2_architecture_with_fsdp2_on_its_blocks(dp, sp):
    """The SeedVR2 DiT (released architecture, small width) with its blocks sharded: one all-gather a block."""
    from winsp.testing.fake_gpu import run_fake_gpu

    config, latent = _small_seedvr2(), (3, 8, 12)
    report = run_fake_gpu(_seedvr2_rank, dp * sp, dp, sp, config, latent, False)
    _check_seedvr2(report, dp, sp, latent)
    assert len([c for c in report.ranks[0].collectives if c.op == "all_gather"]) == config.num_layers


@pytest.mark.slow  # 4 ranks of the 3B at full width and depth: about a minute each on 2 busy cores
@pytest.mark.parametrize("dp,sp", [(2, 2), (1, 4)])
def test_released_3b_dit_with_fsdp2_at_720p(dp, sp):
    from examples.seedvr2.models.dit import NaDiTConfig
    from examples.seedvr2.memory.fake_gpu_runs import CLIPS
    from winsp.testing.fake_gpu import run_fake_gpu

    config, latent = NaDiTConfig.released("3b"), CLIPS["720p"].latent
    report = run_fake_gpu(_seedvr2_rank, dp * sp, dp, sp, config, latent, False)
    _check_seedvr2(report, dp, sp, latent)
    assert len([c for c in report.ranks[0].collectives if c.op == "all_gather"]) == config.num_layers == 32
    for trace in report.ranks.values():  # each block's gathered weights are freed after it: never half of them whole
        r = trace.result
        assert trace.peak_bytes < 2 * r["local"] + r["total"], (trace.peak_bytes, r)  # bytes: 2 a bf16 element
