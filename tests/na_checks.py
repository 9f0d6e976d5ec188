"""Checks shared by the neighbourhood test files: natten over whole grids, and one rank against the dense oracle.

``natten_whole_grid`` is the reference of every backend and cut (natten on each sample's grid, its dims the axes of
kernel > 1, the other axes folded into the batch); ``check_rpb_against_oracle`` holds one rank's layer with a
relative position bias to ``tests/na_oracle.py``'s oracle in float64, outputs and every gradient.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import winsp
from tests.na_oracle import oracle_attention
from winsp.attention.halo.layer import halo_tensors, neighborhood_rpb_score_mod
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


def check_rpb_against_oracle(inputs, grids, text_lengths, geom: Neighborhood) -> None:
    """One rank's layer with a random relative position bias table equals the oracle in float64: outputs to 1e-12,
    and the gradients of every input and of the table to 1e-10. ``inputs``: float64 q, k, v and the text's, each
    requiring grad."""
    heads = inputs[0].shape[1]
    table = torch.randn(heads, *(2 * k - 1 for k in geom.kernel), dtype=torch.float64, requires_grad=True)
    req = winsp.WindowRuntime([geom]).request(grids, text_lengths)
    mod = neighborhood_rpb_score_mod(table, halo_tensors(req, 0), geom)
    out, txt = req.attention(*(req.scatter(x) for x in inputs[:3]), *inputs[3:], layer=0, score_mod=mod)
    out = req.gather(out)
    ref, ref_txt = oracle_attention(*inputs[:3], grids, geom, *inputs[3:], text_lengths, table=table)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(txt, ref_txt, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(out), torch.randn_like(txt)
    grads = torch.autograd.grad((out * weights[0]).sum() + (txt * weights[1]).sum(), inputs + [table])
    ref_grads = torch.autograd.grad((ref * weights[0]).sum() + (ref_txt * weights[1]).sum(), inputs + [table])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)
