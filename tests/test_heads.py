"""The ``"heads"`` planner: head parallelism (Ulysses) expressed with split windows, exact against one rank.

Every window's rows are cut into ``P`` runs, so every rank computes about ``H / P`` of each window's heads. The tiny
SeedVR2 DiT has 3 heads: SP = 2 gives uneven heads (2 + 1), SP = 4 more ranks than heads (a rank computes no head
of some windows, yet still holds rows). The toy cases with gradients are in test_split.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import winsp
from tests.test_gradients import SHAPES, _train
from winsp.attention.split import SplitAttention
from winsp.geometry.layout import build_layout
from winsp.planning.balance import heads_placement
from winsp.testing import run_ranks

SEEDVR2 = [winsp.make_geometry(m, (4, 3, 3)) for m in ("regular", "shifted")]


@pytest.mark.parametrize("grid, p", [((3, 16, 24), 2), ((1, 45, 80), 3), ((6, 30, 53), 8), ((1, 2, 3), 8)])
def test_every_window_is_shared_by_all_ranks_in_equal_runs(grid, p):
    for plan in winsp.planning.plan_schedule([grid], SEEDVR2, p, "heads"):
        counts = plan.layout.token_counts
        holders = plan.window_holders
        for w, count in enumerate(counts):
            pieces = holders.get(w, ((int(plan.window_owner[w]), 0, int(count)),))
            assert len(pieces) == min(p, count), (w, pieces)
            sizes = [b - a for _, a, b in pieces]
            assert max(sizes) - min(sizes) <= 1
            assert len({r for r, _, _ in pieces}) == len(pieces)
        if counts.min() >= p:
            assert plan.row_imbalance <= 1 + counts.size / plan.layout.num_tokens * p


def test_uneven_heads_rotate_over_the_windows():
    """20 heads on 8 ranks: each window gives four ranks 3 heads and four 2; the rotation evens it out over windows."""
    lay = build_layout([(6, 30, 53)], SEEDVR2[0])  # 480p x 21 frames: 12 windows
    plan = winsp.planning.Plan(lay, 8, rank_pieces=heads_placement(lay, 8))
    heads = np.zeros(8)
    for rank in range(8):
        split = SplitAttention.build(plan, rank, 20, (58,))
        heads[rank] = sum(h for *_, h in split.windows)
    assert heads.sum() == 20 * lay.num_windows
    assert heads.max() - heads.min() <= 1, heads  # without the rotation: 36 against 24


def test_heads_is_refused_for_models_with_score_mods():
    with pytest.raises(ValueError, match='"heads" splits windows'):
        winsp.planning.plan_schedule([(1, 6, 6)], SEEDVR2, 2, "heads", split_windows=False)


def _rank_main(rank, world_size):
    return _train(world_size, "heads")


@pytest.fixture(scope="module")
def one_rank():
    return _train(1)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow),
                                        pytest.param(3, marks=pytest.mark.slow)])
def test_dit_under_heads_equals_one_rank_with_gradients(world_size, one_rank):
    """The tiny SeedVR2 DiT (3 heads) in float64, train mode: output, vid / txt and every parameter gradient."""
    for rank, r in enumerate(run_ranks(_rank_main, world_size, timeout=300)):
        assert r["split"], rank
        for key in ("out", "vid", "txt"):
            err = (r[key] - one_rank[key]).abs().max().item()
            assert err <= 1e-9 * max(1.0, one_rank[key].abs().max().item()), (rank, key, err)
        assert set(r["params"]) == set(one_rank["params"])
        for name, want in one_rank["params"].items():
            err = (r["params"][name] - want).abs().max().item()
            assert err <= 1e-9 * max(1.0, want.abs().max().item()), (rank, name, err)


def test_shapes_give_every_rank_rows_at_sp4():
    grids = [(t, h // 2, w // 2) for t, h, w in SHAPES]
    for plan in winsp.planning.plan_schedule(grids, SEEDVR2, 4, "heads"):
        assert min(plan.rank_rows) > 0
