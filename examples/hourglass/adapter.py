"""The hourglass model on winsp: the whole U-net is one region, its levels in forward order, one plan.

Each level's windows are a :class:`winsp.FixedWindows` read from its blocks; the middle level's global attention is a
window over the whole grid that the planner may split across ranks (head-parallel). Merges and splits are sharded grid
changes; the skips need no code (a split lands where its skip is); the feed-forward's dropout draws as the original.
"""

from __future__ import annotations

from torch import nn

import winsp

__all__ = ["hourglass_plan", "parallelize"]


def attend(m, x):
    q, k, v = m.qkv(x).unflatten(-1, (3, m.heads, -1)).unbind(-3)
    return m.proj(winsp.current_request().attention(q, k, v, layer=m.index)[0].flatten(1))


def merge(m, x):
    return m.reduce(m.norm(winsp.current_request().to_grid(x, m.index)))


def split(m, x, like):
    return winsp.current_request().to_grid(m.expand(x), m.index)


def hourglass_plan(model: nn.Module) -> winsp.ParallelPlan:
    level = [winsp.FixedWindows(b.attn.window, b.attn.shift) for b in model.body.down[0].blocks]
    return winsp.ParallelPlan(
        region=winsp.Region("body", "body"),
        stages=[winsp.Stage(level), winsp.Stage(level, merge=(1, 2, 2)),
                winsp.Stage([winsp.FixedWindows((1 << 20,) * 3)], merge=(1, 2, 2), split_windows=True),
                winsp.Stage(level, split=(1, 2, 2), like=1), winsp.Stage(level, split=(1, 2, 2), like=0)],
        forward_order=("body.down", "body.merges", "body.mid", "body.splits.1", "body.up.1", "body.splits.0",
                       "body.up.0"),
        attention="body.**.attn", make_attention=winsp.swapped(attend),
        grid_changes=("body.merges.*", "body.splits.*"),
        make_grid_change=lambda m, stage: winsp.swapped(merge if hasattr(m, "reduce") else split)(m, stage),
        swaps=[("body.**.mlp.2", winsp.RowDropout.like)])


def parallelize(model: nn.Module, config: winsp.DiffusionParallelConfig | None = None, *, group=None) -> nn.Module:
    """Make an :class:`~examples.hourglass.model.HourglassNet` window-parallel in place (all levels, one region)."""
    return winsp.parallelize(model, hourglass_plan(model), config, group=group)
