"""winsp.comm.temporal: temporal groups x window-SP subgroups, the interleaved schedule, ordered collection at the writer."""

from __future__ import annotations

import pytest
import torch

from winsp.comm.temporal import TemporalMesh, build_temporal_mesh, interleaved_schedule, ordered_results
from winsp.testing import run_ranks

TIMEOUT = 120.0


def test_interleaved_schedule():
    assert interleaved_schedule(7, 3) == ((0, 3, 6), (1, 4), (2, 5))
    assert interleaved_schedule(2, 4) == ((0,), (1,), (), ())
    assert interleaved_schedule(0, 1) == ((),)
    with pytest.raises(ValueError):
        interleaved_schedule(3, 0)


def test_single_process_mesh_is_one_group_of_one():
    mesh = build_temporal_mesh()
    assert (mesh.world_size, mesh.rank, mesh.sp_size, mesh.num_groups, mesh.is_writer) == (1, 0, 1, 1, True)
    assert mesh.sp.is_single and all(mesh.owns(i) for i in range(5))
    seen = list(ordered_results(mesh, 3, lambda i: torch.full((2,), i)))
    assert [i for i, _ in seen] == [0, 1, 2] and [int(t[0]) for _, t in seen] == [0, 1, 2]


def test_before_is_called_before_every_batch_and_can_stop_the_run():
    mesh = build_temporal_mesh()
    called = []
    seen = list(ordered_results(mesh, 3, lambda i: torch.full((1,), i), before=called.append))
    assert called == [0, 1, 2] and len(seen) == 3

    def stop_at_2(index: int) -> None:
        if index == 2:
            raise KeyboardInterrupt("stop")

    computed = []
    with pytest.raises(KeyboardInterrupt):
        list(ordered_results(mesh, 4, lambda i: computed.append(i) or torch.zeros(1), before=stop_at_2))
    assert computed == [0, 1]


def test_single_process_refuses_a_larger_sp_size():
    with pytest.raises(ValueError, match="world size 1 is not a multiple of the SP size 2"):
        build_temporal_mesh(2)
    with pytest.raises(ValueError, match="positive integer"):
        build_temporal_mesh(0)


def _rank_mesh(rank: int, world: int, sp_size: int, num_batches: int) -> dict:
    mesh = build_temporal_mesh(sp_size)
    # the SP subgroup really is this group: a sum over it adds the group's ranks only
    total = mesh.sp.all_reduce_sum(torch.tensor([float(rank)]))
    computed, held = [], []

    def compute(index: int) -> torch.Tensor:
        assert mesh.owns(index)
        computed.append(index)
        # a collective inside the batch, as the DiT runs: every rank of the group must be here for the same batch
        tag = mesh.sp.all_reduce_sum(torch.tensor([float(index)]))
        assert float(tag) == index * mesh.sp_size
        frames = 3 + index % 2  # batches of different lengths (as the last one of a clip)
        return torch.arange(frames * 4, dtype=torch.uint8).reshape(frames, 2, 2) + index

    out = []
    for index, result in ordered_results(mesh, num_batches, compute):
        held.append(index)
        out.append((index, result.tolist()))
    return {"group": mesh.group_index, "sp_rank": mesh.sp_rank, "sp_sum": float(total), "computed": computed,
            "received": out}


@pytest.mark.multirank
@pytest.mark.parametrize("world,sp_size", [(4, 2), (2, 1), (3, 3)])
def test_ordered_results_over_groups(world, sp_size):
    num_batches = 7
    results = run_ranks(_rank_mesh, world, sp_size, num_batches, timeout=TIMEOUT)
    groups = world // sp_size
    for rank, r in enumerate(results):
        g = rank // sp_size
        assert r["group"] == g and r["sp_rank"] == rank % sp_size
        assert r["sp_sum"] == sum(range(g * sp_size, (g + 1) * sp_size))
        assert r["computed"] == list(interleaved_schedule(num_batches, groups)[g])
        if rank != 0:
            assert r["received"] == []
    expected = [(i, (torch.arange((3 + i % 2) * 4, dtype=torch.uint8).reshape(-1, 2, 2) + i).tolist())
                for i in range(num_batches)]
    assert results[0]["received"] == expected


def _rank_bad_sp(rank: int, world: int) -> str:
    try:
        build_temporal_mesh(2)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.multirank
def test_world_not_a_multiple_of_sp_size_is_refused_on_every_rank():
    for message in run_ranks(_rank_bad_sp, 3, timeout=TIMEOUT):
        assert "world size 3 is not a multiple of the SP size 2" in message


def test_mesh_geometry_properties():
    mesh = TemporalMesh(world_size=6, rank=5, sp_size=2, sp=None)
    assert (mesh.num_groups, mesh.group_index, mesh.sp_rank, mesh.leader_of(2)) == (3, 2, 1, 4)
    assert [mesh.group_of_batch(i) for i in range(5)] == [0, 1, 2, 0, 1]
    assert mesh.describe() == "3 temporal groups x SP 2"
