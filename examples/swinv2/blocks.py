"""What is truly Swin V2 (Hugging Face ``Swinv2Layer``, ``Swinv2PatchMerging``) as modules on local rows.

HF's ``Swinv2Layer.forward`` views its input as a grid, pads it to a window multiple, rolls it, cuts windows and calls
``Swinv2SelfAttention`` on ``[windows, w*w, C]``. On local rows the windows are winsp's (clipped shifted windows on
the padded grid: the groups roll + mask computes), so the *layer* is swapped, for a module that adopts the layer's
own children (nothing copied, state_dict keys unchanged):

- cosine attention: q and k are L2-normalised per head, the learned logit scale (clamped at log 100) is folded into
  q, and the softmax scale is 1;
- continuous position bias: ``16 * sigmoid(cpb_mlp(relative_coords_table))`` indexed by the pair's relative position
  inside its window, as a ``score_mod`` (relative positions are translation invariant, so a clipped window's local
  coordinates give HF's index);
- padding: HF's pad tokens are zeros that take part in attention (key 0 -> cosine score 0, value = value.bias); they
  are the padding rows of the stage's padded grid here, set to zero before every attention;
- drop path per sample: the plan swaps ``drop_path`` for :class:`winsp.SampleDropPath` (HF's ``rand`` draw).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import winsp


def continuous_position_bias(attention, window_coords: Tensor):
    """A ``score_mod`` adding HF Swin V2's ``16 * sigmoid`` continuous position bias (gradients reach the MLP)."""
    heads, (wh, ww) = attention.num_attention_heads, attention.window_size
    table = 16 * torch.sigmoid(attention.continuous_position_bias_mlp(attention.relative_coords_table).view(-1, heads))
    span = 2 * ww - 1
    code = window_coords[:, 1] * span + window_coords[:, 2]  # code[q] - code[k] = HF's relative index - offset
    offset = (wh - 1) * span + (ww - 1)
    return lambda score, head, q_row, k_row: score + table[code[q_row] - code[k_row] + offset, head]


class ParallelSwinv2Layer(nn.Module):
    """``Swinv2Layer`` on this rank's rows ``[L, C]`` of window layer ``index`` (the original's children, adopted)."""

    def __init__(self, original: nn.Module, index: int) -> None:
        super().__init__()
        winsp.adopt(self, original)
        self.index = index

    def forward(self, x: Tensor, input_dimensions=None, output_attentions: bool = False) -> tuple[Tensor]:
        request, attn = winsp.current_request(), self.attention.self
        x = request.to_layer(x, self.index)
        h = x.masked_fill(~request.valid_rows[:, None], 0.0)
        heads = attn.num_attention_heads
        scale = torch.clamp(attn.logit_scale, max=math.log(1.0 / 0.01)).exp().view(heads, 1)
        q = F.normalize(attn.query(h).unflatten(-1, (heads, -1)), dim=-1) * scale
        k = F.normalize(attn.key(h).unflatten(-1, (heads, -1)), dim=-1)
        v = attn.value(h).unflatten(-1, (heads, -1))
        out, _ = request.attention(q, k, v, layer=self.index, softmax_scale=1.0,
                                   score_mod=continuous_position_bias(attn, request.window_coords))
        x = x + self.drop_path(self.layernorm_before(self.attention.output.dense(out.flatten(1))))
        return (x + self.drop_path(self.layernorm_after(self.output(self.intermediate(x)))),)


class ParallelPatchMerging(nn.Module):
    """``Swinv2PatchMerging`` as winsp's sharded grid change into ``stage``, then HF's reduction and norm."""

    def __init__(self, original: nn.Module, stage: int) -> None:
        super().__init__()
        winsp.adopt(self, original)
        self.stage = stage

    def forward(self, x: Tensor, input_dimensions=None) -> Tensor:
        return self.norm(self.reduction(winsp.current_request().to_grid(x, self.stage)))
