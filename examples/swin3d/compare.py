"""Run torchvision's swin3d_t untouched and window-parallel side by side on one rank of a group; report differences.

Used by ``python -m examples.swin3d`` and ``tests/test_swin3d.py``. Every rank builds the same model (same seed) and
runs the parallel copy; rank 0 also runs the untouched original and compares the logits, every stage's output, and
(after ``loss.backward()`` and ``winsp.sync_gradients``) every parameter gradient and the input gradient, as relative
max differences (``max |a - b| / max |b|``).
"""

from __future__ import annotations

import copy

import torch

import winsp

from .adapter import parallelize
from .load_torchvision import import_torchvision

__all__ = ["compare_with_torchvision"]

STAGES = ("features.0", "features.2", "features.4", "features.6")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def stage_output(output: torch.Tensor) -> torch.Tensor:
    """A stage's output as the model's ``[B, T, H, W, C]``: as is outside a region, gathered from the local rows
    inside one (an extra all-gather: for checks only)."""
    request = winsp.runtime.context.current_request_or_none()
    if request is None:
        return output
    rows = request.gather(output)
    grids = request.stage_model_grids[request.stage]
    return rows.reshape((len(grids),) + tuple(grids[0]) + tuple(rows.shape[1:]))


def _stage_outputs(model: torch.nn.Module) -> dict:
    """Hooks recording each stage's output, detached."""
    seen: dict = {}
    for name in STAGES:
        model.get_submodule(name).register_forward_hook(
            lambda module, args, output, name=name: seen.__setitem__(name, stage_output(output.detach())))
    return seen


def compare_with_torchvision(rank: int, sp: int, shape=(2, 3, 4, 32, 32), train: bool = False, seed: int = 0,
                             group=None) -> dict | None:
    """On SP rank 0 of ``sp`` ranks (the world, or ``group``): the relative max differences (``logits``, each stage,
    the worst ``param_grad``, ``input_grad``); on the other ranks: None. Fits ``run_ranks(fn, sp, ...)``."""
    import_torchvision()
    from torchvision.models.video import swin3d_t

    torch.manual_seed(seed)
    reference = swin3d_t(weights=None).double().train(train)
    if train:  # a high stochastic depth rate makes sure some samples' branches are dropped
        for module in reference.modules():
            if type(module).__name__ == "StochasticDepth":
                module.p = 0.5
    model = parallelize(copy.deepcopy(reference), winsp.DiffusionParallelConfig(ulysses_degree=sp),
                        group=group)
    x = torch.randn(shape, dtype=torch.float64)
    target = torch.randn(shape[0], 400, dtype=torch.float64)

    def run(net):
        stages = _stage_outputs(net)
        inp = x.clone().requires_grad_(True)
        torch.manual_seed(seed + 1)  # stochastic depth draws the same samples in both models
        out = net(inp)
        loss = ((out - target) ** 2).mean()
        loss.backward()
        return out.detach(), stages, inp

    out, stages, inp = run(model)
    winsp.sync_gradients(model)
    winsp.sync_gradients([inp], model)
    if rank != 0:
        return None
    ref_out, ref_stages, ref_inp = run(reference)
    grads = {n: p.grad for n, p in model.named_parameters()}
    worst = max((_relative(grads[n], p.grad), n) for n, p in reference.named_parameters())
    report = {"logits": _relative(out, ref_out), "input_grad": _relative(inp.grad, ref_inp.grad),
              "param_grad": worst[0], "worst_param": worst[1]}
    report.update({name: _relative(stages[name], ref_stages[name]) for name in STAGES})
    return report


class WithStages(torch.nn.Module):
    """A swin3d returning ``(logits, stage 0 output, ..., stage 3 output)``, so that
    :func:`winsp.testing.check_parallel` compares the intermediate features too (in the parallel model each stage's
    rows are gathered for it)."""

    def __init__(self, module: torch.nn.Module, stages: tuple[str, ...] = STAGES) -> None:
        super().__init__()
        self.module, self.stages = module, stages

    def forward(self, x: torch.Tensor):
        seen: list = []

        def record(module, args, output):
            seen.append(stage_output(output))

        handles = [self.module.get_submodule(name).register_forward_hook(record) for name in self.stages]
        try:
            logits = self.module(x)
        finally:
            for handle in handles:
                handle.remove()
        return (logits, *seen)


def swin3d_t_with_stages(drop_prob: float = 0.5) -> WithStages:
    """torchvision's swin3d_t (random weights, float64) with every stochastic depth at ``drop_prob``, in
    :class:`WithStages`: the original model of :func:`winsp.testing.check_parallel`."""
    import_torchvision()
    from torchvision.models.video import swin3d_t

    model = swin3d_t(weights=None).double()
    for module in model.modules():
        if type(module).__name__ == "StochasticDepth":
            module.p = drop_prob
    return WithStages(model)


def parallelize_with_stages(original: WithStages, world_size: int) -> WithStages:
    """``make_parallel`` of :func:`winsp.testing.check_parallel`: the swin3d inside, parallelized in place."""
    parallelize(original.module, winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    return original
