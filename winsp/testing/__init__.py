"""Testing a window-parallel model: on several CPU ranks against the original model, and on a fake GPU.

- :mod:`winsp.testing.ranks`: :func:`run_ranks` runs a function on several gloo ranks (one process a rank) with a
  deadline; :func:`check_parallel` compares a parallelised model with the original one at several world sizes.
- :mod:`winsp.testing.fake_gpu`: :func:`run_fake_gpu` runs a function as every rank of a fake process group on fake
  CUDA tensors (the CUDA build of torch, no GPU needed) and checks what would break on real GPUs: collectives that
  differ between ranks, host syncs and device mismatches inside compute; it also reports each rank's peak of device
  memory. Imported on first use (it needs ``torch._subclasses`` and the fake process group).
"""

from __future__ import annotations

from winsp.testing.ranks import (
    DEFAULT_TOLERANCES,
    FORKSERVER_PRELOAD,
    Discrepancy,
    ParallelCheckError,
    ParallelReport,
    RankError,
    check_parallel,
    run_ranks,
)

__all__ = ["run_ranks", "RankError", "check_parallel", "ParallelCheckError", "ParallelReport", "Discrepancy",
           "DEFAULT_TOLERANCES", "FORKSERVER_PRELOAD", "run_fake_gpu", "FakeGpuError", "FakeGpuReport"]

_FAKE_GPU_NAMES = ("run_fake_gpu", "FakeGpuError", "FakeGpuReport")


def __getattr__(name: str):
    if name in _FAKE_GPU_NAMES:
        from winsp.testing import fake_gpu

        return getattr(fake_gpu, name)
    raise AttributeError(f"module 'winsp.testing' has no attribute {name!r}")
