"""What is truly Swin V2 (Hugging Face ``Swinv2Layer``) in window-parallel form: one block on local rows.

HF's ``Swinv2Layer.forward`` pads the grid to a window multiple, rolls it, cuts windows and calls
``Swinv2SelfAttention`` on ``[windows, w*w, C]``. On local rows the windows are winsp's (clipped shifted windows on
the padded grid, which is what roll + mask computes), so the block is rewritten around the layer's own children:
nothing is copied, the state_dict keys stay the layer's.

- cosine attention: q and k are L2-normalised per head, the learned logit scale (clamped at log 100) is folded into
  q, and the softmax scale is 1;
- continuous position bias: ``16 * sigmoid(cpb_mlp(relative_coords_table))`` indexed by the pair's relative position
  inside the window, as a ``score_mod`` (relative positions are translation invariant, so a clipped window's local
  coordinates give HF's index);
- padding: HF's pad tokens are zeros that take part in attention (key 0 -> cosine score 0, value = value.bias); they
  are rows of the padded grid here, reset to zero before every attention;
- drop path per sample: the layer's own module draws ``rand(B)`` (same RNG on every rank) on a ``[B, 1]`` tensor of
  ones, and each row takes its sample's factor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def continuous_position_bias(attention, window_coords: Tensor):
    """A ``score_mod`` adding HF Swin V2's ``16 * sigmoid`` continuous position bias (gradients reach the MLP)."""
    heads, (wh, ww) = attention.num_attention_heads, attention.window_size
    table = 16 * torch.sigmoid(attention.continuous_position_bias_mlp(attention.relative_coords_table).view(-1, heads))
    span = 2 * ww - 1
    code = window_coords[:, 1] * span + window_coords[:, 2]  # index difference = relative index - offset
    offset = (wh - 1) * span + (ww - 1)
    return lambda score, head, q_row, k_row: score + table[code[q_row] - code[k_row] + offset, head]


def swinv2_layer_forward(layer, request, index: int, x: Tensor, true_size: tuple[int, int], batch: int) -> Tensor:
    """``Swinv2Layer.forward`` on this rank's rows ``x`` [L, C] of a padded grid whose real part is ``true_size``."""
    attn = layer.attention.self
    x = request.to_layer(x, index)
    pad = (request.grid_coords[:, 1] >= true_size[0]) | (request.grid_coords[:, 2] >= true_size[1])
    h = x.masked_fill(pad[:, None], 0.0)
    heads = attn.num_attention_heads
    scale = torch.clamp(attn.logit_scale, max=math.log(1.0 / 0.01)).exp().view(heads, 1)
    q = F.normalize(attn.query(h).unflatten(-1, (heads, -1)), dim=-1) * scale
    k = F.normalize(attn.key(h).unflatten(-1, (heads, -1)), dim=-1)
    v = attn.value(h).unflatten(-1, (heads, -1))
    out, _ = request.attention(q, k, v, layer=index, softmax_scale=1.0,
                               score_mod=continuous_position_bias(attn, request.window_coords))
    out = layer.attention.output.dense(out.flatten(1))
    keep = layer.drop_path(x.new_ones(batch, 1))[request.row_sample]
    x = x + layer.layernorm_before(out) * keep
    keep = layer.drop_path(x.new_ones(batch, 1))[request.row_sample]
    return x + layer.layernorm_after(layer.output(layer.intermediate(x))) * keep
