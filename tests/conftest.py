"""Marks every test of a module that starts process groups as ``multirank``; skips ``fake_gpu`` tests on a CPU-only
torch (they need the CUDA build, not a GPU).

The collective-consistency run (``.ci/run detail``, ``tests/test_distributed_debug.py``) selects ``-m multirank``;
marking by hand missed modules, so a module that calls ``run_ranks`` or starts ranks through torchrun or the CLI's
``--ranks`` launcher has all of its tests marked.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

STARTS_RANKS = ("run_ranks(", "torch.distributed.run", "torchrun", '"--ranks"', "nproc-per-node")


@functools.lru_cache(maxsize=None)
def _starts_ranks(path: Path) -> bool:
    text = path.read_text(encoding="utf-8")
    return any(marker in text for marker in STARTS_RANKS)


@functools.lru_cache(maxsize=None)
def _cuda_build() -> bool:
    import torch

    return torch.backends.cuda.is_built() and torch.version.cuda is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    no_fake_gpu = pytest.mark.skip(reason="fake_gpu: this torch is a CPU-only build (fake CUDA tensors need the CUDA "
                                          "build, no GPU); .ci/run runs these in .venv-fake-gpu")
    for item in items:
        if item.path.suffix == ".py" and _starts_ranks(item.path):
            item.add_marker(pytest.mark.multirank)
        if item.get_closest_marker("fake_gpu") is not None and not _cuda_build():
            item.add_marker(no_fake_gpu)
