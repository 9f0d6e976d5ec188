"""Stochastic depth per *sample* on local rows: the one tokenwise op that needs to know each row's sample.

A drop path (stochastic depth) zeroes a residual branch for whole samples at random while training. On a
``[B, ...]`` tensor it draws one number per sample; on window-parallel local rows ``[L, C]`` the batch dimension is
gone, so :class:`SampleDropPath` draws the same ``B`` numbers, in the same way and order as the original module (every
rank holds the same generator state, so every rank draws the same ones), and gives each row its sample's number
through ``request.row_sample``. In eval mode, or with probability 0, it is the identity.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .context import current_request

__all__ = ["SampleDropPath"]

_DRAWS = ("bernoulli", "rand")


class SampleDropPath(nn.Module):
    """Per-sample drop path on local rows; ``draw`` reproduces the original's random draws exactly.

    Args:
        p: probability of dropping a sample's branch.
        draw: ``"bernoulli"`` (torchvision's ``StochasticDepth(p, "row")``: ``empty(B).bernoulli_(1 - p)``) or
            ``"rand"`` (timm / transformers ``drop_path``: ``floor(1 - p + rand(B))``).
        scale: divide kept branches by ``1 - p`` (both originals do).
    """

    def __init__(self, p: float, draw: str = "bernoulli", scale: bool = True) -> None:
        super().__init__()
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"drop probability must be in [0, 1], got {p!r}")
        if draw not in _DRAWS:
            raise ValueError(f"draw must be one of {_DRAWS}, got {draw!r}")
        self.p, self.draw, self.scale = float(p), draw, bool(scale)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        request = current_request()
        keep = 1.0 - self.p
        batch = len(request.grids)
        if self.draw == "bernoulli":
            noise = torch.empty(batch, dtype=x.dtype, device=x.device).bernoulli_(keep)
        else:
            noise = (keep + torch.rand(batch, dtype=x.dtype, device=x.device)).floor_()
        if self.scale and keep > 0.0:
            noise = noise.div(keep)
        return x * noise[request.row_sample].view((-1,) + (1,) * (x.dim() - 1))

    def extra_repr(self) -> str:
        return f"p={self.p}, draw={self.draw!r}, scale={self.scale}"
