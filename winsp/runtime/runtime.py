"""The runtime: it owns the layer schedule (one stage, or several on different grids), the store of prepared data,
and makes the requests that execute the plans.

A model builds one :class:`WindowRuntime` (its window geometries, one per layer, flat or in
:class:`~winsp.planning.stages.Stage` s, and the SP group), then for each forward asks it for a
:class:`~winsp.runtime.request.WindowRequest` over that batch's grids. Making the request is the *planning* phase: plans
come from pure functions (:func:`winsp.plan_schedule` for one stage, :func:`winsp.planning.hierarchy.staged_plans` over
stages), and they, the transitions, each rank's windows and every device index tensor are kept in the runtime's store
(built on a miss, numpy on the CPU). It is marked for torch.compile to leave alone. The request's steps are the
*per-layer* phase (:mod:`winsp.runtime.request`). Model code calls only these; it never sees a collective.

Gradient convention: every rank computes the same loss from replicated values, each rank's copy of a replicated value
is its own contribution, and after ``backward`` :func:`winsp.sync_gradients` averages the gradients over the SP group
(as DDP does). Each step's backward is its forward's exact adjoint (``scatter``: this rank's rows; ``to_layer``: the
reverse all-to-all; ``attention``'s text reduction: an all-reduce; ``gather``: a reduce-scatter), so that holds
wherever a model scatters and gathers.
"""

from __future__ import annotations

import logging
from functools import cached_property
from itertools import pairwise
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from winsp.attention.backends import REGISTRY, available_backends, check_backend_name
from winsp.attention.halo.backends import check_neighborhood_backend, explain_neighborhood_backend
from winsp.attention.split import SplitAttention, SplitAttentionTensors
from winsp.comm.group import SPGroup
from winsp.comm.redistribute import RankTransitionTensors, Transition
from winsp.geometry.layout import Grids, check_grids
from winsp.geometry.neighborhood import is_neighborhood
from winsp.geometry.rolled import GlobalWindow
from winsp.geometry.windows import WindowGeometry
from winsp.planning.costs import DEFAULT_COSTS, CostConstants
from winsp.planning.grid_step import GridStep, StageRows
from winsp.planning.hierarchy import staged_plans
from winsp.planning.plan import Plan
from winsp.planning.schedule import _check_schedule, check_planner
from winsp.planning.stages import Stage, check_stages, grid_sources, stage_grids
from winsp.runtime.config import DiffusionParallelConfig
from winsp.runtime.local import LayoutTensors, LocalWindows, layout_tensors
from winsp.runtime.request import CheckedRequest, PreparedRequest, WindowRequest
from winsp.runtime.store import CacheInfo, RuntimeStore
from winsp.utils.compile import planning
from winsp.utils.phases import plans as planning_block

__all__ = ["WindowRuntime", "WindowRequest", "CheckedRequest", "StagedRuntime", "StagedRequest", "LocalWindows",
           "LayoutTensors", "PreparedRequest", "as_stages"]

_log = logging.getLogger("winsp")


def as_stages(schedule: Sequence[WindowGeometry] | Sequence[Stage]) -> tuple[Stage, ...]:
    """A runtime's stages: a list of :class:`Stage` as given (checked), or a flat schedule as one stage. A last stage
    without layers (only a grid change) gets one layer for its rows to land in: a global window split over every rank,
    where no attention runs."""
    items: tuple = tuple(schedule) if not isinstance(schedule, (str, bytes)) else (schedule,)
    stages = [s for s in items if isinstance(s, Stage)]
    if items and len(stages) == len(items):
        stages = list(check_stages(stages))
        if not stages[-1].layers:  # a region that ends with a grid change: its rows land spread over every rank
            last = stages[-1]
            stages[-1] = Stage((GlobalWindow(),), merge=last.merge, split=last.split, like=last.like,
                               order=last.order, split_windows=True)
        return tuple(stages)
    if stages:
        raise ValueError("give a runtime either one WindowGeometry per layer or a list of winsp.Stage, not a mix")
    return (Stage(_check_schedule(items)),)


class WindowRuntime:
    """Window-parallel execution of a model whose layer ``i`` attends inside ``schedule[i]``'s windows.

    Args:
        schedule: one :class:`~winsp.geometry.windows.WindowGeometry` per layer (a model on one grid), or the
            :class:`~winsp.planning.stages.Stage` list of a hierarchical one (layers are numbered across stages; a flat
            schedule is simply one stage).
        group: a :class:`~winsp.comm.group.SPGroup`, a ``torch.distributed`` process group, a 1-D ``DeviceMesh`` (or
            ``mesh["sp"]`` of a larger one), or None (one rank).
        attention_backend: ``"auto"`` or a backend name of :mod:`winsp.attention.backends`.
        neighborhood_backend: the kernel of :class:`~winsp.Neighborhood` layers: ``"auto"``, ``"tiled"``, ``"flex"`` or
            ``"natten"`` (:mod:`winsp.attention.halo.backends`).
        planner: a name of :data:`winsp.planning.schedule.PLANNERS` (``"auto"`` by default: whole or split windows per
            layout, whichever is predicted faster).
        store_size: how many entries the runtime's store keeps (LRU).
        split_windows: False for a model whose attention takes a ``score_mod`` / ``mask_mod``: ``"auto"`` then keeps
            whole windows (a split window has no per-local-row tensors for them to index); a stage's own
            ``Stage.split_windows`` wins for its layers.
        costs: the cost constants the planner weighs placements with (None: :data:`winsp.planning.costs.DEFAULT_COSTS`).
    """

    def __init__(
        self,
        schedule: Sequence[WindowGeometry] | Sequence[Stage],
        *,
        group=None,
        attention_backend: str = "auto",
        planner: str = "auto",
        store_size: int = 64,
        split_windows: bool = True,
        costs: CostConstants | None = None,
        neighborhood_backend: str = "auto",
    ) -> None:
        self.stages = as_stages(schedule)
        self.costs = DEFAULT_COSTS if costs is None else costs  # checked by plan_schedule
        self.schedule = tuple(g for st in self.stages for g in st.layers)
        self.stage_of_layer: tuple[int, ...] = tuple(s for s, st in enumerate(self.stages) for _ in st.layers)
        starts = np.concatenate([[0], np.cumsum([len(st.layers) for st in self.stages])])
        self.first_layer: tuple[int, ...] = tuple(int(v) for v in starts[:-1])
        if not isinstance(split_windows, bool):
            raise ValueError(f"split_windows must be True or False, got {split_windows!r}")
        self.split_windows = split_windows
        self.group = group if isinstance(group, SPGroup) else SPGroup(group)
        self.attention_backend = check_backend_name(attention_backend)
        self.neighborhood_backend = check_neighborhood_backend(neighborhood_backend)
        self.planner = check_planner(planner)
        self.store = RuntimeStore(store_size)
        self.layout_hooks: dict[str, Callable[[LocalWindows, torch.device], Any]] = {}
        self._modded_seen = False  # an attention call passed a score_mod / mask_mod: prepare that backend too
        self._last: tuple[torch.device, torch.dtype | None, str] | None = None
        self.layer_names: tuple[str, ...] | None = None  # module paths of the layers (winsp.parallelize names them)

    @classmethod
    def from_config(
        cls,
        config: DiffusionParallelConfig | None,
        schedule: Sequence[WindowGeometry] | Sequence[Stage],
        *,
        group=None,
        **options: Any,
    ) -> "WindowRuntime":
        """Build the runtime a :class:`DiffusionParallelConfig` asks for (``options``: other keyword arguments of
        the constructor, e.g. ``split_windows``).

        ``config`` None with a ``group``: every rank of the group. The SP degree N (``sp_degree``, ``ulysses_degree``
        in the vLLM-Omni lineage) = 1 needs no process group. For N > 1 torch.distributed must be initialised;
        ``group`` (a process group, a 1-D ``DeviceMesh`` or ``mesh["sp"]``, or the config's ``mesh``) defaults to
        the world, and its size must equal N.
        """
        sized_by_group = config is None and group is not None  # no config: the group's size is the SP degree
        config = config if config is not None else DiffusionParallelConfig()
        if not isinstance(config, DiffusionParallelConfig):
            raise ValueError(f"parallel_config must be a DiffusionParallelConfig, got {type(config).__name__}")
        n = config.ulysses_degree
        if config.mesh is not None:
            from_mesh = SPGroup(config.mesh)
            given = None if group is None else group if isinstance(group, SPGroup) else SPGroup(group)
            if given is not None and given.group is not from_mesh.group:
                raise ValueError("the SP group was given twice, differently (DiffusionParallelConfig(mesh=...) and "
                                 "group=...); give one of them")
            group = from_mesh if given is None else given
        if isinstance(group, SPGroup):
            sp = group
        elif group is not None:
            sp = SPGroup(group)
        elif n == 1:
            sp = SPGroup(None)
        else:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    f"ulysses_degree={n} needs an initialised torch.distributed world (e.g. launch with torchrun and "
                    f"call torch.distributed.init_process_group), or a process group passed as group="
                )
            sp = SPGroup(dist.group.WORLD)
        if sp.size != n and not sized_by_group:
            raise ValueError(
                f"ulysses_degree={n} but the SP group has {sp.size} ranks; pass a subgroup of exactly {n} ranks"
            )
        runtime = cls(schedule, group=sp, attention_backend=config.attention_backend, planner=config.planner,
                      store_size=config.plan_cache_size,
                      **{"costs": config.costs, "neighborhood_backend": config.neighborhood_backend, **options})
        _log.info("winsp rank %d: %s (%d layers, %d layout transitions per forward)", runtime.rank,
                  runtime.execution_path, len(runtime.schedule), runtime.num_transitions)
        return runtime

    @property
    def world_size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    @cached_property
    def layout_changes(self) -> tuple[int, ...]:
        """Layers before which the layout changes (derived from the schedule, not assumed to alternate)."""
        fps = [g.fingerprint for g in self.schedule]
        return tuple(i for i in range(1, len(fps)) if fps[i] != fps[i - 1])

    @property
    def num_transitions(self) -> int:
        """Inter-layer layout transitions per forward (31 for SeedVR2 3B's 32 alternating layers)."""
        return len(self.layout_changes)

    def cache_info(self) -> CacheInfo:
        """Hits, misses, bound and size of the runtime's store."""
        return self.store.cache_info()

    def backend_for(self, device: torch.device | str) -> str:
        """The attention backend this runtime uses on ``device`` in general (a request knows its own exactly)."""
        device = torch.device(device)
        if self.attention_backend != "auto":
            return self.attention_backend
        usable = [b for b in available_backends(device)
                  if b != "batched_sdpa" and REGISTRY[b].auto_rule(device, False) is None]
        return usable[0] if usable else "grouped_sdpa"

    def layer_kinds(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(kind, layers)`` per kind of layer in the schedule, in order of first appearance: ``"windows"`` (whole
        windows per rank), ``"split windows"`` (a stage whose windows the planner may split across ranks, their heads
        in parallel), ``"neighborhood halos"`` (:class:`~winsp.Neighborhood` layers: blocks of the grid per rank, halos
        exchanged)."""
        kinds: dict[str, list[int]] = {}
        for layer, geometry in enumerate(self.schedule):
            st = self.stages[self.stage_of_layer[layer]]
            split = st.split_windows if st.split_windows is not None else self.split_windows
            kind = "neighborhood halos" if is_neighborhood(geometry) else "split windows" if split else "windows"
            kinds.setdefault(kind, []).append(layer)
        return [(kind, tuple(layers)) for kind, layers in kinds.items()]

    def describe(self, device: torch.device | str = "cpu", backend: str | None = None) -> str:
        """A report of the execution path: one line (``window-aligned SP, Plan A (auto), 4 ranks, grouped SDPA``),
        then, for a schedule with more than one kind of layer or with layers named by :func:`winsp.parallelize`, a line
        per kind (:meth:`layer_kinds`) with its backend and its layers' module paths (or numbers).

        "Plan A" names how rows move between layouts: every layout change re-shards the activation with one
        all-to-all (:mod:`winsp.comm.redistribute`), as opposed to exchanging only halos (neighborhood layers,
        :mod:`winsp.planning.halo`); the planner follows in parentheses.
        """
        backend = (backend or self.backend_for(device)).replace("_", " ").replace("sdpa", "SDPA")
        if self.world_size == 1:
            head = f"window attention, single rank (no communication), {backend}"
        else:
            head = f"window-aligned SP, Plan A ({self.planner}), {self.world_size} ranks, {backend}"
        kinds = self.layer_kinds()
        names = self.layer_names
        if names is None and len(kinds) == 1:
            return head
        halo = explain_neighborhood_backend(self.neighborhood_backend, device)[0]
        how = {"windows": backend, "split windows": f"heads across ranks, {backend}",
               "neighborhood halos": f"{halo} kernel"}
        lines = [head]
        for kind, layers in kinds:
            which = ", ".join(names[i] for i in layers) if names is not None else ", ".join(map(str, layers))
            lines.append(f"  {kind} ({how[kind]}): {which}")
        return "\n".join(lines)

    @property
    def execution_path(self) -> str:
        """:meth:`describe` for the latest request's device, dtype and the backend it actually uses."""
        if self._last is None:
            return self.describe("cpu")
        device, _, backend = self._last
        return self.describe(device, backend)

    # ---- planning (eager, cached in the store) ----------------------------------------------------------

    def register_layout_hook(self, name: str, fn: Callable[[LocalWindows, torch.device], Any]) -> None:
        """Have every request build ``fn(local, device)`` once per layout, in the planning phase.

        ``local`` is this rank's :class:`LocalWindows` of a layout (its windows, rows, positions, window ids,
        ``window_coords``, ...); whatever ``fn`` returns (typically index tensors on ``device``, e.g. a relative
        position bias index per local row) is kept in the runtime's store with the layout and read in the forward
        with :meth:`WindowRequest.layout_data`, so blocks build nothing on first use and compile with
        ``fullgraph=True``. Registering a name again replaces its function (entries built by the old one are not
        reused).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a layout hook needs a non-empty string name, got {name!r}")
        if not callable(fn):
            raise ValueError(f"layout hook {name!r}: fn must be callable fn(local, device), got {type(fn).__name__}")
        self.layout_hooks[name] = fn

    def _hook_data(self, name: str, layout: LayoutTensors, text_lengths: tuple[int, ...], device: torch.device):
        fn = self.layout_hooks[name]
        key = ("hook", name, id(fn), layout.plan.key or id(layout.plan), self.rank, text_lengths, str(device))
        return self.store.get(key, lambda: fn(layout.local, device))

    def landing_layer(self, stage: int) -> int:
        """The layer whose layout :meth:`WindowRequest.to_grid` into ``stage`` lands in: the stage's first layer, or,
        for a split cropped ``like`` stage s, stage s's *last* layer, where a skip connection kept from the end of
        stage s already lies (so unchanged code adding it right after the split is right)."""
        st = self.stages[stage]
        if st.like is not None:
            return self.first_layer[st.like] + len(self.stages[st.like].layers) - 1
        return self.first_layer[stage]

    def stage_grids(self, grids: Sequence[Sequence[int]]) -> tuple[tuple[Grids, ...], tuple[Grids, ...]]:
        """(model grids, laid-out grids) of each stage for these stage-0 grids
        (:func:`winsp.planning.stages.stage_grids`)."""
        return self._stage_grids(check_grids(grids))

    def _stage_grids(self, grids: Grids) -> tuple[tuple[Grids, ...], tuple[Grids, ...]]:
        return self.store.get(("stage-grids", grids), lambda: stage_grids(self.stages, grids))

    def plans(self, grids: Sequence[Sequence[int]], *, split_windows: bool | None = None) -> tuple[Plan, ...]:
        """One plan per layer for a packed batch of stage-0 ``grids`` (from the store; :func:`winsp.plan_schedule`
        per stage, :func:`winsp.planning.hierarchy.staged_plans` over all of them).

        ``split_windows`` (default: the runtime's) False keeps every window whole (attention with score mods).
        """
        split = self.split_windows if split_windows is None else bool(split_windows)
        return self._plans(check_grids(grids), split)

    def _plans(self, grids: Grids, split_windows: bool) -> tuple[Plan, ...]:
        return self.store.get(("plans", grids, split_windows), lambda: staged_plans(
            self.stages, grids, self.world_size, self.planner, split_windows=split_windows, costs=self.costs))

    @planning  # also reached lazily from a step (a jump between non-neighbouring layouts) inside a compiled block
    @planning_block
    def _step(self, src: Plan, dst: Plan, device: torch.device) -> RankTransitionTensors:
        key = ("transition", src.key or id(src), dst.key or id(dst), self.rank, str(device))
        return self.store.get(key, lambda: Transition(src, dst).for_rank(self.rank).to(device))

    def _split(self, plan: Plan, text_lengths: tuple[int, ...], heads: int,
               device: torch.device) -> SplitAttentionTensors:
        key = ("split", plan.key or id(plan), self.rank, heads, text_lengths, str(device))
        return self.store.get(key, lambda: SplitAttention.build(plan, self.rank, heads, text_lengths).to(device))

    def _layout(self, plan: Plan, text_lengths: tuple[int, ...], device: torch.device) -> LayoutTensors:
        return self.store.get(("layout", plan.key or id(plan), self.rank, text_lengths, str(device)),
                              lambda: layout_tensors(plan, self.rank, text_lengths, device))

    def _stage_rows(self, layout: LayoutTensors, stage: int, grids: Grids, device: torch.device) -> StageRows:
        def build() -> StageRows:
            model, laid = self._stage_grids(grids)
            local = layout.local
            return StageRows.build(layout.plan, self.rank, local.row_sample, local.token_ids, model[stage],
                                   laid[stage], device)

        key = ("stage-rows", layout.plan.key or id(layout.plan), stage, grids, self.rank, str(device))
        return self.store.get(key, build)

    def _sources(self, stage: int, grids: Grids) -> tuple[np.ndarray, Optional[np.ndarray]]:
        def build():
            model, laid = self._stage_grids(grids)
            st = self.stages[stage]
            sources, chunk = grid_sources(st, model[stage - 1], laid[stage - 1], model[stage], laid[stage])
            return sources, (chunk if st.split != (1, 1, 1) else None)

        return self.store.get(("grid-sources", grids, stage), build)

    def _grid_step(self, request: WindowRequest, src_slot: int, stage: int) -> GridStep:
        src = request.prepared.layouts[src_slot].plan
        dst = request.prepared.plans[self.landing_layer(stage)]
        key = ("grid-step", src.key or id(src), dst.key or id(dst), stage, request.model_grids, self.rank,
               str(request.device))

        def build() -> GridStep:
            sources, chunk = self._sources(stage, request.model_grids)
            parts = 1 if chunk is None else self.stages[stage].children
            return GridStep.build(src, dst, sources, chunk, parts, self.rank, request.device)

        return self.store.get(key, build)

    def _prepare(self, inputs: CheckedRequest, split_windows: bool) -> PreparedRequest:
        grids, text_lengths, device = inputs.grids, inputs.text_lengths, inputs.device

        def build() -> PreparedRequest:
            plans = self._plans(grids, split_windows)
            distinct: list[Plan] = []
            slot_of_layer = []
            for plan in plans:
                if not any(plan is p for p in distinct):
                    distinct.append(plan)
                slot_of_layer.append(next(i for i, p in enumerate(distinct) if p is plan))
            layouts = tuple(self._layout(p, text_lengths, device) for p in distinct)
            stage_of_slot = {slot: self.stage_of_layer[layer] for layer, slot in enumerate(slot_of_layer)}
            rows = tuple(self._stage_rows(lay, stage_of_slot[s], grids, device) for s, lay in enumerate(layouts))
            steps = {}
            for a, b in pairwise(slot_of_layer):
                if a != b and (a, b) not in steps and distinct[a].layout.grids == distinct[b].layout.grids:
                    steps[(a, b)] = self._step(distinct[a], distinct[b], device)
            model, laid = self._stage_grids(grids)
            return PreparedRequest(plans=plans, slot_of_layer=tuple(slot_of_layer), layouts=layouts, stage_rows=rows,
                                   stage_model_grids=model, stage_laid_grids=laid, steps=steps, runners={},
                                   hook_data={})

        return self.store.get(("request", grids, text_lengths, self.rank, str(device), split_windows), build)

    @planning
    @planning_block
    def request(
        self,
        grids: Sequence[Sequence[int]],
        text_lengths: Sequence[int] | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        score_mods: bool | None = None,
        text_layers: Sequence[bool] | None = None,
    ) -> "WindowRequest":
        """Start one forward over a packed batch with these post-patch grids (the stage-0 model grids, before any
        padding; and text lengths, one per sample).

        Everything the forward needs is prepared here (or found in the store), including what every registered
        layout hook builds. Give ``dtype`` (the attention inputs' dtype) so the attention backend is chosen here too;
        without it, it is chosen on the first attention call (which a ``fullgraph=True`` compile cannot trace).
        ``score_mods`` says whether attention calls will pass a ``score_mod`` / ``mask_mod`` (their backend is then
        chosen here as well, and the default planner keeps every window whole, since a split window has no
        per-local-row tensors for them); None: as this runtime's earlier requests did.

        The inputs are checked here, once, into a :class:`~winsp.runtime.request.CheckedRequest`; planning and
        preparing take that and check nothing again.

        ``text_layers``: per layer, whether its attention takes the text (replicated tokens that join some layers
        only: a CLS token in spatial layers, absent from temporal ones); None: every layer does.
        """
        return self._request(CheckedRequest.check(grids, text_lengths, device=device, dtype=dtype,
                                                  score_mods=score_mods, text_layers=text_layers))

    def _check_text_layers(self, text_layers: tuple[bool, ...]) -> None:
        if len(text_layers) != len(self.schedule):
            raise ValueError(f"text_layers has {len(text_layers)} entries but the schedule has {len(self.schedule)} "
                             f"layers")
        halo = [i for i, joins in enumerate(text_layers) if not joins and is_neighborhood(self.schedule[i])]
        if halo:
            raise ValueError(f"text_layers: layers {halo} are neighborhood layers, which take the text in every layer "
                             f"or in none (a layer without text there is not supported)")

    def _request(self, inputs: CheckedRequest) -> WindowRequest:
        """Plan (or find in the store) and prepare a request whose inputs are checked: this checks nothing again."""
        modded = self._modded_seen if inputs.score_mods is None else inputs.score_mods
        if inputs.text_layers is not None:
            self._check_text_layers(inputs.text_layers)
        prepared = self._prepare(inputs, self.split_windows and not modded)
        if inputs.text_layers is not None and not prepared.bare:
            bare = (0,) * len(inputs.text_lengths)
            prepared.bare = tuple(self._layout(lay.plan, bare, inputs.device) for lay in prepared.layouts)
        for name in self.layout_hooks:
            for slot, layout in enumerate(prepared.layouts):
                prepared.hook_data[(slot, name)] = self._hook_data(name, layout, inputs.text_lengths, inputs.device)
        request = WindowRequest(self, prepared, inputs)
        if inputs.dtype is not None:
            for slot in range(len(prepared.layouts)):
                request._runner(slot, inputs.dtype, modded)
                if inputs.text_layers is not None:  # layers without the text attend on the layout planned without it
                    request._runner(slot, inputs.dtype, modded, bare=True)
        self._last = (inputs.device, inputs.dtype, request.backend(inputs.dtype, modded=modded))
        return request


class StagedRuntime(WindowRuntime):
    """The earlier spelling of ``WindowRuntime(stages, planner="lpt", split_windows=False)``: a runtime over stages
    whose windows stay whole unless a stage says otherwise. It adds nothing else; new code uses
    :class:`WindowRuntime` directly."""

    def __init__(self, stages: Sequence[Stage], *, group=None, attention_backend: str = "auto",
                 planner: str = "lpt", store_size: int = 64, split_windows: bool = False,
                 costs: CostConstants | None = None, neighborhood_backend: str = "auto") -> None:
        super().__init__(stages, group=group, attention_backend=attention_backend, planner=planner,
                         store_size=store_size, split_windows=split_windows, costs=costs,
                         neighborhood_backend=neighborhood_backend)


#: The earlier name of a request over stages: every request is a :class:`WindowRequest`.
StagedRequest = WindowRequest
