"""``winsp.adoption.Hourglass``: a U-net's stages, grid changes and forward order from one declaration.

An hourglass (U-net) model runs its down levels, each followed by a merge to a coarser grid, then a middle level,
then its up levels in reverse, each preceded by a split back to the grid of the down level whose skip it takes. Given
``ParallelPlan(stages=Hourglass(...))``, :func:`winsp.parallelize` reads the levels from the model (down level ``i``
pairs with up level ``i``, split ``i`` and merge ``i``: the usual ``zip(down, merges)`` / ``reversed(zip(up,
splits))``), builds one :class:`~winsp.planning.stages.Stage` per level with each attention layer's geometry from
``windows(attention_module)``, the splits cropped ``like=`` their skip's level (odd grids come back exactly), the grid
changes (merges down, splits up) and the forward order; a middle (or any) level whose layers are all
:class:`~winsp.geometry.GlobalWindow` may be split across ranks. Unless the plan gives one, the region runs from the
first down level's call to the first up level's return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

from torch import nn

from winsp.geometry.rolled import GlobalWindow
from winsp.geometry.windows import WindowGeometry
from winsp.planning.stages import Stage

__all__ = ["Hourglass"]

Globs = Union[str, Sequence[str]]


@dataclass(frozen=True)
class Hourglass:
    """A U-net's levels, as globs of ``named_modules`` paths (module docstring).

    Args:
        down: the down levels (``"down_levels.*"``), in the order they run.
        mid: the middle level (``"mid_level"``).
        up: the up levels, up level ``i`` taking the skip of down level ``i`` (so they run last to first).
        merges: merge ``i`` follows down level ``i``.
        splits: split ``i`` precedes up level ``i`` (it runs on the output of the level below).
        windows: ``attention_module -> WindowGeometry`` (the original module, as the model built it); None for a
            layer attending globally (:class:`~winsp.geometry.GlobalWindow`).
        factor: the (t, h, w) factor of every merge and split.
        tokens: the region's :class:`~winsp.adoption.parallelize.TokenIO` where the plan gives no region
            (None: ``winsp.ChannelsLast()``, tokens ``[B, T, H, W, C]``; ``winsp.ChannelsLast(2)``: ``[B, H, W, C]``).
    """

    down: Globs
    mid: Globs
    up: Globs
    merges: Globs
    splits: Globs
    windows: Callable[[nn.Module], WindowGeometry]
    factor: tuple[int, int, int] = (1, 2, 2)
    tokens: Any = None

    def __post_init__(self) -> None:
        if not callable(self.windows):
            raise ValueError(f"Hourglass.windows must be a function attention_module -> WindowGeometry, got "
                             f"{type(self.windows).__name__}")

    def resolve(self, model: nn.Module, attention: Callable[[str], list[tuple[str, nn.Module]]],
                match: Callable[[Globs, str], list[tuple[str, nn.Module]]]) -> dict:
        """The plan fields this declaration stands for on ``model``: ``stages``, ``grid_changes``, ``forward_order``
        and ``region_paths`` (first down level, first up level). ``attention(prefix)`` lists the plan's attention
        modules under a level; ``match(globs, what)`` lists the modules of a glob in ``named_modules`` order."""
        down, up = match(self.down, "stages.down"), match(self.up, "stages.up")
        merges, splits = match(self.merges, "stages.merges"), match(self.splits, "stages.splits")
        mid = match(self.mid, "stages.mid")
        if not (len(down) == len(up) == len(merges) == len(splits)) or len(mid) != 1:
            raise ValueError(f"Hourglass: {len(down)} down levels, {len(up)} up levels, {len(merges)} merges, "
                             f"{len(splits)} splits and {len(mid)} middle levels; a U-net has one of each per level "
                             f"and one middle ({[p for p, _ in down]}, {[p for p, _ in up]}, {[p for p, _ in mid]})")

        def stage(path: str, **grid) -> Stage:
            layers = [self.windows(module) for _, module in attention(path)]
            layers = [GlobalWindow() if g is None else g for g in layers]
            if not layers:
                raise ValueError(f"Hourglass: level {path!r} holds no module of ParallelPlan.attention")
            for geometry in layers:
                if not isinstance(geometry, WindowGeometry):
                    raise ValueError(f"Hourglass.windows returned {type(geometry).__name__} for a layer of {path!r}; "
                                     f"it must return a WindowGeometry (winsp.FixedWindows, RolledWindows, ...)")
            split = all(isinstance(g, GlobalWindow) for g in layers)
            return Stage(tuple(layers), split_windows=True if split else None, **grid)

        levels = len(down)
        stages = [stage(path, merge=self.factor if i else (1, 1, 1)) for i, (path, _) in enumerate(down)]
        stages.append(stage(mid[0][0], merge=self.factor))
        stages += [stage(up[i][0], split=self.factor, like=i) for i in reversed(range(levels))]
        order: list[str] = []
        for (level, _), (merge, _) in zip(down, merges, strict=True):
            order += [level, merge]
        order.append(mid[0][0])
        for i in reversed(range(levels)):
            order += [splits[i][0], up[i][0]]
        return dict(stages=tuple(stages), grid_changes=tuple(p for p, _ in merges) + tuple(p for p, _ in reversed(
            splits)), forward_order=tuple(order), region_paths=(down[0][0], up[0][0]))
