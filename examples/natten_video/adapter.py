"""The NATTEN video transformer on winsp: one plan, the attention's forward written once on local rows.

Each neighborhood block becomes a :class:`winsp.Neighborhood` layer with the block's own kernel, dilation and causal
flags (its ``qkv`` / ``proj`` reused); the embedding and head run outside the region, norms and MLPs on this rank's
rows, and attention exchanges only halos between the ranks' blocks of the grid. natten has no meta kernels, so the
forward order is recorded once from a no-grad forward of the original modules (winsp says so in one warning line).
"""

from __future__ import annotations

from torch import nn

import winsp

__all__ = ["natten_video_plan", "parallelize"]


def attend(m, x):
    q, k, v = m.qkv(x).unflatten(-1, (3, m.heads, -1)).unbind(-3)
    return m.proj(winsp.current_request().attention(q, k, v, layer=m.index)[0].flatten(1))


def natten_video_plan(model: nn.Module) -> winsp.ParallelPlan:
    layers = [winsp.Neighborhood(b.attn.kernel_size, b.attn.dilation, b.attn.is_causal) for b in model.blocks]
    return winsp.ParallelPlan(region=winsp.Region("blocks", "blocks"), stages=[winsp.Stage(layers)],
                              attention="blocks.*.attn", make_attention=winsp.swapped(attend))


def parallelize(model: nn.Module, config: winsp.DiffusionParallelConfig | None = None, *, group=None) -> nn.Module:
    """Make a :class:`~examples.natten_video.model.NATVideo` sequence-parallel in place; returns it."""
    return winsp.parallelize(model, natten_video_plan(model), config, group=group)
