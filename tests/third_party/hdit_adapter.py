"""k-diffusion's HDiT (``image_transformer_v2``) on winsp, from its own code: one plan.

The three attention blocks (rolled shifted windows, neighborhoods, global) share one forward on local rows: AdaRMSNorm,
qkv, cosine-similarity scaling, axial RoPE from the grid positions of the rows, attention of the layer, dropout, out
projection, residual. Token merges and splits move rows to the other grid (a split then lerps to its skip).
AdaRMSNorm runs unchanged, per row; the feed-forwards are untouched.
"""

import winsp
from tests.third_party.k_diffusion_hdit import image_transformer_v2 as hdit


def attend(m, x, pos, cond):  # the global block casts its positions to the activations' dtype, the others do not
    r = winsp.current_request()
    q, k, v = m.qkv_proj(m.norm(x, cond)).unflatten(-1, (3, m.n_heads, -1)).unbind(-3)
    theta = m.pos_emb(r.grid_rows(pos).to(q.dtype if m.swapped_from == "SelfAttentionBlock" else pos.dtype))
    q, k = (hdit.apply_rotary_emb_(t, theta) for t in hdit.scale_for_cosine_sim(q, k, m.scale[:, None], 1e-6))
    return x + m.out_proj(m.dropout(r.attention(q, k, v, layer=m.index, softmax_scale=1.0)[0].flatten(1)))


def resize(m, x, skip=None):  # TokenMerge: move, then project; TokenSplit: project, move, lerp to the skip
    y = winsp.current_request().to_grid(x if skip is None else m.proj(x), m.index)
    return m.proj(y) if skip is None else skip.lerp(y, m.fac.to(y.dtype))


def windows(a):  # rolled by +window_shift, NATTEN neighborhoods, or None: global
    if hasattr(a, "window_size"):
        return winsp.geometry.RolledWindows((a.window_size,) * 2, (a.window_shift,) * 2)
    return winsp.Neighborhood((a.kernel_size,) * 2) if hasattr(a, "kernel_size") else None


PLAN = winsp.ParallelPlan(
    stages=winsp.adoption.Hourglass("down_levels.*", "mid_level", "up_levels.*", "merges.*", "splits.*", windows,
                                    tokens=winsp.ChannelsLast(2)),
    attention="**.self_attn", make_attention=winsp.swapped(attend), make_grid_change=winsp.swapped(resize),
    per_sample="*_level*.**.norm", dropout="rows")
