"""The neighborhood backends: ``flex`` (FlexAttention under a block mask) and ``natten`` (NATTEN on extended boxes)
against the tiled path and natten itself, their selection and their errors.

On this CPU machine flex runs eagerly and forward only, and natten is pure Python (its FlexAttention path, float32
forward): both are checked in that form, at SP = 1..3. libnatten's own CUDA kernels are never run here; the
extended-box logic they would run on is, through natten's own Python path.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import winsp
import winsp.planning.halo as halo_module
from tests.na_checks import natten_whole_grid
from tests.na_oracle import _axis_keys
from winsp.attention.halo.backends import explain_neighborhood_backend, neighborhood_backend
from winsp.attention.halo.flex import build_flex_neighborhood
from winsp.attention.halo.layer import _text_index, _video_queries, halo_tensors, neighborhood_rpb_score_mod
from winsp.attention.halo.natten import box_is_exact, natten_boxes, natten_plan_reason, natten_video_queries
from winsp.geometry.neighborhood import Neighborhood
from winsp.planning.halo import HaloExchange, choose_splits, neighborhood_plan
from winsp.testing import run_ranks

natten = pytest.importorskip("natten", reason="natten (the neighborhood attention oracle) is not installed: "
                                              "pip install -e '.[natten]'")

HEADS, DIM = 2, 8  # natten's CPU (flex) path wants a head dim that is a power of two >= 8
SCALE = DIM ** -0.5

# name: (grids, text lengths, geometry); natten's dims follow from the kernel's axes > 1
CASES = {
    "1d-dilated": ([(1, 1, 23)], [3], Neighborhood((5,), (3,))),
    "2d-causal-dilated": ([(1, 9, 13)], [2], Neighborhood((4, 3), (2, 3), (False, True))),
    "3d-causal-time": ([(6, 8, 7)], [3], Neighborhood((3, 4, 3), (2, 2, 2), (True, False, False))),
    "2d-packed": ([(3, 7, 10), (1, 3, 4)], [4, 2], Neighborhood((1, 3, 3))),
    # at 3 ranks a block of 3 with dilation 4 has a ragged halo: natten is refused there, on every rank alike
    "1d-ragged": ([(1, 1, 10)], [2], Neighborhood((2,), (4,))),
}



def _even_columns_or_self(halo):
    """A mask_mod on key coordinates: keys in even columns, and the query's own row."""
    return lambda h, q, k: (halo.key_coords[k][..., 2] % 2 == 0) | (k == q)

def _inputs(name, dtype=torch.float32, seed=0):
    grids, text_lengths, _ = CASES[name]
    g = torch.Generator().manual_seed(seed)
    n, t = sum(math.prod(grid) for grid in grids), sum(text_lengths)
    return [torch.randn(rows, HEADS, DIM, generator=g, dtype=dtype) for rows in (n, n, n, t, t, t)]


def _table(geom, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS, *(2 * k - 1 for k in geom.kernel), generator=g, dtype=dtype)


def _layer(runtime, name, inputs, rpb=False):
    grids, text_lengths, geom = CASES[name]
    req = runtime.request(grids, text_lengths)
    q, k, v = (req.scatter(x) for x in inputs[:3])
    mod = neighborhood_rpb_score_mod(_table(geom, dtype=q.dtype), halo_tensors(req, 0), geom) if rpb else None
    out, txt = req.attention(q, k, v, *inputs[3:], layer=0, score_mod=mod)
    return req.gather(out), txt


def _natten_global(name, inputs):
    """natten over each sample's whole grid, text as additional keys: the oracle of every backend here."""
    grids, text_lengths, geom = CASES[name]
    return natten_whole_grid(inputs, grids, text_lengths, geom)


# ---- one rank ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_one_rank_flex_and_natten_equal_natten_and_the_tiled_path(name):
    inputs = _inputs(name)
    expected = _natten_global(name, inputs)
    schedule = [CASES[name][2]]
    with torch.no_grad():
        tiled, tiled_txt = _layer(winsp.WindowRuntime(schedule, neighborhood_backend="tiled"), name, inputs)
        torch.testing.assert_close(tiled, expected, rtol=1e-5, atol=1e-5)
        for backend in ("flex", "natten"):
            out, txt = _layer(winsp.WindowRuntime(schedule, neighborhood_backend=backend), name, inputs)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(txt, tiled_txt, rtol=0, atol=0)  # text queries stay on the tiled code


def test_flex_equals_the_tiled_path_in_float64_with_score_and_mask_mods():
    name = "3d-causal-time"
    grids, text_lengths, geom = CASES[name]
    inputs = _inputs(name, torch.float64)
    outs = {}
    for backend in ("tiled", "flex"):
        req = winsp.WindowRuntime([geom], neighborhood_backend=backend).request(grids, text_lengths)
        halo = halo_tensors(req, 0)
        rpb = neighborhood_rpb_score_mod(_table(geom, dtype=torch.float64), halo, geom)
        # a mask_mod on key coordinates: drop keys in odd columns except the query's own
        mask = _even_columns_or_self(halo)
        with torch.no_grad():
            out, _ = req.attention(*(req.scatter(x) for x in inputs[:3]), *inputs[3:], layer=0, score_mod=rpb,
                                   mask_mod=mask)
        outs[backend] = req.gather(out)
    torch.testing.assert_close(outs["flex"], outs["tiled"], rtol=1e-12, atol=1e-12)


def test_compiled_flex_lowers_the_mask_and_the_bias_on_a_rank_with_halos(monkeypatch):
    """Compiled FlexAttention (inductor, as on CUDA; here its CPU kernel) under the block mask with the rpb score_mod,
    at rank 1 of 2 (local and halo key rows), against the tiled path (one compile: it is the slow part)."""
    from torch.nn.attention.flex_attention import flex_attention

    import winsp.attention.halo.flex as halo_flex
    from winsp.attention.halo.flex import flex_video_queries
    from winsp.attention.score_mods import ScoreMods

    monkeypatch.setattr(halo_flex, "_kernel", lambda device: torch.compile(flex_attention, dynamic=False))
    grids, geom = [(4, 10, 12)], Neighborhood((2, 3, 3), (1, 2, 1), (True, False, False))
    plan = neighborhood_plan(grids, [geom], 2)
    halo = HaloExchange(plan, 1, geom).to("cpu")
    assert halo.num_keys > halo.num_rows
    txt_sample = torch.zeros(3, dtype=torch.int64)
    data = build_flex_neighborhood(halo, geom, plan.layout.grids, txt_sample, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(rows, HEADS, 16, generator=g) for rows in (halo.num_rows, halo.num_keys, halo.num_keys))
    txt = (torch.randn(3, HEADS, 16, generator=g), torch.randn(3, HEADS, 16, generator=g), _text_index(txt_sample, 1))
    rpb = ScoreMods(neighborhood_rpb_score_mod(_table(geom), halo, geom))
    torch.testing.assert_close(flex_video_queries(data, q, k, v, txt, 0.25, rpb),
                               _video_queries(q, k, v, txt, halo, 0.25, rpb), rtol=1e-5, atol=1e-5)


# ---- SP = 2, 3 ------------------------------------------------------------------------------------------------

def _backends_rank(rank, world_size, names):
    results = {}
    group = winsp.comm.SPGroup.world()
    for name in names:
        inputs = _inputs(name)
        geom = CASES[name][2]
        got = {}
        with torch.no_grad():
            for backend in ("tiled", "flex", "natten"):
                runtime = winsp.WindowRuntime([geom], group=group, neighborhood_backend=backend)
                try:
                    got[backend] = _layer(runtime, name, inputs)[0]
                except ValueError as error:  # natten where some rank's extended box is not exact
                    got[backend] = str(error)
            for backend in ("tiled", "flex"):
                runtime = winsp.WindowRuntime([geom], group=group, neighborhood_backend=backend)
                got[backend + "+rpb"] = _layer(runtime, name, inputs, rpb=True)[0]
            got["plan"] = winsp.WindowRuntime([geom], group=group).plans(CASES[name][0])[0].rank_rows
        got["grads"] = [_dispatch_grads(name, group, forced) for forced in (False, True)]
        results[name] = got
    return results


def _dispatch_grads(name, group, forced: bool):
    """Gradients through the runtime's default path, or (``forced``) through the dispatch point every other backend
    takes (the whole exchange, then a kernel: here the tiled one, which has a CPU backward), its reverse included."""
    import winsp.attention.halo.backends as halo_backends

    inputs = [x.requires_grad_(True) for x in _inputs(name, torch.float64)]
    runner = halo_backends.neighborhood_runner
    if forced:
        halo_backends.neighborhood_runner = lambda *args: _video_queries
    try:
        out, txt = _layer(winsp.WindowRuntime([CASES[name][2]], group=group), name, inputs)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        return torch.autograd.grad((out * weights).sum() + txt.square().sum(), inputs)
    finally:
        halo_backends.neighborhood_runner = runner


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, names", [
    (2, ("1d-dilated", "2d-packed")),  # grids that do not divide; two samples of different grids
    pytest.param(3, ("3d-causal-time", "1d-ragged"), marks=pytest.mark.slow),  # rank 0's causal box padded; a ragged halo
])
def test_flex_and_natten_on_ranks_equal_natten(world_size, names):
    results = run_ranks(_backends_rank, world_size, names, timeout=240)
    natten_ran = natten_refused = 0
    for name in names:
        expected = _natten_global(name, _inputs(name))
        for got in results:
            got = got[name]
            torch.testing.assert_close(got["tiled"], expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["flex"], expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["flex+rpb"], got["tiled+rpb"], rtol=1e-5, atol=1e-5)
            for g_forced, g_default in zip(*got["grads"]):
                torch.testing.assert_close(g_forced, g_default, rtol=1e-12, atol=1e-12)
            if isinstance(got["natten"], str):
                assert "cannot run" in got["natten"] and "rank" in got["natten"], got["natten"]
                natten_refused += 1
            else:
                torch.testing.assert_close(got["natten"], expected, rtol=1e-5, atol=1e-5)
                natten_ran += 1
    assert natten_ran >= world_size  # the extended boxes really ran (a refusal everywhere would prove nothing)
    assert natten_refused == (world_size if "1d-ragged" in names else 0)  # refused on every rank alike


# ---- the extended box -----------------------------------------------------------------------------------------

def test_box_is_exact_follows_the_rules():
    """Against the oracle's neighbourhood sets: exact iff every block query keeps its neighbourhood in the box (and
    the box holds NATTEN's ``kernel * dilation``)."""
    rng = random.Random(0)
    seen = {True: 0, False: 0}
    for _ in range(400):
        k, d = rng.randint(1, 5), rng.randint(1, 3)
        n = rng.randint(k * d, 24)
        causal = rng.random() < 0.4
        lo = rng.randrange(n)
        hi = rng.randint(lo + 1, n)
        a, b = rng.randint(0, lo), rng.randint(hi, n + (k * d if causal else 0))  # a causal box may be padded
        expect = b - a >= k * d and all(
            {p + a for p in _axis_keys(b - a, k, d, causal, i - a)} == _axis_keys(n, k, d, causal, i)
            for i in range(lo, hi))
        assert box_is_exact(n, k, d, causal, lo, hi, a, b) == expect, (n, k, d, causal, lo, hi, a, b)
        seen[expect] += 1
    assert min(seen.values()) > 50


def test_a_causal_axis_is_padded_to_natten_s_minimum():
    """Causal time at rank 0 reaches only its own 2 frames, fewer than NATTEN's kernel x dilation (6): the box is padded
    after them (never attended), which is exact; a non-causal axis is never padded."""
    from winsp.attention.halo.natten import extended_box

    geom = CASES["3d-causal-time"][2]
    box, why = extended_box((6, 8, 7), geom, [(0, 2), (0, 8), (0, 7)])
    assert why is None and box == [(0, 0, 2, 6), (0, 0, 8, 8), (0, 0, 7, 7)]
    box, why = extended_box((6, 8, 7), geom, [(0, 1), (0, 8), (0, 7)])
    assert why is None and box[0] == (0, 0, 1, 6)
    # non-causal, one frame: it reaches frames 0, 2, 4 only (its dilation group), a ragged halo
    _, why = extended_box((6, 8, 7), Neighborhood((3, 4, 3), (2, 2, 2)), [(0, 1), (0, 8), (0, 7)])
    assert why is not None and "axis t" in why


def test_natten_on_an_inexact_box_really_differs():
    """The check matters: natten over a box it refuses gives other outputs than the whole grid's neighbourhoods."""
    n, k, d = 12, 3, 2
    lo, hi, a, b = 2, 4, 1, 7  # position 2 keeps 0, 2, 4 in the axis, but in the box [1, 7) it gets 2, 4, 6
    assert not box_is_exact(n, k, d, False, lo, hi, a, b)
    g = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(1, n, HEADS, DIM, generator=g) for _ in range(3))
    whole = natten.na1d(q, kk, v, kernel_size=k, dilation=d)
    boxed = natten.na1d(*(x[:, a:b].contiguous() for x in (q, kk, v)), kernel_size=k, dilation=d)
    assert not torch.allclose(boxed[:, lo - a:hi - a], whole[:, lo:hi], rtol=1e-3, atol=1e-3)
    assert box_is_exact(n, k, d, False, lo, hi, 0, n)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_natten_boxes_equal_the_tiled_path_per_rank(world_size):
    """Every rank's extended boxes (built from its HaloExchange, no process group needed) against its tiled output."""
    ran = 0
    for name in sorted(CASES):
        grids, text_lengths, geom = CASES[name]
        plan = neighborhood_plan(grids, [geom], world_size)
        reason = natten_plan_reason(plan, geom)
        inputs = _inputs(name)
        txt_sample = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor(text_lengths))
        txt = (inputs[4], inputs[5], _text_index(txt_sample, len(grids)))
        for rank in range(world_size):
            halo = HaloExchange(plan, rank, geom).to("cpu")
            boxes, why = natten_boxes(halo, geom, plan.layout.grids, text_lengths, "cpu")
            assert (why is None) or (reason is not None)  # a rank that fails makes the plan fail
            if boxes is None:
                continue
            rows = torch.from_numpy(_key_ids(plan, halo))
            q, k_all, v_all = inputs[0][rows[:halo.num_rows]], inputs[1][rows], inputs[2][rows]
            torch.testing.assert_close(natten_video_queries(boxes, q, k_all, v_all, txt, SCALE),
                                       _video_queries(q, k_all, v_all, txt, halo, SCALE, None), rtol=1e-5, atol=1e-5)
            ran += halo.num_keys > halo.num_rows
    assert ran >= world_size  # boxes with real halos ran


def _key_ids(plan, halo) -> np.ndarray:
    """Canonical packed rows of a rank's key rows (local, then halo)."""
    lay = plan.layout
    coords, sample = halo.key_coords.numpy(), halo.key_sample.numpy()
    grids = np.asarray(lay.grids)[sample]
    return lay.sample_offsets[sample] + (coords[:, 0] * grids[:, 1] + coords[:, 1]) * grids[:, 2] + coords[:, 2]


def test_a_ragged_dilated_halo_is_refused_naming_the_rank_and_axis():
    geom = Neighborhood((3,), (4,))
    plan = neighborhood_plan([(1, 1, 14)], [geom], 4)
    reason = natten_plan_reason(plan, geom)
    assert reason is not None and "rank" in reason and "axis w" in reason
    assert natten_plan_reason(neighborhood_plan([(1, 1, 14)], [geom], 1), geom) is None
    with pytest.raises(ValueError, match="kernel is 1 on every axis"):
        req = winsp.WindowRuntime([Neighborhood(1)], neighborhood_backend="natten").request([(1, 2, 3)])
        x = req.scatter(torch.zeros(6, HEADS, DIM))
        req.attention(x, x, x, layer=0)


def test_a_rank_that_holds_nothing_gets_empty_outputs_from_every_backend():
    from winsp.attention.halo.flex import flex_video_queries

    geom = Neighborhood((3,))
    plan = neighborhood_plan([(1, 1, 3)], [geom], 4)
    assert plan.rank_rows == (1, 1, 1, 0) and natten_plan_reason(plan, geom) is None
    halo = HaloExchange(plan, 3, geom).to("cpu")
    txt_sample = torch.zeros(2, dtype=torch.int64)
    data = build_flex_neighborhood(halo, geom, plan.layout.grids, txt_sample, torch.device("cpu"))
    boxes, why = natten_boxes(halo, geom, plan.layout.grids, (2,), "cpu")
    q = torch.zeros(0, HEADS, DIM)
    txt = (torch.randn(2, HEADS, DIM), torch.randn(2, HEADS, DIM), _text_index(txt_sample, 1))
    assert why is None and boxes.groups == ()
    assert flex_video_queries(data, q, q, q, txt, SCALE, None).shape == (0, HEADS, DIM)
    assert natten_video_queries(boxes, q, q, q, txt, SCALE).shape == (0, HEADS, DIM)


# ---- the block mask -------------------------------------------------------------------------------------------

def test_flex_block_lists_cover_every_allowed_pair(monkeypatch):
    """Eager flex reads only the mask_mod, so the block lists (what the CUDA kernel skips by) are checked here
    against the dense mask, on a grid large enough for many 128-row blocks, at a rank with halos."""
    from torch.nn.attention.flex_attention import create_mask

    grids, text_lengths = [(4, 32, 32), (3, 10, 9)], [5, 3]
    geom = Neighborhood((2, 3, 3), dilation=(1, 2, 1), causal=(True, False, False))
    # the fastest cut, along h (rows in contiguous runs): within TIME_TOLERANCE the planner takes the cut along w
    # (fewer halo rows), whose blocks at this small grid leave more than half the 128 x 128 tiles occupied
    monkeypatch.setattr(halo_module, "TIME_TOLERANCE", 0.0)
    assert choose_splits(grids, [geom], 2) == (1, 2, 1)
    plan = neighborhood_plan(grids, [geom], 2)
    txt_sample = torch.repeat_interleave(torch.arange(2), torch.tensor(text_lengths))
    for rank in range(2):
        halo = HaloExchange(plan, rank, geom).to("cpu")
        data = build_flex_neighborhood(halo, geom, plan.layout.grids, txt_sample, torch.device("cpu"))
        q_len, kv_len = halo.num_rows, halo.num_keys + txt_sample.numel()
        dense = create_mask(data.block_mask.mask_mod, 1, 1, q_len, kv_len, device="cpu")[0, 0]
        # the mask_mod is the neighbourhood: against the tiles' masks, in the kernel's row orders
        want = torch.zeros(halo.num_rows, halo.num_keys, dtype=torch.bool)
        for query, key, mask, _ in halo.tiles:
            want[query[:, :, None].expand_as(mask), key[:, None, :].expand_as(mask)] = mask
        got = torch.zeros_like(want)
        got[data.q_order[:, None], data.k_order[None, :]] = dense[:, :halo.num_keys]
        assert torch.equal(got, want)
        q_samples = halo.row_sample[data.q_order]
        assert torch.equal(dense[:, halo.num_keys:], q_samples[:, None] == txt_sample[None, :])
        pad = torch.zeros(-(-q_len // 128) * 128, -(-kv_len // 128) * 128, dtype=torch.bool)
        pad[:q_len, :kv_len] = dense
        occupied = pad.view(pad.shape[0] // 128, 128, -1, 128).any(3).any(1)
        listed = data.block_mask.to_dense()[0, 0].bool()
        assert not (occupied & ~listed).any()
        # and nearly tight (the tile orders keep blocks compact): what the kernel visits is mostly needed
        assert listed.sum() <= 1.25 * occupied.sum() and listed.sum() < listed.numel() / 2


# ---- selection and errors -------------------------------------------------------------------------------------

def test_auto_picks_tiled_on_cpu_and_says_why():
    grids, text_lengths, geom = CASES["3d-causal-time"]
    req = winsp.WindowRuntime([geom]).request(grids, text_lengths)
    assert neighborhood_backend(req, 0, torch.float32, head_dim=DIM) == "tiled"
    name, why = explain_neighborhood_backend("auto", "cpu", torch.float32, head_dim=DIM)
    assert name == "tiled" and "libnatten" in why[0] and "CPU" in why[1]


def test_auto_rules_on_cuda(monkeypatch):
    cuda = torch.device("cuda")  # resolution only: nothing runs
    assert explain_neighborhood_backend("auto", cuda, torch.bfloat16, head_dim=64)[0] == "flex"
    assert explain_neighborhood_backend("auto", cuda, torch.float64, head_dim=64)[0] == "tiled"
    monkeypatch.setattr(natten, "HAS_LIBNATTEN", True)
    assert explain_neighborhood_backend("auto", cuda, torch.float16, head_dim=64)[0] == "natten"
    assert explain_neighborhood_backend("auto", cuda, torch.float32, head_dim=64)[0] == "natten"
    name, why = explain_neighborhood_backend("auto", cuda, torch.float16, modded=True, head_dim=64)
    assert name == "flex" and "score_mod" in why[0]
    assert explain_neighborhood_backend("auto", cuda, torch.float16, head_dim=12)[0] == "flex"
    name, why = explain_neighborhood_backend("auto", cuda, torch.float16, head_dim=64,
                                             layer_reason=lambda: "rank 1, sample 0, axis w: ragged")
    assert name == "flex" and "ragged" in why[0]
    assert explain_neighborhood_backend("auto", "cpu", torch.float32, head_dim=64)[0] == "tiled"


def test_explicit_backends_refuse_what_they_cannot_do():
    grids, text_lengths, geom = CASES["2d-packed"]
    inputs = [x.requires_grad_(True) for x in _inputs("2d-packed")]
    with pytest.raises(ValueError, match=r"unknown neighborhood backend 'natten_cuda'; choose 'auto' or one of "
                                         r"\['natten', 'flex', 'tiled'\]"):
        winsp.WindowRuntime([geom], neighborhood_backend="natten_cuda")
    with pytest.raises(ValueError, match="unknown neighborhood backend 'FLEX'"):
        winsp.DiffusionParallelConfig(neighborhood_backend="FLEX")
    config = winsp.DiffusionParallelConfig(neighborhood_backend="flex")
    assert winsp.WindowRuntime.from_config(config, [geom]).neighborhood_backend == "flex"
    for backend, match in (("flex", "inference-only"), ("natten", "no backward on CPU")):
        req = winsp.WindowRuntime([geom], neighborhood_backend=backend).request(grids, text_lengths)
        with pytest.raises(ValueError, match=match):
            req.attention(*(req.scatter(x) for x in inputs[:3]), *inputs[3:], layer=0)
    req = winsp.WindowRuntime([geom], neighborhood_backend="natten").request(grids, text_lengths)
    halo = halo_tensors(req, 0)
    with torch.no_grad(), pytest.raises(ValueError, match="natten.*cannot run: NATTEN takes no score_mod"):
        req.attention(*(req.scatter(x) for x in inputs[:3]), *inputs[3:], layer=0,
                      score_mod=neighborhood_rpb_score_mod(_table(geom), halo, geom))
    req = winsp.WindowRuntime([geom], neighborhood_backend="natten").request(grids, text_lengths)
    with torch.no_grad(), pytest.raises(ValueError, match="float32 only here, got torch.float64"):
        x = [t.detach().double() for t in inputs]
        req.attention(*(req.scatter(t) for t in x[:3]), *x[3:], layer=0)
    # the tiled path (and "auto" on CPU) trains
    req = winsp.WindowRuntime([geom]).request(grids, text_lengths)
    out, _ = req.attention(*(req.scatter(x) for x in inputs[:3]), *inputs[3:], layer=0)
    out.sum().backward()
    assert inputs[0].grad is not None
