"""``DiffusionParallelConfig``: how many ranks share one request's windows, and what is refused.

winsp parallelises windowed models by giving whole windows to ranks ("window-aligned SP"). The config keeps the
field names of the vLLM-Omni lineage it grew from, where sequence parallelism (SP) splits attention heads over ranks
with all-to-alls (DeepSpeed-Ulysses), so the SP degree there is called ``ulysses_degree``. Here the same number is
simply the window-SP degree: every rank keeps all attention heads and no head count has to divide by anything.
``sp_degree`` is the plain name for it and either may be given. The head-sharded and ring-style options have no
meaning for such models and are refused up front.
"""

from __future__ import annotations

from dataclasses import dataclass

from winsp.attention.backends import check_backend_name
from winsp.attention.halo.backends import check_neighborhood_backend
from winsp.planning.costs import CostConstants
from winsp.planning.schedule import check_planner

__all__ = ["DiffusionParallelConfig"]

_WHY = "window-parallel models use whole-window SP: set sp_degree (or ulysses_degree) to the number of ranks instead"


@dataclass(frozen=True, init=False)
class DiffusionParallelConfig:
    """Parallel configuration of one diffusion request.

    Args:
        ulysses_degree: the SP degree N under its vLLM-Omni name: the number of ranks that share one request's
            windows (the size of the SP group; the world, or a subgroup given by the caller). Default 1.
        ring_degree: must be 1. Ring attention (K/V blocks passed around a ring of ranks) does not apply to windowed
            attention.
        allgather: must be False. An all-gather of every rank's keys and values is not needed: a window's keys are
            on the rank that holds the window.
        ulysses_mode: must be ``"strict"``. ``"advanced_uaa"`` (head padding, so that a head count the degree does
            not divide can still be split over heads) is refused: winsp does not split heads.
        advanced_uaa: must be False (the same as ``ulysses_mode="advanced_uaa"``).
        ulysses_a2a_permute: must be False. It reorders the head all-to-all of Ulysses, which winsp does not make.
        attention_backend: ``"auto"`` or a backend name of :mod:`winsp.attention.backends` (checked here, at
            construction).
        planner: how rows are placed on ranks: ``"auto"`` (the default: per layout, whole windows, split windows or
            head parallelism, whichever the cost constants of :mod:`winsp.planning.costs` predict is fastest among
            those that keep rows and attention within 5 % of a perfect split), ``"lpt"`` or ``"locality"`` (whole
            windows always), ``"split"`` (always cut the rows evenly, splitting windows), ``"heads"`` (head
            parallelism: every window over all ranks); see :data:`winsp.planning.schedule.PLANNERS`. Every planner
            gives the same output.
        plan_cache_size: how many request shapes the runtime's store keeps (plans, transitions, indices).
        costs: the cost constants ``"auto"`` weighs placements with (None:
            :data:`winsp.planning.costs.DEFAULT_COSTS`, SeedVR2 3B on an NVLink GPU node;
            ``benchmarks/cost_model.py --fit-wall`` refits them on measured wall time).
        neighborhood_backend: the kernel of neighborhood layers, ``"auto"``, ``"tiled"``, ``"flex"`` or ``"natten"``
            (:mod:`winsp.attention.halo.backends`; checked here).
        sp_degree: the SP degree N under its plain name (keyword only). Give ``sp_degree`` or ``ulysses_degree``;
            both are accepted when they agree, and after construction both attributes read N. (To change it with
            ``dataclasses.replace``, pass ``ulysses_degree``, the stored field: the copy passes that field along, so
            a different ``sp_degree`` beside it would be refused as a disagreement.)
    """

    ulysses_degree: int
    ring_degree: int
    allgather: bool
    ulysses_mode: str
    advanced_uaa: bool
    ulysses_a2a_permute: bool
    attention_backend: str
    planner: str
    plan_cache_size: int
    costs: CostConstants | None
    neighborhood_backend: str

    def __init__(self, ulysses_degree: int | None = None, ring_degree: int = 1, allgather: bool = False,
                 ulysses_mode: str = "strict", advanced_uaa: bool = False, ulysses_a2a_permute: bool = False,
                 attention_backend: str = "auto", planner: str = "auto", plan_cache_size: int = 64,
                 costs: CostConstants | None = None, neighborhood_backend: str = "auto", *,
                 sp_degree: int | None = None) -> None:
        degree = _one_degree(sp_degree, ulysses_degree)
        for name, value in (("ulysses_degree", degree), ("ring_degree", ring_degree), ("allgather", allgather),
                            ("ulysses_mode", ulysses_mode), ("advanced_uaa", advanced_uaa),
                            ("ulysses_a2a_permute", ulysses_a2a_permute), ("attention_backend", attention_backend),
                            ("planner", planner), ("plan_cache_size", plan_cache_size), ("costs", costs),
                            ("neighborhood_backend", neighborhood_backend)):
            object.__setattr__(self, name, value)
        self._check()

    @property
    def sp_degree(self) -> int:
        """The number of ranks that share one request's windows (the same number as ``ulysses_degree``)."""
        return self.ulysses_degree

    def _check(self) -> None:
        for name in ("ring_degree", "plan_cache_size"):
            _check_positive(name, getattr(self, name))
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
            raise ValueError("costs must be a winsp.planning.costs.CostConstants or None, got "
                             f"{type(self.costs).__name__}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _one_degree(sp_degree: int | None, ulysses_degree: int | None) -> int:
    """The SP degree from its two names: the one given (1 when neither is), or a ValueError when they disagree."""
    for name, value in (("sp_degree", sp_degree), ("ulysses_degree", ulysses_degree)):
        if value is not None:
            _check_positive(name, value)
    if sp_degree is not None and ulysses_degree is not None and sp_degree != ulysses_degree:
        raise ValueError(f"sp_degree={sp_degree} and ulysses_degree={ulysses_degree} disagree: they are one setting "
                         "(ulysses_degree is its vLLM-Omni name); give one of them")
    degree = sp_degree if sp_degree is not None else ulysses_degree
    return 1 if degree is None else int(degree)
