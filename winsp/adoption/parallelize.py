"""``winsp.parallelize``: make an existing window-attention model window-parallel without editing its code.

A :class:`ParallelPlan` is plain data about the model: which module call is the window-parallel *region* (its input
tokens are scattered to the ranks' windows, its output gathered back), which modules are attention layers (swapped
for winsp modules that reuse their parameters, so ``state_dict`` keys and checkpoints are unchanged), the window
geometry of every layer grouped in :class:`~winsp.planning.hierarchy.Stage` s, the modules that change the grid between
stages (patch merging), and any other module to swap (a per-sample drop path). :func:`parallelize` applies it in
place with forward hooks and module swaps; :func:`unparallelize` takes it all back.

Inside the region every unchanged module runs on this rank's local rows ``[L, C]`` (tokenwise code such as norms,
MLPs and residuals needs nothing); the swapped modules reach the request through :func:`winsp.current_request`.
Before each attention layer's *entry* module (by default the attention's parent, i.e. the block, so the residual
stream moves with it) the rows move into that layer's layout.

The runtime is attached to the root module as ``model._winsp_runtime`` (not a parameter or buffer), where
``winsp.sync_gradients(model)`` finds the SP group.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from torch import Tensor, nn

import winsp.adoption.region_dropout as region_dropout
import winsp.adoption.skips as skips
import winsp.adoption.space_time as space_time
import winsp.runtime.context as context
from winsp.adoption.hourglass import Hourglass
from winsp.adoption.recompute import watch_recompute
from winsp.adoption.recording import HOOK_DICTS, dry_run
from winsp.adoption.region import ChannelsLast, Region, TokenIO
from winsp.adoption.region_checks import ForwardOrder, Step, watch_rows
from winsp.adoption.replicated import Replicated
from winsp.adoption.space_time import SpaceTime, install_tables, remove_tables
from winsp.planning.schedule import SPLITTING_PLANNERS
from winsp.planning.stages import Stage, check_stages
from winsp.runtime.config import DiffusionParallelConfig
from winsp.runtime.runtime import WindowRuntime

__all__ = [
    "ParallelPlan",
    "Region",
    "TokenIO",
    "ChannelsLast",
    "parallelize",
    "unparallelize",
    "adopt",
    "is_parallelized",
]



@dataclass(frozen=True)
class ParallelPlan:
    """What :func:`parallelize` does to a model.

    Module paths are ``named_modules`` names matched by globs (the one rule, :func:`path_matches`): component by
    component, ``*`` (and ``?``, ``[...]``) inside one component, never across a dot; ``**`` spans any number of
    components, none included. Where a glob is taken, a tuple of globs matches a module matching any of them.

    Args:
        region: the window-parallel region (with ``stages=Hourglass(...)`` it may be left out: from the first down
            level's call to the first up level's return).
        stages: the window geometry of every attention layer, per stage, in forward order (one stage for a model on
            one grid); or a :class:`~winsp.adoption.hourglass.Hourglass`, which reads a U-net's stages, grid changes
            and forward order from the model.
        attention: glob of the attention modules: the i-th one the forward runs is layer i.
        make_attention: ``(original, layer) -> module`` reusing the original's parameters (see :func:`adopt`).
        layer_entry: ``"parent"`` (rows move into layer i's layout when the attention's parent module is called:
            the block, whose residual then moves too), or a glob matching one entry module per layer.
        grid_changes: glob of the modules that change the grid (patch merging): the i-th one the forward runs leads
            into the i-th stage that merges or splits.
        make_grid_change: ``(original, stage) -> module`` (calls ``current_request().to_grid(x, stage)``).
        swaps: ``(glob, factory)`` pairs: every module matching the glob is replaced by ``factory(original)``
            (e.g. a drop path that must draw per sample: :class:`winsp.SampleDropPath`; an element-wise dropout:
            :meth:`winsp.RowDropout.like`).
        per_sample: glob of modules that broadcast a per-sample tensor over the channels-last grid (AdaRMSNorm,
            adaLN: ``cond[:, None, None, :]``): they run unchanged on local rows viewed as one-token grids, their
            per-sample arguments taken per row (:class:`~winsp.adoption.per_sample.PerSampleOnRows`).
        forward_order: by default (None) the order in which the forward runs the attention layers, entries and grid
            changes is *recorded* before the first forward, by running the model's forward with the original
            modules on meta tensors (the matches are then numbered in that order). A model that cannot run on meta
            tensors (an op without a meta kernel, such as natten's) is said so in one warning line, and its order is
            recorded once from a no-grad forward of the original modules on the real inputs (full size on every rank,
            rows not moved). Given (globs of the model's containers in the order its forward runs them), the order is
            stated, and the recording only checks it: each match is placed by the first glob matching it or one of
            its parents, matches under one glob keep ``named_modules`` order, a match under none is refused, and a
            model that cannot run on meta tensors is checked step by step as it runs (no extra forward). Either way a
            module that runs out of order in a later forward is refused before its rows move.
        dropout: element-wise dropout on local rows in a training forward: ``"refuse"`` (an ``nn.Dropout`` module or
            an ``F.dropout`` / ``torch.dropout`` call is refused, naming the module, and suggesting ``"rows"`` only
            where that draw is the original's) or ``"rows"`` (both draw the original's mask over the region's token
            tensor *as it came in*, then keep this rank's rows: the tokens in the ``TokenIO``'s axis order (row-major
            for ``ChannelsLast``, frames fastest for ``FlatTokens(order="hwt")``), the replicated tokens the region
            holds at their place, ``ChannelsFirst``'s ``[B, C, T, H, W]`` in the memory order the rows have there;
            exact where the original's tensor at that dropout is that tensor, which winsp cannot always see: a
            dropout inside a forward the plan swapped is refused with a pointer to ``check_parallel``, and one where
            no such draw is the original's is refused). Channel-wise and alpha dropouts on local rows are refused
            either way; dropout on other tensors runs unchanged.
            ``"unchecked"``: functional dropout is not watched (it costs about 2 us a torch call in a training
            forward), for a model known to call none on local rows; ``nn.Dropout`` modules are still refused.
        replicated: tokens every rank holds whole (text, a CLS token, registers): where the region's input has them
            and which layers they join (:class:`~winsp.adoption.replicated.Replicated`); a joining layer's attention
            passes them as the request's text, the others pass none. An argument name or index stands for
            ``Replicated(at=...)``: a separate argument of the region's start, joining every layer.
        space_time: a model that reshapes its own batches between per-frame ``[B*T, S, C]`` and per-position
            ``[B*S, T, C]`` (:class:`~winsp.adoption.space_time.SpaceTime`): which blocks take which, and the
            positional and frame tables it adds to them.
        skips: glob of modules inside the region whose outputs also feed skip connections on the whole tensor (a
            hierarchical encoder's stages feeding a CNN decoder): each is gathered once at its return, and scattered
            again (no communication) when the next of them is called with it (:mod:`winsp.adoption.skips`).
    """

    # region, stages, attention and make_attention are required (checked below); region may be left out with
    # stages=Hourglass(...), and parallelize() fills both in before it reads them
    region: Region = None  # type: ignore[assignment]
    stages: tuple[Stage, ...] = None  # type: ignore[assignment]
    attention: Union[str, tuple[str, ...]] = None  # type: ignore[assignment]
    make_attention: Callable[[nn.Module, int], nn.Module] = None  # type: ignore[assignment]
    layer_entry: Union[str, tuple[str, ...]] = "parent"
    grid_changes: Union[str, tuple[str, ...], None] = None
    make_grid_change: Optional[Callable[[nn.Module, int], nn.Module]] = None
    swaps: tuple[tuple[str, Callable[[nn.Module], nn.Module]], ...] = ()
    per_sample: Union[str, tuple[str, ...], None] = None
    forward_order: Optional[tuple[str, ...]] = None
    dropout: str = "refuse"
    replicated: Optional[Replicated] = None  # an argument name or index is taken as Replicated(at=...)
    space_time: Optional[SpaceTime] = None
    skips: Union[str, tuple[str, ...], None] = None

    def __post_init__(self) -> None:
        hourglass = isinstance(self.stages, Hourglass)
        if not isinstance(self.region, Region) and not (hourglass and self.region is None):
            raise ValueError(f"ParallelPlan.region must be a winsp.Region (it may be left out with "
                             f"stages=Hourglass(...)), got {type(self.region).__name__}")
        for name in ("stages", "attention", "make_attention"):
            if getattr(self, name) is None:
                raise ValueError(f"ParallelPlan.{name} is required")
        for name, optional in (("attention", False), ("layer_entry", False), ("grid_changes", True),
                               ("per_sample", True), ("skips", True)):
            globs = getattr(self, name)
            if not (optional and globs is None) and not _are_globs(globs):
                what = ('"parent" (the attention\'s parent module) or a glob, or a tuple of globs, of one entry '
                        "module per layer" if name == "layer_entry" else "a glob, or a tuple of globs, of module paths")
                raise ValueError(f"ParallelPlan.{name} must be {what}{' (or None)' if optional else ''}, got "
                                 f"{globs!r}")
        if isinstance(self.replicated, (str, int)) and not isinstance(self.replicated, bool):
            object.__setattr__(self, "replicated", Replicated(at=self.replicated))
        if self.replicated is not None and not isinstance(self.replicated, Replicated):
            raise ValueError(f"ParallelPlan.replicated must be a winsp.adoption.Replicated (or an argument name or "
                             f"index: Replicated(at=...)), got {type(self.replicated).__name__}")
        if self.space_time is not None and not isinstance(self.space_time, SpaceTime):
            raise ValueError(f"ParallelPlan.space_time must be a winsp.adoption.SpaceTime, got "
                             f"{type(self.space_time).__name__}")
        if self.space_time is not None and self.dropout == "rows":
            raise ValueError("ParallelPlan: dropout='rows' draws the original's mask for tensors whose tokens are "
                             "row-major; a space_time model's per-position batches [B*S, T, C] are not: keep "
                             "dropout='refuse' (train with the model's dropout off, or end the region before it)")
        if self.space_time is not None and self.replicated is not None:
            raise ValueError("ParallelPlan: space_time with replicated tokens is not supported (the presented sample "
                             "would hold them beside the rows)")
        if self.dropout not in region_dropout.DROPOUT_POLICIES:
            raise ValueError(f"ParallelPlan.dropout must be one of {region_dropout.DROPOUT_POLICIES}, got "
                             f"{self.dropout!r}")
        if not hourglass:
            object.__setattr__(self, "stages", check_stages(self.stages))
        elif self.grid_changes is not None or self.forward_order is not None:
            raise ValueError("ParallelPlan: stages=Hourglass(...) gives the grid changes and the forward order; leave "
                             "grid_changes and forward_order out")
        if (self.grid_changes is None and not hourglass) != (self.make_grid_change is None):
            raise ValueError("ParallelPlan: give make_grid_change with stages=Hourglass(...)" if hourglass else
                             "ParallelPlan: give grid_changes and make_grid_change together")
        object.__setattr__(self, "swaps", tuple(tuple(s) for s in self.swaps))
        if self.forward_order is not None:
            order = (self.forward_order,) if isinstance(self.forward_order, str) else tuple(self.forward_order)
            if not order or not all(isinstance(g, str) and g for g in order):
                raise ValueError(f"ParallelPlan.forward_order must be non-empty globs of module paths, got "
                                 f"{self.forward_order!r}")
            object.__setattr__(self, "forward_order", order)

    @property
    def num_layers(self) -> int:
        if isinstance(self.stages, Hourglass):
            raise ValueError("ParallelPlan.num_layers: the stages of an Hourglass are read from the model")
        return sum(len(st.layers) for st in self.stages)


def _are_globs(value) -> bool:
    """Whether ``value`` is a non-empty glob or a non-empty tuple / list of them (what a plan's module fields take)."""
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, (tuple, list)) and bool(value) and all(isinstance(g, str) and g for g in value)


def adopt(module: nn.Module, original: nn.Module) -> nn.Module:
    """Register ``original``'s parameters, buffers (same persistence) and submodules on ``module`` under the same
    names, so a swapped-in module shares the original's tensors and keeps its ``state_dict`` keys; returns ``module``.
    """
    for name, param in original.named_parameters(recurse=False):
        module.register_parameter(name, param)
    for name, buf in original.named_buffers(recurse=False):
        module.register_buffer(name, buf, persistent=name not in original._non_persistent_buffers_set)
    for name, child in original.named_children():
        module.add_module(name, child)
    module.train(original.training)
    return module


def is_parallelized(model: nn.Module) -> bool:
    """Whether :func:`parallelize` was applied to ``model`` (and not undone)."""
    return getattr(model, "_winsp_parallel", None) is not None


@dataclass(eq=False)
class _Applied:
    plan: ParallelPlan
    model: nn.Module
    runtime: WindowRuntime
    stated: bool  # the forward order was stated (ParallelPlan.forward_order or an Hourglass): recording only checks
    swapped: list = field(default_factory=list)  # (parent, name, original, path) in application order
    handles: list = field(default_factory=list)
    tokens: list = field(default_factory=list)  # ContextVar tokens of regions in progress
    order: ForwardOrder = field(default_factory=lambda: ForwardOrder(()))  # replaced by _apply
    dropouts: list = field(default_factory=list)  # per region call in progress: its RegionDropout (None in eval)
    depths: list = field(default_factory=list)  # per model call in progress: the region calls open when it began
    numbering: tuple = ()  # (attention paths, entry paths, {stage: grid change path}) as layers are numbered now
    step_paths: dict = field(default_factory=dict)  # (kind, index) -> the module path that step starts at
    text_layers: Optional[tuple] = None  # per layer, whether the plan's replicated tokens join it
    carried: dict = field(default_factory=dict)  # path -> the swapped module a renumbering replaces (hooks carried)
    batches: dict = field(default_factory=dict)  # SpaceTime: entry path -> "frames" / "positions"
    returns: list = field(default_factory=list)  # SpaceTime: per block call in progress, the layer its rows came from
    tables: list = field(default_factory=list)  # SpaceTime: the table dicts installed (space_time.install_tables)
    wholes: list = field(default_factory=list)  # per region call in progress: whether a skip gathered its rows


def path_matches(path: str, pattern: str) -> bool:
    """Whether module path ``path`` matches ``pattern``, component by component (split on ``.``).

    A component of the pattern is an fnmatch glob of one path component (``*`` never crosses a dot, so
    ``layers.*.blocks.*`` does not match ``layers.0.blocks.0.attn``); ``**`` matches any number of components,
    none included (``body.**.attn``).
    """
    def match(parts: list[str], globs: list[str]) -> bool:
        if not globs:
            return not parts
        if globs[0] == "**":
            return any(match(parts[i:], globs[1:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], globs[0]) and match(parts[1:], globs[1:])

    return match(path.split("."), pattern.split("."))


def _matches(model: nn.Module, pattern, what: str) -> list[tuple[str, nn.Module]]:
    """Modules whose path matches the glob ``pattern`` (or any glob of a tuple of them), in ``named_modules`` order."""
    patterns = (pattern,) if isinstance(pattern, str) else tuple(pattern)
    found = [(n, m) for n, m in model.named_modules() if n and any(path_matches(n, p) for p in patterns)]
    if not found:
        raise ValueError(f"ParallelPlan.{what}={pattern!r} matches no module of {type(model).__name__}")
    return found


def _in_forward_order(found: list[tuple[str, nn.Module]], order: Optional[tuple[str, ...]],
                      what: str) -> list[tuple[str, nn.Module]]:
    """``found`` sorted by the first ``order`` glob matching each path or a parent of it (stable); as is for None."""
    if order is None:
        return found

    def rank(path: str) -> int:
        parts = path.split(".")
        for i, pattern in enumerate(order):
            if any(path_matches(".".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
                return i
        raise ValueError(f"ParallelPlan.{what} matches {path!r}, which no glob of ParallelPlan.forward_order={order!r} "
                         f"covers; list every container the forward runs, in the order it runs them")

    ranks = {path: rank(path) for path, _ in found}
    return sorted(found, key=lambda item: ranks[item[0]])


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), name


def _swap(model: nn.Module, path: str, new: nn.Module, applied: _Applied, what: str) -> None:
    parent, name = _parent(model, path)
    original = getattr(parent, name)
    before = {k: v for k, v in original.state_dict(keep_vars=True).items()}
    after = {k: v for k, v in new.state_dict(keep_vars=True).items()}
    if before.keys() != after.keys() or any(before[k] is not after[k] for k in before):
        differ = sorted(set(before) ^ set(after)) or sorted(k for k in before if before[k] is not after[k])
        raise ValueError(f"{what} for {path!r} must reuse the original module's parameters and buffers under the "
                         f"same names (state_dict keys unchanged; winsp.adopt(new, original) does it); these "
                         f"differ: {differ}")
    new.train(original.training)
    previous = applied.carried.pop(path, None)
    if previous is not None and _same_swap(previous, new):  # a renumbering of a winsp.swapped module: kept, renumbered
        previous._modules.update(new._modules)  # its children as they are now (a nested swap may have rebuilt one)
        previous.index, new = new.index, previous
    elif previous is not None:  # a renumbering rebuilt it: the hooks registered on the module it replaces carry over
        for hooks in HOOK_DICTS + ("_backward_hooks", "_backward_pre_hooks"):
            if hasattr(previous, hooks):
                object.__setattr__(new, hooks, getattr(previous, hooks))
    parent._modules[name] = new
    applied.swapped.append((parent, name, original, path))


def _with_hourglass(model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
    """``plan`` with an :class:`Hourglass`'s stages, grid changes, forward order (and default region) filled in."""
    if not isinstance(plan.stages, Hourglass):
        return plan
    hourglass = plan.stages

    def attention(prefix: str) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in _matches(model, plan.attention, "attention") if n.startswith(prefix + ".")]

    fields = hourglass.resolve(model, attention, lambda globs, what: _matches(model, globs, what))
    start, end = fields.pop("region_paths")
    region = plan.region or Region(start, end, hourglass.tokens if hourglass.tokens is not None else ChannelsLast())
    return ParallelPlan(**{**plan.__dict__, **fields, "region": region})


def parallelize(model: nn.Module, plan: ParallelPlan, config: Optional[DiffusionParallelConfig] = None, *,
                group=None) -> nn.Module:
    """Make ``model`` window-parallel in place as ``plan`` says, on the SP group ``config`` asks for; returns it.

    ``config`` None runs one rank, or all ranks of ``group``. Under ``torch.distributed`` pass
    ``DiffusionParallelConfig(sp_degree=N)`` (the world, or ``group=`` a subgroup of N ranks: a process group, a
    1-D ``DeviceMesh``, or ``mesh["sp"]`` of a (dp, sp) mesh whose dp groups take different samples). Every rank of
    the group must call the model with identical inputs; the region's output is complete on every rank. Gradients
    follow winsp's convention: call ``winsp.sync_gradients(model)`` after ``backward`` (not needed when FSDP2 shards
    the weights over every rank: :mod:`winsp.adoption.sharding`). Shard after this call, never before.
    Whatever a forward raises inside the region, winsp leaves nothing behind (no current request, no dropout mode
    pushed): the next forward, and code outside the region, run as if it had not happened.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"parallelize: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, ParallelPlan):
        raise ValueError(f"parallelize: plan must be a winsp.ParallelPlan, got {type(plan).__name__}")
    if is_parallelized(model):
        raise ValueError("parallelize: this model is parallelized already; call winsp.unparallelize(model) first")
    _refuse_sharded(model)
    stated = plan.forward_order is not None or isinstance(plan.stages, Hourglass)
    plan = _with_hourglass(model, plan)
    modules = dict(model.named_modules())
    for end in ("start", "end"):
        path = getattr(plan.region, end)
        if path not in modules:
            raise ValueError(f"Region.{end}={path!r} is not a module path of {type(model).__name__}")
    attention = _in_forward_order(_matches(model, plan.attention, "attention"), plan.forward_order, "attention")
    if len(attention) != plan.num_layers:
        raise ValueError(f"ParallelPlan.attention={plan.attention!r} matches {len(attention)} modules but the stages "
                         f"list {plan.num_layers} layers ({[len(s.layers) for s in plan.stages]} per stage)")
    if plan.layer_entry == "parent":
        entry_paths = [path.rpartition(".")[0] for path, _ in attention]
    else:
        entry_paths = [path for path, _ in _in_forward_order(_matches(model, plan.layer_entry, "layer_entry"),
                                                             plan.forward_order, "layer_entry")]
        if len(entry_paths) != len(attention):
            raise ValueError(f"ParallelPlan.layer_entry={plan.layer_entry!r} matches {len(entry_paths)} modules, one "
                             f"per attention layer ({len(attention)}) is needed")
    if len(set(entry_paths)) != len(entry_paths):
        shared = sorted({p for p in entry_paths if entry_paths.count(p) > 1})
        raise ValueError(f"attention layers share the entry module(s) {shared}: rows can move into one layer's layout "
                         f"per entry; give ParallelPlan.layer_entry a glob matching one module per layer")
    changing = [s for s, st in enumerate(plan.stages) if st.changes_grid]
    grid_changes = _in_forward_order(_matches(model, plan.grid_changes, "grid_changes"), plan.forward_order,
                                     "grid_changes") if plan.grid_changes else []
    if len(grid_changes) != len(changing):
        raise ValueError(f"ParallelPlan.grid_changes matches {len(grid_changes)} modules but {len(changing)} stages "
                         f"change the grid (stages {changing})")
    if not plan.stages[-1].layers and plan.replicated is not None:
        raise ValueError("ParallelPlan: a region that ends with a grid change (a last Stage without layers) cannot "
                         "hold replicated tokens")
    if plan.per_sample is not None and plan.replicated is not None and plan.replicated.held:
        raise ValueError(f"ParallelPlan.per_sample with Replicated(at={plan.replicated.at!r}): the held tokens share "
                         f"the rows' tensor, which per-sample modules cannot take per row; pass them as a separate "
                         f"argument (Replicated(at=name)) or swap those modules")
    if plan.per_sample is not None:
        dims = getattr(plan.region.tokens, "spatial_dims", None)
        if dims not in (1, 2, 3):
            raise ValueError(f"ParallelPlan.per_sample needs the region's grid dimensions; "
                             f"{type(plan.region.tokens).__name__} has no spatial_dims of 1, 2 or 3")
        _matches(model, plan.per_sample, "per_sample")
    _refuse_splitting_planner(config, plan.stages)
    runtime = WindowRuntime.from_config(config, plan.stages, group=group, split_windows=False)
    applied = _Applied(plan=plan, model=model, runtime=runtime, stated=stated)
    grid_paths = dict(zip(changing, (p for p, _ in grid_changes), strict=True))
    _apply(applied, ([p for p, _ in attention], entry_paths, grid_paths))
    # torch's stubs type Module.__setattr__ for tensors and modules only; plain attributes are set the same way
    model._winsp_runtime = runtime  # type: ignore[assignment]
    model._winsp_parallel = applied  # type: ignore[assignment]
    return model


def _same_swap(previous: nn.Module, new: nn.Module) -> bool:
    """Whether ``new`` is ``previous`` (a :func:`winsp.swapped` module) again but for its index."""
    from winsp.adoption.swapped import Swapped

    return (type(previous) is Swapped and type(new) is Swapped and previous.fn is new.fn
            and previous.checkpoint == new.checkpoint and previous._swapped_class is new._swapped_class)


def _refuse_splitting_planner(config: Optional[DiffusionParallelConfig], stages: Sequence[Stage]) -> None:
    """A planner that splits windows needs stages that may be split: parallelize keeps windows whole by default."""
    planner = getattr(config, "planner", "auto")
    whole = [s for s, st in enumerate(stages) if st.split_windows is not True]
    if planner in SPLITTING_PLANNERS and whole:
        raise ValueError(f'parallelize: planner "{planner}" splits windows, but winsp.parallelize keeps every window '
                         f"whole unless the plan's Stage says split_windows=True (stages {whole} do not): give "
                         f"winsp.Stage(..., split_windows=True) to the stages whose windows may be split (not one "
                         f'whose attention takes a score_mod / mask_mod), or use planner "auto", "lpt" or "locality"')


def _refuse_sharded(model: nn.Module) -> None:
    """Refuse a model whose weights FSDP2 (or any DTensor API) sharded already: FSDP keeps references to the modules
    it sharded, and its all-gathers would fill the originals, not winsp's swapped modules. Sharding comes second."""
    from winsp.adoption.sharding import is_sharded_module

    for path, module in model.named_modules():
        if is_sharded_module(module):
            where = f"its module {path!r}" if path else "the model"
            raise ValueError(f"parallelize: {where} is sharded already (FSDP2 fully_shard or DTensor parameters); "
                             f"call winsp.parallelize first and shard afterwards (fully_shard the blocks, then the "
                             f"root, or winsp.adoption.shard_weights(model, mesh))")


def _apply(applied: _Applied, numbering: tuple) -> None:
    """Swap the modules and hook the model for the layers numbered as ``numbering`` says; all or nothing."""
    from winsp.adoption.per_sample import PerSampleOnRows  # it builds on adopt()

    model, plan = applied.model, applied.plan
    attention, entry_paths, grid_paths = numbering
    applied.numbering = numbering
    if plan.replicated is not None:  # per layer in this numbering (joins may name the attention modules)
        applied.text_layers = plan.replicated.layers([len(st.layers) for st in plan.stages], attention)
    landing = len(applied.runtime.schedule) > len(attention)  # a last stage without layers has one to land in
    applied.runtime.layer_names = tuple(attention) + ((f"(rows after {grid_paths[max(grid_paths)]})",) if landing
                                                      else ())
    applied.order = ForwardOrder(_steps(plan, entry_paths, grid_paths))
    per_sample = ([p for p, _ in _matches(model, plan.per_sample, "per_sample")]
                  if plan.per_sample is not None else [])
    swaps = [(path, factory) for pattern, factory in plan.swaps for path, _ in _matches(model, pattern, "swaps")]
    try:
        for layer, path in enumerate(attention):
            _swap(model, path, plan.make_attention(model.get_submodule(path), layer), applied, "make_attention")
        make_grid_change = plan.make_grid_change
        for stage, path in grid_paths.items():
            assert make_grid_change is not None  # checked by ParallelPlan: grid changes come with make_grid_change
            _swap(model, path, make_grid_change(model.get_submodule(path), stage), applied, "make_grid_change")
        dims = int(getattr(plan.region.tokens, "spatial_dims", 0))  # checked by parallelize() where per_sample is set
        for path in per_sample:
            _swap(model, path, PerSampleOnRows(model.get_submodule(path), dims, path), applied, "per_sample")
        for path, factory in swaps:
            _swap(model, path, factory(model.get_submodule(path)), applied, "swaps")
        applied.step_paths = {("layer", layer): path for layer, path in enumerate(entry_paths)}
        applied.step_paths.update({("grid", stage): path for stage, path in grid_paths.items()})
        if plan.region.start != plan.region.end:  # the forward between them is the model's own: hook the model
            applied.handles.append(model.register_forward_pre_hook(_model_call(applied), with_kwargs=True))
            applied.handles.append(model.register_forward_hook(_model_return(applied), always_call=True))
        # before the entries' hooks: a region may start at its first block, which is also a layer entry
        applied.handles.append(model.get_submodule(plan.region.start).register_forward_pre_hook(
            _region_start(applied), with_kwargs=True))
        for path in entry_paths:  # looked up after the swaps: an entry may have been swapped
            entry = model.get_submodule(path) if path else model
            applied.handles.append(entry.register_forward_pre_hook(_layer_entry(path, applied), with_kwargs=True))
        for path in grid_paths.values():
            applied.handles.append(model.get_submodule(path).register_forward_pre_hook(_grid_change(path, applied)))
        applied.handles += watch_rows(model, _inner_paths(model, plan.region, list(grid_paths.values())),
                                      dropout=plan.dropout, modes=applied.dropouts)
        applied.handles += watch_recompute(model, _inner_paths(model, plan.region, []),  # activation checkpointing
                                           modes=applied.dropouts)
        for path, module in (_matches(model, plan.skips, "skips") if plan.skips is not None else []):
            applied.handles.append(module.register_forward_pre_hook(skips.skip_call(path, applied), with_kwargs=True))
            applied.handles.append(module.register_forward_hook(skips.skip_return(path, applied)))
        applied.handles.append(model.get_submodule(plan.region.end).register_forward_hook(
            _region_end(plan.region.tokens, applied), with_kwargs=True, always_call=True))
        if plan.space_time is not None:
            applied.batches = space_time.batch_kinds(plan.space_time, entry_paths)
            for path in applied.batches:
                applied.handles.append(model.get_submodule(path).register_forward_hook(
                    _block_return(applied), always_call=True))
            applied.tables = install_tables(model, plan.space_time.tables, lambda: context.current_request_or_none()
                                            if applied.tokens and applied.order.recording is None else None)
    except BaseException:
        _undo(applied)
        raise


def unparallelize(model: nn.Module) -> nn.Module:
    """Undo :func:`parallelize`: the original modules back in place, hooks removed, the runtime detached."""
    applied = getattr(model, "_winsp_parallel", None)
    if applied is None:
        raise ValueError("unparallelize: this model was not parallelized by winsp.parallelize")
    from winsp.adoption.sharding import is_sharded_module

    if any(is_sharded_module(m) for m in model.modules()):
        raise ValueError("unparallelize: this model's weights were sharded (FSDP2) after parallelize, and FSDP now "
                         "fills the swapped modules; build the model again to get the original back")
    _undo(applied)
    del model._winsp_parallel
    del model._winsp_runtime
    return model


def _undo(applied: _Applied) -> None:
    for handle in reversed(applied.handles):
        handle.remove()
    for parent, name, original, _ in reversed(applied.swapped):
        parent._modules[name] = original
    remove_tables(applied.tables)
    applied.tables.clear()
    applied.handles.clear()
    applied.swapped.clear()


def _steps(plan: ParallelPlan, entry_paths: list[str], grid_paths: dict[int, str]) -> tuple[Step, ...]:
    """The plan's steps in the order its forward must run them: per stage, its grid change, then its layers."""
    steps, layer = [], 0
    for s, st in enumerate(plan.stages):
        if st.changes_grid:
            steps.append(Step("grid", s, grid_paths[s]))
        for _ in st.layers:
            steps.append(Step("layer", layer, entry_paths[layer]))
            layer += 1
    return tuple(steps)


def _inner_paths(model: nn.Module, region: Region, grid_paths: list[str]) -> list[str]:
    """Modules inside the region whose row shape is checked: below the region's start and end (or their common
    parent), except the grid changes and their parents (their output is on another grid)."""
    start, end = region.start.split("."), region.end.split(".")
    n = 0
    while n < min(len(start), len(end)) and start[n] == end[n]:
        n += 1
    top = ".".join(start[:n]) if region.start and region.end else ""
    skip = {region.start, region.end}
    for path in grid_paths:
        parts = path.split(".")
        skip |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
    return [path for path, _ in model.named_modules()
            if path and path not in skip and (not top or path.startswith(top + "."))]


def _layer_entry(path: str, applied: _Applied):
    """Layer entry ``path``'s hook; its layer number is looked up when it runs (a hook that was already running when
    the first forward renumbered the layers acts for the new numbering). The tokens are the entry's first positional
    argument or, for a call by keywords only, its first keyword argument."""
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        layer, order = applied.numbering[1].index(path), applied.order
        x = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(x, Tensor):
            raise ValueError(f"{type(module).__name__} (entry of window layer {layer}) must take the tokens as its "
                             f"first argument (positional, or the first keyword of a call by keywords)")
        if applied.wholes and applied.wholes[-1]:
            raise ValueError(f"winsp.parallelize: {path!r} (entry of window layer {layer}) is called with the whole "
                             f"tensor a ParallelPlan.skips module gathered: the first module to take it back must be a "
                             f"skips module (its input is scattered again); add it to ParallelPlan.skips")
        order.arrive("layer", layer)
        if path in applied.batches:
            return space_time.enter_block(context.current_request(), layer, path, applied.batches[path], args,
                                          kwargs, applied.returns)
        moved = _to_layer(context.current_request(), x, layer, applied.plan.replicated)
        if args:
            return (moved,) + tuple(args[1:]), kwargs
        return args, {**kwargs, next(iter(kwargs)): moved}

    return hook


def _to_layer(request, x: Tensor, layer: int, replicated: Optional[Replicated]) -> Tensor:
    """``request.to_layer`` of a region tensor: local rows ``[L, ...]``, with the plan's held replicated tokens at
    their side (``[R + L, ...]``), or either as a batch of one (``[1, L, ...]``: a TokenIO that presents the local rows
    so, such as :class:`~winsp.adoption.token_io.Patches`)."""
    held = request.num_text_rows if replicated is not None and replicated.held else 0
    rows = request._current_layout().num_rows + held
    one = x.dim() >= 2 and x.shape[0] == 1 and x.shape[0] != rows and x.shape[1] == rows
    y = x[0] if one else x
    if held and replicated is not None:
        tokens, local = replicated.part(y, held)
        y = replicated.join(request.to_layer(local, layer), tokens)
    else:
        y = request.to_layer(y, layer)
    return _in_memory_order(y[None], x) if one else y


def _in_memory_order(y: Tensor, x: Tensor) -> Tensor:
    """``y`` laid out in memory in ``x``'s dim order (a batch of one whose memory is channels-first stays so, as the
    original's tensor is: its dropout draws follow that order)."""
    if x.is_contiguous() or y.dim() != x.dim():
        return y
    order = sorted(range(x.dim()), key=lambda d: -int(x.stride()[d]))  # outermost first; ties keep the dims' order
    out = y.new_empty([y.shape[d] for d in order]).permute([order.index(d) for d in range(y.dim())])
    return out.copy_(y)


def _block_return(applied: _Applied):
    """SpaceTime: a block's output goes back to the layout its rows came in (sizes the model read stay true)."""
    def hook(module: nn.Module, args: tuple, output: Any):
        back, kind = applied.returns.pop() if applied.returns else (None, None)
        if back is None or kind is None or output is None or context.current_request_or_none() is None:
            return None
        out = space_time.leave_block(context.current_request(), TokenIO.first_item(output), kind, back)
        return TokenIO.with_first_item(output, out)

    return hook


def _grid_change(path: str, applied: _Applied):
    def hook(module: nn.Module, args: tuple):
        applied.order.arrive("grid", next(s for s, p in applied.numbering[2].items() if p == path))

    return hook


def _region_start(applied: _Applied):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if applied.order.recording is not None:  # a recording forward of the original modules
            return None
        plan = applied.plan
        if plan.region.start == plan.region.end and not applied.order.dry_run_done:
            dry_run(applied, module, args, kwargs, repeats=False)
        io, replicated, held, lengths = plan.region.tokens, plan.replicated, None, None
        if replicated is not None:
            args, kwargs, held, counts = replicated.take(module, args, kwargs)
        if plan.space_time is not None:
            space_time.check_one_sample(args[0] if args else None)
        rows, grids = io.read(args, kwargs)
        if replicated is not None:
            lengths = replicated.lengths(counts, len(grids))
        request = applied.runtime.request(grids, lengths, device=rows.device, dtype=rows.dtype,
                                          text_layers=applied.text_layers)
        local = request.scatter(rows)
        new_args, new_kwargs = io.with_rows(args, kwargs, local)
        if plan.space_time is not None:  # one sample of one frame: the model's own reshapes keep the rows in order
            new_args = (space_time.present(new_args[0], args[0]),) + tuple(new_args[1:])
        if held is not None and replicated is not None:
            new_args = (replicated.join(new_args[0], held),) + tuple(new_args[1:])
        watched = module.training and plan.dropout != "unchecked"
        dropout = region_dropout.enter(plan.dropout, plan.region.start) if watched else None
        if dropout is not None:
            dropout.tokens = io
        applied.tokens.append(context._enter(request))  # nothing can fail from here to the return
        applied.dropouts.append(dropout)
        applied.wholes.append(False)
        applied.order.begin()
        return new_args, new_kwargs

    return hook


def _model_call(applied: _Applied):
    """For a region whose start and end are different modules: the model's call notes how many region calls are open
    (its return closes what it opened, had the forward raised between them) and, before the first forward, records
    the forward's steps (the region may run any number of times in it)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        applied.depths.append(len(applied.tokens))
        if applied.order.recording is None and not applied.order.dry_run_done and not applied.tokens:
            dry_run(applied, module, args, kwargs, repeats=True)
        return None

    return hook


def _model_return(applied: _Applied):
    def hook(module: nn.Module, args: tuple, output: Any):
        depth = applied.depths.pop() if applied.depths else 0
        while len(applied.tokens) > depth:  # the forward raised inside a region: close it
            _close_region_call(applied)
        return None

    return hook


def _close_region_call(applied: _Applied) -> None:
    token, dropout = applied.tokens.pop(), applied.dropouts.pop()
    if applied.wholes:
        applied.wholes.pop()
    if applied.order.progress:
        applied.order.progress.pop()
    try:
        region_dropout.leave(dropout)
    finally:
        context._leave(token)



def _region_end(io: TokenIO, applied: _Applied):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if not applied.tokens or len(applied.tokens) <= (applied.depths[-1] if applied.depths else 0):
            return None  # no region call of this model call is open (a recording forward, or the end ran alone)
        token, dropout = applied.tokens.pop(), applied.dropouts.pop()
        whole = applied.wholes.pop() if applied.wholes else False
        try:
            applied.order.end(completed=output is not None)
            if output is None or whole:  # the region raised (the hook only restores the context), or a skip gathered
                return None
            request = context.current_request()
            replicated = applied.plan.replicated
            local = io.output_rows(output)
            if applied.plan.space_time is not None:
                local = local.flatten(0, -2)
            if replicated is not None and replicated.held:  # the held tokens go back next to the rows
                held, local = replicated.part(local, request.num_text_rows)
            grids = request.stage_model_grids[request.stage]
            rebuilt = io.with_output(output, request.gather(local), grids)
            if replicated is None or not replicated.held:
                return rebuilt
            tokens = TokenIO.first_item(rebuilt)
            return TokenIO.with_first_item(rebuilt, replicated.write_back(tokens, held, len(grids)))
        finally:
            try:
                region_dropout.leave(dropout)
            finally:
                context._leave(token)

    return hook
