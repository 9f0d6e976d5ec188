"""The per-request runtime: it owns the layer schedule and every step that crosses ranks.

A model builds one :class:`WindowRuntime` (the schedule of window geometries, one per layer, and the SP group), then
for each forward asks it for a :class:`WindowRequest` over that batch's grids. The request does, in order:
``scatter`` (canonical rows -> this rank's rows of layer 0), ``to_layer`` before each layer (a redistribution only
where the layout really changes), ``attention`` (window attention on local rows plus the replicated-text reduction),
and ``gather`` (the canonical output on every rank). Model code calls only these; it never sees a collective.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from .attention import WindowSegments, available_backends, select_backend, window_attention
from .config import DiffusionParallelConfig
from .geometry import WindowGeometry
from .group import SPGroup
from .layout import check_grids
from .planner import Plan, PlanCache
from .redistribute import count_layout_changes, ensure_layout, gather_rows, scatter_rows
from .text import TextReduction, reduce_window_text, replicated_text_entry

__all__ = ["WindowRuntime", "WindowRequest", "LocalWindows"]

_log = logging.getLogger("winsp")


class LocalWindows:
    """One rank's share of one plan: its windows, rows, window-local coordinates and attention segments."""

    def __init__(self, plan: Plan, rank: int, text_lengths: tuple[int, ...]) -> None:
        self.plan, self.rank = plan, rank
        lay = plan.layout
        self.windows = np.asarray(plan.rank_windows[rank], dtype=np.int64)
        self.num_rows = plan.rank_token_counts[rank]
        counts = lay.token_counts[self.windows]
        samples = lay.window_sample[self.windows]
        text_len = np.asarray(text_lengths, dtype=np.int64)
        text_start = np.concatenate([[0], np.cumsum(text_len)[:-1]]).astype(np.int64)
        self.segments = WindowSegments(
            vid_counts=tuple(int(c) for c in counts),
            txt_lengths=tuple(int(text_len[s]) for s in samples),
            txt_starts=tuple(int(text_start[s]) for s in samples),
        )
        # window-text row k -> packed text row; each text row is divided by its sample's global window count
        lengths = text_len[samples]
        row_target = (np.repeat(text_start[samples] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
                      + np.arange(int(lengths.sum()), dtype=np.int64)) if lengths.size else np.empty(0, np.int64)
        self.text = TextReduction(
            row_target=row_target.astype(np.int64),
            row_divisor=np.repeat(lay.windows_per_sample, text_len),
            num_text_rows=int(text_len.sum()),
        )
        self._device_cache: dict = {}

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, str(device))
        t = self._device_cache.get(key)
        if t is None:
            positions = self.plan.rank_positions(self.rank)
            lay = self.plan.layout
            if name == "coords":
                arr = lay.window_coords[positions]
            else:
                arr = lay.window_sample[lay.window_of_position[positions]]
            t = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
            self._device_cache[key] = t
        return t


_LOCAL_PER_PLAN = 8  # text-length variants kept per plan (prompts of different lengths)


def _local_windows(plan: Plan, rank: int, text_lengths: tuple[int, ...]) -> LocalWindows:
    """This rank's :class:`LocalWindows` of ``plan``, cached on the plan so later requests of the same shape reuse the
    segments, indices and device tensors (a small LRU per plan, since text lengths vary between prompts)."""
    cache = plan.__dict__.setdefault("_local_windows", OrderedDict())
    key = (rank, text_lengths)
    found = cache.get(key)
    if found is None:
        found = LocalWindows(plan, rank, text_lengths)
        cache[key] = found
        while len(cache) > _LOCAL_PER_PLAN:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return found


class WindowRuntime:
    """Window-parallel execution of a model whose layer ``i`` attends inside ``schedule[i]``'s windows.

    Args:
        schedule: one :class:`~winsp.geometry.WindowGeometry` per layer.
        group: a :class:`~winsp.group.SPGroup`, a ``torch.distributed`` process group, or None (one rank).
        attention_backend: ``"auto"`` or a backend name of :mod:`winsp.attention`.
        plan_cache: the plan cache to use (a private LRU cache of 64 plans by default).
    """

    def __init__(
        self,
        schedule: Sequence[WindowGeometry],
        *,
        group=None,
        attention_backend: str = "auto",
        plan_cache: PlanCache | None = None,
    ) -> None:
        schedule = tuple(schedule)
        if not schedule:
            raise ValueError("schedule must list one window geometry per layer; it is empty")
        for i, geom in enumerate(schedule):
            if not isinstance(geom, WindowGeometry):
                raise ValueError(f"schedule[{i}] must be a WindowGeometry, got {type(geom).__name__}")
        self.schedule = schedule
        self.group = group if isinstance(group, SPGroup) else SPGroup(group)
        self.attention_backend = attention_backend
        self.plan_cache = plan_cache if plan_cache is not None else PlanCache()

    @classmethod
    def from_config(
        cls,
        config: DiffusionParallelConfig | None,
        schedule: Sequence[WindowGeometry],
        *,
        group=None,
    ) -> "WindowRuntime":
        """Build the runtime a :class:`DiffusionParallelConfig` asks for.

        ``ulysses_degree`` N = 1 needs no process group. For N > 1 torch.distributed must be initialised; ``group``
        defaults to the world, and its size must equal N.
        """
        config = config if config is not None else DiffusionParallelConfig()
        if not isinstance(config, DiffusionParallelConfig):
            raise ValueError(f"parallel_config must be a DiffusionParallelConfig, got {type(config).__name__}")
        n = config.ulysses_degree
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
        if sp.size != n:
            raise ValueError(
                f"ulysses_degree={n} but the SP group has {sp.size} ranks; pass a subgroup of exactly {n} ranks"
            )
        runtime = cls(schedule, group=sp, attention_backend=config.attention_backend,
                      plan_cache=PlanCache(config.plan_cache_size))
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
        return count_layout_changes(g.fingerprint for g in self.schedule)

    def backend_for(
        self, device: torch.device | str, segments: WindowSegments | None = None, dtype: torch.dtype | None = None
    ) -> str:
        """The attention backend this runtime uses on ``device`` (for ``segments`` if given, else in general)."""
        device = torch.device(device)
        if segments is not None:
            return select_backend(device, segments, self.attention_backend, dtype=dtype)
        if self.attention_backend != "auto":
            return self.attention_backend
        usable = [b for b in available_backends(device) if b != "batched_sdpa"]
        return usable[0] if usable else "grouped_sdpa"

    def describe(self, device: torch.device | str = "cpu") -> str:
        """A one-line report of the execution path, e.g. ``window-aligned SP, Plan A, 4 ranks, grouped SDPA``."""
        backend = self.backend_for(device).replace("_", " ").replace("sdpa", "SDPA")
        if self.world_size == 1:
            return f"window attention, single rank (no communication), {backend}"
        return f"window-aligned SP, Plan A, {self.world_size} ranks, {backend}"

    @property
    def execution_path(self) -> str:
        return self.describe(getattr(self, "_last_device", "cpu"))

    def request(
        self,
        grids: Sequence[Sequence[int]],
        text_lengths: Sequence[int] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> "WindowRequest":
        """Start one forward over a packed batch with these post-patch grids (and text lengths, one per sample)."""
        grids = check_grids(grids)
        if text_lengths is None:
            text_lengths = (0,) * len(grids)
        text_lengths = tuple(int(t) for t in text_lengths)
        if len(text_lengths) != len(grids):
            raise ValueError(f"text_lengths has {len(text_lengths)} entries but there are {len(grids)} samples")
        if any(t < 0 for t in text_lengths):
            raise ValueError(f"text_lengths must be non-negative, got {text_lengths}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._last_device = device
        return WindowRequest(self, grids, text_lengths, device)


class WindowRequest:
    """One forward's window-parallel state: which layout the local rows are in, and the steps between layouts."""

    def __init__(self, runtime: WindowRuntime, grids, text_lengths, device: torch.device) -> None:
        self.runtime = runtime
        self.grids = grids
        self.text_lengths = text_lengths
        self.device = device
        self.group = runtime.group
        self._plans: dict[str, Plan] = {}
        self.layer: int | None = None
        self.transitions_done = 0

    # ---- plans -------------------------------------------------------------------------------------------

    def plan(self, layer: int) -> Plan:
        """The plan of layer ``layer``'s layout (one per distinct geometry, from the runtime's cache)."""
        if not 0 <= layer < len(self.runtime.schedule):
            raise ValueError(f"layer {layer} is outside the schedule of {len(self.runtime.schedule)} layers")
        geom = self.runtime.schedule[layer]
        plan = self._plans.get(geom.fingerprint)
        if plan is None:
            plan = self.runtime.plan_cache.get(self.grids, geom, self.runtime.world_size)
            self._plans[geom.fingerprint] = plan
        return plan

    def local(self, layer: int | None = None) -> LocalWindows:
        """This rank's windows in ``layer``'s layout (default: the current layer)."""
        layer = self._current() if layer is None else layer
        return _local_windows(self.plan(layer), self.group.rank, self.text_lengths)

    def _current(self) -> int:
        if self.layer is None:
            raise RuntimeError("call scatter() first: the request has no local rows yet")
        return self.layer

    # ---- the steps ---------------------------------------------------------------------------------------

    def scatter(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Entry: this rank's rows of a canonical packed tensor [N, ...] in ``layer``'s layout."""
        out = scatter_rows(x, self.plan(layer), self.group)
        self.layer = layer
        return out

    def to_layer(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """``ensure_layout``: bring local rows into ``layer``'s layout; nothing happens if it is the current one."""
        src, dst = self.plan(self._current()), self.plan(layer)
        self.layer = layer
        if src is not dst:
            self.transitions_done += 1
        return ensure_layout(x, src, dst, self.group)

    ensure_layout = to_layer

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Exit: the canonical tensor [N, ...] from every rank's local rows, complete on every rank."""
        return gather_rows(x, self.plan(self._current()), self.group)

    @property
    def window_coords(self) -> torch.Tensor:
        """[L_local, 3] window-local (dt, dh, dw) of each local row in the current layout."""
        return self.local()._on("coords", self.device)

    @property
    def row_sample(self) -> torch.Tensor:
        """[L_local] sample index of each local row in the current layout."""
        return self.local()._on("sample", self.device)

    @property
    def num_local_rows(self) -> int:
        return self.local().num_rows

    def reduce_text(self, window_text: torch.Tensor) -> torch.Tensor:
        """Mean over all windows (all ranks) of window-major per-window text outputs; identical on every rank."""
        return reduce_window_text(window_text, self.local().text, self.group)

    def attention(
        self,
        q_vid: torch.Tensor,
        k_vid: torch.Tensor,
        v_vid: torch.Tensor,
        q_txt: torch.Tensor | None = None,
        k_txt: torch.Tensor | None = None,
        v_txt: torch.Tensor | None = None,
        *,
        softmax_scale: float | None = None,
        text_output: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Window attention on local rows over [window video, sample text], then the text reduction.

        Video tensors are [L_local, heads, head_dim]; text tensors [L_txt, heads, head_dim] replicated (or None).
        Returns (video output [L_local, heads, head_dim], text output [L_txt, heads, head_dim] or None).
        ``text_output=False`` (a layer whose text output is never read, e.g. a model's last block) skips the text
        reduction and its all-reduce; every rank must pass the same value.
        """
        local = self.local()
        if q_vid.shape[0] != local.num_rows:
            raise ValueError(
                f"rank {self.group.rank}: attention got {q_vid.shape[0]} video rows, layer {self.layer}'s layout "
                f"gives this rank {local.num_rows}"
            )
        has_text = q_txt is not None
        if has_text:
            q_txt, k_txt, v_txt = (replicated_text_entry(t, self.group) for t in (q_txt, k_txt, v_txt))
        if not has_text and any(self.text_lengths):
            raise ValueError(f"the request has text lengths {self.text_lengths} but attention got no text tensors")
        backend = self.runtime.backend_for(q_vid.device, local.segments, q_vid.dtype)
        vid_out, window_text = window_attention(
            q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, local.segments, backend=backend, softmax_scale=softmax_scale,
        )
        if not (has_text and text_output):
            return vid_out, None
        return vid_out, self.reduce_text(window_text)
