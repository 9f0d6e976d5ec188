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
from .planner import PLANNER_VERSION, Plan, lpt_assign
from .schedule import PLANNERS, plan_schedule
from .redistribute import Transition, ensure_layout, gather_rows, redistribute_rows, scatter_rows
from .text import reduce_window_text
from .segments import WindowSegments
from .backends import available_backends
from .attention import WindowAttention, reference_window_attention, window_attention
from .store import RuntimeStore
from .runtime import StagedRequest, StagedRuntime, WindowRequest, WindowRuntime
from .gradients import sync_gradients
from .nn import WindowParallel
from .mesh import TemporalMesh, build_temporal_mesh, interleaved_schedule, ordered_results
from .context import active_request, current_request
from .swin import SwinWindows
from .stages import Stage
from .drop_path import RowDropout, SampleDropPath, row_dropout
from .parallelize import ChannelsLast, ParallelPlan, Region, TokenIO, adopt, is_parallelized, parallelize, unparallelize
from .token_io import FlatTokens
from .swapped import Swapped, swapped
from .neighborhood import Neighborhood
from .halo_attention import halo_tensors, neighborhood_attention, neighborhood_rpb_score_mod

__version__ = "0.1.0"

__all__ = [
    "Neighborhood",
    "halo_tensors",
    "neighborhood_attention",
    "neighborhood_rpb_score_mod",
    "unparallelize",
    "parallelize",
    "is_parallelized",
    "current_request",
    "adopt",
    "active_request",
    "TokenIO",
    "SwinWindows",
    "StagedRuntime",
    "StagedRequest",
    "Stage",
    "SampleDropPath",
    "RowDropout",
    "row_dropout",
    "Region",
    "ParallelPlan",
    "ChannelsLast",
    "FlatTokens",
    "Swapped",
    "swapped",
    "DiffusionParallelConfig",
    "FixedWindows",
    "Layout",
    "PLANNERS",
    "PLANNER_VERSION",
    "Plan",
    "REGULAR_METHOD",
    "RuntimeStore",
    "SHIFTED_METHOD",
    "SPGroup",
    "SeedVR2Windows",
    "TemporalMesh",
    "Transition",
    "WindowAttention",
    "WindowGeometry",
    "WindowParallel",
    "WindowRequest",
    "WindowRuntime",
    "WindowSegments",
    "available_backends",
    "build_layout",
    "build_temporal_mesh",
    "ensure_layout",
    "gather_rows",
    "interleaved_schedule",
    "lpt_assign",
    "make_geometry",
    "ordered_results",
    "plan_schedule",
    "redistribute_rows",
    "reduce_window_text",
    "reference_window_attention",
    "scatter_rows",
    "sync_gradients",
    "window_attention",
    "window_slices",
]
