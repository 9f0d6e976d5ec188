"""Attention's input dtypes are checked once per request on every rank of the group (issue 30, case 9): integer
q/k/v reached a torch RuntimeError inside a backend; float32 on one rank and float64 on another aborted inside gloo
(SIGABRT) with no word about dtypes (on NCCL such a mismatch hangs).
"""

from __future__ import annotations

import pytest
import torch

import winsp
from tests.test_runtime import REG, SHIFT
from winsp.attention.input_dtypes import dtype_codes, dtype_problem
from winsp.comm.group import SPGroup
from winsp.testing import run_ranks


def _qkv(req, dtype, heads=2, dim=8):
    n = req.scatter(torch.zeros(2 * 8 * 8, 1)).shape[0]
    q = torch.randn(n, heads, dim).to(dtype)
    return q, q.clone(), q.clone()


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.bool])
def test_non_floating_qkv_is_refused_naming_the_tensor_and_dtype(dtype):
    rt = winsp.WindowRuntime([REG, SHIFT])
    req = rt.request([(2, 8, 8)])
    with pytest.raises(ValueError, match=rf"rank 0: attention inputs must be floating point .*: q_vid is "
                                         rf"{str(dtype).replace('torch.', '')} on rank 0"):
        req.attention(*_qkv(req, dtype), layer=0)


def test_mixed_dtypes_on_one_rank_are_refused():
    rt = winsp.WindowRuntime([REG])
    req = rt.request([(2, 8, 8)])
    q, k, v = _qkv(req, torch.float32)
    with pytest.raises(ValueError, match="must share one dtype, but on rank 0 they are q_vid float32, k_vid float32, "
                                         "v_vid float64"):
        req.attention(q, k, v.double(), layer=0)


def test_the_check_runs_once_per_request(monkeypatch):
    calls = []
    gather = SPGroup.all_gather_ints
    monkeypatch.setattr(SPGroup, "all_gather_ints", lambda self, *a, **k: calls.append(1) or gather(self, *a, **k))
    rt = winsp.WindowRuntime([REG, SHIFT])
    for _ in range(2):
        req = rt.request([(2, 8, 8)])
        q, k, v = _qkv(req, torch.float32)
        req.attention(q, k, v, layer=0)
        q, k, v = req.to_layer(q, 1), req.to_layer(k, 1, source=0), req.to_layer(v, 1, source=0)
        req.attention(q, k, v, layer=1)
    assert len(calls) == 2


def test_the_table_names_ranks_and_dtypes():
    f32, f64 = dtype_codes([torch.zeros(1)])[0], dtype_codes([torch.zeros(1, dtype=torch.float64)])[0]
    rows = [[f32, f32, f32, -1, -1, -1], [f64, f64, f64, -1, -1, -1]]
    assert dtype_problem(rows) == ("attention inputs must have the same dtype on every rank of the SP group (the "
                                   "collectives exchange their bytes), but they are: rank 0 float32, rank 1 float64")
    assert dtype_problem(rows[:1] * 2) is None


def _rank_dtypes(rank, world_size):
    rt = winsp.WindowRuntime.from_config(winsp.DiffusionParallelConfig(ulysses_degree=world_size), [REG, SHIFT])
    req = rt.request([(5, 32, 56)])
    n = req.scatter(torch.zeros(5 * 32 * 56, 1)).shape[0]
    q = torch.randn(n, 2, 8, dtype=torch.float32 if rank == 0 else torch.float64)
    try:
        req.attention(q, q, q, layer=0)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.multirank
def test_dtypes_that_differ_between_ranks_are_refused_on_every_rank():
    for rank, message in enumerate(run_ranks(_rank_dtypes, 2, timeout=120)):
        assert message == (f"rank {rank}: attention inputs must have the same dtype on every rank of the SP group (the "
                           f"collectives exchange their bytes), but they are: rank 0 float32, rank 1 float64")


def test_one_rank_s_row_is_named_by_its_rank():
    """On a GPU each rank checks its own row (the cross-rank comparison stays on the device)."""
    f32, i64 = dtype_codes([torch.zeros(1)])[0], dtype_codes([torch.zeros(1, dtype=torch.int64)])[0]
    assert "k_vid is int64 on rank 3" in dtype_problem([[f32, i64, f32, -1, -1, -1]], first_rank=3)


def _same_ints(rank: int, world_size: int, differ: bool):
    try:
        SPGroup.world().assert_same_ints([7, 1 + (rank if differ else 0)], "cpu", "the ranks' values differ")
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("differ", [False, True])
def test_assert_same_ints_stops_every_rank_when_values_differ(differ):
    out = run_ranks(_same_ints, 2, differ, timeout=120)
    assert out == (["the ranks' values differ"] * 2 if differ else [None, None]), out
