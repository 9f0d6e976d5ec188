"""``parallelize(model, config)``: run a Hugging Face ``Swinv2Model`` window-parallel, in place, via winsp's plan.

The plan (plain data, :func:`plan`): the window-parallel region is ``encoder`` (its ``[B, H*W, C]`` input is scattered
to the ranks' windows, its ``last_hidden_state`` gathered: :class:`winsp.FlatTokens`); one :class:`winsp.Stage` per HF stage, each layer with
HF's own clamped window and shift on the grid padded to whole windows; every ``Swinv2Layer`` swapped for
:class:`~examples.swinv2.blocks.ParallelSwinv2Layer`, every ``Swinv2PatchMerging`` for the sharded grid change
(:class:`~examples.swinv2.blocks.ParallelPatchMerging`, children concatenated in HF's (h, w) order (0,0), (1,0),
(0,1), (1,1)), every ``drop_path`` for :class:`winsp.SampleDropPath`. ``output_hidden_states`` and
``output_attentions`` are refused: HF's encoder views every stage output as a ``(B, H, W, C)`` grid. Parameters, buffers and state_dict keys stay
the model's; ``winsp.unparallelize(model)`` undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

import winsp
from winsp.parallelize import is_parallelized

from .blocks import ParallelPatchMerging, ParallelSwinv2Layer

__all__ = ["parallelize", "plan", "PaddedWindows"]

MERGE_ORDER = ((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))  # HF: x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], ...


@dataclass(frozen=True)
class PaddedWindows(winsp.FixedWindows):
    """HF's windows: the layer's window and shift (HF clamped them by the *config's* resolution) on the grid padded to
    whole windows (HF's ``maybe_pad``); never clamped again by the actual grid."""

    def padded_grid(self, grid):
        return tuple(-(-g // k) * k for g, k in zip(winsp.geometry.check_grid(grid), self.window_size))


def _sample_drop_path(original: nn.Module) -> nn.Module:
    return winsp.SampleDropPath(getattr(original, "drop_prob", 0.0), draw="rand").train(original.training)


def plan(model: nn.Module) -> winsp.ParallelPlan:
    """The :class:`winsp.ParallelPlan` of HF ``Swinv2Model`` ``model`` (fewer than 10 stages and 10 blocks a stage)."""
    stages = [winsp.Stage([PaddedWindows((1, b.window_size, b.window_size), (0, b.shift_size, b.shift_size))
                           for b in stage.blocks], merge=(1, 2, 2) if i else (1, 1, 1), order=MERGE_ORDER if i else None)
              for i, stage in enumerate(model.encoder.layers)]
    tokens = winsp.FlatTokens(refuse=("output_hidden_states", "output_attentions"))  # HF views stage outputs as grids
    return winsp.ParallelPlan(
        region=winsp.Region("encoder", "encoder", tokens), stages=tuple(stages),
        attention="encoder.layers.?.blocks.?", make_attention=ParallelSwinv2Layer,
        grid_changes="encoder.layers.?.downsample", make_grid_change=ParallelPatchMerging,
        swaps=(("encoder.layers.?.blocks.?.drop_path", _sample_drop_path),))


def parallelize(model: nn.Module, config: winsp.DiffusionParallelConfig | None = None, *, group=None) -> nn.Module:
    """Make HF ``Swinv2Model`` ``model`` window-parallel over ``config``'s SP group (None: one rank); returns it.

    ``group``: a subgroup of ``config.ulysses_degree`` ranks (default: the world), as for :func:`winsp.parallelize`.
    Every rank calls the model with the same ``pixel_values`` (and, in training, the same RNG state, so drop path draws
    the same numbers) and gets the whole output. After ``loss.backward()``, ``winsp.sync_gradients(model)``.
    """
    config_ = getattr(model, "config", None)
    if getattr(config_, "model_type", None) != "swinv2" or not hasattr(model, "encoder"):
        raise ValueError(f"examples.swinv2.parallelize needs a transformers Swinv2Model, got {type(model).__name__}")
    if is_parallelized(model):
        raise ValueError("examples.swinv2: this model is parallelized already; call winsp.unparallelize(model) first")
    for key in ("attention_probs_dropout_prob", "hidden_dropout_prob"):
        if getattr(config_, key) != 0.0:
            raise ValueError(f"examples.swinv2: config.{key}={getattr(config_, key)} must be 0 (element-wise dropout "
                             f"on window-parallel rows cannot draw the numbers one rank draws)")
    return winsp.parallelize(model, plan(model), config, group=group)
