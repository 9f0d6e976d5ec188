"""SeedVR2 NaDiT under window-aligned SP on gloo CPU ranks: golden parity, packing and empty ranks at SP = 2, 3, 4."""

from __future__ import annotations

import pytest
import torch

import winsp
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT, load_dit_checkpoint
from tests.test_dit import random_batch, read_golden, run, split_batch
from winsp.testing import run_ranks

pytestmark = pytest.mark.multirank

TIMEOUT = 240.0

# a packed batch of three grids, and batches with fewer windows than ranks (post-patch grids (1, 2, 2) and (1, 3, 2)
# are one window each, regular and shifted)
PACKED = dict(shapes=[(3, 18, 24), (1, 10, 8), (2, 8, 30)], text_lengths=[5, 3, 8], timesteps=[999.0, 250.0, 17.5])
FEW_WINDOWS = dict(shapes=[(1, 4, 4), (1, 6, 4)], text_lengths=[3, 2], timesteps=[600.0, 40.0])


def _golden_model():
    meta, state, inputs, expected = read_golden()
    model = SeedVR2NaDiT(NaDiTConfig.from_metadata(meta)).eval()
    load_dit_checkpoint(model, state)
    return model, inputs, expected


def _batch(model, spec, seed):
    return random_batch(model.config, spec["shapes"], spec["text_lengths"], spec["timesteps"], seed=seed)


def _rank_main(rank: int, world_size: int) -> dict:
    model, inputs, expected = _golden_model()
    runtime = model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    assert runtime.world_size == world_size and runtime.rank == rank
    out = {"path": runtime.execution_path}
    golden = run(model, inputs)
    out["golden_err"] = (golden - expected).abs().max().item()
    out["golden_checksum"] = golden.double().sum().item()

    packed = _batch(model, PACKED, seed=1)
    out["packed"] = run(model, packed)
    out["packed_single"] = torch.cat([run(model, s) for s in split_batch(packed)])

    few = _batch(model, FEW_WINDOWS, seed=2)
    out["split"] = any(p.has_split_windows for p in runtime.plans([(1, 2, 2), (1, 3, 2)]))
    out["few"] = run(model, few)
    out["few_first"] = run(model, split_batch(few)[0])
    return out


@pytest.fixture(scope="module")
def single_rank_reference():
    model, _, _ = _golden_model()
    packed = _batch(model, PACKED, seed=1)
    few = _batch(model, FEW_WINDOWS, seed=2)
    return {"packed": run(model, packed), "few": run(model, few), "few_first": run(model, split_batch(few)[0])}


def test_few_windows_batch_really_has_fewer_windows_than_ranks():
    model, _, _ = _golden_model()
    rt = model.build_runtime(None)
    req = rt.request(grids=[(1, 2, 2), (1, 3, 2)], text_lengths=[3, 2])
    assert all(req.plan(i).layout.num_windows == 2 for i in range(2))
    req = rt.request(grids=[(1, 2, 2)], text_lengths=[3])
    assert req.plan(0).layout.num_windows == 1 and req.plan(1).layout.num_windows == 1


@pytest.mark.parametrize("world_size", [2, 3, 4, *(pytest.param(n, marks=pytest.mark.large_world) for n in (5, 6, 7, 8))])
def test_sp_matches_golden_and_single_rank(world_size, single_rank_reference):
    """Under the default planner, which splits windows of the packed and few-window batches at most degrees."""
    results = run_ranks(_rank_main, world_size, timeout=TIMEOUT * max(1, world_size // 4))
    for rank, res in enumerate(results):
        assert f"{world_size} ranks" in res["path"], res["path"]
        assert res["split"], rank
        # golden parity on every rank (the full output is returned everywhere)
        assert res["golden_err"] <= 1e-4, (rank, res["golden_err"])
        assert res["golden_checksum"] == results[0]["golden_checksum"], rank
        # a packed batch equals its samples run one at a time, at this SP degree and at SP = 1
        assert (res["packed"] - res["packed_single"]).abs().max().item() <= 1e-5, rank
        assert (res["packed"] - single_rank_reference["packed"]).abs().max().item() <= 1e-5, rank
        assert torch.equal(res["packed"], results[0]["packed"]), rank
        # fewer windows than ranks: idle ranks still take part and get the full result
        assert (res["few"] - single_rank_reference["few"]).abs().max().item() <= 1e-5, rank
        assert (res["few_first"] - single_rank_reference["few_first"]).abs().max().item() <= 1e-5, rank
        assert torch.equal(res["few"], results[0]["few"]), rank
