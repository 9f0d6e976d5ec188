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

This top level holds what the README and guides call (``__all__``, the index below); everything else is in those
subpackages. ``help(winsp.<name>)`` gives one name's full documentation.

Adopt an existing model (guide: docs/adopting_a_model.md)::

    parallelize(model, plan, config)   make a model window-parallel in place, as a ParallelPlan says
    unparallelize(model)               undo parallelize
    ParallelPlan                       what parallelize does: region, stages, attention globs and swaps
    Region, Stage                      the window-parallel part of a forward; one resolution level's windows
    ChannelsLast, FlatTokens, TokenIO  how a region's input holds its tokens
    swapped(fn), adopt                 a module swap written as one function; reuse an original's tensors
    current_request()                  the request of the region running now
    RowDropout, SampleDropPath         dropout and drop path on local rows with the original's draws
    shard_weights(model, mesh)         FSDP2 weight sharding over a DeviceMesh

Write a model for winsp, the request API (guide: docs/request_api.md)::

    DiffusionParallelConfig            the SP degree (ulysses_degree / sp_degree) and group
    WindowParallel                     mixin: window_schedule(), build_runtime(), require_runtime().request(...)
    WindowRuntime                      the runtime behind it
    sync_gradients(model)              average gradients over the SP group after backward

Distributed checkpoints (guide: docs/training_at_scale.md)::

    save_checkpoint, load_checkpoint   DCP with a SHA-256 manifest, checked before torch reads a file
    CheckpointError                    a checkpoint refused, naming its file

Window geometries::

    FixedWindows, SwinWindows          fixed-size windows, optionally shifted (clipped; Swin's rules)
    SeedVR2Windows, make_geometry      SeedVR2's windows (a fixed number per 720p area)
    Neighborhood                       NATTEN-style neighbourhood attention
    WindowGeometry                     the base class of all of them

Kernels::

    window_attention, WindowAttention  attention inside each local window (and the text rows)
    neighborhood_attention             one neighbourhood layer on local rows, halos exchanged

Run ranks and check a parallel model: ``winsp.testing`` (``run_ranks``, ``check_parallel``).
"""

from typing import TYPE_CHECKING

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



if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise accept any winsp.<name>

    def __getattr__(name: str):
        """A name that moved off the top level (``winsp.Swapped``) raises an AttributeError saying where it went."""
        from winsp._moved import moved_name_error

        raise moved_name_error(name)
