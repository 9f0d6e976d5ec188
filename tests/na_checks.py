"""Checks shared by the neighbourhood test files: natten over whole grids.

``natten_whole_grid`` is the reference of every backend and cut (natten on each sample's grid, its dims the axes of
kernel > 1, the other axes folded into the batch).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from winsp.geometry.neighborhood import Neighborhood


def natten_whole_grid(inputs, grids, text_lengths, geom: Neighborhood, text: bool = True) -> torch.Tensor:
    """natten over each sample's whole grid; ``inputs`` are q, k, v ``[N, H, D]`` (then the text's q, k, v, taken
    as natten's additional keys when ``text``)."""
    natten = pytest.importorskip("natten", reason="natten (the neighborhood attention oracle) is not installed: "
                                                  "pip install -e '.[natten]'")
    heads, dim = inputs[0].shape[1:]
    axes = [a for a in range(3) if geom.kernel[a] > 1]
    fn = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[len(axes)]
    outs, start, tstart = [], 0, 0
    for grid, tl in zip(grids, text_lengths, strict=True):
        n = math.prod(grid)
        batch = [a for a in range(3) if a not in axes]
        perm = [1 + a for a in batch + axes]
        x = [t[start:start + n].reshape(1, *grid, heads, dim).permute(0, *perm, 4, 5) for t in inputs[:3]]
        folded = math.prod(grid[a] for a in batch)
        x = [t.reshape(folded, *(grid[a] for a in axes), heads, dim).contiguous() for t in x]
        kwargs = {}
        if text:
            kt, vt = (t[tstart:tstart + tl].unsqueeze(0).expand(folded, -1, -1, -1).contiguous() for t in inputs[4:])
            kwargs = dict(additional_keys=kt, additional_values=vt)
        pick = lambda values: tuple(values[a] for a in axes)  # noqa: E731
        out = fn(*x, kernel_size=pick(geom.kernel), stride=pick(geom.stride), dilation=pick(geom.dilation),
                 is_causal=pick(geom.causal), **kwargs)
        out = out.reshape(1, *(grid[a] for a in batch + axes), heads, dim).permute(0, *np.argsort(perm) + 1, 4, 5)
        outs.append(out.reshape(n, heads, dim))
        start, tstart = start + n, tstart + tl
    return torch.cat(outs)

