"""Names that left winsp's top level, and where they went: ``winsp.Swapped`` raises an AttributeError that says so.

The top level holds what the README and guides call (``winsp.__all__``); issue 28 moved the other names into the
layered subpackages and the top-level modules under them, and round two removed a few names (CHANGELOG.md).
"""

from __future__ import annotations

__all__ = ["MOVED_NAMES", "MOVED_MODULES", "REMOVED", "moved_name_error"]

#: old top-level name -> the subpackage that exports it now
MOVED_NAMES: dict[str, str] = {
    **dict.fromkeys(("Plan", "lpt_assign", "plan_schedule", "PLANNERS", "PLANNER_VERSION"), "winsp.planning"),
    **dict.fromkeys(("Layout", "build_layout", "window_slices", "REGULAR_METHOD", "SHIFTED_METHOD"), "winsp.geometry"),
    **dict.fromkeys(("Transition", "redistribute_rows", "ensure_layout", "scatter_rows", "gather_rows",
                     "reduce_window_text", "TemporalMesh", "build_temporal_mesh", "interleaved_schedule",
                     "ordered_results"), "winsp.comm"),
    **dict.fromkeys(("WindowSegments", "reference_window_attention", "available_backends", "halo_tensors",
                     "neighborhood_rpb_score_mod"), "winsp.attention"),
    **dict.fromkeys(("WindowRequest", "StagedRuntime", "StagedRequest", "RuntimeStore", "active_request",
                     "row_dropout"), "winsp.runtime"),
    **dict.fromkeys(("Swapped", "is_parallelized"), "winsp.adoption"),
}

#: old top-level module -> the module it is now (winsp.geometry, .attention, .runtime kept their names as packages)
MOVED_MODULES: dict[str, str] = {
    **{m: f"winsp.geometry.{m}" for m in ("swin", "neighborhood", "layout")},
    "planner": "winsp.planning.plan",
    **{m: f"winsp.planning.{m}" for m in ("costs", "balance", "locality", "halo", "schedule", "stages", "hierarchy",
                                          "grid_step")},
    **{m: f"winsp.comm.{m}" for m in ("group", "redistribute", "text", "spatial")},
    "mesh": "winsp.comm.temporal",
    **{m: f"winsp.attention.{m}" for m in ("segments", "score_mods", "split", "backends")},
    "halo_attention": "winsp.attention.halo.layer", "halo_backends": "winsp.attention.halo.backends",
    "halo_flex": "winsp.attention.halo.flex", "halo_natten": "winsp.attention.halo.natten",
    **{m: f"winsp.runtime.{m}" for m in ("config", "store", "local", "request", "context", "gradients", "nn",
                                         "drop_path")},
    **{m: f"winsp.adoption.{m}" for m in ("token_io", "recompute", "region_checks", "region_dropout")},
    **{m: f"winsp.utils.{m}" for m in ("checks", "compile")},
}

#: old top-level name -> what to use instead (removed in round two)
REMOVED: dict[str, str] = {
    "PlanCache": "winsp.planning.plan_schedule, or a runtime's plans(grids) for cached plans",
    "plan_windows": "winsp.planning.plan_schedule",
    "default_plan_cache": "a runtime's plans(grids)",
    "plan_transition": "the transitions a runtime's schedule prepares (winsp.comm.Transition)",
}


def moved_name_error(name: str) -> AttributeError:
    """The AttributeError for ``winsp.<name>``: where a moved name went, what replaces a removed one, else Python's."""
    if name in MOVED_NAMES:
        home = MOVED_NAMES[name]
        return AttributeError(f"winsp.{name} moved to {home}.{name}: from {home} import {name} (the top level keeps "
                              f"what the README and guides call, winsp.__all__)")
    if name in MOVED_MODULES:
        return AttributeError(f"the module winsp.{name} moved to {MOVED_MODULES[name]}: import {MOVED_MODULES[name]}")
    if name in REMOVED:
        return AttributeError(f"winsp.{name} was removed; use {REMOVED[name]}")
    return AttributeError(f"module 'winsp' has no attribute {name!r}")
