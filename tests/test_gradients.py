"""Training gradients under window SP equal one rank's, whatever a parameter feeds (float64, SP = 2, 3, 4).

winsp's convention: every rank computes the same loss, each rank's copy of a replicated value is its own contribution,
and ``winsp.sync_gradients`` averages the gradients over the SP group. Covered here on the SeedVR2 DiT in train() mode:
blocks before ``mm_layers`` keep separate video/text weights, later blocks share one set between the streams, the
timestep embedding modulates both streams, and the inputs ``vid`` and ``txt`` get gradients too. (The toy model's
version of the same check, with video-only, text-only and shared weights, is in test_parallel_core.py.)
"""

from __future__ import annotations

import pytest
import torch

import winsp
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT, load_dit_checkpoint
from tests.test_dit import random_batch, read_golden
from winsp.testing import check_parallel, run_ranks

SHAPES, TEXT, STEPS = [(2, 12, 16), (1, 8, 8)], [5, 3], [700.0, 120.0]


def _train(world_size: int, planner: str = "auto") -> dict:
    meta, state, _, _ = read_golden()
    torch.manual_seed(0)
    model = SeedVR2NaDiT(NaDiTConfig.from_metadata(meta))
    load_dit_checkpoint(model, state)
    model = model.double().train()
    runtime = model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size, planner=planner))
    b = random_batch(model.config, SHAPES, TEXT, STEPS, seed=5)
    vid = b["vid"].double().requires_grad_(True)
    txt = b["txt"].double().requires_grad_(True)
    out = model(vid, txt, b["vid_shape"], b["txt_shape"], b["timestep"].double())
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (out * weight).sum().backward()  # every rank computes the same loss from the gathered output
    winsp.sync_gradients(model)  # the group of the runtime build_runtime attached
    winsp.sync_gradients([vid, txt], model)
    grids = [(t // p[0], h // p[1], w // p[2]) for p in [model.config.patch_size] for t, h, w in SHAPES]
    return dict(out=out.detach(), vid=vid.grad, txt=txt.grad,
                split=any(plan.has_split_windows for plan in runtime.plans(grids)),
                params={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def _rank_main(rank, world_size, planner="auto"):
    return _train(world_size, planner)


@pytest.fixture(scope="module")
def one_rank():
    return _train(1)


def test_the_dit_has_every_kind_of_parameter(one_rank):
    names = set(one_rank["params"])
    assert any(".vid." in n for n in names) and any(".txt." in n for n in names)  # separate streams
    assert any(".all." in n for n in names)  # shared between the streams (blocks past mm_layers)
    assert any(n.startswith("emb_in.") for n in names)  # the timestep embedding behind both modulations
    assert all(g.abs().max() > 0 for g in one_rank["params"].values())


def test_sp4_has_a_rank_without_windows():
    """So the SP = 4 lpt case below also covers a rank that owns no window in some layer (the default splits)."""
    meta = read_golden()[0]
    model = SeedVR2NaDiT(NaDiTConfig.from_metadata(meta))
    patch = model.config.patch_size
    grids = [(t // patch[0], h // patch[1], w // patch[2]) for t, h, w in SHAPES]
    plans = winsp.planning.plan_schedule(grids, model.window_schedule(), 4, "lpt")
    assert any(0 in plan.rank_token_counts for plan in plans)
    for world_size in (2, 3, 4):  # the default splits windows of this batch at SP = 2, 3, 4
        assert all(plan.has_split_windows for plan in winsp.planning.plan_schedule(grids, model.window_schedule(), world_size))


def make_dit() -> SeedVR2NaDiT:
    """The tiny golden DiT in float64 (its one-rank output is checked against the reference code's in test_dit)."""
    meta, state, _, _ = read_golden()
    model = SeedVR2NaDiT(NaDiTConfig.from_metadata(meta))
    load_dit_checkpoint(model, state)
    return model.double()


def with_runtime(model: SeedVR2NaDiT, world_size: int) -> SeedVR2NaDiT:
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    return model


def dit_inputs():
    b = random_batch(make_dit().config, SHAPES, TEXT, STEPS, seed=5)
    # the timestep's gradient is not compared: the sinusoidal embedding runs in float32 (as the reference does)
    return (b["vid"].double().requires_grad_(), b["txt"].double().requires_grad_(), b["vid_shape"], b["txt_shape"],
            b["timestep"].double())


@pytest.mark.multirank
def test_dit_training_gradients_equal_one_rank():
    """Output, every parameter gradient and the vid / txt gradients, on every rank, at SP = 2, 3, 4 (the default
    planner splits windows of this batch at every one of them: test_sp4_has_a_rank_without_windows checks it)."""
    report = check_parallel(make_dit, with_runtime, dit_inputs, world_sizes=(2, 3, 4), train=True)
    assert {("input", "args[0]"), ("input", "args[1]")} <= set(report.items)
    assert sum(kind == "param" for kind, _ in report.items) == len(list(make_dit().parameters()))


@pytest.mark.slow  # the default run's budget
@pytest.mark.multirank
def test_dit_training_gradients_with_a_rank_without_windows(one_rank):
    """Whole windows (lpt) at SP = 4 leave a rank without rows in some layer; its gradients still equal one rank."""
    for rank, r in enumerate(run_ranks(_rank_main, 4, "lpt", timeout=300)):
        assert not r["split"], rank
        for key in ("out", "vid", "txt"):
            err = (r[key] - one_rank[key]).abs().max().item()
            assert err <= 1e-9 * max(1.0, one_rank[key].abs().max().item()), (rank, key, err)
        for name, want in one_rank["params"].items():
            err = (r["params"][name] - want).abs().max().item()
            assert err <= 1e-9 * max(1.0, want.abs().max().item()), (rank, name, err)


def _partial_worker(rank, world_size):
    """Without sync_gradients each rank holds its own contribution: their mean over ranks is the whole gradient."""
    meta, state, _, _ = read_golden()
    model = SeedVR2NaDiT(NaDiTConfig.from_metadata(meta))
    load_dit_checkpoint(model, state)
    model = model.double().train()
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    b = random_batch(model.config, SHAPES, TEXT, STEPS, seed=5)
    out = model(b["vid"].double(), b["txt"].double(), b["vid_shape"], b["txt_shape"], b["timestep"].double())
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (out * weight).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if ".all." in n or n.startswith("emb_in.")}


@pytest.mark.multirank
def test_unsynced_gradients_average_to_the_whole_gradient(one_rank):
    results = run_ranks(_partial_worker, 2, timeout=300)
    for name, grads in ((n, [r[n] for r in results]) for n in results[0]):
        want = one_rank["params"][name]
        assert (grads[0] - want).abs().max() > 1e-6 * want.abs().max()  # one rank alone is not the gradient
        mean = (grads[0] + grads[1]) / 2
        assert (mean - want).abs().max() <= 1e-9 * max(1.0, want.abs().max().item()), name
