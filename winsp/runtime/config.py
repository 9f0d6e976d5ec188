"""``DiffusionParallelConfig``: how many ranks share one request's windows, and what is refused.

winsp parallelises windowed models by giving whole windows to ranks ("window-aligned SP"), so the familiar
``ulysses_degree`` is simply the window-SP degree: every rank keeps all attention heads and no head count has to
divide by anything. Head-sharded and ring-style options have no meaning for such models and are refused up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from winsp.attention.backends import check_backend_name
from winsp.attention.halo.backends import check_neighborhood_backend
from winsp.comm.mesh import mesh_size
from winsp.planning.costs import CostConstants
from winsp.planning.schedule import check_planner

__all__ = ["DiffusionParallelConfig"]

_WHY = "window-parallel models use whole-window SP: set ulysses_degree to the number of ranks instead"


@dataclass(frozen=True)
class DiffusionParallelConfig:
    """Parallel configuration of one diffusion request.

    Args:
        ulysses_degree: the window-SP degree N (the size of the SP group; the world, or a subgroup given by the caller).
            None (the default): the size of ``mesh`` when one is given, else 1.
        ring_degree: must be 1 (ring attention does not apply to windowed attention).
        allgather: must be False (no K/V all-gather strategy).
        ulysses_mode: must be ``"strict"``; ``"advanced_uaa"`` (head padding) is refused.
        advanced_uaa: must be False (same as ``ulysses_mode="advanced_uaa"``).
        ulysses_a2a_permute: must be False (there is no head all-to-all to permute).
        attention_backend: ``"auto"`` or a backend name of :mod:`winsp.attention.backends` (checked here, at construction).
        neighborhood_backend: the kernel of neighborhood layers, ``"auto"``, ``"tiled"``, ``"flex"`` or ``"natten"``
            (:mod:`winsp.attention.halo.backends`; checked here).
        planner: how rows are placed on ranks: ``"auto"`` (the default: per layout, whole windows, split windows or
            head parallelism, whichever the cost constants of :mod:`winsp.planning.costs` predict is fastest among those that
            keep rows and attention within 5 % of a perfect split), ``"lpt"`` or ``"locality"`` (whole windows
            always), ``"split"`` (always cut the rows evenly, splitting windows), ``"heads"`` (head parallelism:
            every window over all ranks); see :data:`winsp.planning.schedule.PLANNERS`. Every planner gives the same output.
        plan_cache_size: how many request shapes the runtime's store keeps (plans, transitions, indices).
        costs: the cost constants ``"auto"`` weighs placements with (None: :data:`winsp.planning.costs.DEFAULT_COSTS`, SeedVR2
            3B on an NVLink GPU node; ``benchmarks/cost_model.py --fit-wall`` refits them on measured wall time).
        mesh: the SP group as a ``torch.distributed`` ``DeviceMesh``: a 1-D mesh, or the window-SP dimension of a
            larger one (``mesh["sp"]`` of a (dp, sp) mesh). None: the world, or the ``group=`` the runtime is given.
    """

    ulysses_degree: Optional[int] = None
    ring_degree: int = 1
    allgather: bool = False
    ulysses_mode: str = "strict"
    advanced_uaa: bool = False
    ulysses_a2a_permute: bool = False
    attention_backend: str = "auto"
    planner: str = "auto"
    plan_cache_size: int = 64
    costs: CostConstants | None = None
    neighborhood_backend: str = "auto"
    mesh: Any = None

    def __post_init__(self) -> None:
        if self.mesh is not None:
            size = mesh_size(self.mesh)
            if self.ulysses_degree is not None and self.ulysses_degree != size:
                raise ValueError(f"ulysses_degree={self.ulysses_degree!r} but the SP mesh has {size} ranks; leave "
                                 f"ulysses_degree out to take the mesh's size")
            object.__setattr__(self, "ulysses_degree", size)
        elif self.ulysses_degree is None:
            object.__setattr__(self, "ulysses_degree", 1)
        for name in ("ulysses_degree", "ring_degree", "plan_cache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ring_degree != 1:
            raise ValueError(f"ring_degree={self.ring_degree} is not supported: {_WHY}")
        if self.allgather:
            raise ValueError(f"allgather=True is not supported: {_WHY}")
        if self.ulysses_mode != "strict":
            raise ValueError(f"ulysses_mode={self.ulysses_mode!r} is not supported: {_WHY}")
        if self.advanced_uaa:
            raise ValueError(f"advanced_uaa=True is not supported: {_WHY}")
        if self.ulysses_a2a_permute:
            raise ValueError(f"ulysses_a2a_permute=True is not supported: {_WHY}")
        check_backend_name(self.attention_backend)
        check_neighborhood_backend(self.neighborhood_backend)
        check_planner(self.planner)
        if self.costs is not None and not isinstance(self.costs, CostConstants):
            raise ValueError(f"costs must be a winsp.planning.costs.CostConstants or None, got {type(self.costs).__name__}")

    @property
    def sp_degree(self) -> int:
        """The number of ranks that share one request's windows."""
        return self.ulysses_degree
