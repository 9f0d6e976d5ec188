"""The parity check of the Swin V2 adapter: an untouched HF ``Swinv2Model`` against its parallelized copy, per rank.

Every rank builds the same tiny random model (float64, every parameter perturbed so biases, logit scales and the cpb
MLP are not at their initial values), runs the untouched model and the parallelized copy on the same images with the
same RNG seed (drop path draws the same numbers), takes the same loss from the outputs of both, and reports the
largest differences: outputs (last_hidden_state, pooler_output, and the hidden state after every stage: HF's
``output_hidden_states``, read on the parallel model by forward hooks that gather each stage's rows, since HF's
encoder cannot view local rows as a grid) absolute; gradients (every parameter, and pixel_values) relative to the
largest reference gradient entry, after ``winsp.sync_gradients``. Every loss term feeds the backward.
"""

from __future__ import annotations

import copy

import torch

import winsp

from .adapter import parallelize
from .hf_import import import_swinv2

__all__ = ["tiny_config", "compare_with_original", "boundary_rows"]


def tiny_config(**overrides):
    """A small random ``Swinv2Config``: 3 stages (window 4, 4 then clamped to 2 at 32x32), 2 blocks each."""
    config_cls, _ = import_swinv2()
    fields = dict(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=(2, 2, 2), num_heads=(2, 4, 4),
                  window_size=4, mlp_ratio=2.0, drop_path_rate=0.0)
    fields.update(overrides)
    return config_cls(**fields)


def _models(config, world_size: int, seed: int, group=None):
    _, model_cls = import_swinv2()
    torch.manual_seed(seed)
    original = model_cls(config).double()
    with torch.no_grad():
        for p in original.parameters():
            p.add_(0.1 * torch.randn_like(p))
    parallel = copy.deepcopy(original)
    sp = winsp.DiffusionParallelConfig(ulysses_degree=world_size) if world_size > 1 else None
    parallel = parallelize(parallel, sp, group=group)
    return original, parallel


def boundary_rows(rank: int, world_size: int, size: int = 36) -> list[tuple[int, int]]:
    """Per stage boundary: (rows the sharded patch merging moves between ranks, in total; this rank's real rows of
    the grid it leaves). Call it on every rank."""
    _, model = _models(tiny_config(), world_size, 0)
    found = []

    def record(module, args):
        request = winsp.current_request()
        found.append((request.grid_step(module.index).rows_moved, int(request.valid_rows.sum())))

    for module in model.modules():
        if isinstance(module, winsp.adoption.Swapped) and module.swapped_from == "Swinv2PatchMerging":
            module.register_forward_pre_hook(record)
    model(torch.randn(2, 3, size, size, dtype=torch.float64))
    return found


def _gathered_stage_outputs(model) -> list[torch.Tensor]:
    """Hooks on the parallel model's stages: each stage's output rows gathered (canonical ``[B*H*W, C]``)."""
    found: list[torch.Tensor] = []
    for stage in model.encoder.layers:
        stage.register_forward_hook(lambda module, args, out: found.append(winsp.current_request().gather(out[0])))
    return found


def _loss(tensors: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    return sum((t * w).sum() for t, w in zip(tensors, weights, strict=True))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


ALL_CASES = ((32, False), (32, True), (36, False), (36, True))


def compare_with_original(rank: int, world_size: int, cases=ALL_CASES, drop_path_rate: float = 0.3,
                          seed: int = 0, group=None) -> dict:
    """Largest differences (see the module docstring) per case ``(image size, train)``; call it on every rank of the
    SP group (``group``: a subgroup of ``world_size`` ranks; default the world).

    32x32 images give grids that are window multiples at every stage; 36x36 pad at every stage and merge odd grids.
    """
    original, parallel = _models(tiny_config(drop_path_rate=drop_path_rate), world_size, seed, group)
    stage_outputs = _gathered_stage_outputs(parallel)
    results = {}
    for size, train in cases:
        original.train(train), parallel.train(train)
        original.zero_grad(), parallel.zero_grad()
        stage_outputs.clear()
        torch.manual_seed(seed + size)
        pixels = torch.randn(2, 3, size, size, dtype=torch.float64)
        ref_in, par_in = pixels.clone().requires_grad_(), pixels.clone().requires_grad_()
        torch.manual_seed(seed + 1)
        ref = original(ref_in, output_hidden_states=True)
        torch.manual_seed(seed + 1)
        out = parallel(par_in)
        ref_tensors = [ref.last_hidden_state, ref.pooler_output, *ref.hidden_states[1:]]
        # the stages the hooks saw (as many as the reference's, or fewer: stages_compared says how many)
        compared = zip(stage_outputs, ref.hidden_states[1:], strict=False)
        par_tensors = [out.last_hidden_state, out.pooler_output, *(s.view_as(r) for s, r in compared)]
        weights = [torch.randn_like(t) for t in ref_tensors]
        _loss(ref_tensors, weights).backward()
        _loss(par_tensors, weights).backward()
        winsp.sync_gradients(parallel)
        winsp.sync_gradients([par_in], parallel)
        named = dict(original.named_parameters())
        grads = {n: _relative(p.grad, named[n].grad) for n, p in parallel.named_parameters()
                 if named[n].grad is not None and p.grad is not None}
        missing = [n for n, p in parallel.named_parameters() if (p.grad is None) != (named[n].grad is None)]
        results[(size, train)] = {
            "last_hidden_state": (out.last_hidden_state - ref.last_hidden_state).abs().max().item(),
            "pooler_output": (out.pooler_output - ref.pooler_output).abs().max().item(),
            "hidden_states": max((a - b).abs().max().item()
                                 for a, b in zip(par_tensors[2:], ref_tensors[2:], strict=False)),
            "stages_compared": len(stage_outputs),
            "parameter_grad": max(grads.values()),
            "worst_parameter": max(grads, key=grads.get),
            "pixel_grad": _relative(par_in.grad, ref_in.grad),
            "grad_presence_mismatch": missing,
        }
    return results
