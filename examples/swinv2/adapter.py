"""``parallelize(model, config)``: run a Hugging Face ``Swinv2Model`` window-parallel, in place.

Every ``Swinv2Stage`` runs on this rank's whole windows: its input (canonical ``[B, H*W, C]``) is padded to the
window multiple, scattered into the first block's layout, moved between the regular and shifted layouts by winsp,
gathered at the end of the stage, cropped, and HF's own patch merging runs on it. The model's parameters, buffers and
state_dict keys are untouched (each stage gets a forward on the instance; ``unparallelize`` removes it).
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor, nn

import winsp

from .blocks import swinv2_layer_forward

__all__ = ["parallelize", "unparallelize", "stage_schedule"]


def stage_schedule(stage) -> list[winsp.FixedWindows]:
    """One winsp geometry per block of an HF ``Swinv2Stage``: HF's clamped window and shift, on a (1, H, W) grid."""
    return [winsp.FixedWindows((1, b.window_size, b.window_size), shift=(0, b.shift_size, b.shift_size))
            for b in stage.blocks]


def _stage_forward(stage, runtime: winsp.WindowRuntime, hidden_states: Tensor, input_dimensions, output_attentions=False):
    if output_attentions:
        raise ValueError("examples.swinv2: output_attentions=True is not supported by the window-parallel stages")
    batch, _, channels = hidden_states.shape
    height, width = input_dimensions
    size = stage.blocks[0].window_size
    hp, wp = -(-height // size) * size, -(-width // size) * size
    padded = F.pad(hidden_states.view(batch, height, width, channels), (0, 0, 0, wp - width, 0, hp - height))
    request = runtime.request([(1, hp, wp)] * batch, device=hidden_states.device)
    x = request.scatter(padded.reshape(batch * hp * wp, channels))
    for index, layer in enumerate(stage.blocks):
        x = swinv2_layer_forward(layer, request, index, x, (height, width), batch)
    out = request.gather(x).view(batch, hp, wp, channels)[:, :height, :width].reshape(batch, height * width, channels)
    if stage.downsample is None:
        return out, out, (height, width, height, width)
    return stage.downsample(out, input_dimensions), out, (height, width, (height + 1) // 2, (width + 1) // 2)


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "swinv2" or not hasattr(model, "encoder"):
        raise ValueError(f"examples.swinv2.parallelize needs a transformers Swinv2Model, got {type(model).__name__}")
    for key in ("attention_probs_dropout_prob", "hidden_dropout_prob"):
        if getattr(config, key) != 0.0:
            raise ValueError(f"examples.swinv2: config.{key}={getattr(config, key)} must be 0 (element-wise dropout "
                             f"inside a window-parallel stage would draw different numbers than one rank)")


def parallelize(model: nn.Module, config: winsp.DiffusionParallelConfig | None = None) -> nn.Module:
    """Make every stage of HF ``Swinv2Model`` ``model`` window-parallel over ``config``'s SP group; returns ``model``.

    ``config`` None means one rank. Under torch.distributed, every rank calls it with the same model (same weights,
    same RNG seed for drop path in training) and feeds the same ``pixel_values``; every rank gets the whole output.
    After ``loss.backward()``, ``winsp.sync_gradients(model)`` makes the parameter gradients the one-rank ones.
    """
    _check_model(model)
    if getattr(model, "_winsp_runtime", None) is not None:
        raise ValueError("examples.swinv2: this model is already parallelized (call unparallelize first)")
    runtime = None
    for stage in model.encoder.layers:
        runtime = winsp.WindowRuntime.from_config(config, stage_schedule(stage))
        stage.forward = functools.partial(_stage_forward, stage, runtime)
    object.__setattr__(model, "_winsp_runtime", runtime)  # where winsp.sync_gradients(model) finds the SP group
    return model


def unparallelize(model: nn.Module) -> nn.Module:
    """Undo :func:`parallelize`: the stages run HF's own forward again."""
    for stage in model.encoder.layers:
        stage.__dict__.pop("forward", None)
    object.__setattr__(model, "_winsp_runtime", None)
    return model
