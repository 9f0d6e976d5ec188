"""diffusers' ``CogVideoXTransformer3DModel`` on winsp, its code and ``state_dict`` unchanged.

The whole model is the region: :class:`~winsp.adoption.Patches` hands each rank its patches of the latent video (the
model's own patch embedding and unpatchify run on them), the text stays whole on every rank (``replicated``: the
model's ``encoder_hidden_states`` stream), and every layer is one global window per sample, split over the ranks
head-parallel. Each swapped attention attends text and video jointly (``request.joint_attention``: the text output is
the mean over the windows' copies, here the one window's: the original's), RoPE on the video rows only, each local row
reading its own angles. RoPE models only (5b, 1.5): the 2b and 5b-I2V add absolute positions for the whole grid inside
the patch embedding, and are refused.
"""

import torch
from diffusers.models.embeddings import apply_rotary_emb

import winsp


def attend(m, hidden_states, encoder_hidden_states, image_rotary_emb):  # on [1, L, C] local rows and [1, n, C] text
    r, n, x = m.request, encoder_hidden_states.shape[1], torch.cat([encoder_hidden_states, hidden_states], 1)[0]
    q, k, v = (f(x).unflatten(-1, (m.heads, -1)) for f in (m.to_q, m.to_k, m.to_v))
    e = [r.grid_rows(t) for t in image_rotary_emb]  # RoPE's cos, sin [T*H*W, D]: this rank's rows
    q, k = (torch.cat([t[:n], apply_rotary_emb(t[None, n:], e, sequence_dim=1)[0]]) for t in (m.norm_q(q), m.norm_k(k)))
    # to_out[1] is CogVideoX's attention-output dropout, built with p = 0 in every configuration: not called
    return m.to_out[0](r.joint_attention(q, k, v, layer=m.index).flatten(1))[None].split([n, x.shape[0] - n], 1)[::-1]


def cogvideox_plan(model: torch.nn.Module) -> winsp.ParallelPlan:
    if not (c := model.config).use_rotary_positional_embeddings or c.use_learned_positional_embeddings:
        raise ValueError("cogvideox_plan: RoPE models only; the 2b and 5b-I2V add whole-grid positions in patch_embed")
    return winsp.ParallelPlan(make_attention=winsp.swapped(attend), replicated="encoder_hidden_states",
        region=winsp.Region("", "", winsp.adoption.Patches((c.patch_size_t or 1, c.patch_size, c.patch_size))),
        stages=[winsp.Stage([winsp.geometry.GlobalWindow()] * c.num_layers, split_windows=True)], attention="*.*.attn1")
