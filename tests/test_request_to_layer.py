"""``request.to_layer`` is never a silent no-op on a tensor whose layout it cannot know (issue 30, case 9).

Moving a second tensor with ``to_layer(t, i)`` after the rows were moved into layer i returned ``t`` unmoved, and
attention took the stale layout (wrong results at any SP degree). One rank suffices: the shifted windows order the
rows differently from the regular ones at two ranks (at one rank every layout holds every row in one order).
"""

from __future__ import annotations

import pytest
import torch

import winsp
from tests.test_runtime import REG, SHIFT
from winsp.testing import run_ranks


def _request(grid=(2, 8, 8), world_size=1):
    rt = winsp.WindowRuntime.from_config(winsp.DiffusionParallelConfig(ulysses_degree=world_size), [REG, SHIFT, SHIFT])
    req = rt.request([grid], [3])
    n = grid[0] * grid[1] * grid[2]
    a = torch.arange(float(n)).unsqueeze(1)
    b = -a
    return req, a, b, req.scatter(a), req.scatter(b)


def _second_tensor(rank, world_size):
    req, a, b, x, y = _request((5, 32, 56), world_size)
    req.to_layer(x, 1)
    try:
        req.to_layer(y, 1)
        refused = False
    except ValueError:
        refused = True
    stale_would_differ = not torch.equal(y, req.to_layer(y, 1, source=0)) or y.shape[0] != x.shape[0]
    return refused, stale_would_differ, bool(torch.equal(req.gather(req.to_layer(y, 1, source=0)), b))


@pytest.mark.multirank
def test_at_two_ranks_the_second_tensor_is_refused_and_source_moves_it_right():
    for refused, stale_would_differ, right in run_ranks(_second_tensor, 2, timeout=120):
        assert refused and right
        assert stale_would_differ  # the no-op it used to be would have left rows of the wrong windows


def test_a_second_tensor_into_the_same_layer_is_refused_asking_for_source():
    req, _, b, x, y = _request()
    req.to_layer(x, 1)
    with pytest.raises(ValueError, match=r"to_layer\(x, 1\): the rows were already moved .* source=0\)"):
        req.to_layer(y, 1)
    assert torch.equal(req.gather(req.to_layer(y, 1, source=0)), b)


def test_the_tensor_the_move_was_given_is_moved_the_same_way_and_its_result_kept():
    req, a, _, x, _ = _request()
    moved = req.to_layer(x, 1)
    assert req.to_layer(moved, 1) is moved
    again = req.to_layer(x, 1)  # its layout is known: the one the first call moved it from
    assert torch.equal(again, moved) and torch.equal(req.gather(again), a)


def test_the_next_layer_in_the_same_layout_takes_computed_rows_as_they_are():
    req, a, _, x, _ = _request()
    h = req.to_layer(x, 1) * 2  # computed from the moved rows
    assert req.to_layer(h, 2) is h  # layer 2 shares layer 1's layout: nothing to move, nothing refused
    assert torch.equal(req.gather(h), a * 2)
