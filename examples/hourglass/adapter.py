"""The hourglass model on winsp: the whole U-net is one region, declared as an :class:`~winsp.adoption.Hourglass`.

Each attention layer's windows are read from the module (a global middle: :class:`~winsp.geometry.GlobalWindow`,
split across ranks); the levels, merges, splits with their skips and the forward order come from the declaration.
Merges and splits are sharded grid changes; the skips need no code (a split lands where its skip is); the
feed-forward's dropout draws as the original.
"""

from __future__ import annotations

from torch import nn

import winsp
from winsp.adoption import Hourglass
from winsp.geometry import GlobalWindow

__all__ = ["hourglass_plan", "parallelize"]


def attend(m, x):
    q, k, v = m.qkv(x).unflatten(-1, (3, m.heads, -1)).unbind(-3)
    return m.proj(m.request.attention(q, k, v, layer=m.index)[0].flatten(1))


def resize(m, x, like=None):  # a merge (norm, reduce after the move) or a split (expand before it)
    x = m.request.to_grid(x if like is None else m.expand(x), m.index)
    return m.reduce(m.norm(x)) if like is None else x


def hourglass_plan(model: nn.Module) -> winsp.ParallelPlan:
    return winsp.ParallelPlan(
        region=winsp.Region("body", "body"), attention="body.**.attn", make_attention=winsp.swapped(attend),
        stages=Hourglass(down="body.down.*", mid="body.mid", up="body.up.*", merges="body.merges.*",
                         splits="body.splits.*", windows=lambda a: winsp.FixedWindows(a.window, a.shift)
                         if a.window else GlobalWindow()),
        make_grid_change=winsp.swapped(resize), dropout="rows")


def parallelize(model: nn.Module, config: winsp.DiffusionParallelConfig | None = None, *, group=None) -> nn.Module:
    """Make an :class:`~examples.hourglass.model.HourglassNet` window-parallel in place (all levels, one region)."""
    return winsp.parallelize(model, hourglass_plan(model), config, group=group)
