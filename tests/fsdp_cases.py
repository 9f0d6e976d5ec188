"""Rank functions for ``tests/test_fsdp.py`` and ``tests/test_dcp.py``: window SP on a (dp, sp) DeviceMesh with FSDP2
sharding the weights over every rank.

Every case compares one training step of the parallel, sharded model with the ORIGINAL model run in one process on
the global batch (the mean over the dp groups' samples of each sample's loss): outputs, and every parameter gradient
(FSDP's sharded gradient gathered whole), from ``loss.backward()`` and FSDP's own reduction alone.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import winsp
from winsp.adoption.parallelize import path_matches

GRID = (2, 8, 6)  # the hourglass's levels: (2, 8, 6) -> (2, 4, 3) -> middle (2, 2, 2)


def quiet() -> None:
    # FSDP2 warns that a root returning a view (any nn.Linear on a 5-D input does) must not be modified in place
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def make_mesh(dp: int, sp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))


# ---- models -----------------------------------------------------------------------------------------------------

def hourglass(dtype=torch.float64) -> nn.Module:
    from examples.hourglass import HourglassNet

    torch.manual_seed(0)
    return HourglassNet(dropout=0.0).to(dtype)


def tiny_swin3d() -> nn.Module:
    from examples.swin3d import import_torchvision

    import_torchvision()
    from torchvision.models.video.swin_transformer import SwinTransformer3d

    torch.manual_seed(0)
    return SwinTransformer3d(patch_size=[1, 2, 2], embed_dim=8, depths=[2, 2], num_heads=[2, 2], window_size=[2, 2, 2],
                             num_classes=5, stochastic_depth_prob=0.0).double()


def toy_dit(layers: int = 4) -> nn.Module:
    from examples.toy_windowed_block import ToyWindowedDiT

    torch.manual_seed(0)
    return ToyWindowedDiT(dim=8, heads=2, layers=layers, window=(2, 3, 3)).double()


def video_batch(dp: int, shape: tuple, dtype=torch.float64, seed: int = 1) -> torch.Tensor:
    """One sample per dp group: ``[dp, *shape]``."""
    torch.manual_seed(seed)
    return torch.randn(dp, *shape, dtype=dtype)


def dit_sample(d: int):
    """Sample ``d`` of the toy DiT's batch: canonical video rows, text rows, grids, text lengths, timestep (all
    differ by d)."""
    g = torch.Generator().manual_seed(100 + d)
    grids, lengths = [(2, 6, 5 + d)], [3 + d]
    n = sum(t * h * w for t, h, w in grids)
    vid = torch.randn(n, 8, generator=g, dtype=torch.float64)
    txt = torch.randn(sum(lengths), 8, generator=g, dtype=torch.float64)
    return vid, txt, grids, lengths, torch.tensor([0.25 + d], dtype=torch.float64)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean() if out.dtype == torch.bfloat16 else (out ** 2).mean()


# ---- comparing with the original ----------------------------------------------------------------------------------

def reference_step(model: nn.Module, samples: list, run) -> tuple[list, dict]:
    """The original model in this process on the global batch: per-sample outputs and the gradients of the mean over
    samples of each sample's loss."""
    model.zero_grad()
    outs = [run(model, s) for s in samples]
    (sum(loss_of(o) for o in outs) / len(outs)).backward()
    return [o.detach() for o in outs], {n: _grad(p).detach().clone() for n, p in model.named_parameters()}


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, whole; zeros for one the loss does not reach (the toy DiT's last text projection)."""
    return full(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def errors(model: nn.Module, out: torch.Tensor, ref_out: torch.Tensor, ref_grads: dict) -> dict:
    """Max abs differences: output, and the worst parameter gradient (gathered whole), with its scale."""
    return grad_errors({n: _grad(p) for n, p in model.named_parameters()}, out, ref_out, ref_grads)


def grad_errors(grads: dict, out: torch.Tensor, ref_out: torch.Tensor, ref_grads: dict) -> dict:
    """:func:`errors` of gradients given by name."""
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    worst = max(((grads[n].double() - ref_grads[n].double()).abs().max().item(), n) for n in grads)
    return {"out": (out.double() - ref_out.double()).abs().max().item(),
            "out_scale": ref_out.double().abs().max().item(),
            "grad": worst[0], "worst": worst[1],
            "grad_scale": max(g.double().abs().max().item() for g in ref_grads.values())}


def shard_numels(model: nn.Module, world: int) -> dict:
    """This rank's share of the weights: its local shard elements, the whole model's elements, and the most one even
    dim-0 split can give a rank (FSDP2 pads dim 0 to a multiple of the world)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    return {"local": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
            "total": sum(p.numel() for p in params),
            "bound": sum(-(-p.shape[0] // world) * (p.numel() // max(p.shape[0], 1)) for p in params),
            "all_dtensor": all(isinstance(p, DTensor) for p in params)}


# ---- the cases ------------------------------------------------------------------------------------------------------

def _run_video(model, x):
    return model(x)


def _run_dit(model, sample):
    return model(*sample)


def _shard_plainly(model: nn.Module, mesh, blocks, **options) -> None:
    """FSDP2 as users apply it: fully_shard every block, then the root, over every rank (the mesh flattened)."""
    from torch.distributed.fsdp import fully_shard

    flat = mesh._flatten("dp_sp") if mesh.ndim > 1 else mesh
    for name, module in model.named_modules():
        if any(path_matches(name, b) for b in blocks):
            fully_shard(module, mesh=flat, **options)
    fully_shard(model, mesh=flat, **options)


def train_step_case(rank: int, world: int, dp: int, sp: int, which: str, how: str = "shard_weights",
                    reshard: bool = True, compile_backend: str | None = None) -> dict:
    """One training step of ``which`` (``hourglass``, ``swin3d``, ``dit``) made window-parallel over ``mesh["sp"]``
    and sharded over every rank (``how``: ``shard_weights`` or plain ``fully_shard``; ``dp_only``: plain
    ``fully_shard`` over ``mesh["dp"]``), against the original."""
    quiet()
    mesh = make_mesh(dp, sp)
    d = mesh.get_local_rank("dp")
    if which == "dit":
        original = toy_dit()
        samples, run = [dit_sample(i) for i in range(dp)], _run_dit
        model = copy.deepcopy(original)
        original.build_runtime(None)  # one rank: this process alone runs the reference
        model.build_runtime(winsp.DiffusionParallelConfig(mesh=mesh["sp"]))
        blocks = ("blocks.*",)
    else:
        original = hourglass() if which == "hourglass" else tiny_swin3d()
        shape = (*GRID, 3) if which == "hourglass" else (3, 4, 8, 8)
        batch = video_batch(dp, shape)
        samples, run = [batch[i:i + 1] for i in range(dp)], _run_video
        model = copy.deepcopy(original)
        if which == "hourglass":
            from examples.hourglass import parallelize
        else:
            from examples.swin3d import parallelize
        parallelize(model, group=mesh["sp"])
        blocks = ("body.**.blocks.*", "body.mid") if which == "hourglass" else ("features.*.*",)
    if compile_backend is not None:
        for name, module in model.named_modules():
            if any(path_matches(name, b) for b in blocks):
                module.compile(backend=compile_backend)
    if how == "shard_weights":
        winsp.shard_weights(model, mesh, blocks=None if which != "dit" else "blocks.*", reshard_after_forward=reshard)
    elif how == "dp_only":  # FSDP over the dp dimension only: winsp.sync_gradients averages each shard over SP
        _shard_plainly(model, mesh["dp"], blocks, reshard_after_forward=reshard)
    else:
        _shard_plainly(model, mesh, blocks, reshard_after_forward=reshard)
    shards = shard_numels(model, dp if how == "dp_only" else world)
    with torch.no_grad():  # inference first: reshard_after_forward applies to a no-grad forward too
        inference = run(model, samples[d])
    out = run(model, samples[d])
    loss_of(out).backward()
    synced = winsp.sync_gradients(model)  # FSDP reduced over every rank already: nothing left to average
    ref_outs, ref_grads = reference_step(original, samples, run)
    report = errors(model, out, ref_outs[d], ref_grads)
    report.update(shards=shards, synced=synced, dp_rank=d, out_sum=out.double().sum().item(),
                  inference=(inference - ref_outs[d]).abs().max().item(),
                  sp_size=model._winsp_runtime.world_size if hasattr(model, "_winsp_runtime") else None)
    parallel = getattr(model, "_winsp_parallel", None)
    report["dry_run_done"] = None if parallel is None else parallel.order.dry_run_done
    return report


def mixed_precision_case(rank: int, world: int, dp: int, sp: int) -> dict:
    """The hourglass under FSDP2 mixed precision (bf16 parameters and compute, fp32 gradient reduction) against the
    original run in one process with the same casting (its weights and input in bf16), and against float64."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from examples.hourglass import parallelize

    quiet()
    mesh = make_mesh(dp, sp)
    d = mesh.get_local_rank("dp")
    original = hourglass(torch.float32)
    model = parallelize(copy.deepcopy(original), group=mesh["sp"])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    winsp.shard_weights(model, mesh, mp_policy=policy)
    batch = video_batch(dp, (*GRID, 3), torch.float32)
    samples = [batch[i:i + 1] for i in range(dp)]
    out = model(samples[d])
    loss_of(out).backward()
    bf16_outs, bf16_grads = reference_step(copy.deepcopy(original).bfloat16(), [s.bfloat16() for s in samples],
                                           _run_video)
    f64_outs, f64_grads = reference_step(copy.deepcopy(original).double(), [s.double() for s in samples], _run_video)
    return {"out_dtype": str(out.dtype), "grad_dtype": str(next(model.parameters()).grad.dtype),
            "dry_run_done": model._winsp_parallel.order.dry_run_done,
            "vs_bf16": errors(model, out, bf16_outs[d], bf16_grads),
            # how far bf16 itself is from exact: the scale of an honest tolerance
            "bf16_vs_f64": grad_errors(bf16_grads, bf16_outs[d], f64_outs[d], f64_grads),
            "parallel_vs_f64": errors(model, out, f64_outs[d], f64_grads)}


def mesh_checks(rank: int, world: int, dp: int, sp: int) -> dict:
    """A (2, 2) mesh given where an SP group goes: whole (refused, naming the dimensions), by dimension (accepted),
    in the config, twice (refused); dp groups hold different SP groups."""
    from winsp.comm.group import SPGroup

    mesh = make_mesh(dp, sp)
    found = {}
    try:
        SPGroup(mesh)
    except ValueError as error:
        found["whole"] = str(error)
    sp = SPGroup(mesh["sp"])
    found["sp"] = (sp.rank, sp.size)
    config = winsp.DiffusionParallelConfig(mesh=mesh["sp"])
    found["degree"] = config.ulysses_degree
    try:
        winsp.DiffusionParallelConfig(ulysses_degree=4, mesh=mesh["sp"])
    except ValueError as error:
        found["degree_mismatch"] = str(error)
    try:
        winsp.WindowRuntime.from_config(config, [winsp.FixedWindows((1, 2, 2))], group=mesh["dp"])
    except ValueError as error:
        found["twice"] = str(error)
    found["same_twice"] = winsp.WindowRuntime.from_config(config, [winsp.FixedWindows((1, 2, 2))],
                                                          group=SPGroup(mesh["sp"])).world_size
    runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))], group=mesh["sp"])
    found["runtime"] = (runtime.rank, runtime.world_size)
    import torch.distributed as dist

    found["sp_ranks"] = dist.get_process_group_ranks(sp.group)
    return found


def seedvr2_pipeline_on_mesh(rank: int, world: int, dp: int, sp: int) -> dict:
    """The SeedVR2 pipeline (golden tiny weights) given ``mesh["sp"]`` as ``group=``, and as the config's mesh:
    its SP size, and the small restore of ``tests/test_pipeline.py``."""
    from examples.seedvr2.pipeline import SeedVR2Pipeline
    from tests.test_pipeline import build_golden_models, restore_small

    mesh = make_mesh(dp, sp)
    dit, vae = build_golden_models()
    by_group = SeedVR2Pipeline(dit, vae, "replicated", group=mesh["sp"])
    sizes = [by_group.group.size, by_group.runtime.world_size]
    out = restore_small(by_group)
    by_config = SeedVR2Pipeline(dit, vae, "replicated", parallel_config=winsp.DiffusionParallelConfig(mesh=mesh["sp"]))
    sizes += [by_config.group.size, by_config.runtime.world_size]
    return {"sizes": sizes, "restored": out}


def seedvr2_dit_fully_shard(rank: int, world: int, dp: int, sp: int) -> dict:
    """The SeedVR2 DiT (golden tiny weights) made window-parallel on ``mesh["sp"]``, then plain ``fully_shard`` of
    every block and the root over every rank: its error against the original code's golden output, and this rank's
    share of the weights."""
    from tests.test_dit import run
    from tests.test_dit_parallel import _golden_model

    quiet()
    mesh = make_mesh(dp, sp)
    model, inputs, expected = _golden_model()
    model.build_runtime(winsp.DiffusionParallelConfig(mesh=mesh["sp"]))
    _shard_plainly(model, mesh, ("blocks.*",))
    shards = shard_numels(model, world)  # before the forward: FSDP2 leaves the root's parameters gathered after it
    out = run(model, inputs)
    return {"golden_err": (out - expected).abs().max().item(), "shards": shards,
            "sp_size": model.require_runtime().world_size}


def sharded_first(rank: int, world: int, dp: int, sp: int) -> str:
    """``parallelize`` on a model FSDP2 sharded already, and ``unparallelize`` on one sharded after: the refusals."""
    from torch.distributed.fsdp import fully_shard

    from examples.hourglass import parallelize

    model = hourglass()
    fully_shard(model, mesh=make_mesh(dp, sp)._flatten("dp_sp"))
    found = ""
    try:
        parallelize(model, group=make_mesh(dp, sp)["sp"])
    except ValueError as error:
        found += str(error)
    model = parallelize(hourglass(), group=make_mesh(dp, sp)["sp"])
    winsp.shard_weights(model, make_mesh(dp, sp))
    try:
        winsp.unparallelize(model)
    except ValueError as error:
        found += "\n" + str(error)
    return found


# ---- distributed checkpoints ----------------------------------------------------------------------------------------

def _dcp_batch(step: int) -> torch.Tensor:
    """The global batch of training step ``step``: two samples (a 2-way dp mesh gives one to each group)."""
    return video_batch(2, (*GRID, 3), seed=10 + step)


def _sharded_trainer(dp: int, sp: int, seed: int):
    from examples.hourglass import parallelize

    mesh = make_mesh(dp, sp)
    torch.manual_seed(seed)
    from examples.hourglass import HourglassNet

    model = parallelize(HourglassNet(dropout=0.0).double(), group=mesh["sp"])
    winsp.shard_weights(model, mesh)
    return mesh, model, adamw(model)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with eps 1e-6: a gradient that is zero in exact arithmetic (the attention's key bias: softmax ignores it)
    is rounding noise of about 1e-17 here, different in each reduction order, and Adam moves the weight by about
    lr * noise / eps; at eps 1e-8 that is 1e-11, at 1e-6 it is 1e-13, below the runs' float64 agreement."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)


def _train_step(mesh, model, optimizer, step: int) -> None:
    """One step on the global batch: dp group d takes its share of the samples; the loss is its local mean."""
    batch = _dcp_batch(step)
    dp, d = mesh.size(0), mesh.get_local_rank("dp")
    local = batch.chunk(dp)[d]
    optimizer.zero_grad()
    loss_of(model(local)).backward()
    optimizer.step()


def _full_params(model: nn.Module) -> dict:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def dcp_save_case(rank: int, world: int, dp: int, sp: int, path: str) -> dict:
    """Train one step on a (dp, sp) mesh, save model and optimizer state with DCP, then train the next step
    uninterrupted; returns every parameter (whole) after it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    quiet()
    mesh, model, optimizer = _sharded_trainer(dp, sp, seed=0)
    _train_step(mesh, model, optimizer, 0)
    model_state, optim_state = get_state_dict(model, optimizer)
    winsp.save_checkpoint({"model": model_state, "optim": optim_state}, path)
    _train_step(mesh, model, optimizer, 1)
    return _full_params(model)


def dcp_resume_case(rank: int, world: int, dp: int, sp: int, path: str) -> dict:
    """A model initialised differently on another (dp, sp) shape, resumed from the checkpoint, then the next step;
    returns every parameter (whole) after it, and how far the fresh model was from the checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    quiet()
    mesh, model, optimizer = _sharded_trainer(dp, sp, seed=123)
    model_state, optim_state = get_state_dict(model, optimizer)
    fresh = _full_params(model)
    state = {"model": model_state, "optim": optim_state}
    winsp.load_checkpoint(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_params(model)
    _train_step(mesh, model, optimizer, 1)
    return {"params": _full_params(model), "moved": max((fresh[n] - loaded[n]).abs().max().item() for n in fresh)}


def dcp_single_process_reference() -> dict:
    """The original model trained two steps in one process on the same global batches (the mean over samples)."""
    from examples.hourglass import HourglassNet

    torch.manual_seed(0)
    model = HourglassNet(dropout=0.0).double()
    optimizer = adamw(model)
    for step in (0, 1):
        optimizer.zero_grad()
        batch = _dcp_batch(step)
        (sum(loss_of(model(batch[i:i + 1])) for i in range(len(batch))) / len(batch)).backward()
        optimizer.step()
    return _full_params(model)
