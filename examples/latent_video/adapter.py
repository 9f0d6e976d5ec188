"""The latent video DiT (``model.py``) on winsp: the plan says which blocks run on per-frame and per-position batches
and which tables the model adds to them; the model's own reshapes run untouched."""

import winsp
from winsp.adoption import SpaceTime

BIG = 1 << 20  # a window longer than any axis: a whole frame, or all frames of a position


def attend(m, x):  # per-frame [1, L, C] or per-position [L, 1, C] batches of this rank's rows
    q, k, v = m.qkv(x.flatten(0, 1)).unflatten(-1, (3, m.heads, -1)).unbind(-3)
    return m.proj(m.request.attention(q, k, v, layer=m.index)[0].flatten(1)).reshape(x.shape)


def video_plan(depth: int = 2) -> winsp.ParallelPlan:
    windows = [winsp.FixedWindows((1, BIG, BIG)), winsp.FixedWindows((BIG, 1, 1))] * depth
    return winsp.ParallelPlan(
        region=winsp.Region("", ""), attention="blocks.*.attn", make_attention=winsp.swapped(attend),
        stages=[winsp.Stage(windows)], space_time=SpaceTime(frames="blocks.[02468]", positions="blocks.[13579]",
                                                            tables=(("pos", "frames"), ("frame_pos", "positions"))))
