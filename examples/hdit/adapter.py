"""The ``hdit`` package's hourglass diffusion transformer (k-diffusion's HDiT, ``pip install hdit``) on winsp: one plan.

The three attention blocks (rolled shifted windows, neighborhoods, global) share one forward on local rows: AdaRMSNorm,
qkv, cosine-similarity scaling, axial RoPE from the grid positions of the rows (the global block casts them to the
activations' dtype, the others do not), the layer's attention, dropout, out projection, residual. A token merge moves
rows to the coarser grid, then projects; a split projects, moves, and lerps to its skip. The windows: rolled by
``+window_shift``, NATTEN neighborhoods, or (None) global. AdaRMSNorm runs unchanged per row; feed-forwards untouched.
"""

from hdit.modules.attention.self_attention import apply_rotary_emb_, scale_for_cosine_sim

import winsp


def attend(m, x, pos, cond):
    q, k, v = m.qkv_proj(m.norm(x, cond)).unflatten(-1, (3, m.n_heads, -1)).unbind(-3)
    theta = m.pos_emb(m.request.grid_rows(pos).to(q.dtype if m.swapped_from == "SelfAttentionBlock" else pos.dtype))
    q, k = (apply_rotary_emb_(t, theta) for t in scale_for_cosine_sim(q, k, m.scale[:, None], 1e-6))
    return x + m.out_proj(m.dropout(m.request.attention(q, k, v, layer=m.index, softmax_scale=1.0)[0].flatten(1)))


def resize(m, x, skip=None):
    y = m.request.to_grid(x if skip is None else m.proj(x), m.index)
    return m.proj(y) if skip is None else skip.lerp(y, m.fac.to(y.dtype))


PLAN = winsp.ParallelPlan(attention="**.self_attn", per_sample="*_level*.**.norm", dropout="rows",
    make_attention=winsp.swapped(attend), make_grid_change=winsp.swapped(resize), stages=winsp.adoption.Hourglass(
        "down_levels.*", "middle_level", "up_levels.*", "merges.*", "splits.*", tokens=winsp.ChannelsLast(2), windows=
        lambda a: winsp.geometry.RolledWindows((a.window_size,) * 2, (a.window_shift,) * 2) if hasattr(a, "window_size")
        else winsp.Neighborhood((a.kernel_size,) * 2) if hasattr(a, "kernel_size") else None))
