"""A dense masked oracle of NATTEN's neighborhood attention, written from the rules (no winsp index code).

Checked against natten's forward in ``tests/test_neighborhood.py``; it then serves for float64 and gradients, which
natten cannot give on a CPU machine (its flex path is float32 forward only there).
"""

from __future__ import annotations

import math

import torch

from winsp.geometry.neighborhood import Neighborhood


def _axis_keys(n: int, k: int, d: int, causal: bool, i: int, s: int = 1) -> set[int]:
    """NATTEN's neighbourhood of position i along one axis, as a set (written from the rules, not from winsp).

    Stride ``s``: the dilation group's members are dealt into runs of ``s`` (the last one shorter); every query of a
    run takes the window of the run's leader, its middle member (the right one of two) or, causally, its last.
    """
    members = list(range(i % d, n, d))
    j = members.index(i)
    run = [x for x in range(len(members)) if x // s == j // s]
    if causal:
        leader = run[-1]
        chosen = [x for x in range(len(members)) if leader - k < x <= j]
    else:
        leader = run[min(s // 2, len(run) - 1)]
        left, right = k // 2, k // 2 - (1 - k % 2)
        centre = min(max(leader, left), len(members) - 1 - right)
        chosen = list(range(centre - left, centre + right + 1))
    return {members[x] for x in chosen}


def _coords(grid):
    t, h, w = grid
    return [(a, b, c) for a in range(t) for b in range(h) for c in range(w)]


def oracle_mask(grids, geometry: Neighborhood) -> torch.Tensor:
    """[N, N] True where a query (packed canonical row) may attend to a video key."""
    n = sum(math.prod(g) for g in grids)
    mask = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    for grid in grids:
        cs = torch.tensor(_coords(grid))
        for qi, qc in enumerate(cs.tolist()):
            ok = torch.ones(len(cs), dtype=torch.bool)
            for a in range(3):  # a key is in the neighbourhood iff each of its coordinates is in that axis's set
                inside = torch.zeros(grid[a], dtype=torch.bool)
                inside[list(_axis_keys(grid[a], geometry.kernel[a], geometry.dilation[a], geometry.causal[a],
                                       qc[a], geometry.stride[a]))] = True
                ok &= inside[cs[:, a]]
            mask[start + qi, start:start + len(cs)] = ok
        start += math.prod(grid)
    return mask


def oracle_bias(grids, geometry: Neighborhood, table: torch.Tensor) -> torch.Tensor:
    """[H, N, N] NATTEN-style relative position bias of every (query, key) pair (zero where masked)."""
    coords = torch.tensor([c for g in grids for c in _coords(g)])
    rel = (coords[None, :, :] - coords[:, None, :]) // torch.tensor(geometry.dilation) \
        + torch.tensor(geometry.kernel) - 1
    rel = torch.maximum(rel, torch.zeros_like(rel))
    rel = torch.minimum(rel, 2 * torch.tensor(geometry.kernel) - 2)
    return table[:, rel[..., 0], rel[..., 1], rel[..., 2]]


def oracle_attention(q, k, v, grids, geometry, q_txt=None, k_txt=None, v_txt=None, text_lengths=None, table=None):
    """Dense masked attention: video queries over their neighbourhood and their sample's text, text queries over
    their sample's whole video and text. Canonical rows; [N, H, D] (and [L_txt, H, D])."""
    n = q.shape[0]
    scale = q.shape[-1] ** -0.5
    mask = oracle_mask(grids, geometry)
    sample = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor([math.prod(g) for g in grids]))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if table is not None:
        scores = scores + oracle_bias(grids, geometry, table)
    scores = scores.masked_fill(~mask, float("-inf"))
    if k_txt is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v), None
    tsample = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor(text_lengths))
    vt = (torch.einsum("qhd,khd->hqk", q, k_txt) * scale).masked_fill(sample[:, None] != tsample[None], float("-inf"))
    probs = torch.cat([scores, vt], -1).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs[..., :n], v) + torch.einsum("hqk,khd->qhd", probs[..., n:], v_txt)
    tv = (torch.einsum("qhd,khd->hqk", q_txt, k) * scale).masked_fill(tsample[:, None] != sample[None], float("-inf"))
    tt = (torch.einsum("qhd,khd->hqk", q_txt, k_txt) * scale).masked_fill(tsample[:, None] != tsample[None],
                                                                          float("-inf"))
    tp = torch.cat([tv, tt], -1).softmax(-1)
    txt = torch.einsum("hqk,khd->qhd", tp[..., :n], v) + torch.einsum("hqk,khd->qhd", tp[..., n:], v_txt)
    return out, txt




def dense_na3d(query, key, value, kernel_size, dilation=1, is_causal=False, scale=None, stride=1, **unused):
    """``natten.na3d``'s signature on ``[B, T, H, W, heads, D]``, computed densely (a drop-in for checks)."""
    geom = Neighborhood(kernel_size, dilation, is_causal, stride=stride)
    b, t, h, w, heads, d = query.shape
    grids = [(t, h, w)] * b
    flat = [x.reshape(b * t * h * w, heads, -1) for x in (query, key, value)]
    if scale is not None:
        flat[0] = flat[0] * (scale * d ** 0.5)
    out, _ = oracle_attention(*flat, grids, geom)
    return out.reshape(b, t, h, w, heads, -1)
