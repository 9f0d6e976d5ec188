"""Sharding a window-parallel model's weights with FSDP2 over every rank of a ``DeviceMesh``.

winsp shards a model's activations over the SP ranks; FSDP2 (``torch.distributed.fsdp.fully_shard``) shards its
weights, gradients and optimizer state. The two compose when winsp comes first and FSDP shards over *all* ranks of
the mesh, SP ranks included:

- order: :func:`winsp.parallelize` (its swaps and hooks), then ``fully_shard`` on the blocks, then on the root.
  FSDP's pre-forward hook is registered first in line (it all-gathers the block's weights), so winsp's layer-entry
  hook on the same block then moves the rows into that layer's layout with whole weights at hand. A model sharded
  first is refused by ``parallelize``: FSDP would fill the modules winsp swapped out.
- gradients: winsp's convention is a mean over SP (each SP rank's gradient is its share of P copies of one loss), so
  FSDP's reduce-scatter, a mean over every rank of the mesh, gives the gradient of the global batch mean from
  ``loss.backward()`` alone. :func:`winsp.sync_gradients` then has nothing to do and skips those parameters.

:func:`shard_weights` is that recipe in one call; plain ``fully_shard`` works the same way.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

from torch import nn

from winsp.comm.mesh import is_device_mesh, world_mesh

__all__ = ["shard_weights", "sharded_blocks", "is_sharded_module"]


def is_sharded_module(module: nn.Module) -> bool:
    """Whether ``module`` was given to FSDP2's ``fully_shard``, or holds DTensor parameters of its own."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return isinstance(module, FSDPModule) or any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def sharded_blocks(model: nn.Module, blocks: Union[str, Sequence[str], None] = None) -> list[str]:
    """The module paths :func:`shard_weights` gives to ``fully_shard`` before the root, deepest first.

    ``blocks`` None: the layer entries of the plan :func:`winsp.parallelize` applied (the blocks, by default the
    attention modules' parents). A glob (or globs) of module paths (:func:`winsp.adoption.parallelize.path_matches`):
    those modules, e.g. ``"blocks.*"`` for a model on the request API, which has no plan.
    """
    from winsp.adoption.parallelize import _matches

    if blocks is None:
        applied = getattr(model, "_winsp_parallel", None)
        if applied is None:
            raise ValueError(f"shard_weights: {type(model).__name__} was not made parallel by winsp.parallelize, so "
                             f"no plan says where its blocks are; pass blocks= a glob of their module paths "
                             f"(e.g. blocks='blocks.*')")
        paths = {step.path for step in applied.order.steps if step.kind == "layer" and step.path}
    else:
        paths = {path for path, _ in _matches(model, blocks, "blocks")}
    return sorted(paths, key=lambda p: (-p.count("."), p))


def shard_weights(model: nn.Module, mesh: Any, *, blocks: Union[str, Sequence[str], None] = None,
                  shard_root: bool = True, **fully_shard_options: Any) -> nn.Module:
    """Shard ``model``'s weights over every rank of ``mesh`` with FSDP2: ``fully_shard`` on each block, then on the
    root; returns ``model`` (then an ``FSDPModule``).

    Args:
        model: a model made window-parallel (:func:`winsp.parallelize`, or a :class:`winsp.WindowParallel` model with
            its runtime built).
        mesh: a ``DeviceMesh``; one of several dimensions, e.g. (dp, sp), is flattened so every rank holds
            1 / world of the weights (an SP dimension alone, ``mesh["sp"]``, shards over it only).
        blocks: which modules to shard one by one (see :func:`sharded_blocks`); None: the plan's blocks.
        shard_root: False: the blocks only. The root's own parameters (embeddings, heads) stay whole on every rank,
            and the root's forward is the model's own: FSDP2's root moves every tensor argument to the device first,
            so a model that plans from host tensors it is given (SeedVR2's DiT and its shape tensors) would read them
            back from the device, a sync every forward. Each block is then an FSDP root of its own, which keeps its
            gathered weights after forward unless told otherwise, so ``reshard_after_forward`` defaults to True
            here. For inference; in training the root's gradients are not reduced by FSDP (average them over every
            rank yourself).
        fully_shard_options: passed to every ``fully_shard`` call (``reshard_after_forward``, ``mp_policy``, ...).

    Gradients need no :func:`winsp.sync_gradients` afterwards: FSDP's reduction averages them over every rank.
    """
    from torch.distributed.fsdp import fully_shard

    if not isinstance(model, nn.Module):
        raise ValueError(f"shard_weights: model must be an nn.Module, got {type(model).__name__}")
    if not is_device_mesh(mesh):
        raise ValueError(f"shard_weights: mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if "mesh" in fully_shard_options:
        raise ValueError("shard_weights: give the mesh once, as the second argument")
    if not isinstance(shard_root, bool):
        raise ValueError(f"shard_weights: shard_root must be True or False, got {shard_root!r}")
    if is_sharded_module(model):
        raise ValueError(f"shard_weights: {type(model).__name__} is sharded already")
    paths = sharded_blocks(model, blocks)
    done = [p for p in paths if is_sharded_module(model.get_submodule(p))]
    if done:
        raise ValueError(f"shard_weights: block {done[0]!r} of {type(model).__name__} is sharded already")
    if not shard_root:
        fully_shard_options.setdefault("reshard_after_forward", True)
    flat = world_mesh(mesh)
    for path in paths:
        fully_shard(model.get_submodule(path), mesh=flat, **fully_shard_options)
    if shard_root:
        fully_shard(model, mesh=flat, **fully_shard_options)
    return model
