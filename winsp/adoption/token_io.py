"""``FlatTokens``: a region whose tokens come as ``[B, L, C]`` with the grid as another argument.

Hugging Face vision encoders (Swin, Swin V2, and the models built on them) take ``hidden_states [B, H*W, C]`` plus
``input_dimensions (H, W)`` and return a tuple or a ``ModelOutput`` whose first field is the tokens. This
:class:`~winsp.adoption.parallelize.TokenIO` reads that, so such a model's plan needs no token code of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from winsp.adoption.parallelize import TokenIO

__all__ = ["FlatTokens"]


@dataclass(frozen=True)
class FlatTokens(TokenIO):
    """Tokens ``[B, L, C]`` (row-major over the grid) as the first positional argument; the grid ``(H, W)`` or
    ``(T, H, W)``, the same for every sample, as positional argument ``grid_arg``.

    The output is the tokens on the region's last grid: a tensor ``[B, L', C]``, or a tuple / mapping (a
    ``ModelOutput``) whose first item is replaced by it. ``refuse`` names keyword flags the region cannot honour
    (``output_hidden_states``, say): a truthy one raises ValueError.
    """

    grid_arg: int = 1
    refuse: tuple[str, ...] = ()

    def read(self, args: tuple, kwargs: dict) -> tuple[Tensor, list]:
        for key in self.refuse:
            if kwargs.get(key):
                raise ValueError(f"{key}={kwargs[key]!r} is not supported inside this window-parallel region")
        if len(args) <= self.grid_arg or not isinstance(args[0], Tensor) or args[0].dim() != 3:
            raise ValueError(f"FlatTokens: the region needs tokens [B, L, C] first and the grid as positional "
                             f"argument {self.grid_arg}; got {len(args)} positional arguments")
        x, grid = args[0], tuple(int(g) for g in args[self.grid_arg])
        if len(grid) not in (2, 3) or math.prod(grid) != x.shape[1]:
            raise ValueError(f"FlatTokens: grid {grid} does not describe the {x.shape[1]} tokens of each sample")
        return x.reshape(-1, x.shape[-1]), [(1,) * (3 - len(grid)) + grid] * x.shape[0]

    def with_rows(self, args: tuple, kwargs: dict, rows: Tensor) -> tuple[tuple, dict]:
        return (rows,) + tuple(args[1:]), kwargs

    def output_rows(self, output: Any) -> Tensor:
        return output if isinstance(output, Tensor) else output[0]

    def with_output(self, output: Any, rows: Tensor, grids) -> Any:
        if len(set(grids)) != 1:
            raise ValueError(f"FlatTokens: samples end on different grids {sorted(set(grids))}")
        tokens = rows.reshape(len(grids), -1, *rows.shape[1:])
        if isinstance(output, Tensor):
            return tokens
        if isinstance(output, tuple):
            return (tokens,) + tuple(output[1:])
        output[next(iter(output.keys()))] = tokens  # a ModelOutput: its first field (last_hidden_state)
        return output
