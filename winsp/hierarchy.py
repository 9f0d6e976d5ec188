"""Hierarchical models: one request over several grids (stages), and the sharded step between them.

Swin, HDiT and U-shaped DiTs attend at several resolutions: a *stage* is a run of attention layers on one token grid,
and between stages a patch merging (2 x 2 tokens -> one token of 4x the channels) or its inverse changes the grid.
A :class:`StagedRuntime` plans all stages of one forward together (layers are numbered across stages), and its
requests (:class:`StagedRequest`) add :meth:`StagedRequest.to_grid`, the grid change as a *sharded* step: every
merged (or split) output row is built on the rank that owns it in the next stage's first layout, from rows that
either are already there or arrive in one variable-split all-to-all. Only rows whose output lives on another rank
move; nothing is all-gathered. Each stage's plans are relabelled (a permutation of ranks, which keeps their balance)
so that as many input rows as possible already sit on the rank that needs them.

Padding: a stage's grid is laid out as ``layers[0].padded_grid(grid)`` (Swin pads to whole windows). Padding rows
are ordinary local rows for the runtime; ``request.valid_rows`` tells them apart, ``scatter`` fills them with zeros,
``gather`` drops them and ``to_grid`` never reads them (missing children of a merge are zeros, as Swin's ``F.pad``).

Skip connections: a split cropped ``like`` stage s lands in the layout of stage s's last layer, where a skip kept
from the end of stage s (a U-net level's output) already lies, so unchanged model code adding it right after the
split is right. A tensor kept from any other layer of the same grid comes into the current layout with
``request.to_layer(skip, layer, source=earlier_layer)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .compile import planning
from .config import DiffusionParallelConfig
from .geometry import Grid, WindowGeometry, _positive_int_triple
from .group import SPGroup
from .layout import Layout, check_grids
from .locality import SLACK_LIMIT
from .planner import Plan
from .runtime import WindowRequest, WindowRuntime
from .schedule import plan_schedule

__all__ = ["Stage", "StagedRuntime", "StagedRequest", "GridStep", "grid_sources", "stage_grids", "affinity_placement",
           "staged_plans", "grid_change_rows"]


@dataclass(frozen=True)
class Stage:
    """One resolution level: its attention layers' window geometries and how its grid follows from the previous one.

    Args:
        layers: one :class:`~winsp.geometry.WindowGeometry` per attention layer of the stage, in forward order.
        merge: this stage's grid is ``ceil(previous / merge)`` per axis (patch merging; (1, 2, 2) for Swin).
        split: or ``previous * split`` per axis (the inverse: patch expanding, a U-net's way up).
        like: with ``split``: crop the grid to stage ``like``'s grid (a U-net level whose grid was odd on the way down).
        order: the (t, h, w) offsets of a merged token's children in the order their channels are concatenated
            (default raster order, t slowest); the same order splits channels back.
    """

    layers: tuple[WindowGeometry, ...]
    merge: Grid = (1, 1, 1)
    split: Grid = (1, 1, 1)
    like: Optional[int] = None
    order: Optional[tuple[Grid, ...]] = None

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers or not all(isinstance(g, WindowGeometry) for g in layers):
            raise ValueError(f"Stage.layers must be a non-empty list of WindowGeometry, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)
        merge = _positive_int_triple(self.merge, "Stage.merge")
        split = _positive_int_triple(self.split, "Stage.split")
        if merge != (1, 1, 1) and split != (1, 1, 1):
            raise ValueError(f"a stage either merges or splits, got merge={merge} and split={split}")
        object.__setattr__(self, "merge", merge)
        object.__setattr__(self, "split", split)
        if self.like is not None and split == (1, 1, 1):
            raise ValueError("Stage.like crops the grid of a splitting stage; give split= too")
        factor = self.factor
        default = tuple((a, b, c) for a in range(factor[0]) for b in range(factor[1]) for c in range(factor[2]))
        order = default if self.order is None else tuple(tuple(int(v) for v in o) for o in self.order)
        if sorted(order) != sorted(default):
            raise ValueError(f"Stage.order must list every child offset of the factor {factor} once, got {order}")
        object.__setattr__(self, "order", order)

    @property
    def factor(self) -> Grid:
        """The merge or split factor ((1, 1, 1) when the grid does not change)."""
        return self.merge if self.merge != (1, 1, 1) else self.split

    @property
    def changes_grid(self) -> bool:
        return self.factor != (1, 1, 1)


def _check_stages(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    stages = tuple(stages)
    if not stages:
        raise ValueError("a staged runtime needs at least one Stage")
    for i, st in enumerate(stages):
        if not isinstance(st, Stage):
            raise ValueError(f"stages[{i}] must be a winsp.Stage, got {type(st).__name__}")
        if i == 0 and st.changes_grid:
            raise ValueError("stages[0] is the input grid: it cannot merge or split")
        if st.like is not None and not 0 <= st.like < i:
            raise ValueError(f"stages[{i}].like={st.like} must name an earlier stage")
    return stages


def stage_grids(stages: Sequence[Stage], grids: Sequence[Sequence[int]]) -> tuple[tuple, tuple]:
    """(model grids, laid-out grids) of every stage for a batch whose stage-0 grids are ``grids``.

    The laid-out grid is the model grid padded by the stage's geometry; every layer of a stage must agree on it.
    """
    grids = check_grids(grids)
    model: list[tuple[Grid, ...]] = []
    laid: list[tuple[Grid, ...]] = []
    for i, st in enumerate(stages):
        if i == 0:
            cur = grids
        elif st.merge != (1, 1, 1):
            cur = tuple(tuple(-(-g // f) for g, f in zip(grid, st.merge)) for grid in model[-1])
        elif st.split != (1, 1, 1):
            cur = tuple(tuple(g * f for g, f in zip(grid, st.split)) for grid in model[-1])
            if st.like is not None:
                target = model[st.like]
                for s, (big, want) in enumerate(zip(cur, target)):
                    if any(w > b for w, b in zip(want, big)):
                        raise ValueError(f"stage {i}: sample {s}'s split grid {big} is smaller than stage "
                                         f"{st.like}'s grid {want}, which it is cropped to")
                cur = target
        else:
            cur = model[-1]
        padded = tuple(st.layers[0].padded_grid(g) for g in cur)
        for j, geom in enumerate(st.layers[1:], 1):
            other = tuple(geom.padded_grid(g) for g in cur)
            if other != padded:
                raise ValueError(f"stage {i}: layer {j}'s geometry pads the grids to {other}, layer 0's to "
                                 f"{padded}; the layers of one stage must share one laid-out grid")
        model.append(tuple(cur))
        laid.append(padded)
    return tuple(model), tuple(laid)


def _coords(grids: Sequence[Grid]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample, [N, 3] coordinates, [N, 3] grid of the row's sample) of every canonical row of packed ``grids``."""
    sizes = [t * h * w for t, h, w in grids]
    sample = np.repeat(np.arange(len(grids), dtype=np.int64), sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    g = np.asarray(grids, dtype=np.int64)[sample].reshape(-1, 3)
    within = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[sample]
    coords = np.stack([within // (g[:, 1] * g[:, 2]), (within // g[:, 2]) % g[:, 1], within % g[:, 2]], axis=-1)
    return sample, coords.reshape(-1, 3), g


def _ids(sample: np.ndarray, coords: np.ndarray, grids: Sequence[Grid]) -> np.ndarray:
    """Canonical ids of (sample, coords) rows in packed ``grids``."""
    g = np.asarray(grids, dtype=np.int64)[sample].reshape(-1, 3)
    offsets = np.concatenate([[0], np.cumsum([t * h * w for t, h, w in grids])]).astype(np.int64)
    return offsets[sample] + (coords[:, 0] * g[:, 1] + coords[:, 1]) * g[:, 2] + coords[:, 2]


def logical_ids(model: Sequence[Grid], laid: Sequence[Grid]) -> np.ndarray:
    """[N_laid] canonical id in the model grids of each laid-out row, or -1 for a padding row."""
    sample, coords, _ = _coords(laid)
    inside = (coords < np.asarray(model, dtype=np.int64)[sample]).all(axis=1)
    out = np.full(sample.size, -1, dtype=np.int64)
    out[inside] = _ids(sample[inside], coords[inside], model)
    return out


def grid_sources(stage: Stage, src_model, src_laid, dst_model, dst_laid) -> tuple[np.ndarray, np.ndarray]:
    """Which source rows build each destination row of a grid change.

    Returns ``(sources [N_dst, K], chunk [N_dst])``: for a merge, the K children (canonical ids in the source's laid
    grids, -1 where a child is outside the source model grid or the row is padding) in ``stage.order``; for a split,
    the parent (K = 1) and which of its channel chunks the row takes.
    """
    sample, coords, _ = _coords(dst_laid)
    dst_inside = (coords < np.asarray(dst_model, dtype=np.int64)[sample]).all(axis=1)
    src_model_rows = np.asarray(src_model, dtype=np.int64)[sample]
    order = np.asarray(stage.order, dtype=np.int64)  # [K, 3]
    if stage.merge != (1, 1, 1):
        child = coords[:, None, :] * np.asarray(stage.merge, dtype=np.int64) + order[None]  # [N, K, 3]
        ok = dst_inside[:, None] & (child < src_model_rows[:, None, :]).all(axis=2)
        k = order.shape[0]
        flat_sample = np.repeat(sample, k)
        ids = _ids(flat_sample, child.reshape(-1, 3), src_laid).reshape(-1, k)
        return np.where(ok, ids, -1), np.zeros(sample.size, dtype=np.int64)
    factor = np.asarray(stage.split, dtype=np.int64)
    parent = coords // factor
    ok = dst_inside & (parent < src_model_rows).all(axis=1)
    ids = np.where(ok, _ids(sample, parent, src_laid), -1)
    lookup = np.empty(int(factor.prod()), dtype=np.int64)  # raveled child offset -> its place in stage.order
    lookup[(order[:, 0] * factor[1] + order[:, 1]) * factor[2] + order[:, 2]] = np.arange(order.shape[0])
    rem = coords % factor
    chunk = lookup[(rem[:, 0] * factor[1] + rem[:, 1]) * factor[2] + rem[:, 2]]
    return ids[:, None], np.where(ok, chunk, 0)


@dataclass(frozen=True, eq=False)
class GridStep:
    """One rank's part of a grid change: gather, exchange, then build each local output row (all prepared)."""

    send_index: Tensor
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    build_index: Tensor  # [L_dst, K] rows of [received; one zero row]
    chunk: Optional[Tensor]  # [L_dst] for a split, None for a merge
    network_exchange_required: bool
    num_src_rows: int
    rows_moved: int  # rows that change rank over the whole group (for reports)
    parts: int  # children a split makes of one row's channels (1 for a merge)

    @staticmethod
    def build(src: Plan, dst: Plan, sources: np.ndarray, chunk: Optional[np.ndarray], parts: int, rank: int,
              device: torch.device) -> "GridStep":
        """The step of ``rank`` moving rows of ``src``'s layout into ``dst``'s, output rows from ``sources``."""
        p, n_src = src.world_size, src.layout.num_tokens
        dst_owner = dst.token_owner
        rows, cols = np.nonzero(sources >= 0)
        pair = np.unique(dst_owner[rows] * n_src + sources[rows, cols])  # needed (destination rank, source row)
        need_rank, need_src = pair // n_src, pair % n_src
        src_rank, src_local = src.token_owner[need_src], src.token_local_index[need_src]
        counts = np.bincount(src_rank * p + need_rank, minlength=p * p).reshape(p, p)
        mine = src_rank == rank
        send = np.lexsort((src_local[mine], need_rank[mine]))
        incoming = need_rank == rank
        arrival = np.lexsort((src_local[incoming], src_rank[incoming]))
        buffer_ids = need_src[incoming][arrival]
        position = np.full(n_src, buffer_ids.size, dtype=np.int64)  # default: the zero row after the buffer
        position[buffer_ids] = np.arange(buffer_ids.size, dtype=np.int64)
        local = sources[dst.rank_token_ids(rank)]
        build_index = np.where(local >= 0, position[np.maximum(local, 0)], buffer_ids.size)
        moved = int(counts.sum() - np.trace(counts))

        def t(a: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        return GridStep(
            send_index=t(src_local[mine][send]),
            input_split_sizes=tuple(int(c) for c in counts[rank, :]),
            output_split_sizes=tuple(int(c) for c in counts[:, rank]),
            build_index=t(build_index.reshape(local.shape)),
            chunk=None if chunk is None else t(chunk[dst.rank_token_ids(rank)]),
            network_exchange_required=moved > 0,
            num_src_rows=src.rank_token_counts[rank],
            rows_moved=moved,
            parts=parts,
        )

    def __call__(self, x: Tensor, group: SPGroup) -> Tensor:
        if x.shape[0] != self.num_src_rows:
            raise ValueError(f"rank {group.rank}: to_grid got {x.shape[0]} rows, the current layout gives this rank "
                             f"{self.num_src_rows}")
        if x.dim() < 2 or x.shape[1] % self.parts:
            raise ValueError(f"to_grid: rows must be [L, C, ...] with C divisible by {self.parts} (the children a "
                             f"split makes), got shape {tuple(x.shape)}")
        packed = x.index_select(0, self.send_index)
        if self.network_exchange_required:
            packed = group.all_to_all_single(packed, self.output_split_sizes, self.input_split_sizes)
        rest = tuple(x.shape[2:])
        buffer = torch.cat([packed, packed.new_zeros((1,) + tuple(x.shape[1:]))])
        rows, k = self.build_index.shape
        out = buffer.index_select(0, self.build_index.reshape(-1))
        if self.chunk is None:  # merge: the children's channels side by side, in the stage's order
            return out.reshape((rows, k * x.shape[1]) + rest)
        parts = out.reshape((rows, self.parts, x.shape[1] // self.parts) + rest)
        return parts[torch.arange(rows, device=x.device), self.chunk]


def _relabel(prev: Plan, stage_plans: list[Plan], sources: np.ndarray) -> list[Plan]:
    """The stage's plans with ranks permuted so that most rows of the grid change stay where they are."""
    first = stage_plans[0]
    p, n_src = prev.world_size, prev.layout.num_tokens
    rows, cols = np.nonzero(sources >= 0)
    overlap = np.bincount(prev.token_owner[sources[rows, cols]] * p + first.token_owner[rows],
                          minlength=p * p).reshape(p, p)  # [old rank, new rank]
    perm = [-1] * p  # perm[new rank] = the rank its windows go to
    taken = set()
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        old, new = divmod(int(flat), p)
        if perm[new] < 0 and old not in taken:
            perm[new], taken = old, taken | {old}
    if perm == list(range(p)):
        return stage_plans
    relabelled: dict[int, Plan] = {}
    out = []
    for plan in stage_plans:
        if id(plan) not in relabelled:
            pieces = [()] * p
            for new, ps in enumerate(plan.rank_pieces):  # whole windows or pieces of split windows alike
                pieces[perm[new]] = ps
            relabelled[id(plan)] = Plan(plan.layout, p, key=plan.key + (("ranks", tuple(perm)),),
                                        rank_pieces=pieces)
        out.append(relabelled[id(plan)])
    return out


def _owner_weights(window_of: np.ndarray, owner: np.ndarray, num_windows: int, world_size: int) -> np.ndarray:
    """[windows, P]: how many rows of each window have their input on each rank."""
    return np.bincount(window_of * world_size + owner, minlength=num_windows * world_size).reshape(
        num_windows, world_size)


def affinity_placement(layout: Layout, weights: np.ndarray, world_size: int) -> Optional[list[list[int]]]:
    """Windows of ``layout`` on the rank holding most of their input rows (``weights`` [windows, P]), under a cap.

    Largest windows first (most-attached first among equals), each to its best rank whose load stays under
    ``(1 + SLACK_LIMIT)`` x the ideal, else to the least-loaded rank. None if the result is less balanced than
    ``max(1 + SLACK_LIMIT, LPT's imbalance + 0.01)`` (the locality planner's promise).
    """
    counts = layout.token_counts
    ideal = max(int(counts.max()), -(-layout.num_tokens // world_size))
    cap = (1 + SLACK_LIMIT) * ideal
    load = np.zeros(world_size, dtype=np.int64)
    placed: list[list[int]] = [[] for _ in range(world_size)]
    strength = weights.max(axis=1) / np.maximum(counts, 1)
    for w in np.lexsort((np.arange(counts.size), -strength, -counts)):
        fits = load + counts[w] <= cap
        rank = int(np.argmax(np.where(fits, weights[w], -1))) if fits.any() else int(np.argmin(load))
        placed[rank].append(int(w))
        load[rank] += counts[w]
    lpt = Plan(layout, world_size).window_bound_imbalance
    if load.max() / ideal > max(1 + SLACK_LIMIT, lpt + 0.01):
        return None
    return [sorted(ws) for ws in placed]


def _rows_moved(prev: Plan, plans: Sequence[Plan], sources: np.ndarray) -> int:
    """Rows moved by the grid change into ``plans[0]`` plus every layout change between the stage's layers."""
    rows, cols = np.nonzero(sources >= 0)
    needed = np.unique(plans[0].token_owner[rows] * prev.layout.num_tokens + sources[rows, cols])
    moved = int((prev.token_owner[needed % prev.layout.num_tokens] != needed // prev.layout.num_tokens).sum())
    for a, b in zip(plans, plans[1:]):
        if a is not b:
            moved += int((a.token_owner != b.token_owner).sum())
    return moved


def _place_stage(prev: Plan, plans: list[Plan], sources: np.ndarray, planner: str) -> list[Plan]:
    """The stage's plans, placed so that the grid change moves few rows.

    Every planner: the stage's ranks relabelled (:func:`_relabel`, balance unchanged). ``"locality"`` also tries
    placing each of the stage's layouts where its input rows are (the first after the previous stage, each next one
    after the one before) and keeps whichever moves fewer rows over the grid change and the stage's own layer changes.
    """
    relabelled = _relabel(prev, plans, sources)
    if planner != "locality":
        return relabelled
    p = prev.world_size
    rows = np.nonzero((sources >= 0).any(axis=1))[0]
    first = plans[0].layout
    # each destination row's input rank: the rank holding most of its children (ties: the first child's)
    owners = np.where(sources[rows] >= 0, prev.token_owner[np.maximum(sources[rows], 0)], -1)
    votes = np.stack([(owners == r).sum(axis=1) for r in range(p)], axis=1)
    weights = _owner_weights(first.window_of_position[first.position_of_token[rows]], votes.argmax(axis=1),
                             first.num_windows, p)
    placement = affinity_placement(first, weights, p)
    if placement is None:
        return relabelled
    chained: dict[int, Plan] = {}
    out: list[Plan] = []
    for plan in plans:
        if id(plan) not in chained:
            if out:
                lay = plan.layout
                weights = _owner_weights(lay.window_of_position[lay.position_of_token], out[-1].token_owner,
                                         lay.num_windows, p)
                placement = affinity_placement(lay, weights, p)
                if placement is None:
                    return relabelled
            # the placement follows from the plan it was placed after: that plan's key makes this key unique
            anchor = out[-1] if out else prev
            chained[id(plan)] = Plan(plan.layout, p, key=plan.key + (("affinity", anchor.key),),
                                     rank_windows=placement)
        out.append(chained[id(plan)])
    return min((relabelled, out), key=lambda ps: _rows_moved(prev, ps, sources))


def staged_plans(stages: Sequence[Stage], grids: Sequence[Sequence[int]], world_size: int,
                 planner: str = "lpt") -> tuple[Plan, ...]:
    """One plan per layer over all ``stages`` (what :meth:`StagedRuntime.plans` returns; pure, no process group).

    Staged models keep whole windows: the default ``"auto"`` plans as ``"lpt"`` here (their adopted attention modules
    commonly take a ``score_mod``, e.g. Swin's relative position bias, which a split window cannot run), and
    ``"split"`` is refused.
    """
    stages = _check_stages(stages)
    if planner == "split":
        raise ValueError('planner "split" is for flat window runtimes; a staged model keeps whole windows: use "auto", '
                         '"lpt" or "locality"')
    model, laid = stage_grids(stages, grids)
    out: list[Plan] = []
    for s, st in enumerate(stages):
        plans = plan_schedule(laid[s], st.layers, world_size, planner, split_windows=False)
        if s and st.changes_grid and world_size > 1:
            sources, _ = grid_sources(st, model[s - 1], laid[s - 1], model[s], laid[s])
            plans = _place_stage(out[-1], plans, sources, planner)
        out.extend(plans)
    return tuple(out)


def grid_change_rows(stages: Sequence[Stage], grids: Sequence[Sequence[int]], world_size: int,
                     planner: str = "lpt") -> list[tuple[int, int, int]]:
    """For each grid change of a forward: ``(stage, rows to_grid moves between ranks, rows an all-gather of the same
    activations would move)``; the all-gather moves every row to every rank that does not hold it, ``N * (P - 1)``."""
    stages = _check_stages(stages)
    model, laid = stage_grids(stages, grids)
    plans = staged_plans(stages, grids, world_size, planner)
    starts = np.concatenate([[0], np.cumsum([len(st.layers) for st in stages])]).astype(int)
    out = []
    for s, st in enumerate(stages):
        if not st.changes_grid:
            continue
        landing = starts[st.like + 1] - 1 if st.like is not None else starts[s]
        sources, chunk = grid_sources(st, model[s - 1], laid[s - 1], model[s], laid[s])
        split = st.split != (1, 1, 1)
        step = GridStep.build(plans[starts[s] - 1], plans[landing], sources, chunk if split else None,
                              len(st.order) if split else 1, 0, torch.device("cpu"))
        rows = sum(t * h * w for t, h, w in model[s - 1])
        out.append((s, step.rows_moved, rows * (world_size - 1)))
    return out


class StagedRuntime(WindowRuntime):
    """A :class:`~winsp.runtime.WindowRuntime` over several stages; layer ``i`` is the i-th layer over all stages.

    Args:
        stages: the :class:`Stage` list, stage 0 first.
        group, attention_backend, planner, store_size: as :class:`~winsp.runtime.WindowRuntime`.
    """

    def __init__(self, stages: Sequence[Stage], *, group=None, attention_backend: str = "auto",
                 planner: str = "lpt", store_size: int = 64) -> None:
        self.stages = _check_stages(stages)
        super().__init__([g for st in self.stages for g in st.layers], group=group,
                         attention_backend=attention_backend, planner=planner, store_size=store_size)
        self.stage_of_layer: tuple[int, ...] = tuple(s for s, st in enumerate(self.stages) for _ in st.layers)
        starts = np.concatenate([[0], np.cumsum([len(st.layers) for st in self.stages])])
        self.first_layer: tuple[int, ...] = tuple(int(v) for v in starts[:-1])

    @classmethod
    def from_config(cls, config: DiffusionParallelConfig | None, stages: Sequence[Stage], *,
                    group=None) -> "StagedRuntime":
        """The staged runtime a :class:`~winsp.DiffusionParallelConfig` asks for (group rules as the base class)."""
        stages = _check_stages(stages)
        flat = WindowRuntime.from_config(config, [g for st in stages for g in st.layers], group=group)
        return cls(stages, group=flat.group, attention_backend=flat.attention_backend, planner=flat.planner,
                   store_size=flat.store.maxsize)

    def landing_layer(self, stage: int) -> int:
        """The layer whose layout :meth:`StagedRequest.to_grid` into ``stage`` lands in: the stage's first layer, or,
        for a split cropped ``like`` stage s, stage s's *last* layer, where a skip connection kept from the end of
        stage s already lies (so unchanged code adding it right after the split is right)."""
        st = self.stages[stage]
        if st.like is not None:
            return self.first_layer[st.like] + len(self.stages[st.like].layers) - 1
        return self.first_layer[stage]

    def stage_grids(self, grids: Sequence[Sequence[int]]) -> tuple[tuple, tuple]:
        """(model grids, laid-out grids) of each stage (:func:`stage_grids`)."""
        grids = check_grids(grids)
        return self.store.get(("stage-grids", grids), lambda: stage_grids(self.stages, grids))

    def _sources(self, stage: int, grids) -> tuple[np.ndarray, Optional[np.ndarray]]:
        def build():
            model, laid = self.stage_grids(grids)
            st = self.stages[stage]
            sources, chunk = grid_sources(st, model[stage - 1], laid[stage - 1], model[stage], laid[stage])
            return sources, (chunk if st.split != (1, 1, 1) else None)

        return self.store.get(("grid-sources", check_grids(grids), stage), build)

    def plans(self, grids: Sequence[Sequence[int]], *, split_windows: bool | None = None) -> tuple[Plan, ...]:
        """One plan per layer over all stages; each stage's ranks relabelled to keep grid-change rows in place.

        Whole windows always (``split_windows`` is accepted for the base class's callers and ignored).
        """
        grids = check_grids(grids)

        return self.store.get(("staged-plans", grids),
                              lambda: staged_plans(self.stages, grids, self.world_size, self.planner))

    @planning
    def request(self, grids: Sequence[Sequence[int]], text_lengths: Sequence[int] | None = None, *,
                device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                **kwargs) -> "StagedRequest":
        """Start one forward; ``grids`` are the stage-0 model grids (before any padding)."""
        base = super().request(grids, text_lengths, device=device, dtype=dtype, **kwargs)
        request = StagedRequest.__new__(StagedRequest)
        request.__dict__.update(base.__dict__)
        request.stage_model_grids, request.stage_laid_grids = self.stage_grids(grids)
        request.model_grids = check_grids(grids)
        return request

    def _grid_step(self, request: "StagedRequest", src_slot: int, stage: int) -> GridStep:
        src = request.prepared.layouts[src_slot].plan
        dst = request.prepared.plans[self.landing_layer(stage)]
        key = ("grid-step", src.key or id(src), dst.key or id(dst), stage, request.model_grids, self.rank,
               str(request.device))

        def build() -> GridStep:
            sources, chunk = self._sources(stage, request.model_grids)
            parts = 1 if chunk is None else len(self.stages[stage].order)
            return GridStep.build(src, dst, sources, chunk, parts, self.rank, request.device)

        return self.store.get(key, build)

    def _stage_rows(self, request: "StagedRequest", slot: int) -> "StageRows":
        lay = request.prepared.layouts[slot]
        stage = self.stage_of_layer[request.prepared.slot_of_layer.index(slot)]
        key = ("stage-rows", lay.plan.key or id(lay.plan), stage, request.model_grids, self.rank, str(request.device))

        def build() -> StageRows:
            model, laid = request.stage_model_grids[stage], request.stage_laid_grids[stage]
            keep = logical_ids(model, laid)
            logical = keep[lay.local.token_ids]
            grid = np.asarray(laid, dtype=np.int64)[lay.local.row_sample].reshape(-1, 3)
            total = sum(t * h * w for t, h, w in model)
            device = request.device
            return StageRows(
                valid=torch.from_numpy(logical >= 0).to(device),
                scatter_index=torch.from_numpy(np.where(logical >= 0, logical, total)).to(device),
                laid_grid=torch.from_numpy(np.ascontiguousarray(grid)).to(device),
                crop_index=torch.from_numpy(np.nonzero(keep >= 0)[0][np.argsort(keep[keep >= 0])]).to(device),
                padded=bool((keep < 0).any()),
            )

        return self.store.get(key, build)


@dataclass(frozen=True, eq=False)
class StageRows:
    """Per-row padding data of one layout on one rank (prepared once)."""

    valid: Tensor  # [L] bool: the row is inside the model grid
    scatter_index: Tensor  # [L] model-canonical id of each local row (N_model for padding: a zero row)
    laid_grid: Tensor  # [L, 3] the laid-out grid of each row's sample
    crop_index: Tensor  # [N_model] laid-canonical id of each model-canonical row
    padded: bool


class StagedRequest(WindowRequest):
    """A request of a :class:`StagedRuntime`: the base steps plus grid changes, padding rows and skip moves."""

    runtime: StagedRuntime

    @property
    def stage(self) -> int:
        """The stage of the current layer."""
        return self.runtime.stage_of_layer[self._current()]

    def _rows(self, layer: int | None = None) -> StageRows:
        slot = self._slot if layer is None else self.prepared.slot_of_layer[self._check_layer(layer)]
        if slot is None:
            raise RuntimeError("call scatter() first: the request has no local rows yet")
        return self.runtime._stage_rows(self, slot)

    @property
    def valid_rows(self) -> Tensor:
        """[L_local] bool: True for rows inside the model grid, False for padding rows of a padded stage grid."""
        return self._rows().valid

    @property
    def laid_grid(self) -> Tensor:
        """[L_local, 3] the laid-out (padded) grid of each local row's sample (``grid_coords`` live in it)."""
        return self._rows().laid_grid

    def geometry(self, layer: int | None = None) -> WindowGeometry:
        """The window geometry of ``layer`` (default: the current layer)."""
        return self.runtime.schedule[self._current() if layer is None else self._check_layer(layer)]

    def scatter(self, x: Tensor, layer: int = 0) -> Tensor:
        """Entry: this rank's rows of the canonical tensor of ``layer``'s stage's *model* grids (padding: zeros)."""
        layer = self._check_layer(layer)
        stage = self.runtime.stage_of_layer[layer]
        total = sum(t * h * w for t, h, w in self.stage_model_grids[stage])
        if x.shape[0] != total:
            raise ValueError(f"scatter: the canonical tensor has {x.shape[0]} rows but stage {stage}'s grids "
                             f"{self.stage_model_grids[stage]} have {total} tokens")
        rows = self._rows(layer)
        self._enter(layer)
        if not rows.padded:
            return x.index_select(0, self.token_ids)
        return torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))]).index_select(0, rows.scatter_index)

    def gather(self, x: Tensor) -> Tensor:
        """Exit: the canonical tensor of the current stage's model grids (padding rows dropped), on every rank."""
        rows = self._rows()
        out = super().gather(x)
        return out.index_select(0, rows.crop_index) if rows.padded else out

    def to_layer(self, x: Tensor, layer: int, *, source: int | None = None) -> Tensor:
        """Bring rows into ``layer``'s layout; ``source``: rows of that earlier layer (a skip), current stays.

        Both layers must share a grid (same stage, or a stage cropped ``like`` it); use :meth:`to_grid` between grids.
        """
        layer = self._check_layer(layer)
        if source is None:
            here = self._current()
            if self.stage_laid_grids[self.runtime.stage_of_layer[here]] != \
                    self.stage_laid_grids[self.runtime.stage_of_layer[layer]]:
                raise ValueError(f"layer {layer} is in stage {self.runtime.stage_of_layer[layer]}, on another grid "
                                 f"than the current layer {here}; call request.to_grid(x, stage) first")
            return super().to_layer(x, layer)
        source = self._check_layer(source)
        src_slot, dst_slot = (self.prepared.slot_of_layer[i] for i in (source, layer))
        if src_slot == dst_slot:
            return x
        src, dst = self.prepared.layouts[src_slot].plan, self.prepared.layouts[dst_slot].plan
        if src.layout.grids != dst.layout.grids:
            raise ValueError(f"to_layer(source={source}): layers {source} and {layer} lie on different grids "
                             f"({src.layout.grids} vs {dst.layout.grids})")
        from .redistribute import redistribute_rows

        return redistribute_rows(x, self.runtime._step(src, dst, self.device), self.group)

    def to_grid(self, x: Tensor, stage: int) -> Tensor:
        """The grid change into ``stage`` (the next one): local rows of its first layer's layout (of stage s's last
        layer for a split cropped ``like`` s: see :meth:`StagedRuntime.landing_layer`).

        A merge returns ``[L, K * C, ...]`` (children's channels side by side in the stage's ``order``, zeros for
        children outside the grid); a split takes ``[L, C, ...]`` with ``C = K * C'`` and returns ``[L, C', ...]``.
        Only rows whose output row lives on another rank move (one all-to-all, none if no row does).
        """
        if not isinstance(stage, int) or not 0 < stage < len(self.runtime.stages):
            raise ValueError(f"to_grid: stage must be 1 .. {len(self.runtime.stages) - 1}, got {stage!r}")
        if not self.runtime.stages[stage].changes_grid:
            raise ValueError(f"to_grid: stage {stage} keeps the previous grid; use to_layer")
        here = self.stage
        if here != stage - 1:
            raise ValueError(f"to_grid: rows are in stage {here}; stage {stage} follows stage {stage - 1}")
        out = self.runtime._grid_step(self, self._slot, stage)(x, self.group)
        self._enter(self.runtime.landing_layer(stage))
        self.transitions_done += 1
        return out

    def grid_step(self, stage: int) -> GridStep:
        """The prepared step :meth:`to_grid` takes from the current layout into ``stage`` (``rows_moved`` etc.)."""
        return self.runtime._grid_step(self, self._slot, stage)
