"""winsp's own GPU paths on the fake GPU (winsp.testing.fake_gpu), in bf16, at every rank of P.

The request/runtime with text, window plans (whole windows, split windows, head parallelism: every planner),
redistribution between layouts, the replicated text's reduction with ranks that hold no window, and each attention
backend that selects on CUDA: every rank issues the same collectives (op, dtype, sizes, all-to-all splits that
agree), with 0 device syncs and 0 device mismatches in compute. Sizes: small grids, and a 720p x 21-frame latent grid
(6 x 45 x 80 tokens) at SeedVR2-3B's width (2560, 20 heads). Needs the CUDA build of torch (no GPU); skipped on a
CPU-only build.
"""

from __future__ import annotations

import pytest
import torch

import winsp
from examples.toy_windowed_block import ToyWindowedDiT

pytestmark = [pytest.mark.fake_gpu, pytest.mark.timeout(600)]

# (grids, text lengths, width, heads, layers, window)
SMALL = ([(3, 12, 20), (2, 8, 8)], [5, 3], 64, 2, 4, (2, 4, 4))
ONE_WINDOW = ([(2, 6, 6)], [4], 64, 2, 2, (2, 6, 6))  # one window: every rank but one holds none
REAL_720P = ([(6, 45, 80)], [77], 2560, 20, 2, (6, 15, 16))


def _toy_rank(rank: int, world: int, case, backend: str = "auto", planner: str = "auto") -> dict:
    grids, lengths, dim, heads, layers, window = case
    with torch.device("meta"):
        model = ToyWindowedDiT(dim=dim, heads=heads, layers=layers, window=window)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    config = winsp.DiffusionParallelConfig(ulysses_degree=world, attention_backend=backend, planner=planner)
    model.build_runtime(config)
    n = sum(t * h * w for t, h, w in grids)
    vid = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16)
    txt = torch.randn(sum(lengths), dim, device="cuda", dtype=torch.bfloat16)
    timestep = torch.full((len(grids),), 0.5, device="cuda")
    with torch.no_grad():
        out = model(vid, txt, grids, lengths, timestep)
    return {"shape": tuple(out.shape), "dtype": out.dtype, "device": str(out.device)}


def _bf16_end_to_end(c, text_rows: int) -> bool:
    """Activations travel in bf16; the one exception is the text mean's all-reduce, which winsp accumulates in
    float32 on purpose (winsp.comm.text), on every rank alike; the dtype check's int64 codes."""
    if c.dtype == torch.float32:
        return c.op == "all_reduce" and c.shape[0] == text_rows
    return c.dtype in (torch.bfloat16, torch.int64)


def _check_clean(report, case) -> None:
    grids, lengths, dim = case[0], case[1], case[2]
    n = sum(t * h * w for t, h, w in grids)
    assert report.problems() == []
    for trace in report.ranks.values():
        assert trace.result == {"shape": (n, dim), "dtype": torch.bfloat16, "device": "cuda:0"}
        assert trace.device_syncs_in_compute() == [] and trace.mismatches == []
        odd = [c.describe() for c in trace.collectives if not _bf16_end_to_end(c, sum(lengths))]
        assert odd == []
        assert trace.peak_bytes > 0


@pytest.mark.parametrize("world", [1, 2, 4])
def test_core_small_bf16(world):
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(_toy_rank, world, SMALL)
    _check_clean(report, SMALL)
    if world > 1:
        ops = {c.op for c in report.ranks[0].collectives}
        assert {"all_to_all", "all_reduce"} <= ops, ops  # redistribution and the text reduction


@pytest.mark.parametrize("planner", ["lpt", "locality", "split", "heads"])
def test_every_planner_window_split_and_head_plans(planner):
    """Whole windows (lpt, locality), windows split over ranks (split), every window over all ranks (heads), at an
    uneven P = 3."""
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(_toy_rank, 3, SMALL, "auto", planner)
    _check_clean(report, SMALL)
    # inside the layers: the dtype check's one small all-gather, plus the split windows' / heads' all-to-alls
    in_layers = [c for c in report.ranks[0].collectives if c.op == "all_to_all" and ".blocks." in c.layer]
    assert (len(in_layers) == 1) if planner in ("lpt", "locality") else (len(in_layers) > 2), in_layers


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_without_a_window_send_their_peers_dtype(world):
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(_toy_rank, world, ONE_WINDOW)
    _check_clean(report, ONE_WINDOW)
    # every layer's text reduction: the rank that holds the window and those that hold none add the same dtype
    reduces = [[(c.dtype, c.shape) for c in t.collectives if c.op == "all_reduce"] for t in report.ranks.values()]
    assert len(reduces[0]) >= 2 and all(r == reduces[0] for r in reduces)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_core_at_720p_21_frames_3b_width(world):
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(_toy_rank, world, REAL_720P)
    _check_clean(report, REAL_720P)
    # two layers of [2560 -> 3 x 2560] x 2 streams, out projections and MLP: more than 150 MB of bf16 weights
    assert report.peak_bytes() > 150e6


@pytest.mark.parametrize("backend", ["grouped_sdpa", "batched_sdpa", "flex"])
def test_backends_that_select_on_cuda(backend):
    """flex runs uncompiled: on the fake GPU torch.compile'd functions run eagerly (compile cannot trace there)."""
    from winsp.testing.fake_gpu import run_fake_gpu

    case = ONE_WINDOW if backend == "batched_sdpa" else SMALL  # batched: windows of one length
    report = run_fake_gpu(_toy_rank, 2, case, backend)
    _check_clean(report, case)


def test_torch_varlen_where_this_torch_has_it():
    from winsp.attention.backends import REGISTRY
    from winsp.testing.fake_gpu import fake_gpu, run_fake_gpu

    with fake_gpu():
        reason = REGISTRY["torch_varlen"].unavailable_reason(torch.device("cuda"), None, torch.bfloat16)
    if reason is not None:
        pytest.skip(f"torch_varlen: {reason}")
    _check_clean(run_fake_gpu(_toy_rank, 2, SMALL, "torch_varlen"), SMALL)


def test_flash_varlen_up_to_the_kernel_call(monkeypatch):
    """flash-attn is not installed: a stand-in kernel checks what winsp passes it (dtypes, devices, cu_seqlens)."""
    import winsp.attention.backends.flash_varlen as flash_varlen
    from winsp.testing.fake_gpu import host_values, run_fake_gpu

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal):
        for name, t in (("q", q), ("k", k), ("v", v)):
            assert t.device.type == "cuda" and t.dtype == torch.bfloat16 and t.is_contiguous(), (name, t)
            assert t.dim() == 3 and t.shape == q.shape, (name, t.shape)
        for cu in (cu_q, cu_k):
            assert cu.device.type == "cuda" and cu.dtype == torch.int32 and cu.dim() == 1, cu
        assert cu_q is cu_k and isinstance(max_q, int) and max_q == max_k and max_q > 0
        assert dropout_p == 0.0 and causal is False and softmax_scale is None or softmax_scale > 0
        # cu_seqlens came from planning's host tensor: its values start at 0, rise, end at the packed rows, and
        # their longest step is max_seqlen
        cu = host_values(cu_q)
        assert cu is not None, "cu_seqlens was not copied from a host tensor"
        steps = cu[1:] - cu[:-1]
        assert int(cu[0]) == 0 and int(cu[-1]) == q.shape[0] and bool((steps > 0).all()), cu
        assert int(steps.max()) == max_q
        calls.append((tuple(q.shape), cu_q.shape[0] - 1, max_q))
        return torch.empty_like(q)

    monkeypatch.setattr(flash_varlen, "_import", lambda: kernel)
    report = run_fake_gpu(_toy_rank, 2, SMALL, "flash_varlen")
    _check_clean(report, SMALL)
    assert calls
    # each call packs its windows' video and text rows: cu_seqlens has one entry per window and one more, and the
    # packed rows are at least one window's worth
    for (rows, heads, head_dim), windows, longest in calls:
        assert heads == SMALL[3] and head_dim == SMALL[2] // SMALL[3]
        assert windows >= 1 and longest <= rows


def _sharded_rank(rank: int, world: int, case, shard: bool) -> dict:
    from winsp.comm.group import SPGroup
    from winsp.runtime.weight_shards import GatheredModules, module_layout, shard_of_module
    from winsp.testing.fake_gpu import measure

    grids, lengths, dim, heads, layers, window = case
    with torch.device("meta"):
        model = ToyWindowedDiT(dim=dim, heads=heads, layers=layers, window=window)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world))
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    if shard:
        blocks = list(model.blocks)
        layouts = [module_layout(b, world) for b in blocks]
        shards = [shard_of_module(b, lay, rank) for b, lay in zip(blocks, layouts, strict=True)]
        GatheredModules(blocks, layouts, shards, SPGroup.world(), root=model)
    n = sum(t * h * w for t, h, w in grids)
    vid = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16)
    txt = torch.randn(sum(lengths), dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), measure("forward"):
        model(vid, txt, grids, lengths)
    return block_bytes


def test_weight_shards_gather_one_block_at_a_time():
    """winsp's inference weight sharding (winsp.runtime.weight_shards, behind SeedVR2's --shard-weights): one uint8
    all-gather a block, the same size on every rank, and a forward peak lower than the replicated model's by the
    blocks that are never whole at once (at most two are: the running one and the prefetched next)."""
    from winsp.testing.fake_gpu import run_fake_gpu

    world, layers = 4, 6
    case = REAL_720P[:4] + (layers,) + REAL_720P[5:]
    replicated = run_fake_gpu(_sharded_rank, world, case, False)
    sharded = run_fake_gpu(_sharded_rank, world, case, True)
    assert replicated.problems() == [] and sharded.problems() == []
    block_bytes = sharded.ranks[0].result
    for trace in sharded.ranks.values():
        gathers = [c for c in trace.collectives if c.op == "all_gather"]
        assert len(gathers) == layers and {c.dtype for c in gathers} == {torch.uint8}
    saved = replicated.ranks[0].stage_peaks["forward"] - sharded.ranks[0].stage_peaks["forward"]
    expected = (layers - 2 - layers / world) * block_bytes
    assert saved >= 0.95 * expected, (saved, expected)
