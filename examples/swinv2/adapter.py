"""Hugging Face ``Swinv2Model`` on winsp: a plan and two swapped forwards (``parallelize(model, config)``).

The plan (plain data, :func:`plan`): the region is ``encoder`` (its ``[B, H*W, C]`` input scattered to the ranks'
windows, its ``last_hidden_state`` gathered: :class:`winsp.FlatTokens`); one :class:`winsp.Stage` per HF stage, each
layer with HF's own window and shift on the grid padded to whole windows (``SwinWindows(..., clamp=False)``); stages 2..
merge 2 x 2 with HF's child order. Swaps: every ``Swinv2Layer`` (HF pads, rolls and cuts windows in the *layer*, so the
layer is swapped, not only its attention) for :func:`swinv2_layer`, every ``Swinv2PatchMerging`` for
:func:`patch_merging` (winsp's sharded grid change), every ``drop_path`` for :class:`winsp.SampleDropPath`. The
swapped modules adopt the originals' children: parameters, buffers and state_dict keys stay the model's;
``winsp.unparallelize(model)`` undoes it.

What is Swin V2 in :func:`swinv2_layer`:

- cosine attention: q and k are L2-normalised per head, the learned logit scale (clamped at log 100) is folded into q,
  and the softmax scale is 1;
- continuous position bias: ``16 * sigmoid(cpb_mlp(relative_coords_table))`` indexed by the pair's relative position
  inside its window, as a ``score_mod`` (relative positions are translation invariant, so a clipped shifted window's
  local coordinates give HF's index);
- padding: HF's pad tokens are zeros that take part in attention (key 0 -> cosine score 0, value = value.bias); they are
  the padding rows of the stage's padded grid here, set to zero before every attention.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

import winsp
from winsp.geometry.swin import relative_position_score_mod, window_raster

MERGE_ORDER = ((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))  # HF: x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], ...
BLOCKS = "encoder.layers.*.blocks.*"  # a * stays inside one path component
DROP_PATHS = ("encoder.**.drop_path", lambda m: winsp.SampleDropPath(getattr(m, "drop_prob", 0.0), draw="rand"))


def swinv2_layer(layer: nn.Module, x: Tensor, *_) -> tuple[Tensor]:
    """``Swinv2Layer.forward`` on this rank's rows ``[L, C]`` of window layer ``layer.index``."""
    request, attn = winsp.current_request(), layer.attention.self  # x is in layer.index's layout (plan's layer_entry)
    h = x.masked_fill(~request.valid_rows[:, None], 0.0)
    q, k, v = (lin(h).unflatten(-1, (attn.num_attention_heads, -1)) for lin in (attn.query, attn.key, attn.value))
    scale = torch.clamp(attn.logit_scale, max=math.log(1.0 / 0.01)).exp().view(-1, 1)  # folded into q per head
    table = 16 * torch.sigmoid(attn.continuous_position_bias_mlp(attn.relative_coords_table).flatten(0, -2))
    raster = window_raster(request.geometry(), request.grid_coords, request.laid_grid)  # HF's rolled-window raster
    cpb = relative_position_score_mod(table, attn.relative_position_index, raster)  # continuous position bias
    q, k = (nn.functional.normalize(t, dim=-1) for t in (q, k))  # cosine attention
    out, _ = request.attention(q * scale, k, v, layer=layer.index, softmax_scale=1.0, score_mod=cpb)
    x = x + layer.drop_path(layer.layernorm_before(layer.attention.output.dense(out.flatten(1))))
    return (x + layer.drop_path(layer.layernorm_after(layer.output(layer.intermediate(x)))),)


def patch_merging(merging: nn.Module, x: Tensor, *_) -> Tensor:
    """``Swinv2PatchMerging``: winsp's sharded 2 x 2 grid change into stage ``merging.index``, HF's reduction, norm."""
    return merging.norm(merging.reduction(winsp.current_request().to_grid(x, merging.index)))


def plan(model: nn.Module) -> winsp.ParallelPlan:
    """The :class:`winsp.ParallelPlan` of HF ``Swinv2Model`` ``model`` ."""
    # HF clamped window and shift by the config's resolution: keep them (clamp=False), pad to whole windows
    stages = [winsp.Stage([winsp.SwinWindows((1, b.window_size, b.window_size), (0, b.shift_size, b.shift_size),
                                             clamp=False)
                           for b in st.blocks], merge=(1, 2, 2) if i else (1, 1, 1), order=MERGE_ORDER if i else None)
              for i, st in enumerate(model.encoder.layers)]
    tokens = winsp.FlatTokens(refuse=("output_hidden_states", "output_attentions"))  # HF views stage outputs as grids
    return winsp.ParallelPlan(
        region=winsp.Region("encoder", "encoder", tokens), stages=tuple(stages), attention=BLOCKS, layer_entry=BLOCKS,
        make_attention=winsp.swapped(swinv2_layer), grid_changes="encoder.layers.*.downsample",
        make_grid_change=winsp.swapped(patch_merging), swaps=(DROP_PATHS,))


def parallelize(model: nn.Module, config: winsp.DiffusionParallelConfig | None = None, *, group=None) -> nn.Module:
    """Make HF ``Swinv2Model`` ``model`` window-parallel over ``config``'s SP group (None: one rank); returns it.

    ``group``: a subgroup of ``config.ulysses_degree`` ranks (default: the world; a process group, a 1-D DeviceMesh
    or ``mesh["sp"]``), as for :func:`winsp.parallelize`.
    Every rank calls the model with the same ``pixel_values`` (and, in training, the same RNG state, so drop path draws
    the same numbers) and gets the whole output. After ``loss.backward()``, ``winsp.sync_gradients(model)``.
    Element-wise dropout inside the region would draw per local row, not the numbers one rank draws: refused.
    """
    cfg = getattr(model, "config", None)
    dropout = [k for k in ("attention_probs_dropout_prob", "hidden_dropout_prob") if getattr(cfg, k, 0)]
    if getattr(cfg, "model_type", None) != "swinv2" or dropout or winsp.adoption.is_parallelized(model):
        raise ValueError(f"examples.swinv2.parallelize needs a transformers Swinv2Model, without dropout, not "
                         f"parallelized already; got {type(model).__name__} (dropout: {dropout or 'none'})")
    return winsp.parallelize(model, plan(model), config, group=group)
