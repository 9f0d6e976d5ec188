"""Layer 5, runtime: it owns the layer schedule and executes the plans, one request a forward.

:class:`~winsp.runtime.runtime.WindowRuntime` plans once per request shape (cached in
:mod:`~winsp.runtime.store`) and makes a :class:`~winsp.runtime.request.WindowRequest` per forward, whose per-layer
steps move and attend rows. The request in progress is found with :mod:`~winsp.runtime.context`; gradients are made
whole with :mod:`~winsp.runtime.gradients`. Inference weights sharded over the SP group are gathered a module at a
time by :mod:`~winsp.runtime.weight_shards`. Training state is saved and resumed with
:mod:`~winsp.runtime.checkpoint` (DCP folders with a manifest, loaded without running pickled code).
"""

from winsp.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from winsp.runtime.config import DiffusionParallelConfig
from winsp.runtime.context import active_request, current_request
from winsp.runtime.drop_path import RowDropout, SampleDropPath, row_dropout
from winsp.runtime.gradients import sync_gradients
from winsp.runtime.nn import WindowParallel
from winsp.runtime.request import CheckedRequest
from winsp.runtime.runtime import StagedRequest, StagedRuntime, WindowRequest, WindowRuntime
from winsp.runtime.store import RuntimeStore
from winsp.runtime.weight_shards import FlatShardLayout, GatheredModules

__all__ = ["DiffusionParallelConfig", "WindowRuntime", "WindowRequest", "CheckedRequest", "StagedRuntime",
           "StagedRequest", "RuntimeStore", "WindowParallel", "current_request", "active_request", "sync_gradients",
           "RowDropout", "SampleDropPath", "row_dropout", "GatheredModules", "FlatShardLayout", "save_checkpoint",
           "load_checkpoint", "CheckpointError"]
