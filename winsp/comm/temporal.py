"""Temporal x window-SP mesh: several SP groups each take whole temporal batches of a long clip, one writer collects.

A world of ``W`` ranks with window-SP degree ``N`` (``W % N == 0``) forms ``W / N`` groups of ``N`` consecutive ranks
(consecutive so that a group sits on one node when ranks are numbered node by node). Inside a group the model runs
window-parallel as usual over the group's :class:`~winsp.comm.group.SPGroup`; across groups nothing is shared but the
finished batches, which each group's first rank (its leader) sends to the writer, rank 0. Batches are assigned
round-robin (batch ``i`` to group ``i % (W / N)``): batches are of equal size (bar the last), so this balances like a
work queue without any coordination, and it is a pure function of the batch index, the same on every rank.

:func:`ordered_results` runs the schedule. The writer yields the finished batches in order, holding one at a time: a
leader blocks in its send until the writer reaches that batch, so no rank ever holds more than one finished batch and
the writer never holds the whole clip. Nothing can deadlock: the writer waits only on its own group's collectives and
on the leader of the batch it needs next, and that leader waits on nothing but the writer.

Model code never calls ``torch.distributed``; it calls :func:`build_temporal_mesh` and :func:`ordered_results`, and
those reach ranks only through :mod:`winsp.comm.group`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from winsp.comm.group import SPGroup, new_subgroup, recv_tensor, send_tensor, world_rank_and_size

__all__ = ["TemporalMesh", "build_temporal_mesh", "interleaved_schedule", "ordered_results"]

@dataclass(frozen=True)
class TemporalMesh:
    """This rank's place in a ``world_size = num_groups x sp_size`` mesh, and its group's :class:`SPGroup`."""

    world_size: int
    rank: int
    sp_size: int
    sp: SPGroup = field(compare=False, repr=False)
    writer_rank: int = 0
    #: the world's point-to-point twin, on which finished batches travel to the writer (None: one group, no messages)
    relay: Optional[SPGroup] = field(default=None, compare=False, repr=False)

    @property
    def num_groups(self) -> int:
        return self.world_size // self.sp_size

    @property
    def group_index(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def is_writer(self) -> bool:
        return self.rank == self.writer_rank

    def leader_of(self, group: int) -> int:
        """The global rank that sends group ``group``'s finished batches to the writer."""
        return group * self.sp_size

    def group_of_batch(self, index: int) -> int:
        return index % self.num_groups

    def owns(self, index: int) -> bool:
        """Whether this rank's group restores batch ``index``."""
        return self.group_of_batch(index) == self.group_index

    def describe(self) -> str:
        return f"{self.num_groups} temporal group{'s' if self.num_groups != 1 else ''} x SP {self.sp_size}"


def interleaved_schedule(num_batches: int, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """Batch indices per group: group ``g`` takes ``g, g + num_groups, g + 2 * num_groups, ...``."""
    if num_batches < 0 or num_groups < 1:
        raise ValueError(f"need num_batches >= 0 and num_groups >= 1, got {num_batches} and {num_groups}")
    return tuple(tuple(range(g, num_batches, num_groups)) for g in range(num_groups))


def build_temporal_mesh(sp_size: Optional[int] = None) -> TemporalMesh:
    """The mesh of the initialised default world (or a single rank) with SP degree ``sp_size`` (default: the whole
    world, one group). Every rank must call it, with the same ``sp_size``: it creates the subgroups collectively.

    Raises ``ValueError`` when ``sp_size`` is not a positive integer dividing the world size.
    """
    rank, world = world_rank_and_size()
    if sp_size is None:
        sp_size = world
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"the SP size must be a positive integer, got {sp_size!r}")
    if world % sp_size:
        raise ValueError(
            f"the world size {world} is not a multiple of the SP size {sp_size}: launch a multiple of {sp_size} "
            f"ranks (e.g. torchrun --nproc-per-node {sp_size * max(1, world // sp_size)}) or pick an SP size that "
            f"divides {world}"
        )
    if sp_size == 1:
        sp = SPGroup(None)
    elif sp_size == world:
        sp = SPGroup.world()
    else:
        mine = None
        for g in range(world // sp_size):  # every rank creates every subgroup, in the same order
            group = new_subgroup(range(g * sp_size, (g + 1) * sp_size))
            if g == rank // sp_size:
                mine = group
        sp = SPGroup(mine)
    relay = SPGroup.world().point_to_point() if world > sp_size else None  # every rank is here: made together
    return TemporalMesh(world_size=world, rank=rank, sp_size=sp_size, sp=sp, relay=relay)


def ordered_results(
    mesh: TemporalMesh, num_batches: int, compute: Callable[[int], torch.Tensor],
    before: Optional[Callable[[int], None]] = None, first: int = 0,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Run batches ``0 .. num_batches - 1`` over the mesh; on the writer, yield ``(index, result)`` in index order.

    ``compute(index)`` is called on every rank of the owning group, in increasing index order (so collectives inside
    it line up within the group), and must return the batch's result (a tensor, the same on every rank of the group).
    The group's leader sends it to the writer unless it is the writer; other ranks yield nothing. The writer must
    consume each result before asking for the next (it is sent, or computed, only then), which bounds memory.
    ``before(index)``, when given, is called on every rank before batch ``index`` (whichever group owns it), so a
    collective in it lines up over the world; an exception it raises ends the run there, on every rank that raises.
    ``first``: the batches before it are skipped on every rank (their results are kept from an earlier run); every
    rank must pass the same value.
    """
    if not 0 <= first <= num_batches:
        raise ValueError(f"first must be in [0, num_batches] = [0, {num_batches}], got {first}")
    for index in range(first, num_batches):
        if before is not None:
            before(index)
        group = mesh.group_of_batch(index)
        if group == mesh.group_index:
            result = compute(index)
            if mesh.is_writer:
                yield index, result
            elif mesh.rank == mesh.leader_of(group):
                send_tensor(result, mesh.writer_rank, group=_relay(mesh))
            del result
        elif mesh.is_writer:
            yield index, recv_tensor(mesh.leader_of(group), group=_relay(mesh))


def _relay(mesh: TemporalMesh):
    """The process group batches travel on (the default one for a mesh built by hand without a relay)."""
    return None if mesh.relay is None else mesh.relay.group
