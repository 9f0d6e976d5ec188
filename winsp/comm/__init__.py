"""Layer 3, communication: the only layer that talks to ``torch.distributed``.

:class:`~winsp.comm.group.SPGroup` wraps the sequence-parallel group; on it sit the count-matrix redistribution of
rows between layouts (:mod:`~winsp.comm.redistribute`), the replicated-text reducer (:mod:`~winsp.comm.text`),
collectives for row bands of convolutional models (:mod:`~winsp.comm.spatial`) and the temporal x window-SP mesh
(:mod:`~winsp.comm.temporal`).
"""

from winsp.comm.group import SPGroup
from winsp.comm.redistribute import Transition, ensure_layout, gather_rows, redistribute_rows, scatter_rows
from winsp.comm.temporal import TemporalMesh, build_temporal_mesh, interleaved_schedule, ordered_results
from winsp.comm.text import reduce_window_text

__all__ = ["SPGroup", "Transition", "redistribute_rows", "ensure_layout", "scatter_rows", "gather_rows",
           "reduce_window_text", "TemporalMesh", "build_temporal_mesh", "interleaved_schedule", "ordered_results"]
