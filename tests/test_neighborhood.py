"""Neighborhood attention: NATTEN's semantics (checked against natten), halo plans, and exact SP = 1..4 execution.

natten (0.21, pure Python on a CPU machine) runs only a float32 forward here. So: winsp's neighborhood layer equals
``natten.na1d/na2d/na3d`` in float32; a dense masked oracle written below (sets of key positions, no shared index
code) equals natten too; and the oracle then checks float64 outputs and every gradient, with text rows and a
relative position bias, at one rank. At 2..4 ranks a mixed model (neighborhood, window and global layers) equals
its one-rank run in outputs and every gradient, on grids that do and do not divide by the ranks.
"""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
import torch

import winsp
from tests.na_checks import check_rpb_against_oracle
from tests.na_oracle import _axis_keys, oracle_attention
from winsp.attention.halo.layer import halo_tensors, neighborhood_rpb_score_mod
from winsp.geometry.neighborhood import Neighborhood, axis_neighbours, neighbourhood_ids
from winsp.planning.halo import HaloExchange, block_halo_rows, choose_splits, neighborhood_plan
from winsp.testing import run_ranks

HEADS, HEAD_DIM = 2, 4
NATTEN_HEAD_DIM = 8  # natten's CPU (flex) path wants a power of two >= 8


# ---- natten -----------------------------------------------------------------------------------------------------

NATTEN_CASES = [  # (grid, kernel, dilation, causal, na_dim)
    ((1, 1, 23), (5,), (3,), (False,), 1),
    ((1, 1, 17), (4,), (2,), (True,), 1),
    ((1, 9, 13), (4, 3), (2, 3), (False, True), 2),
    ((1, 8, 8), (7, 7), (1, 1), (False, False), 2),
    ((6, 8, 7), (3, 4, 3), (2, 2, 2), (True, False, False), 3),
    ((4, 6, 5), (2, 3, 5), (2, 2, 1), (True, True, False), 3),
]


def _natten(q, k, v, case, extra=None):
    natten = pytest.importorskip("natten", reason="natten (the neighborhood attention oracle) is not installed: "
                                                  "pip install -e '.[natten]'")
    grid, kernel, dilation, causal, nd = case
    shape = (1,) + grid[3 - nd:] + (HEADS, NATTEN_HEAD_DIM)
    fn = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[nd]
    kwargs = {}
    if extra is not None:
        kwargs = dict(additional_keys=extra[0].unsqueeze(0), additional_values=extra[1].unsqueeze(0))
    out = fn(*(x.reshape(shape) for x in (q, k, v)), kernel_size=kernel, dilation=dilation, is_causal=causal,
             **kwargs)
    return out.reshape(q.shape)


def _qkv(n, seed=0, dtype=torch.float32, txt=0, dim=HEAD_DIM):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, HEADS, dim, generator=g, dtype=dtype) for _ in range(3)]
    return out + [torch.randn(txt, HEADS, dim, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("case", NATTEN_CASES, ids=lambda c: f"{c[4]}d-{c[0]}-k{c[1]}-d{c[2]}-c{c[3]}")
def test_layer_and_oracle_equal_natten_in_float32(case):
    grid, kernel, dilation, causal, _ = case
    geom = Neighborhood(kernel, dilation, causal)
    n = math.prod(grid)
    q, k, v, qt, kt, vt = _qkv(n, txt=3, dim=NATTEN_HEAD_DIM)
    expected = _natten(q, k, v, case)
    req = winsp.WindowRuntime([geom]).request([grid])
    out, _ = req.attention(*(req.scatter(x) for x in (q, k, v)), layer=0)
    torch.testing.assert_close(req.gather(out), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(oracle_attention(q, k, v, [grid], geom)[0], expected, rtol=1e-5, atol=1e-5)
    # text rows are NATTEN's additional keys / values: every video query attends to them too
    expected_txt = _natten(q, k, v, case, extra=(kt, vt))
    req = winsp.WindowRuntime([geom]).request([grid], [3])
    out, _ = req.attention(*(req.scatter(x) for x in (q, k, v)), qt, kt, vt, layer=0)
    torch.testing.assert_close(req.gather(out), expected_txt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(oracle_attention(q, k, v, [grid], geom, qt, kt, vt, [3])[0], expected_txt,
                               rtol=1e-5, atol=1e-5)


def test_axis_neighbours_follow_the_rules():
    for n, k, d, c in [(23, 5, 3, False), (17, 4, 2, True), (9, 4, 2, False), (10, 3, 1, True), (7, 7, 1, False)]:
        keys, valid = axis_neighbours(n, k, d, c)
        for i in range(n):
            assert set(keys[i][valid[i]].tolist()) == _axis_keys(n, k, d, c, i)
            assert c or valid[i].all()  # always kernel keys when not causal


def test_neighbourhood_ids_equal_the_oracle_mask():
    from tests.na_oracle import oracle_mask

    grid, geom = (4, 5, 6), Neighborhood((2, 3, 3), dilation=(1, 1, 2), causal=(True, False, False))
    coords = np.stack(np.meshgrid(*(np.arange(n) for n in grid), indexing="ij"), -1).reshape(-1, 3)
    ids, valid = neighbourhood_ids(coords, grid, geom)
    mask = torch.zeros(len(coords), len(coords), dtype=torch.bool)
    rows = np.broadcast_to(np.arange(len(coords))[:, None], ids.shape)
    mask[torch.from_numpy(rows[valid]), torch.from_numpy(ids[valid])] = True
    assert torch.equal(mask, oracle_mask([grid], geom))


def test_bad_neighborhoods_are_refused():
    with pytest.raises(ValueError, match="kernel"):
        Neighborhood((0, 3, 3))
    with pytest.raises(ValueError, match="causal"):
        Neighborhood(3, causal=(1, 0, 0))
    with pytest.raises(ValueError, match=r"along w needs at least 6 tokens"):
        winsp.planning.plan_schedule([(2, 8, 5)], [Neighborhood((1, 3, 3), dilation=(1, 1, 2))], 2)
    with pytest.raises(ValueError, match="not a partition into windows"):
        winsp.geometry.build_layout([(1, 4, 4)], Neighborhood(3))
    assert Neighborhood((7, 7)) == Neighborhood((1, 7, 7)) and Neighborhood(3).kernel == (3, 3, 3)


# ---- one rank: float64 and every gradient against the oracle ------------------------------------------------

ORACLE_CASES = {
    "2d-dilated": ([(1, 7, 9)], [3], Neighborhood((3, 4), dilation=(2, 1))),
    "3d-causal-packed": ([(4, 5, 6), (2, 3, 4)], [2, 3], Neighborhood((2, 3, 3), causal=(True, False, False))),
}


@pytest.mark.parametrize("name", sorted(ORACLE_CASES))
def test_one_rank_equals_the_oracle_in_float64_with_gradients(name):
    grids, text_lengths, geom = ORACLE_CASES[name]
    n, lt = sum(math.prod(g) for g in grids), sum(text_lengths)
    inputs = [x.requires_grad_(True) for x in _qkv(n, seed=3, dtype=torch.float64, txt=lt)]
    check_rpb_against_oracle(inputs, grids, text_lengths, geom)


# ---- plans and halos ------------------------------------------------------------------------------------------

def test_neighborhood_layers_share_one_plan_and_move_only_halos():
    a, b = Neighborhood((1, 3, 3)), Neighborhood((1, 5, 3), dilation=(1, 1, 2))
    win = winsp.FixedWindows((1, 4, 4))
    plans = winsp.planning.plan_schedule([(2, 12, 16)], [a, b, a, win, a], 4)
    assert plans[0] is plans[1] is plans[2] is plans[4] and plans[3] is not plans[0]
    assert plans[0].rank_rows == (96,) * 4
    rt = winsp.WindowRuntime([a, b, a, win, a])
    req = rt.request([(2, 12, 16)])
    h = req.scatter(torch.zeros(384, 1))
    for layer in range(5):
        h = req.to_layer(h, layer)
    assert req.transitions_done == 2  # into the window layer and back out, never between neighborhood layers


def test_halo_is_what_the_block_reaches_and_the_cut_follows_the_kernel():
    geom = Neighborhood((1, 3, 7))
    # a wide kernel along w: cutting h moves fewer rows than cutting w
    assert choose_splits([(1, 32, 32)], [geom], 2) == (1, 2, 1)
    assert block_halo_rows((1, 32, 32), (1, 2, 1), geom) == [(512, 32), (512, 32)]
    assert block_halo_rows((1, 32, 32), (1, 1, 2), geom) == [(512, 96), (512, 96)]
    plan = neighborhood_plan([(1, 32, 32)], [geom], 2)
    halo = HaloExchange(plan, 0, geom)
    assert halo.halo_rows == 32 and halo.input_split_sizes == (0, 32) and halo.output_split_sizes == (0, 32)
    # a causal time kernel reaches only backwards: the first block receives nothing
    causal = Neighborhood((3, 1, 1), causal=(True, False, False))
    assert [h for _, h in block_halo_rows((8, 2, 2), (2, 1, 1), causal)] == [0, 8]


@pytest.mark.parametrize("grid, geom, world, some_interior", [
    ((4, 24, 32), Neighborhood((3, 7, 7)), 2, True), ((5, 6, 9), Neighborhood((2, 3, 3), dilation=(2, 2, 1)), 3, False),
    ((3, 20, 10), Neighborhood((1, 3, 2), dilation=(1, 1, 2)), 4, True),
])
def test_interior_tiles_reach_local_rows_only(grid, geom, world, some_interior):
    """The tiles that run while the halos are in flight read no halo row; every other tile reads one."""
    plan = neighborhood_plan([grid], [geom], world)
    interior_somewhere = False
    for rank in range(world):
        halo = HaloExchange(plan, rank, geom).to("cpu")
        for i, (_, key, _, _) in enumerate(halo.tiles):
            if i < halo.interior_groups:
                assert int(key.max()) < halo.num_rows
            else:
                assert bool((key >= halo.num_rows).any(-1).all())
        interior_somewhere |= halo.interior_groups > 0
        # the edge tiles' compact key buffer [edge rows, halo rows] holds exactly the key rows they read
        key_rows = torch.arange(halo.num_keys)
        compact = torch.cat([key_rows[halo.edge_rows], key_rows[halo.num_rows:]])
        edge = halo.tiles[halo.interior_groups:]
        assert len(halo.edge_keys) == len(edge)
        for (_, key, _, _), where in zip(edge, halo.edge_keys):
            assert torch.equal(compact[where], key)
        reached = torch.cat([key[key < halo.num_rows] for _, key, _, _ in edge]) if edge else torch.empty(0)
        assert torch.equal(halo.edge_rows, torch.unique(reached).long())
    assert interior_somewhere == some_interior


def test_a_rank_can_hold_nothing():
    plan = neighborhood_plan([(1, 1, 3)], [Neighborhood((3,))], 4)
    assert sorted(plan.rank_rows) == [0, 1, 1, 1]


# ---- 2..4 ranks: a mixed model equals its one-rank run ----------------------------------------------------------

MODELS = {
    # grids, text lengths, schedule: neighbourhoods (dilated, causal), windows, a global layer
    "packed": ([(3, 7, 10), (1, 3, 4)], [4, 2],
               [Neighborhood((1, 3, 3)), Neighborhood((1, 3, 2), dilation=(1, 1, 2)), winsp.FixedWindows((1, 3, 4)),
                Neighborhood((1, 3, 3)), winsp.FixedWindows((3, 7, 10))]),
    "video": ([(5, 6, 9)], [3],
              [Neighborhood((3, 3, 3), causal=(True, False, False)), Neighborhood((2, 3, 3), dilation=(2, 2, 1)),
               winsp.FixedWindows((5, 6, 9)), Neighborhood((3, 3, 3), causal=(True, False, False))]),
    "tiny": ([(1, 1, 5)], [2], [Neighborhood((3,)), Neighborhood((2,), causal=True)]),
}


def _model_inputs(name, seed=0):
    grids, text_lengths, schedule = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    n, c = sum(math.prod(grid) for grid in grids), HEADS * HEAD_DIM
    x = torch.randn(n, c, dtype=torch.float64, generator=g)
    txt = torch.randn(sum(text_lengths), c, dtype=torch.float64, generator=g)
    w = torch.randn(len(schedule), 4, c, c, dtype=torch.float64, generator=g) / 3
    tables = [torch.randn(HEADS, *(2 * k - 1 for k in geom.kernel), dtype=torch.float64, generator=g)
              if isinstance(geom, Neighborhood) else torch.zeros(1, dtype=torch.float64) for geom in schedule]
    return x, txt, w, tables


def _model_forward(runtime, name, x, txt, w, tables, fused=False):
    """``fused``: q, k and v as slices of one projection's output (``qkv.view(L, 3, H, D).unbind(1)``)."""
    grids, text_lengths, schedule = MODELS[name]
    req = runtime.request(grids, text_lengths, dtype=torch.float64, score_mods=False)
    h = req.scatter(x)
    shape = (-1, HEADS, HEAD_DIM)
    for layer, geom in enumerate(schedule):
        h = req.to_layer(h, layer)
        if fused:
            q, k, v = torch.tanh(h @ torch.cat(list(w[layer, :3]), dim=1)).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        else:
            q, k, v = (torch.tanh(h @ w[layer, j]).view(shape) for j in range(3))
        qt, kt, vt = (torch.tanh(txt @ w[layer, j]).view(shape) for j in range(3))
        mod = None
        if isinstance(geom, Neighborhood):
            mod = neighborhood_rpb_score_mod(tables[layer], halo_tensors(req, layer), geom)
        out, txt_out = req.attention(q, k, v, qt, kt, vt, layer=layer, score_mod=mod)
        h = h + out.reshape(h.shape) @ w[layer, 3]
        txt = txt + txt_out.reshape(txt.shape)
    return req.gather(h), txt


def _model_rank(rank, world_size, names):
    results = {}
    for name in names:  # several models per spawn: starting ranks costs more than running them
        x, txt, w, tables = _model_inputs(name)
        params = [x, txt, w] + [t for t, geom in zip(tables, MODELS[name][2]) if isinstance(geom, Neighborhood)]
        for p in params:
            p.requires_grad_(True)
        runtime = winsp.WindowRuntime(MODELS[name][2], group=winsp.comm.SPGroup.world())
        out, txt_out = _model_forward(runtime, name, x, txt, w, tables)
        (out.square().sum() + txt_out.square().sum()).backward()
        winsp.sync_gradients(params, runtime)
        plan = runtime.plans(MODELS[name][0])[0]
        with torch.no_grad():  # inference overlaps the halo exchange with the interior tiles: same numbers
            inferred = [_model_forward(runtime, name, x, txt, w, tables, fused) for fused in (False, True)]
        results[name] = (out.detach(), txt_out.detach(), [p.grad.clone() for p in params], plan.rank_rows,
                         inferred)
    return results


def _one_rank(name):
    x, txt, w, tables = _model_inputs(name)
    params = [x, txt, w] + [t for t, geom in zip(tables, MODELS[name][2]) if isinstance(geom, Neighborhood)]
    for p in params:
        p.requires_grad_(True)
    out, txt_out = _model_forward(winsp.WindowRuntime(MODELS[name][2]), name, x, txt, w, tables)
    (out.square().sum() + txt_out.square().sum()).backward()
    return out.detach(), txt_out.detach(), [p.grad for p in params]


def test_the_model_at_one_rank_equals_the_oracle_layers():
    """The one-rank reference of the multi-rank test is itself exact: its first layer against the dense oracle."""
    grids, text_lengths, schedule = MODELS["video"]
    x, txt, w, tables = _model_inputs("video")
    shape = (-1, HEADS, HEAD_DIM)
    q, k, v = (torch.tanh(x @ w[0, j]).view(shape) for j in range(3))
    qt, kt, vt = (torch.tanh(txt @ w[0, j]).view(shape) for j in range(3))
    req = winsp.WindowRuntime(schedule).request(grids, text_lengths)
    mod = neighborhood_rpb_score_mod(tables[0], halo_tensors(req, 0), schedule[0])
    out, txt_out = req.attention(*(req.scatter(t) for t in (q, k, v)), qt, kt, vt, layer=0, score_mod=mod)
    out = req.gather(out)
    ref, ref_txt = oracle_attention(q, k, v, grids, schedule[0], qt, kt, vt, text_lengths, table=tables[0])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(txt_out, ref_txt, rtol=1e-12, atol=1e-12)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, names", [
    (2, ("packed",)), (3, ("video", "tiny")), pytest.param(4, ("packed", "tiny"), marks=pytest.mark.slow),
    pytest.param(4, ("video",), marks=pytest.mark.slow), pytest.param(2, ("video",), marks=pytest.mark.slow),
])
def test_neighborhood_model_on_ranks_equals_one_rank(world_size, names):
    results = run_ranks(_model_rank, world_size, names, timeout=240)
    for name in names:
        ref_out, ref_txt, ref_grads = _one_rank(name)
        for by_name in results:
            out, txt_out, grads, rows, inferred = by_name[name]
            torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(txt_out, ref_txt, rtol=1e-12, atol=1e-12)
            for inferred_out, inferred_txt in inferred:  # separate and fused k / v
                torch.testing.assert_close(inferred_out, ref_out, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(inferred_txt, ref_txt, rtol=1e-12, atol=1e-12)
            assert len(grads) == len(ref_grads)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)
        if name == "tiny":
            assert min(results[0][name][3]) <= 1  # a rank holds (almost) nothing


def test_halo_bytes_targets():
    """benchmarks/bench_neighborhood.py's table: at most 0.25 of Ulysses' bytes at 4K P = 8 with a 3D kernel of 7,
    and never more than Ulysses anywhere in the table."""
    from benchmarks.bench_neighborhood import table

    _, ratios = table()
    assert len(ratios) == 3 * 3 * 4 * 3
    assert ratios[("4K x21", 3, 7, 8)] <= 0.25
    assert max(ratios.values()) <= 1.0


def test_fused_kv_view_is_k_and_v_of_one_projection():
    """Inference gathers k and v of a fused qkv projection in one go: the view must be exactly (k, v), and only
    for slices of one buffer at a positive offset, never when autograd records."""
    from winsp.attention.halo.layer import _fused_kv

    qkv = torch.randn(7, 3 * HEADS * HEAD_DIM)
    q, k, v = qkv.view(-1, 3, HEADS, HEAD_DIM).unbind(1)
    kv = _fused_kv(k, v)
    assert kv is not None and kv.data_ptr() == k.data_ptr()
    assert torch.equal(kv, torch.stack([k, v], dim=1))
    assert _fused_kv(v, k) is None  # v before k in the buffer: no positive step
    assert _fused_kv(k.clone(), v.clone()) is None  # two buffers
    assert _fused_kv(k[:, :1], v[:, :1]) is not None
    assert _fused_kv(k, v[:, :, :2]) is None  # shapes differ
    assert _fused_kv(k, v.double()) is None
    trained = qkv.clone().requires_grad_(True)
    _, k2, v2 = trained.view(-1, 3, HEADS, HEAD_DIM).unbind(1)
    assert _fused_kv(k2, v2) is None
    with torch.no_grad():
        assert _fused_kv(k2, v2) is not None


def test_start_all_to_all_single_checks_its_out_buffer():
    group = winsp.comm.SPGroup()
    rows = torch.randn(3, 2)
    buffer = torch.zeros(5, 2)
    assert torch.equal(group.start_all_to_all_single(rows, [3], [3], out=buffer[2:]).wait(), rows)
    assert torch.equal(buffer[2:], rows)
    with pytest.raises(ValueError, match=r"shape \[3, 2\]"):
        group.start_all_to_all_single(rows, [3], [3], out=buffer[1:])
    with pytest.raises(ValueError, match="not contiguous"):
        group.start_all_to_all_single(rows, [3], [3], out=torch.zeros(2, 3).t())


@pytest.mark.parametrize("lengths", [(4, 2), (0, 3), (3, 0, 1), (0,), (5,)])
def test_text_index_from_the_request_equals_the_one_from_the_rows(lengths):
    """The runtime builds each sample's padded text index from its Python lengths (no data-dependent size under
    torch.compile); it must equal the index computed from the text rows' samples."""
    from winsp.attention.halo.layer import _text_index, _text_index_of, _text_samples

    grids = [(1, 3, 3)] * len(lengths)
    req = winsp.WindowRuntime([Neighborhood((1, 3, 3))]).request(grids, list(lengths))
    index, valid = _text_index_of(req)
    ref_index, ref_valid = _text_index(_text_samples(req), len(lengths))
    assert torch.equal(valid, ref_valid) and torch.equal(index[valid], ref_index[ref_valid])
    assert index.shape == ref_index.shape == (len(lengths), max(1, *lengths))
    for b, n in enumerate(lengths):  # sample b's j-th text row is row sum(lengths[:b]) + j of the packed text
        assert valid[b].tolist() == [j < n for j in range(index.shape[1])]
        assert index[b, :n].tolist() == [sum(lengths[:b]) + j for j in range(n)]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_tiled_path_compiles_with_text_and_bias(backend):
    """torch.compile traces a neighborhood layer (tiled path, text rows, rpb score_mod; the plan and halo lookups run
    eagerly, as for window layers) and gives the eager numbers, forward and backward: ``aot_eager`` (what inductor
    is handed) by default, inductor itself under ``-m slow`` (about 30 s of compiling here)."""
    geom = Neighborhood((3, 3, 3), dilation=(1, 2, 1))
    grids, lengths = [(3, 6, 7), (3, 6, 3)], [2, 3]
    req = winsp.WindowRuntime([geom]).request(grids, lengths, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n = sum(math.prod(grid) for grid in grids)
    q, k, v = (req.scatter(torch.randn(n, HEADS, HEAD_DIM, dtype=torch.float64, generator=g)) for _ in range(3))
    t = torch.randn(sum(lengths), HEADS, HEAD_DIM, dtype=torch.float64, generator=g)
    table = torch.randn(HEADS, 5, 5, 5, dtype=torch.float64, generator=g)
    mod = neighborhood_rpb_score_mod(table, halo_tensors(req, 0), geom)

    def layer(q, k, v, t):
        out, txt = req.attention(q, k, v, t, t, t, layer=0, score_mod=mod)
        return out.square().sum() + txt.square().sum()

    inputs = [x.clone().requires_grad_(True) for x in (q, k, v, t)]
    ref = layer(*inputs)
    ref_grads = torch.autograd.grad(ref, inputs)
    compiled = torch.compile(layer, backend=backend)
    got = compiled(*inputs)
    grads = torch.autograd.grad(got, inputs)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_query_tiles_put_the_longer_tiles_where_they_cost_fewer_pairs():
    """A tile's key reach is clamped at the grid's border: a box ending at the far border takes its longer tiles
    there, so the two halves of a cut grid pay the same padded pairs (longer-first would cost the second 2 % more)."""
    from winsp.geometry.neighborhood import axis_reach
    from winsp.planning.halo import _axis_tiles

    def pairs(tiles):
        return sum((hi - lo) * axis_reach(32, 7, 1, False, lo, hi).size for lo, hi in tiles)

    first, second = _axis_tiles(32, 7, 1, False, slice(0, 16)), _axis_tiles(32, 7, 1, False, slice(16, 32))
    assert first == [(0, 6), (6, 11), (11, 16)] and second == [(16, 21), (21, 26), (26, 32)]
    assert pairs(first) == pairs(second) == 164
    assert pairs([(16, 22), (22, 27), (27, 32)]) == 167  # the longer-first cut it replaces
    for n, k, d, box in [(32, 7, 1, slice(0, 32)), (20, 3, 2, slice(3, 17)), (9, 3, 1, slice(0, 9))]:
        tiles = _axis_tiles(n, k, d, False, box)
        assert tiles[0][0] == box.start and tiles[-1][1] == box.stop
        assert all(a[1] == b[0] for a, b in pairwise(tiles)) and max(hi - lo for lo, hi in tiles) <= k * d
