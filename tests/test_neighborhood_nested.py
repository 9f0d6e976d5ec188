"""Nested cuts of strided neighbourhood layers (winsp.planning.halo_cuts): boxes that tile the grid, balanced work,
the bytes they save on HunyuanVideo 1.5's sliding tile layer, and the exact runs that use them.

The outputs and gradients of ranks on nested plans are checked by tests/test_neighborhood_stride.py (every rank on
every backend against natten at SP 1..4; spawned ranks against one rank, float64 with gradients, at SP 2..4): the
cases below pin that those runs do plan nested cuts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import winsp
from winsp.geometry.neighborhood import is_neighborhood
from winsp.planning.costs import DEFAULT_COSTS, PCIE_COSTS
from winsp.planning.halo import NeighborhoodBlocks, block_halo_rows, block_work, choose_blocks, neighborhood_plan
from winsp.planning.halo_cuts import NestedBlocks, nested_blocks
from winsp.planning.schedule import plan_schedule


def _cover(grid, boxes) -> np.ndarray:
    seen = np.zeros(grid, np.int64)
    for (t0, t1), (h0, h1), (w0, w1) in boxes:
        seen[t0:t1, h0:h1, w0:w1] += 1
    return seen


@pytest.mark.parametrize("p", [2, 3, 5, 6, 7, 8])
def test_nested_boxes_tile_the_grid_once_with_balanced_work(p):
    from benchmarks.bench_strided import GRID, sta_layer

    geom = sta_layer()
    nested = nested_blocks([GRID], [geom], p, PCIE_COSTS)
    assert isinstance(nested, NestedBlocks) and len(nested.rank_boxes(GRID)) == p
    assert (_cover(GRID, nested.rank_boxes(GRID)) == 1).all()
    work = np.asarray(block_work(GRID, nested, geom), np.float64)
    assert work.max() <= 1.05 * work.mean() * (1 + 1e-12)
    assert sum(o for o, _ in block_halo_rows(GRID, nested, geom)) == math.prod(GRID)


def test_an_unplanned_grid_is_refused_naming_it():
    geom = winsp.Neighborhood.sliding_tile((2, 2, 2), (1, 3, 3))
    nested = nested_blocks([(4, 8, 12)], [geom], 3)
    with pytest.raises(ValueError, match=r"grid \(4, 8, 14\) has no nested cut.*\(4, 8, 12\)"):
        nested.slices((4, 8, 14))


def test_a_grid_too_small_for_the_ranks_has_no_nested_cut():
    assert nested_blocks([(1, 1, 5)], [winsp.Neighborhood((4,), stride=(2,))], 8) is None


def test_hunyuanvideo_sta_bytes_with_nested_cuts():
    """HunyuanVideo 1.5 at 720p x 121 frames, STA (6, 8, 8) x 3: PCIe costs plan halos below Ulysses' bytes at
    P = 2, 4 and 8, at most 1.05 of the mean work; NVLink costs (the default) buy balance first and at P = 8 plan the
    nested cut of 1.044x, down from the product cut's 1.143x (a halo row weighs 3 % of a row's work there)."""
    from benchmarks.bench_strided import GRID, layer_figures, sta_layer

    geom = sta_layer()
    pcie = {p: layer_figures(GRID, geom, p, PCIE_COSTS) for p in (2, 4, 8)}
    assert all(f["ratio"] < 1 and f["work"] <= 1.05 + 1e-12 for f in pcie.values()), pcie
    assert pcie[8]["ratio"] == pytest.approx(0.789, abs=1e-3) and pcie[8]["cut"].startswith("nested")
    nvlink = layer_figures(GRID, geom, 8, DEFAULT_COSTS)
    assert nvlink["cut"].startswith("nested") and nvlink["ratio"] == pytest.approx(1.044, abs=1e-3)
    product = NeighborhoodBlocks((1, 1, 8), (1, 1, 1), (geom,))
    assert sum(h for _, h in block_halo_rows(GRID, product, geom)) > 1.09 * nvlink["halo"]


def test_the_runtime_costs_reach_the_neighborhood_plan():
    from benchmarks.bench_strided import GRID, sta_layer

    geom = sta_layer()
    plans = {c: plan_schedule([GRID], [geom], 8, costs=c)[0] for c in (DEFAULT_COSTS, PCIE_COSTS)}
    for costs, plan in plans.items():
        assert plan.key == neighborhood_plan([GRID], [geom], 8, costs).key
    assert plans[DEFAULT_COSTS].key != plans[PCIE_COSTS].key


def test_the_exactness_tests_run_nested_plans():
    """tests/test_neighborhood_stride.py checks these plans' outputs and gradients: they must stay nested cuts."""
    from tests.test_neighborhood_stride import CASES, MODELS

    grids, _, schedule = MODELS["sta"]
    geoms = list({g.fingerprint: g for g in schedule if is_neighborhood(g)}.values())
    for p in (2, 3, 4):
        assert isinstance(choose_blocks(grids, geoms, p), NestedBlocks), p
    grids, _, geom = CASES["2d-packed-sta"]  # two samples of different grids
    for p in (3, 4):
        blocks = choose_blocks(grids, [geom], p)
        assert isinstance(blocks, NestedBlocks)
        for grid in grids:
            assert (_cover(grid, blocks.rank_boxes(grid)) == 1).all()


def test_unstrided_layers_keep_product_cuts():
    geom = winsp.Neighborhood((3, 7, 7))
    for p in (2, 3, 4, 8):
        assert isinstance(choose_blocks([(9, 32, 48)], [geom], p), NeighborhoodBlocks)
