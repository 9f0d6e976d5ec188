"""torch.compile: the SeedVR2 DiT traces without graph breaks, blocks compile with fullgraph=True, output = eager.

Two backends. ``aot_eager`` captures exactly the graphs inductor would get (dynamo and AOTAutograd, custom collectives
included) without a C++ compiler, so the golden model and SP = 2 are checked with it. ``inductor`` (the default backend,
what users run) generates its own kernels, which can be wrong where the graphs are right: torch 2.13's CPU inductor
silently miscomputed the whole compiled DiT (pytorch/pytorch#185702, see docs/torch_compile.md), so the whole model and
``compile_blocks()`` are checked with inductor too, forward and backward, on a two-block cut of the tiny 3B config that
compiles in seconds. The speed of inductor-compiled blocks is measured in ``benchmarks/bench_compile.py``.
"""

from __future__ import annotations

import pytest
import torch

import winsp
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT, load_dit_checkpoint
from tests.test_dit import random_batch, read_golden
from winsp.testing import run_ranks

SHAPES, TEXT, STEPS = [(2, 16, 20), (1, 8, 8)], [6, 3], [400.0, 300.0]


def _model():
    meta, state, _, _ = read_golden()
    model = SeedVR2NaDiT(NaDiTConfig.from_metadata(meta)).eval()
    load_dit_checkpoint(model, state)
    return model


def _args(model, seed=3):
    b = random_batch(model.config, SHAPES, TEXT, STEPS, seed=seed)
    return b["vid"], b["txt"], b["vid_shape"], b["txt_shape"], b["timestep"]


def _check(model, world_size: int) -> dict:
    args = _args(model)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(*args)
        explained = torch._dynamo.explain(model)(*args)
        torch._dynamo.reset()
        model.compile_blocks(backend="aot_eager")  # fullgraph=True: a break inside a block raises
        first = model(*args)
        second = model(*_args(model, seed=4))
        eager_second = _eager(model, _args(model, seed=4))
    return dict(breaks=explained.graph_break_count, graphs=explained.graph_count,
                reasons=[r.reason[:200] for r in explained.break_reasons],
                err=(first - eager).abs().max().item(), err_second=(second - eager_second).abs().max().item(),
                world_size=world_size)


def _eager(model, args):
    for block in model.blocks:  # undo compile_blocks: nn.Module.compile keeps the wrapper in _compiled_call_impl
        block._compiled_call_impl = None
    return model(*args)


def test_dit_traces_in_at_most_two_graphs_and_compiled_blocks_equal_eager():
    r = _check(_model(), 1)
    assert r["breaks"] <= 2, r["reasons"]
    assert r["err"] <= 1e-4 and r["err_second"] <= 1e-4, r


def _rank_main(rank, world_size):
    model = _model()
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    return _check(model, world_size)


@pytest.mark.slow  # the default run's budget
@pytest.mark.multirank
def test_compiled_blocks_at_sp2_on_gloo():
    for r in run_ranks(_rank_main, 2, timeout=400):
        assert r["breaks"] <= 2, r["reasons"]
        assert r["err"] <= 1e-4 and r["err_second"] <= 1e-4, r


@pytest.mark.slow  # the default run's budget
def test_compiled_backward_equals_eager():
    model = _model().train()
    args = _args(model)
    weight = torch.randn(args[0].shape[0], model.config.vid_out_channels, generator=torch.Generator().manual_seed(1))
    (model(*args) * weight).sum().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    model.compile_blocks(backend="aot_eager")
    (model(*args) * weight).sum().backward()
    for name, p in model.named_parameters():
        err = (p.grad - eager[name]).abs().max().item()
        assert err <= 1e-4 * max(1.0, eager[name].abs().max().item()), (name, err)


# ---------------------------------------------------------------------------------------------- inductor
def _two_block_dit() -> SeedVR2NaDiT:
    """The tiny 3B config cut to two blocks, with random weights, to keep inductor's compile time down on 2 CPU cores.

    Block 0 has regular windows and separate stream weights; block 1 has shifted windows (one layout change), shared
    weights and is the video-only last block. Then come the final norm and the output modulation."""
    cfg = NaDiTConfig.from_metadata(read_golden()[0])
    cut = {k: getattr(cfg, k)[:2] for k in ("block_type", "window", "window_method")}
    cfg = NaDiTConfig(**{**cfg.to_dict(), **cut, "num_layers": 2, "mm_layers": 1})
    torch.manual_seed(0)
    model = SeedVR2NaDiT(cfg).train()
    with torch.no_grad():  # norm weights start at one: move them, so a kernel that dropped one would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _forward_backward(model, args, run=None) -> dict:
    """Output, and the gradients of every parameter and of both inputs for a fixed random weighting of the output;
    ``run`` (default ``model``) is what is called: the model or its compiled wrapper."""
    vid, txt = (a.detach().clone().requires_grad_() for a in args[:2])
    model.zero_grad(set_to_none=True)
    out = (model if run is None else run)(vid, txt, *args[2:])
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weight).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"output": out.detach(), **grads, "input vid": vid.grad, "input txt": txt.grad}


def _assert_same(compiled: dict, eager: dict) -> None:
    assert compiled.keys() == eager.keys()
    for name, ref in eager.items():
        assert compiled[name] is not None, name
        err = (compiled[name] - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (name, err, ref.abs().max().item())


@pytest.mark.slow  # inductor's C++ compilation: about a minute of CPU per case from an empty inductor cache
@pytest.mark.parametrize("regional", [False, True], ids=["whole_model", "compile_blocks"])
def test_inductor_equals_eager_forward_and_backward(regional):
    model = _two_block_dit()
    args = _args(model)
    eager = _forward_backward(model, args)
    torch._dynamo.reset()
    if regional:
        compiled = _forward_backward(model.compile_blocks(backend="inductor"), args)
    else:
        compiled = _forward_backward(model, args, torch.compile(model, backend="inductor"))
    torch._dynamo.reset()
    _assert_same(compiled, eager)
