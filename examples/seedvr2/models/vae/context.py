"""What one forward pass of the VAE carries besides activations: temporal chunk state and the spatial band.

Every layer takes a :class:`RunContext`. Its two optional parts are independent:

* ``cache`` (:class:`CausalCache`) is set while a clip is processed in causal temporal chunks: each causal
  convolution leaves the trailing frames the next chunk needs (``keep``) and reads what the previous chunk left
  (``take``), so chunked and whole-clip results agree. A subclass may carry them between ranks instead
  (:mod:`.wavefront`).
* ``bands`` (:class:`HeightBands`) is set when the frame height is sharded across ranks: it supplies the halo
  rows, the group-norm statistics and the full-height gather that a band cannot compute on its own.

With both unset a layer is a plain single-device, whole-clip layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

__all__ = ["CausalCache", "HeightBands", "RunContext"]


@dataclass
class CausalCache:
    """Frames carried between temporal chunks, one entry per causal convolution (and the chunk's position)."""

    first: bool = True
    tails: dict[nn.Module, torch.Tensor] = field(default_factory=dict)

    def take(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The frames the previous chunk left for ``conv`` (None: none), before ``conv`` reads ``x``."""
        return self.tails.get(conv)

    def keep(self, conv: nn.Module, x: torch.Tensor, start: int) -> None:
        """Leave frames ``start:`` of ``conv``'s time-extended input ``x`` for the next chunk (none past the end)."""
        if start < x.shape[2]:
            self.tails[conv] = x[:, :, start:].clone()
        else:
            self.tails.pop(conv, None)


class HeightBands(Protocol):
    """A rank's band of rows (dim -2 of a [b, c, t, h, w] activation) and the collectives that complete it."""

    parts: int  # how many bands the frame is split into

    def pad_rows(self, x: torch.Tensor, top: int, bottom: int) -> torch.Tensor:
        """``x`` with ``top``/``bottom`` neighbouring rows attached (zeros beyond the frame's edges)."""

    def group_norm(
        self, x: torch.Tensor, num_groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Frame-wise group norm of ``x`` [b, c, t, h, w] with statistics over the full frame height."""

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The full frame height, assembled from every rank's band."""


@dataclass
class RunContext:
    cache: CausalCache | None = None
    bands: HeightBands | None = None
