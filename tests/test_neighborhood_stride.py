"""Strided neighbourhoods (NATTEN's ``stride``): sliding tile and blocked attention, with halos, on every CPU backend.

natten (0.21) runs its float32 forward on this CPU machine (its FlexAttention path): winsp's strided layer and the
dense oracle of ``tests/na_oracle.py`` (sets of key positions, written from NATTEN's rules) equal it, text rows as
NATTEN's additional keys. The oracle then checks float64 outputs and every gradient. Each rank's share of a plan at
SP = 1..4 is checked on every backend (tiled, flex, natten where the rank's extended box is exact) against natten over
the whole grid, without a process group; spawned ranks check the exchange itself (outputs and every gradient against
one rank). Sliding tile attention is held against a dense mask written here from its definition.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import winsp
from tests.na_checks import check_rpb_against_oracle, natten_whole_grid
from tests.na_oracle import _axis_keys, oracle_attention, oracle_mask
from winsp.attention.halo.flex import build_flex_neighborhood, flex_video_queries
from winsp.attention.halo.layer import _text_index, _video_queries
from winsp.attention.halo.natten import extended_box, natten_boxes, natten_plan_reason, natten_video_queries
from winsp.geometry.neighborhood import Neighborhood, axis_neighbours, axis_reach
from winsp.planning.halo import (
    HaloExchange,
    NeighborhoodBlocks,
    block_halo_rows,
    block_work,
    choose_blocks,
    neighborhood_plan,
)
from winsp.testing import run_ranks

HEADS, DIM = 2, 8  # natten's CPU (flex) path wants a head dim that is a power of two >= 8
SCALE = DIM ** -0.5

# name: (grids, text lengths, geometry); natten's dims are the axes whose kernel is > 1
CASES = {
    "1d-between-dilated": ([(1, 1, 23)], [3], Neighborhood((5,), (3,), stride=(2,))),
    "1d-causal": ([(1, 1, 17)], [2], Neighborhood((4,), (2,), (True,), stride=(3,))),
    "1d-blocked-ragged": ([(1, 1, 22)], [2], Neighborhood((5,), stride=(5,))),
    "2d-causal-dilated": ([(1, 9, 13)], [2], Neighborhood((4, 3), (2, 3), (False, True), stride=(4, 2))),
    "3d-sta-ragged": ([(7, 10, 11)], [3], Neighborhood.sliding_tile((2, 2, 3), 3)),
    "3d-causal-time": ([(6, 8, 7)], [3], Neighborhood((3, 4, 3), (1, 1, 2), (True, False, False), stride=(3, 2, 1))),
    "3d-blocked": ([(5, 9, 10)], [2], Neighborhood((2, 4, 4), stride=(2, 4, 4))),
    "3d-stride-1": ([(4, 6, 5)], [2], Neighborhood((2, 3, 5), (2, 2, 1), (True, True, False))),
    "2d-packed-sta": ([(3, 8, 12), (1, 6, 8)], [4, 2], Neighborhood.sliding_tile((1, 2, 2), (1, 3, 3))),
}


def _inputs(name, dtype=torch.float32, seed=0):
    grids, text_lengths, _ = CASES[name]
    g = torch.Generator().manual_seed(seed)
    n, t = sum(math.prod(grid) for grid in grids), sum(text_lengths)
    return [torch.randn(rows, HEADS, DIM, generator=g, dtype=dtype) for rows in (n, n, n, t, t, t)]


def _natten(name, inputs, text=True):
    """natten over each sample's whole grid (its dims: the axes of kernel > 1, the others folded into the batch)."""
    grids, text_lengths, geom = CASES[name]
    return natten_whole_grid(inputs, grids, text_lengths, geom, text)


# ---- the rules ----------------------------------------------------------------------------------------------------

def test_axis_tables_follow_the_rules_for_every_small_axis():
    """The per-axis tables against the oracle's sets, for every kernel, stride, dilation and causality on axes up to
    13 long (stride 1 included)."""
    checked = 0
    for n in range(1, 14):
        for k in range(1, n + 1):
            for d in range(1, n // k + 1):
                for s in range(1, k + 1):
                    for causal in (False, True):
                        keys, valid = axis_neighbours(n, k, d, causal, s)
                        for i in range(n):
                            assert set(keys[i][valid[i]].tolist()) == _axis_keys(n, k, d, causal, i, s), (n, k, d, s, i)
                        checked += 1
    assert checked > 1000


def test_stride_groups_share_the_leader_s_window():
    """Blocked attention (stride == kernel): every block attends to itself; the ragged last block (2 of 5 positions)
    takes the last 5 positions, as NATTEN does. Causal: a query never attends after itself."""
    assert [_axis_keys(12, 5, 1, False, i, 5) for i in (0, 4, 5, 9)] == [set(range(5))] * 2 + [set(range(5, 10))] * 2
    assert _axis_keys(12, 5, 1, False, 10, 5) == _axis_keys(12, 5, 1, False, 11, 5) == set(range(7, 12))
    # causal, stride 3, kernel 4: the group [3, 6) leads with 5 and reaches back to 2; 3 stops at itself
    assert _axis_keys(12, 4, 1, True, 3, 3) == {2, 3} and _axis_keys(12, 4, 1, True, 5, 3) == {2, 3, 4, 5}
    keys, valid = axis_neighbours(12, 4, 1, True, 3)
    assert set(keys[3][valid[3]].tolist()) == {2, 3}


def test_bad_strides_are_refused_naming_the_axis_and_the_value():
    with pytest.raises(ValueError, match=r"stride\[h\] = 4 is larger than kernel\[h\] = 3"):
        Neighborhood((3, 3, 3), stride=(1, 4, 1))
    with pytest.raises(ValueError, match=r"stride\[w\] must be a positive integer, got 0"):
        Neighborhood((3, 3), stride=(1, 0))
    with pytest.raises(ValueError, match=r"stride\[t\] must be a positive integer, got True"):
        Neighborhood(3, stride=(True, 1, 1))
    with pytest.raises(ValueError, match=r"tiles\[h\] = 2 is even"):
        Neighborhood.sliding_tile((2, 4, 4), (1, 2, 3))
    assert Neighborhood((7, 7), stride=(2, 2)).stride == (1, 2, 2) and Neighborhood(3, stride=2).stride == (2, 2, 2)
    with pytest.raises(ValueError, match=r"stride\[t\] = 2 is larger than kernel\[t\] = 1"):  # one int: every axis
        Neighborhood((7, 7), stride=2)
    # the stride is part of the fingerprint (plans are cached by it); stride 1 keeps the fingerprint it had
    assert Neighborhood(3, stride=3).fingerprint != Neighborhood(3).fingerprint
    assert "stride" not in Neighborhood(3).params()


# ---- sliding tile attention --------------------------------------------------------------------------------------

def _sta_mask(grid, tile, tiles) -> torch.Tensor:
    """[N, N] sliding tile attention from its definition: the grid is cut into tiles; a query's tile attends to the
    window of ``tiles`` tiles per axis centred on it, the window's centre moved so that it stays inside the grid."""
    coords = np.stack(np.meshgrid(*(np.arange(n) for n in grid), indexing="ij"), -1).reshape(-1, 3)
    tile_of = coords // np.asarray(tile)
    counts = [n // t for n, t in zip(grid, tile, strict=True)]
    ok = np.ones((len(coords), len(coords)), dtype=bool)
    for a in range(3):
        half = tiles[a] // 2
        centre = np.clip(tile_of[:, a], half, counts[a] - 1 - half)  # the window's centre tile, kept inside
        ok &= np.abs(tile_of[None, :, a] - centre[:, None]) <= half
    return torch.from_numpy(ok)


@pytest.mark.parametrize("grid, tile, tiles", [
    ((6, 8, 12), (2, 2, 2), (3, 3, 3)), ((4, 12, 10), (1, 3, 2), (3, 1, 5)), ((1, 16, 16), (1, 4, 4), (1, 3, 3)),
    ((6, 6, 6), (3, 2, 1), (1, 3, 5)),
])
def test_sliding_tile_equals_the_sta_mask(grid, tile, tiles):
    geom = Neighborhood.sliding_tile(tile, tiles)
    assert geom == Neighborhood(kernel=tuple(t * k for t, k in zip(tile, tiles, strict=True)), stride=tile)
    assert torch.equal(oracle_mask([grid], geom), _sta_mask(grid, tile, tiles))
    # and winsp's own tables (what the halo plans and kernels use) give the same mask
    coords = np.stack(np.meshgrid(*(np.arange(n) for n in grid), indexing="ij"), -1).reshape(-1, 3)
    ids, valid = winsp.geometry.neighborhood.neighbourhood_ids(coords, grid, geom)
    mask = torch.zeros(len(coords), len(coords), dtype=torch.bool)
    mask[torch.from_numpy(np.broadcast_to(np.arange(len(coords))[:, None], ids.shape)[valid]),
         torch.from_numpy(ids[valid])] = True
    assert torch.equal(mask, _sta_mask(grid, tile, tiles))


# ---- one rank: natten in float32, the oracle in float64 with gradients ----------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_and_oracle_equal_natten_in_float32(name):
    grids, text_lengths, geom = CASES[name]
    inputs = _inputs(name)
    for text in (False, True):
        expected = _natten(name, inputs, text)
        req = winsp.WindowRuntime([geom]).request(grids, text_lengths if text else None)
        extra = inputs[3:] if text else ()
        out, _ = req.attention(*(req.scatter(x) for x in inputs[:3]), *extra, layer=0)
        torch.testing.assert_close(req.gather(out), expected, rtol=1e-5, atol=1e-5)
        oracle = oracle_attention(*inputs[:3], grids, geom, *(list(extra) + [text_lengths] if text else []))[0]
        torch.testing.assert_close(oracle, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["2d-causal-dilated", "3d-sta-ragged", "3d-causal-time", "2d-packed-sta"])
def test_one_rank_equals_the_oracle_in_float64_with_gradients(name):
    grids, text_lengths, geom = CASES[name]
    inputs = [x.requires_grad_(True) for x in _inputs(name, torch.float64, seed=3)]
    check_rpb_against_oracle(inputs, grids, text_lengths, geom)


# ---- SP = 1..4: every rank's share on every backend, no process group ----------------------------------------------

def _key_ids(plan, halo) -> np.ndarray:
    """Canonical packed rows of a rank's key rows (local, then halo)."""
    lay = plan.layout
    coords, sample = halo.key_coords.numpy(), halo.key_sample.numpy()
    grids = np.asarray(lay.grids)[sample]
    return lay.sample_offsets[sample] + (coords[:, 0] * grids[:, 1] + coords[:, 1]) * grids[:, 2] + coords[:, 2]


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_every_rank_on_every_backend_equals_natten(world_size):
    """Each rank's video queries from its own and halo rows (tiled, flex and natten where its boxes are exact) equal
    natten over the whole grid, text included; natten's boxes ran with real halos, and a rank held nothing."""
    ran = {"natten": 0, "halo": 0, "empty": 0}
    for name in sorted(CASES):
        grids, text_lengths, geom = CASES[name]
        inputs = _inputs(name)
        expected = _natten(name, inputs)
        plan = neighborhood_plan(grids, [geom], world_size)
        reason = natten_plan_reason(plan, geom)
        txt_sample = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor(text_lengths))
        txt = (inputs[4], inputs[5], _text_index(txt_sample, len(grids)))
        for rank in range(world_size):
            halo = HaloExchange(plan, rank, geom).to("cpu")
            rows = torch.from_numpy(_key_ids(plan, halo))
            q, k_all, v_all = inputs[0][rows[:halo.num_rows]], inputs[1][rows], inputs[2][rows]
            want = expected[rows[:halo.num_rows]]
            with torch.no_grad():
                torch.testing.assert_close(_video_queries(q, k_all, v_all, txt, halo, SCALE, None), want,
                                           rtol=1e-5, atol=1e-5)
                data = build_flex_neighborhood(halo, geom, plan.layout.grids, txt_sample, torch.device("cpu"))
                torch.testing.assert_close(flex_video_queries(data, q, k_all, v_all, txt, SCALE, None), want,
                                           rtol=1e-5, atol=1e-5)
                boxes, why = natten_boxes(halo, geom, plan.layout.grids, text_lengths, "cpu")
                assert why is None or reason is not None  # a rank that fails makes the plan fail
                if boxes is not None:
                    torch.testing.assert_close(natten_video_queries(boxes, q, k_all, v_all, txt, SCALE), want,
                                               rtol=1e-5, atol=1e-5)
                    ran["natten"] += 1
            ran["halo"] += halo.num_keys > halo.num_rows
            ran["empty"] += halo.num_rows == 0
    assert ran["natten"] >= world_size
    assert world_size == 1 or ran["halo"] >= world_size


def test_a_rank_with_no_rows_on_every_backend():
    geom = Neighborhood((4,), stride=(2,))
    plan = neighborhood_plan([(1, 1, 5)], [geom], 4)
    assert 0 in plan.rank_rows
    empty = plan.rank_rows.index(0)
    halo = HaloExchange(plan, empty, geom).to("cpu")
    q = torch.zeros(0, HEADS, DIM)
    txt_sample = torch.zeros(2, dtype=torch.int64)
    txt = (torch.randn(2, HEADS, DIM), torch.randn(2, HEADS, DIM), _text_index(txt_sample, 1))
    data = build_flex_neighborhood(halo, geom, plan.layout.grids, txt_sample, torch.device("cpu"))
    boxes, why = natten_boxes(halo, geom, plan.layout.grids, (2,), "cpu")
    assert why is None and boxes.groups == ()
    for out in (_video_queries(q, q, q, txt, halo, SCALE, None), flex_video_queries(data, q, q, q, txt, SCALE, None),
                natten_video_queries(boxes, q, q, q, txt, SCALE)):
        assert out.shape == (0, HEADS, DIM)


def test_natten_boxes_start_at_a_stride_group():
    """kernel 5, stride 2: the block [4, 8) reaches [3, 10); NATTEN's stride groups count from the box's start, so the
    box starts at 2 (a stride group's start: position 2 is padding no block query attends)."""
    geom = Neighborhood((5,), stride=(2,))
    box, why = extended_box((1, 1, 16), geom, [(0, 1), (0, 1), (4, 8)])
    assert why is None and box[2] == (2, 3, 10, 10)
    assert box[:2] == [(0, 0, 1, 1)] * 2


# ---- plans: halos for the strided reach, cuts at stride groups, balance by attention work ---------------------------

def test_blocked_attention_on_aligned_blocks_exchanges_nothing():
    """stride == kernel: a block of whole stride groups reaches only itself, so aligned blocks have no halo; the
    ragged last block reaches back into its neighbour (NATTEN's last window is the last kernel positions)."""
    geom = Neighborhood((2, 4, 4), stride=(2, 4, 4))
    blocks = choose_blocks([(4, 16, 32)], [geom], 4)
    assert all(h == 0 for _, h in block_halo_rows((4, 16, 32), blocks, geom))
    ragged = Neighborhood((4,), stride=(4,))
    assert axis_reach(18, 4, 1, False, 16, 18, 4).tolist() == [14, 15, 16, 17]
    blocks = NeighborhoodBlocks((1, 1, 3), (1, 1, 4), (ragged,))
    assert blocks.axis_runs((1, 1, 18))[2] == [(0, 8), (8, 16), (16, 18)]
    assert [h for _, h in block_halo_rows((1, 1, 18), blocks, ragged)] == [0, 0, 2]


def test_sta_halo_is_one_tile_deep_on_aligned_cuts():
    """STA with 3 tiles reaches one tile beyond its own: an aligned cut along w receives one tile's width per side."""
    geom = Neighborhood.sliding_tile((2, 4, 4), 3)
    blocks = choose_blocks([(6, 16, 32)], [geom], 2)
    assert blocks.splits == (1, 1, 2) and blocks.unit[2] == 4
    assert block_halo_rows((6, 16, 32), blocks, geom) == [(6 * 16 * 16, 6 * 16 * 4)] * 2


def test_causal_work_is_balanced_not_rows():
    """Causal time: early frames attend to fewer keys, so the first rank takes more frames than the last."""
    geom = Neighborhood((4, 1, 1), causal=(True, False, False))
    blocks = choose_blocks([(16, 1, 1)], [geom], 2)
    runs = blocks.axis_runs((16, 1, 1))[0]
    assert runs[0][1] - runs[0][0] > runs[1][1] - runs[1][0]
    work = block_work((16, 1, 1), blocks, geom)
    assert max(work) <= 1.05 * (sum(work) / 2)


def test_hunyuanvideo_sta_work_is_balanced_at_2_to_8_ranks():
    """benchmarks/bench_strided.py's grid and sliding tile layer: the heaviest rank's attention work is at most 1.05
    of the mean at P = 2..8."""
    from benchmarks.bench_strided import GRID, sta_layer

    geom = sta_layer()
    for p in range(2, 9):
        work = np.asarray(block_work(GRID, choose_blocks([GRID], [geom], p), geom), np.float64)
        assert work.max() / work.mean() <= 1.05 + 1e-12, (p, work.max() / work.mean())


def test_sta_halo_bytes_against_ulysses():
    """benchmarks/README.md's table at the default (NVLink) costs: below Ulysses' four all-to-alls at P = 2, 4 and 8
    for both tiles; the (18, 24, 24) window at P = 8 (halos 2.2x a rank's block) by a nested cut predicted within
    TIME_TOLERANCE of the fastest cut, which moves more (tests/test_neighborhood_nested.py)."""
    from benchmarks.bench_strided import GRID, layer_figures, sta_layer

    ratios = {(tile, p): layer_figures(GRID, sta_layer(tile), p)["ratio"] for tile in ((6, 8, 8), (4, 4, 4))
              for p in (2, 4, 8)}
    assert ratios[((6, 8, 8), 2)] == pytest.approx(0.2) and ratios[((4, 4, 4), 2)] == pytest.approx(0.1)
    assert all(r < 1 for r in ratios.values()), ratios
    assert ratios[((6, 8, 8), 8)] == pytest.approx(0.789, abs=1e-3)


# ---- SP = 2..4 on spawned ranks: the exchange, outputs and every gradient ------------------------------------------

MODELS = {  # grids, text lengths, a stack of strided layers (and one window layer between them)
    "sta": ([(4, 8, 12), (2, 6, 6)], [3, 2],
            [Neighborhood.sliding_tile((2, 2, 2), (1, 3, 3)), Neighborhood((2, 4, 4), stride=(2, 4, 4)),
             winsp.FixedWindows((2, 4, 4)),
             Neighborhood((2, 3, 5), (1, 2, 1), (True, False, False), stride=(1, 2, 3))]),
    "tiny": ([(1, 1, 3)], [2], [Neighborhood((2,), stride=(2,)), Neighborhood((3,), causal=True, stride=(3,))]),
}


def _model(runtime, name, x, txt, w):
    grids, text_lengths, schedule = MODELS[name]
    req = runtime.request(grids, text_lengths, dtype=x.dtype)
    h = req.scatter(x)
    for layer in range(len(schedule)):
        h = req.to_layer(h, layer)
        q, k, v = (torch.tanh(h @ w[layer, j]).view(-1, HEADS, DIM) for j in range(3))
        qt, kt, vt = (torch.tanh(txt @ w[layer, j]).view(-1, HEADS, DIM) for j in range(3))
        out, txt_out = req.attention(q, k, v, qt, kt, vt, layer=layer)
        h = h + out.reshape(h.shape) @ w[layer, 3]
        txt = txt + txt_out.reshape(txt.shape)
    return req.gather(h), txt


def _params(name):
    grids, text_lengths, schedule = MODELS[name]
    g = torch.Generator().manual_seed(0)
    n, c = sum(math.prod(grid) for grid in grids), HEADS * DIM
    return [torch.randn(n, c, dtype=torch.float64, generator=g),
            torch.randn(sum(text_lengths), c, dtype=torch.float64, generator=g),
            torch.randn(len(schedule), 4, c, c, dtype=torch.float64, generator=g) / 3]


def _run(runtime, name):
    params = [p.requires_grad_(True) for p in _params(name)]
    out, txt = _model(runtime, name, *params)
    (out.square().sum() + txt.square().sum()).backward()
    return out.detach(), txt.detach(), params


def _backends(group, name) -> dict:
    """float32 inference on the flex and natten backends (natten where every layer's boxes are exact)."""
    grids, _, schedule = MODELS[name]
    out = {}
    for backend in ("flex", "natten"):
        runtime = winsp.WindowRuntime(schedule, group=group, neighborhood_backend=backend)
        plans = runtime.plans(grids)
        if backend == "natten" and any(natten_plan_reason(plans[i], g) is not None
                                       for i, g in enumerate(schedule) if isinstance(g, Neighborhood)):
            continue
        with torch.no_grad():
            out[backend] = _model(runtime, name, *(p.float() for p in _params(name)))
    return out


def _ranks(rank, world_size, names):
    results = {}
    for name in names:
        group = winsp.comm.SPGroup.world()
        runtime = winsp.WindowRuntime(MODELS[name][2], group=group)
        out, txt, params = _run(runtime, name)
        winsp.sync_gradients(params, runtime)
        with torch.no_grad():
            inferred = _model(runtime, name, *_params(name))
        results[name] = (out, txt, [p.grad.clone() for p in params], inferred,
                         runtime.plans(MODELS[name][0])[0].rank_rows, _backends(group, name))
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, *(pytest.param(p, marks=pytest.mark.slow) for p in (3, 4))])
def test_strided_model_on_ranks_equals_one_rank(world_size):
    names = ("sta", "tiny")
    results = run_ranks(_ranks, world_size, names, timeout=240)
    natten_ran = 0
    for name in names:
        ref_out, ref_txt, ref_params = _run(winsp.WindowRuntime(MODELS[name][2]), name)
        with torch.no_grad():
            ref32 = _model(winsp.WindowRuntime(MODELS[name][2]), name, *(p.float() for p in _params(name)))
        for by_name in results:
            out, txt, grads, (inferred, inferred_txt), _, backends = by_name[name]
            for backend_out, backend_txt in backends.values():  # flex and natten against the tiled path
                torch.testing.assert_close(backend_out, ref32[0], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(backend_txt, ref32[1], rtol=1e-4, atol=1e-4)
            assert "flex" in backends
            natten_ran += "natten" in backends
            torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(txt, ref_txt, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(inferred, ref_out, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(inferred_txt, ref_txt, rtol=1e-12, atol=1e-12)
            for g, p in zip(grads, ref_params, strict=True):
                torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-10)
    assert 0 in results[0]["tiny"][4] or world_size < 4  # at 4 ranks a rank of the 3-row grid holds nothing
    assert natten_ran > 0


def test_the_one_rank_reference_is_the_oracle():
    """The first strided layer of the multi-rank model at one rank against the dense oracle (float64, text rows)."""
    grids, text_lengths, schedule = MODELS["sta"]
    x, txt, w = _params("sta")
    q, k, v = (torch.tanh(x @ w[0, j]).view(-1, HEADS, DIM) for j in range(3))
    qt, kt, vt = (torch.tanh(txt @ w[0, j]).view(-1, HEADS, DIM) for j in range(3))
    req = winsp.WindowRuntime(schedule).request(grids, text_lengths)
    out, txt_out = req.attention(*(req.scatter(t) for t in (q, k, v)), qt, kt, vt, layer=0)
    ref, ref_txt = oracle_attention(q, k, v, grids, schedule[0], qt, kt, vt, text_lengths)
    torch.testing.assert_close(req.gather(out), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(txt_out, ref_txt, rtol=1e-12, atol=1e-12)
