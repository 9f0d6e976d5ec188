"""The runtime's one store, and the request's view of it: prepared once per shape, LRU-bounded, positions for models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import winsp
from winsp.runtime.store import RuntimeStore

REG = winsp.make_geometry("regular", (4, 3, 3))
SHIFT = winsp.make_geometry("shifted", (4, 3, 3))


def test_store_is_an_lru_with_cache_info():
    store = RuntimeStore(2)
    built = []

    def make(v):
        return lambda: built.append(v) or v

    assert store.get("a", make(1)) == 1 and store.get("b", make(2)) == 2
    assert store.get("a", make(99)) == 1  # hit: a is now the most recent
    store.get("c", make(3))  # evicts b
    assert "b" not in store and "a" in store and built == [1, 2, 3]
    info = store.cache_info()
    assert (info.hits, info.misses, info.maxsize, info.currsize) == (1, 3, 2, 2)
    with pytest.raises(ValueError, match="maxsize"):
        RuntimeStore(0)


def test_requests_of_one_shape_share_everything_prepared():
    rt = winsp.WindowRuntime([REG, SHIFT, REG, SHIFT])
    a = rt.request([(5, 32, 56)], [4])
    misses = rt.cache_info().misses
    b = rt.request([(5, 32, 56)], [4])
    assert b.prepared is a.prepared and rt.cache_info().misses == misses
    assert a.plan(0) is a.plan(2) and a.plan(1) is a.plan(3) and a.plan(0) is not a.plan(1)
    # other text lengths: new segments, but the plans and the transitions are reused
    c = rt.request([(5, 32, 56)], [7])
    assert c.prepared is not a.prepared and c.plan(0) is a.plan(0)
    assert c.prepared.steps[(0, 1)] is a.prepared.steps[(0, 1)]


def test_the_store_bound_comes_from_the_config():
    rt = winsp.WindowRuntime.from_config(winsp.DiffusionParallelConfig(plan_cache_size=3), [REG, SHIFT])
    for w in range(8, 14):
        rt.request([(2, 8, w)], [2])
    assert rt.cache_info().currsize <= 3 and rt.cache_info().maxsize == 3


def test_two_runtimes_keep_separate_stores():
    one, two = winsp.WindowRuntime([REG, SHIFT]), winsp.WindowRuntime([REG, SHIFT])
    one.request([(5, 32, 56)], [4])
    assert two.cache_info().currsize == 0
    assert one.request([(5, 32, 56)], [4]).prepared is not two.request([(5, 32, 56)], [4]).prepared


def test_positions_of_local_rows():
    grids = [(3, 10, 14), (2, 6, 9)]
    rt = winsp.WindowRuntime([REG, SHIFT])
    req = rt.request(grids, [3, 2])
    canonical = torch.arange(sum(t * h * w for t, h, w in grids))
    x = req.scatter(canonical)
    for layer in (0, 1):
        x = req.to_layer(x, layer)
        assert torch.equal(req.token_ids, x)  # canonical ids of the local rows, without moving anything
        sample = req.row_sample
        coords = req.grid_coords
        offsets = torch.tensor([0, 3 * 10 * 14])
        hw = torch.tensor([[10, 14], [6, 9]])[sample]
        rebuilt = offsets[sample] + (coords[:, 0] * hw[:, 0] + coords[:, 1]) * hw[:, 1] + coords[:, 2]
        assert torch.equal(rebuilt, x)
        # window-local coordinates are grid coordinates minus the window's corner
        lay = req.plan(layer).layout
        windows = lay.window_of_position[lay.position_of_token[x.numpy()]]
        corner = torch.from_numpy(lay.window_start[windows])
        assert torch.equal(req.window_coords, coords - corner)
        assert torch.equal(req.window_shape, torch.from_numpy(lay.window_shape[windows]))
        assert bool((req.window_coords < req.window_shape).all())


def test_execution_path_names_the_backend_used():
    rt = winsp.WindowRuntime([winsp.FixedWindows((1, 4, 4))])
    rt.request([(2, 8, 8)], [3], dtype=torch.float32)
    assert rt.execution_path.endswith("batched SDPA")  # equal windows: one batched call
    rt.request([(2, 8, 6)], [3], dtype=torch.float32)
    assert rt.execution_path.endswith("grouped SDPA")  # ragged windows
    assert rt.request([(2, 8, 6)], [3]).execution_path.endswith("grouped SDPA")


def test_no_state_is_stashed_on_plans():
    rt = winsp.WindowRuntime([REG, SHIFT])
    req = rt.request([(5, 32, 56)], [4])
    x = req.scatter(torch.randn(5 * 32 * 56, 2))
    req.gather(req.to_layer(x, 1))
    plan = req.plan(0)
    assert not any(k.startswith("_") and not k.startswith("_rank") for k in vars(plan)), sorted(vars(plan))
    assert np.array_equal(plan.rank_token_ids(0), req.layout(0).token_ids.numpy())
