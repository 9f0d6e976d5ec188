"""torchvision's Video Swin (``swin3d_t`` / ``_s`` / ``_b``) on winsp: a plan and two swapped modules.

Everything else of the model runs unchanged: the patch embedding and the head outside the region, and inside it the
blocks' norms, MLPs and residuals on this rank's local rows. The attention reuses torchvision's ``qkv``, ``proj``,
bias table and index (``state_dict`` keys unchanged); windows are :class:`winsp.SwinWindows` laid on the padded grid,
so results equal the original whether or not the grid is a multiple of the window.
"""

from __future__ import annotations

from torch import Tensor, nn

import winsp
from winsp.geometry.swin import relative_position_score_mod, window_raster

__all__ = ["parallelize", "swin3d_plan", "SwinAttention3d", "SwinPatchMerging"]

# torchvision's PatchMerging concatenates x0..x3 = (h even, w even), (h odd, w even), (h even, w odd), (h odd, w odd)
MERGE_ORDER = ((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))


class SwinAttention3d(nn.Module):
    """``ShiftedWindowAttention3d`` on local rows [L, C]: same parameters, windows and relative bias through winsp."""

    def __init__(self, original: nn.Module, layer: int) -> None:
        super().__init__()
        if original.attention_dropout or original.dropout:
            raise ValueError("swin3d on winsp: attention dropout is not supported (torchvision's default is 0)")
        winsp.adopt(self, original)
        self.layer, self.num_heads = layer, original.num_heads
        self.window_size, self.shift_size = original.window_size, original.shift_size

    def forward(self, x: Tensor) -> Tensor:
        request = winsp.current_request()
        x = x * request.valid_rows[:, None].to(x.dtype)  # torchvision pads the *normed* input with zeros
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        raster = window_raster(request.geometry(), request.grid_coords, request.laid_grid)
        bias = relative_position_score_mod(self.relative_position_bias_table, self.relative_position_index, raster)
        out, _ = request.attention(q, k, v, layer=self.layer, score_mod=bias)
        return self.proj(out.flatten(1))


class SwinPatchMerging(nn.Module):
    """``PatchMerging`` as a sharded grid change: 2 x 2 rows -> one row (zeros past an odd edge), norm, reduction."""

    def __init__(self, original: nn.Module, stage: int) -> None:
        super().__init__()
        winsp.adopt(self, original)
        self.stage = stage

    def forward(self, x: Tensor) -> Tensor:
        return self.reduction(self.norm(winsp.current_request().to_grid(x, self.stage)))


def swin3d_plan(model: nn.Module) -> winsp.ParallelPlan:
    """The plan of a torchvision ``SwinTransformer3d``: ``features`` is the region, one stage per block sequence."""
    stages = [winsp.Stage([winsp.SwinWindows(b.attn.window_size, b.attn.shift_size) for b in blocks],
                          merge=(1, 2, 2) if s else (1, 1, 1), order=MERGE_ORDER if s else None)
              for s, blocks in enumerate(model.features[0::2])]
    return winsp.ParallelPlan(
        region=winsp.Region("features", "features"), stages=stages,
        attention="features.*.*.attn", make_attention=SwinAttention3d,
        grid_changes="features.[135]", make_grid_change=SwinPatchMerging,
        swaps=[("features.*.*.stochastic_depth", lambda m: winsp.SampleDropPath(m.p))])


def parallelize(model: nn.Module, config: winsp.DiffusionParallelConfig | None = None, *, group=None) -> nn.Module:
    """Make a torchvision ``SwinTransformer3d`` window-parallel in place (all four stages); returns it."""
    return winsp.parallelize(model, swin3d_plan(model), config, group=group)
