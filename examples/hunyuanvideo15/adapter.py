"""diffusers' ``HunyuanVideo15Transformer3DModel`` with sliding tile attention (STA) on winsp, its code and
``state_dict`` unchanged.

The whole model is the region: :class:`~winsp.adoption.Patches` hands each rank its block of the latent video
(channels first), and the joint text stream stays whole on every rank (``replicated``). Every block's attention is STA
of ``tile`` and ``tiles`` tiles per axis, ``winsp.Neighborhood.sliding_tile`` (NATTEN's ``kernel = tile * tiles,
stride = tile``): each rank receives only the halo of k / v rows its tiles reach, at any head count.

The model builds its text stream from three inputs (text, ByT5 glyphs, image tokens), valid rows first, then padding
that its attention mask leaves out: ``valid`` counts the valid rows from the model's inputs, and the swapped attention
passes the padded text (``text_padded=True``: the padding takes no part and its output is zeros, as SDPA gives a fully
masked row). The model computes RoPE from the shape of its input, which inside the region is this rank's patches: the
``rope`` swap (``Patches.whole_grid``) computes it for the whole latent grid and returns this rank's rows.
"""

from diffusers.models.embeddings import apply_rotary_emb

import winsp


# this rank's video rows [1, L, C]; the whole text [1, n, C], valid rows first (their count: the plan's valid)
def attend(m, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
    x, t, h, r = hidden_states[0], encoder_hidden_states[0], lambda f, y: f(y).unflatten(-1, (m.heads, -1)), (
        lambda y: apply_rotary_emb(y[None], image_rotary_emb, sequence_dim=1)[0])  # RoPE on the video rows only
    v, o = m.request.attention(r(m.norm_q(h(m.to_q, x))), r(m.norm_k(h(m.to_k, x))), h(m.to_v, x), m.norm_added_q(h(
        m.add_q_proj, t)), m.norm_added_k(h(m.add_k_proj, t)), h(m.add_v_proj, t), layer=m.index, text_padded=True)
    # [L, C] and [n, C]: the block adds them to its [1, L, C] and [1, n, C]; to_out[1] is a dropout with p = 0
    return m.to_out[0](v.flatten(1)), m.to_add_out(o.flatten(1))


def hunyuanvideo15_sta_plan(model, tile, tiles) -> winsp.ParallelPlan:
    # valid: the text rows the model's masks keep (t2v, all-zero image_embeds: no image rows)
    c, valid = model.config, lambda a: [int(a["encoder_attention_mask"].sum() + a["encoder_attention_mask_2"].sum() + (
        a["image_embeds"].any() * a["image_embeds"].shape[1]))]
    return winsp.ParallelPlan(make_attention=winsp.swapped(attend), attention="*.*.attn", region=winsp.Region("", "", (
        io := winsp.adoption.Patches((c.patch_size_t, c.patch_size, c.patch_size), channels=1))), swaps=[("rope", io.
        whole_grid)], replicated=winsp.adoption.Replicated("encoder_hidden_states", valid=valid), stages=[winsp.Stage([
            winsp.Neighborhood.sliding_tile(tile, tiles)] * c.num_layers)])
