"""winsp: window-parallel attention for 3D-windowed video diffusion transformers.

Each rank owns whole attention windows, so attention needs no communication, every rank keeps all heads, and rows
move only where the window layout changes between layers.
"""

from .config import DiffusionParallelConfig
from .geometry import (
    FixedWindows,
    REGULAR_METHOD,
    SHIFTED_METHOD,
    SeedVR2Windows,
    WindowGeometry,
    make_geometry,
    window_slices,
)
from .group import SPGroup
from .layout import Layout, build_layout
from .planner import PLANNER_VERSION, Plan, PlanCache, default_plan_cache, lpt_assign, plan_windows
from .redistribute import Transition, ensure_layout, gather_rows, plan_transition, redistribute, scatter_rows
from .text import reduce_window_text
from .attention import WindowAttention, WindowSegments, available_backends, reference_window_attention, window_attention
from .runtime import WindowRequest, WindowRuntime

__version__ = "0.1.0"

__all__ = [
    "DiffusionParallelConfig",
    "FixedWindows",
    "Layout",
    "PLANNER_VERSION",
    "Plan",
    "PlanCache",
    "REGULAR_METHOD",
    "SHIFTED_METHOD",
    "SPGroup",
    "SeedVR2Windows",
    "Transition",
    "WindowAttention",
    "WindowGeometry",
    "WindowRequest",
    "WindowRuntime",
    "WindowSegments",
    "available_backends",
    "build_layout",
    "default_plan_cache",
    "ensure_layout",
    "gather_rows",
    "lpt_assign",
    "make_geometry",
    "plan_transition",
    "plan_windows",
    "redistribute",
    "reduce_window_text",
    "reference_window_attention",
    "scatter_rows",
    "window_attention",
    "window_slices",
]
