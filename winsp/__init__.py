"""winsp: window-parallel attention for 3D-windowed video diffusion transformers.

Each rank owns whole attention windows, so attention needs no communication, every rank keeps all heads, and rows
move only where the window layout changes between layers.

The package is layered, each layer importing only those below it (checked in CI by ``import-linter``)::

    winsp.testing    run ranks, compare a parallel model with the original
    winsp.adoption   parallelize an existing model: plans, swaps, region checks
    winsp.runtime    the layer schedule, requests, gradients
    winsp.attention  window, split-window and neighborhood kernels
    winsp.comm       torch.distributed: redistribution, text reduction, bands
    winsp.planning   placements and schedules, pure functions of shapes
    winsp.geometry   windows, neighborhoods, layouts
    winsp.utils      argument checks

This top level holds what the README and guides call; everything else is in those subpackages.
"""

from winsp import testing  # noqa: F401
from winsp.adoption import (
    ChannelsLast,
    FlatTokens,
    ParallelPlan,
    Region,
    TokenIO,
    adopt,
    parallelize,
    shard_weights,
    swapped,
    unparallelize,
)
from winsp.attention import WindowAttention, neighborhood_attention, window_attention
from winsp.comm import SPGroup  # noqa: F401  (kept importable as winsp.SPGroup for type hints; not in __all__)
from winsp.geometry import FixedWindows, Neighborhood, SeedVR2Windows, SwinWindows, WindowGeometry, make_geometry
from winsp.planning import Stage
from winsp.runtime import (
    CheckpointError,
    DiffusionParallelConfig,
    RowDropout,
    SampleDropPath,
    WindowParallel,
    WindowRuntime,
    current_request,
    load_checkpoint,
    save_checkpoint,
    sync_gradients,
)

__version__ = "0.1.0"

__all__ = [
    # adopt an existing model
    "parallelize", "unparallelize", "ParallelPlan", "Region", "Stage", "ChannelsLast", "TokenIO", "FlatTokens",
    "swapped", "adopt", "current_request", "RowDropout", "SampleDropPath", "shard_weights",
    # the request API
    "DiffusionParallelConfig", "WindowRuntime", "WindowParallel", "sync_gradients",
    # training state: distributed checkpoints with a manifest, loaded without running pickled code
    "save_checkpoint", "load_checkpoint", "CheckpointError",
    # geometry
    "WindowGeometry", "SeedVR2Windows", "FixedWindows", "SwinWindows", "Neighborhood", "make_geometry",
    # kernels
    "window_attention", "WindowAttention", "neighborhood_attention",
]
