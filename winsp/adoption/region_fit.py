"""Whether a plan's region fits the model, from what the forward-order recording saw, before any rows move.

The recording runs the original modules on the whole input (meta tensors, or no-grad real ones): it sees the tokens
the region's start takes, those its first layer entry takes, and what its end returns. Two misfits then show, and
are refused naming the cause, where the model's own code would otherwise fail on local rows with a raw torch error:

- a wrong layout: a channels-first input read as channels-last (or the reverse): the first block takes tokens whose
  channels are the size of the input's dim 1 (its last dim), not what the region's TokenIO read as channels;
- a wrong region end: the end returns tokens on another grid than the plan's last stage, such as a region that ends
  at a patch merge the plan does not list.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from winsp.adoption.region import ChannelsFirst, ChannelsLast, TokenIO

__all__ = ["check_fit"]


def check_fit(applied: Any, seen: dict) -> None:
    """Raise ValueError if ``seen`` (``"start"``: the start's ``(args, kwargs)``, ``"entry"``: the first layer entry's
    ``(path, tokens)``, ``"end"``: the end's output) shows a layout or region end that does not fit the plan."""
    io, region = applied.plan.region.tokens, applied.plan.region
    if not isinstance(io, (ChannelsLast, ChannelsFirst)) or "start" not in seen:
        return
    args, kwargs = seen["start"]
    try:
        rows, grids = io.read(args, kwargs)
    except ValueError:
        return  # the parallel forward refuses it, naming it
    x, channels = args[0], rows.shape[-1]
    entry = seen.get("entry")
    if entry is not None and isinstance(entry[1], Tensor) and entry[1].dim() >= 2:
        path, tokens = entry
        other, layout, fix = (x.shape[1], "channels-first", "winsp.adoption.ChannelsFirst()") \
            if isinstance(io, ChannelsLast) else (x.shape[-1], "channels-last", "winsp.ChannelsLast()")
        if tokens.shape[-1] != channels and tokens.shape[-1] == other:
            raise ValueError(f"winsp.parallelize: the region's input {list(x.shape)} at {region.start!r} is read by "
                             f"{type(io).__name__} as tokens of {channels} channels on grids {grids[0]}, but its first "
                             f"layer entry {path!r} takes {list(tokens.shape)}: tokens of {tokens.shape[-1]} channels, "
                             f"the size of the input's {'dim 1' if layout == 'channels-first' else 'last dim'}. The "
                             f"region's input is {layout}: give Region(..., tokens={fix}). Found by recording the "
                             f"forward, before any rows moved")
    end = seen.get("end")
    if end is None or applied.plan.skips is not None:  # with skips, the end returns what they gathered
        return
    try:
        _, got = io.read((TokenIO.first_item(end),), {})
    except (ValueError, TypeError, IndexError):
        return
    want = applied.runtime.stage_grids(grids)[0][-1]
    if list(got) == list(want):
        return
    hint = ""
    if all(g <= w for g, w in zip(got[0], want[0], strict=True)):
        factor = tuple(-(-w // g) for g, w in zip(got[0], want[0], strict=True))
        hint = (f": the region ends with a grid change the plan does not list (a patch merge at the region's end). "
                f"List it as the plan's last stage, winsp.Stage((), merge={factor}), with the module in "
                f"ParallelPlan.grid_changes (make_grid_change moves the rows: request.to_grid), or end the region "
                f"before it")
    raise ValueError(f"winsp.parallelize: the region's end {region.end!r} returns tokens on grids {got[0]}, but the "
                     f"plan's stages end on {want[0]}{hint}. Found by recording the forward, before any rows moved")
