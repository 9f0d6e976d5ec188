"""The NATTEN video transformer on winsp: one plan, one swapped attention module (its parameters reused).

Each neighborhood block becomes a :class:`winsp.Neighborhood` layer with the block's own kernel, dilation and causal
flags; the embedding and head run outside the region, norms and MLPs on this rank's rows, and attention exchanges
only halos between the ranks' blocks of the grid.
"""

from __future__ import annotations

from torch import Tensor, nn

import winsp

__all__ = ["natten_video_plan", "parallelize", "WinspNeighborhoodAttention"]


class WinspNeighborhoodAttention(nn.Module):
    """``NeighborhoodAttention3d`` on local rows ``[L, C]``: the same ``qkv`` / ``proj``, attention through winsp."""

    def __init__(self, original: nn.Module, layer: int) -> None:
        super().__init__()
        winsp.adopt(self, original)
        self.layer, self.heads = layer, original.heads

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(-3)
        out, _ = winsp.current_request().attention(q, k, v, layer=self.layer)
        return self.proj(out.flatten(1))


def natten_video_plan(model: nn.Module) -> winsp.ParallelPlan:
    layers = [winsp.Neighborhood(b.attn.kernel_size, b.attn.dilation, b.attn.is_causal) for b in model.blocks]
    return winsp.ParallelPlan(region=winsp.Region("blocks", "blocks"), stages=[winsp.Stage(layers)],
                              attention="blocks.*.attn", make_attention=WinspNeighborhoodAttention)


def parallelize(model: nn.Module, config: winsp.DiffusionParallelConfig | None = None, *, group=None) -> nn.Module:
    """Make a :class:`~examples.natten_video.model.NATVideo` sequence-parallel in place; returns it."""
    return winsp.parallelize(model, natten_video_plan(model), config, group=group)
