"""Strided neighbourhood layers (sliding tile and blocked attention) on the fake GPU (winsp.testing.fake_gpu), in bf16,
at every rank of P: the halo exchange and the text rows issue the same collectives on every rank, with 0 device syncs
and 0 device mismatches in compute, in the training forward (autograd recording: the exchange runs before the tiles)
and in inference (the exchange overlaps the interior tiles), on the tiled path and on ``auto`` (on CUDA without
libnatten: flex, run uncompiled on the fake GPU). No backward: the autograd engine cannot run on the fake GPU (see
``tests/test_fake_gpu_fsdp.py::test_backward_stops_in_the_autograd_engine``).

Sizes: a small packed batch with text, and HunyuanVideo 1.5's 720p x 121-frame latent grid (31, 45, 80) with the
sliding tile layer of ``benchmarks/bench_strided.py`` at P = 2 (width 128, 2 heads: the collectives and syncs do not
depend on the width). Needs the CUDA build of torch (no GPU); skipped on a CPU-only build.
"""

from __future__ import annotations

import math

import pytest
import torch

import winsp

pytestmark = [pytest.mark.fake_gpu, pytest.mark.timeout(600)]

HEADS, DIM = 2, 64
SMALL = ([(4, 8, 12), (2, 6, 6)], [5, 3],
         [winsp.Neighborhood.sliding_tile((2, 2, 2), (1, 3, 3)), winsp.Neighborhood((2, 4, 4), stride=(2, 4, 4)),
          winsp.Neighborhood((2, 3, 5), (1, 2, 1), (True, False, False), stride=(1, 2, 3))])


def _strided_rank(rank: int, world: int, case, backend: str, train: bool) -> dict:
    grids, lengths, schedule = case
    runtime = winsp.WindowRuntime(schedule, group=winsp.comm.SPGroup.world() if world > 1 else None,
                                  neighborhood_backend=backend)
    req = runtime.request(grids, lengths, device="cuda", dtype=torch.bfloat16)
    n, c = sum(math.prod(g) for g in grids), HEADS * DIM
    w = torch.randn(len(schedule), 3, c, c, device="cuda", dtype=torch.bfloat16, requires_grad=train)
    txt = torch.randn(sum(lengths), c, device="cuda", dtype=torch.bfloat16)
    with torch.set_grad_enabled(train):
        h = req.scatter(torch.randn(n, c, device="cuda", dtype=torch.bfloat16))
        for layer in range(len(schedule)):
            h = req.to_layer(h, layer)
            q, k, v = (torch.tanh(h @ w[layer, j]).view(-1, HEADS, DIM) for j in range(3))
            qt, kt, vt = (torch.tanh(txt @ w[layer, j]).view(-1, HEADS, DIM) for j in range(3))
            out, txt_out = req.attention(q, k, v, qt, kt, vt, layer=layer)
            h = h + out.reshape(h.shape)
            txt = txt + txt_out.reshape(txt.shape)
        out = req.gather(h)
    return {"shape": tuple(out.shape), "dtype": out.dtype, "device": str(out.device)}


def _check(report, n: int) -> None:
    assert report.problems() == []
    for trace in report.ranks.values():
        assert trace.result == {"shape": (n, HEADS * DIM), "dtype": torch.bfloat16, "device": "cuda:0"}
        assert trace.device_syncs_in_compute() == [] and trace.mismatches == []
    if report.world_size > 1:
        assert all(any(c.op == "all_to_all" for c in t.collectives) for t in report.ranks.values())  # the halos


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("backend, train", [("tiled", True), ("tiled", False), ("auto", False)])
def test_strided_layers_on_the_fake_gpu(world, backend, train):
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(_strided_rank, world, SMALL, backend, train)
    _check(report, sum(math.prod(g) for g in SMALL[0]))


def test_hunyuanvideo_sliding_tile_grid_on_the_fake_gpu():
    from benchmarks.bench_strided import GRID, sta_layer
    from winsp.testing.fake_gpu import run_fake_gpu

    case = ([GRID], [32], [sta_layer()])
    report = run_fake_gpu(_strided_rank, 2, case, "tiled", False)
    _check(report, math.prod(GRID))
