"""The divided space-time video transformer of ``examples.divided_video.model`` on winsp, its code unchanged.

The encoder is the region: ``FlatTokens(order="hwt")`` reads its ``[B, S*T, C]`` patches frames fastest (the grid
``(T, 1, S)`` from its frames argument), and the class token in front is replicated on every rank, joining the spatial
attentions only (``joins="**.attn_s"``). Each block is swapped for two residual branches: the temporal attention (one
window per patch position, over the frames; the class tokens, first in the rows, take no part) and the spatial one (a
window per frame, the class tokens joining: their output is the mean over the frames' copies, as the original's);
each attention module is its layer's entry, so the residual rows move into its layout as it is called. Attention
dropout is passed on, so training with it on is refused by name.
"""

import torch

import winsp


def attend(a, x, norm, fc=lambda y: y, n=0):  # a residual branch on [B + L, C] rows, the first n taking no part
    q, k, v = a.qkv(norm(x[n:])).unflatten(-1, (3, a.heads, -1)).unbind(-3)
    out = a.request.joint_attention(q, k, v, layer=a.index, dropout_p=a.attn_drop * a.training)  # refused if on
    return torch.cat([x[:n], x[n:] + fc(a.proj(out.flatten(1)))])


def block(m, x, frames):  # temporal without the class tokens, spatial with them (each moves the rows), then the MLP
    x = m.attn_s(m.attn_t(x, m.norm_t, m.fc_t, m.request.num_text_rows), m.norm_s)
    return x + m.mlp(m.norm_mlp(x))


def parallelize(model, config=None, **fields):  # fields: more of the plan (dropout="rows" to train with dropout)
    windows = [winsp.FixedWindows((1 << 20, 1, 1)), winsp.FixedWindows((1, 1 << 20, 1 << 20))]  # a position, a frame
    return winsp.parallelize(model, winsp.ParallelPlan(replicated=winsp.adoption.Replicated(joins="**.attn_s"),
        region=winsp.Region("encoder", "encoder", winsp.FlatTokens(order="hwt")), attention="encoder.*.*.attn_[ts]",
        stages=[winsp.Stage(windows * len(model.encoder.blocks))], layer_entry="encoder.*.*.attn_[ts]",
        make_attention=winsp.swapped(attend), swaps=[("encoder.blocks.*", winsp.swapped(block))], **fields), config)
