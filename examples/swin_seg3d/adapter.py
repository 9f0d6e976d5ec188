"""The 3D segmentation network (``model.py``) on winsp: the whole Swin encoder is one region whose last step is the
last stage's patch merge; every stage output is gathered once for the decoder's skip connections."""

import winsp
from winsp.adoption import ChannelsFirst
from winsp.geometry import RolledWindows


def attend(m, x):  # this rank's rows as one sample [1, L, 1, 1, C]
    q, k, v = m.qkv(x.flatten(0, -2)).unflatten(-1, (3, m.heads, -1)).unbind(-3)
    return m.proj(m.request.attention(q, k, v, layer=m.index)[0].flatten(1)).reshape(x.shape)


def merge(m, x):
    return m.reduction(m.norm(m.request.to_grid(x.flatten(0, -2), m.index)))[None, :, None, None]


def seg_plan(model) -> winsp.ParallelPlan:
    stages = [winsp.Stage([RolledWindows(b.attn.window, tuple(-s for s in b.attn.shift)) for b in stage.blocks],
                          merge=(2, 2, 2) if i else (1, 1, 1)) for i, stage in enumerate(model.encoder.stages)]
    return winsp.ParallelPlan(
        region=winsp.Region("encoder.stages.0", "encoder", ChannelsFirst()), stages=stages + [winsp.Stage((),
        merge=(2, 2, 2))], attention="**.attn", make_attention=winsp.swapped(attend), skips="encoder.stages.*",
        grid_changes="encoder.stages.*.merge", make_grid_change=winsp.swapped(merge))
