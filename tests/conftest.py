"""Marks every test of a module that starts process groups as ``multirank``.

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".py" and _starts_ranks(item.path):
            item.add_marker(pytest.mark.multirank)


#: what this session collected: the tests selected to run and those deselected by ``-m`` (tests/test_readme_install.py
#: compares them with the README's figures)
COLLECTED = {"selected": 0, "deselected": 0}


def pytest_deselected(items: list[pytest.Item]) -> None:
    COLLECTED["deselected"] += len(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    COLLECTED["selected"] = len(session.items)
