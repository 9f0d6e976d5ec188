"""Checks that run inside a :func:`winsp.parallelize` region, so a plan that does not fit the model fails where the
misfit is, naming the module, instead of a symptom layers later.

- **Forward order**: the plan numbers the attention layers and grid changes; the model's forward must run them in
  that order (its stages one after the other, each grid change between two stages). Every layer entry and grid change
  checks that it is the step the plan expects next, *before* its rows move; the region's end checks that none was
  left out.
- **Local row shape**: inside the region a tensor of local rows is ``[L, ...]`` with ``L`` this rank's rows of the
  current layout. A module that takes such rows and returns a tensor whose first dimension is not ``L`` (a reshape
  into ``[N, 1, L, C]``, a pool over tokens) assumes the whole grid; it is refused by path right after it runs.
- **Element-wise dropout**: ``nn.Dropout`` on local rows would draw other numbers than the original's over its full
  tensor; an unswapped one in training mode is refused by path before it runs, suggesting :class:`winsp.RowDropout`
  or ``ParallelPlan.dropout="rows"`` only where its draws are the original's, and saying so where winsp cannot know
  (:mod:`winsp.adoption.dropout_advice`); a swapped-in ``RowDropout`` is refused where its draw is known not to be.
  Functional dropout calls are :mod:`winsp.adoption.region_dropout`'s; the hooks here keep its stack of the region
  modules running, so a refusal names the innermost one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import Tensor, nn

from winsp.adoption.dropout_advice import OFF, advice, not_exact_refusal, presented_dims
from winsp.runtime.context import current_request_or_none
from winsp.runtime.drop_path import RowDropout

__all__ = ["Step", "ForwardOrder", "watch_rows"]


@dataclass(frozen=True)
class Step:
    """One step of the plan's forward: ``kind`` ``"layer"`` (layer ``index``'s entry) or ``"grid"`` (the grid change
    into stage ``index``), at module ``path``."""

    kind: str
    index: int
    path: str

    def __str__(self) -> str:
        what = f"window layer {self.index}" if self.kind == "layer" else f"the grid change into stage {self.index}"
        return f"{self.path!r} ({what})"


@dataclass(eq=False)
class ForwardOrder:
    """The plan's steps in forward order, and how far each region call in progress has come.

    ``recording`` is set during :meth:`record`'s forward of the original modules: steps are then noted, not checked.
    """

    steps: tuple[Step, ...]
    progress: list = field(default_factory=list)  # one position per region call in progress
    recording: Optional[list] = None
    dry_run_done: bool = False

    def begin(self) -> None:
        self.progress.append(0)

    def end(self, completed: bool) -> None:
        pos = self.progress.pop()
        if completed and pos != len(self.steps):
            raise ValueError(self._short(pos))

    def _short(self, pos: int) -> str:
        return (f"winsp.parallelize: the region ended after {pos} of the plan's {len(self.steps)} steps; "
                f"{self.steps[pos]} never ran. The plan lists more attention layers or grid changes than this forward "
                f"runs (or in another order)")

    def _mismatch(self, pos: int, kind: str, index: int, when: str) -> str:
        expected = self.steps[pos] if pos < len(self.steps) else None
        ran = next(s for s in self.steps if (s.kind, s.index) == (kind, index))
        want = f"expects {expected} next" if expected is not None else "has no step left"
        return (f"winsp.parallelize: the forward runs {ran} where the plan {want} (step {pos}). The plan's order does "
                f"not follow the order the model runs its modules in: attention and grid_changes matches are taken in "
                f"named_modules (registration) order unless ParallelPlan.forward_order lists the model's containers "
                f"in the order its forward runs them. {when}")

    def arrive(self, kind: str, index: int) -> None:
        """Called as ``kind`` / ``index`` starts; raises if the plan expects another step there."""
        if self.recording is not None:
            self.recording.append((kind, index))
            return
        if not self.progress:
            return
        pos = self.progress[-1]
        expected = self.steps[pos] if pos < len(self.steps) else None
        if expected is None or (expected.kind, expected.index) != (kind, index):
            path = next(s for s in self.steps if (s.kind, s.index) == (kind, index)).path
            raise ValueError(self._mismatch(pos, kind, index, f"Refused before {path!r} moved any rows"))
        self.progress[-1] = pos + 1

    def record(self, run: Callable[[], Any]) -> list:
        """Run ``run()`` (a forward of the original modules), noting the steps it takes instead of checking them;
        returns them. Whatever ``run`` raises propagates."""
        self.recording = []
        try:
            run()
        finally:
            recorded, self.recording = self.recording, None
        return recorded

    def check(self, recorded: list, *, repeats: bool = False, found: str = "a forward on meta tensors") -> None:
        """Raise if ``recorded`` (from :meth:`record`) is not the plan's steps; else note the dry run as done.
        ``repeats``: the recording is of a forward *around* the region (the model's, for a region whose start and end
        are different modules), which may run the region any number of times."""
        n = len(self.steps)
        for pos, (kind, index) in enumerate(recorded):
            at = pos % n if repeats else pos
            step = self.steps[at] if at < n else None
            if step is None or (step.kind, step.index) != (kind, index):
                raise ValueError(self._mismatch(at, kind, index, f"Found by {found} before any rows moved"))
        if (len(recorded) % n if repeats else len(recorded) < n):
            raise ValueError(self._short(len(recorded) % n if repeats else len(recorded))
                             + f"; found by {found} before any rows moved")
        self.dry_run_done = True


def watch_rows(model: nn.Module, paths: list[str], *, dropout: str = "refuse", modes: Optional[list] = None) -> list:
    """Hooks on the modules at ``paths`` checking local row shapes and refusing element-wise dropout modules (unless
    ``dropout="rows"``: their ``F.dropout`` call then draws the original's mask); returns the handles. ``modes``: the
    :class:`~winsp.adoption.region_dropout.RegionDropout` of each region call in progress (None in eval), whose stack of
    module paths the hooks keep."""
    modes = [] if modes is None else modes
    handles = []
    for path in paths:
        module = model.get_submodule(path)
        state: list = []
        handles.append(module.register_forward_pre_hook(_before(path, state, dropout, modes, model)))
        handles.append(module.register_forward_hook(_after(path, state), always_call=True))
    return handles


def _held(x: Any, request) -> bool:
    """Whether ``x`` is this rank's rows with the request's replicated rows beside them."""
    return isinstance(x, Tensor) and x.dim() > 0 and bool(request.num_text_rows) \
        and x.shape[0] == request._current_layout().num_rows + request.num_text_rows


def _dropout_refusal(model: nn.Module, path: str, module: nn.Module, x: Any, request) -> str:
    """The refusal of an unswapped dropout module on local rows, suggesting a row-wise draw only where it is exact
    (:mod:`winsp.adoption.dropout_advice`)."""
    where = (f"winsp.parallelize: {path!r} ({type(module).__name__}, p={module.p}) would draw its mask over this "
             f"rank's local rows only, not as the original draws it over its whole tensor")
    if type(module) is not nn.Dropout:
        return f"{where}; it drops whole channels or scales otherwise, which has no row-wise equivalent: {OFF}"
    applied = getattr(model, "_winsp_parallel", None)
    dims = presented_dims(x, request._current_layout().num_rows, applied.plan.region.tokens if applied else None)
    if dims is not None:  # ChannelsFirst's one sample: dropout='rows' draws over [B, C, T, H, W], RowDropout cannot
        said = advice(model, path, x.new_empty(()).expand(x.shape[dims[0]], x.shape[dims[1]]), request, held=False)
        fix = "ParallelPlan(..., dropout='rows')"
        if said.exact:
            return (f"{where}; set {fix}, which draws the original's mask over the region's [B, C, T, H, W] in the "
                    f"memory order this tensor has (or run the model in eval mode)")
    else:
        said = advice(model, path, x, request, held=_held(x, request))
        fix = (f"ParallelPlan.swaps=[({path!r}, winsp.RowDropout.like)], or for every nn.Dropout of the region "
               f"ParallelPlan(..., dropout='rows')") if said.at is None else "ParallelPlan(..., dropout='rows')"
    if said.exact and said.at is None:
        return f"{where}; swap it: {fix} (or run the model in eval mode)"
    if said.exact:
        return (f"{where}; set ParallelPlan(..., dropout='rows'), which draws the original's mask over the region's "
                f"tokens in their order with the replicated tokens at their place (or run the model in eval mode)")
    return not_exact_refusal(where, said, f"A row-wise draw ({fix}) is the original's only where that tensor is the "
                                          f"region's tokens as they came in")


def _before(path: str, state: list, dropout: str, modes: list, model: nn.Module):
    def hook(module: nn.Module, args: tuple):
        request = current_request_or_none()
        if request is None or request._now is None:
            state.append(None)
            return None
        if (isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0
                and not (dropout == "rows" and type(module) is nn.Dropout)):
            raise ValueError(_dropout_refusal(model, path, module, args[0] if args else None, request))
        if isinstance(module, RowDropout) and module.training and module.p > 0:
            x = args[0] if args else None
            said = advice(model, path, x, request, held=_held(x, request))
            if said.exact is False:
                raise ValueError(f"winsp.parallelize: {path!r} (RowDropout, p={module.p}) cannot draw the original's "
                                 f"mask here: {said.why}. {OFF[0].upper() + OFF[1:]}")
            if said.at is not None:
                raise ValueError(f"winsp.parallelize: {path!r} (RowDropout, p={module.p}) draws row-major over this "
                                 f"rank's rows alone, but the region's tokens come in another order or with replicated "
                                 f"tokens beside them: drop the swap and set ParallelPlan(..., dropout='rows'), which "
                                 f"draws the original's mask over them as they came in")
        if modes and modes[-1] is not None:
            modes[-1].model = model  # for the functional dropout refusal's advice
        rows = request._current_layout().num_rows
        x = args[0] if args else None
        shape = tuple(x.shape) if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == rows else None
        paths = modes[-1].paths if modes and modes[-1] is not None else None
        if paths is not None:
            paths.append(path)
        state.append((rows, shape, request._slot, request.transitions_done, paths))
        return None

    return hook


def _after(path: str, state: list):
    def hook(module: nn.Module, args: tuple, output: Any):
        entry = state.pop() if state else None
        if entry is not None and entry[4] is not None:
            entry[4].pop()
        if entry is None or output is None or entry[1] is None:
            return None
        rows, shape, slot, moves, _ = entry
        request = current_request_or_none()
        if request is None or request._slot != slot or request.transitions_done != moves:
            return None  # the module moved rows itself (it holds a layer entry or a grid change)
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, Tensor) and (out.dim() == 0 or out.shape[0] != rows):
            raise ValueError(
                f"winsp.parallelize: {path!r} ({type(module).__name__}) took local rows {list(shape)} and returned "
                f"{list(out.shape)} (rank {request.group.rank}): inside a window-parallel region a module must keep "
                f"this rank's {rows} rows on dim 0; {_why(shape, tuple(out.shape), request, path)}. Swap it for a "
                f"row-wise version (ParallelPlan.swaps) or end the region before it")
        return None

    return hook


def _why(taken: tuple, returned: tuple, request, path: str) -> str:
    """The likely cause of a changed row shape: a per-sample or per-position tensor broadcast against the rows (adaLN's
    ``cond[:, None, None, :]``, RoPE angles of the whole ``[H, W]`` grid), or a reshape / pool that needs the grid."""
    samples = len(request.stage_model_grids[request.stage])
    rows, trailing = taken[0], taken[1:]
    for lead in range(1, len(returned) - len(taken) + 1):  # the rows at dim `lead`, extra dims broadcast before them
        if returned[lead:lead + len(taken)] == (rows,) + trailing and returned[0] == samples:
            return (f"it broadcast a per-sample tensor [{samples}, ..., C] against the rows (a conditioning "
                    f"vector viewed as [N, 1, 1, C]): name it in ParallelPlan(per_sample={path!r}) (a glob) to run it "
                    f"unchanged on local rows, or in a swapped forward index the tensor per row with "
                    f"winsp.current_request().sample_rows(t)")
    return ("reshaping them into a batch or pooling over tokens needs the whole grid (a tensor per grid position, "
            "such as RoPE positions [H, W, 2], is taken per row by winsp.current_request().grid_rows(t))")
