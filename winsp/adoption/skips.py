"""Skip connections out of a window-parallel region: ``ParallelPlan(skips=glob)``.

A hierarchical encoder (a Swin on volumes feeding a CNN decoder, a U-net's down path) hands each stage's output both
to the next stage and to a skip connection that runs on the whole tensor, outside the region's rows. The plan names
the modules whose outputs are such skips; each is gathered once, at its return (the region's TokenIO rebuilds it,
as the region's end would), so the model's own code gets the whole tensor there; when the next of them is called
with it, its input is scattered again into the layout the rows were gathered from (an index, no communication), and
the region goes on sharded in the same request. Gradients: the gather's backward sums over ranks, the scatter's keeps
this rank's rows, as at the region's ends.
"""

from __future__ import annotations

from typing import Any

from torch import nn

import winsp.runtime.context as context

__all__ = ["skip_call", "skip_return"]


def _open(applied) -> bool:
    """Whether a region call of the current model call is open (not a recording forward)."""
    depth = applied.depths[-1] if applied.depths else 0
    return applied.order.recording is None and len(applied.tokens) > depth and bool(applied.wholes)


def skip_call(path: str, applied):
    """Pre-hook of skip module ``path``: a whole input (gathered by the previous skip) is scattered again."""
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if not _open(applied) or not applied.wholes[-1]:
            return None
        io, request = applied.plan.region.tokens, context.current_request()
        rows, grids = io.read(args, kwargs)
        want = list(request.stage_model_grids[request.stage])
        if list(grids) != want:
            raise ValueError(f"ParallelPlan.skips: {path!r} ({type(module).__name__}) is called with tokens on grids "
                             f"{list(grids)}, but the rows were gathered on stage {request.stage}'s grids {want}: the "
                             f"next skip module must take the tensor the previous one returned")
        applied.wholes[-1] = False
        return io.with_rows(args, kwargs, request.scatter(rows, request._current()))

    return hook


def skip_return(path: str, applied):
    """Forward hook of skip module ``path``: its output (this rank's rows) is gathered and rebuilt whole."""
    def hook(module: nn.Module, args: tuple, output: Any):
        if output is None or not _open(applied) or applied.wholes[-1]:
            return None
        io, request = applied.plan.region.tokens, context.current_request()
        grids = request.stage_model_grids[request.stage]
        rebuilt = io.with_output(output, request.gather(io.output_rows(output)), grids)
        applied.wholes[-1] = True
        return rebuilt

    return hook
