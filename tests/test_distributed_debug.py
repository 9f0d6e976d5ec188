"""The multi-rank tests under PyTorch's collective-consistency checker (issue 30).

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps every process group so that each collective first compares its kind,
shapes, dtypes and sequence number across ranks: what NCCL would hang or corrupt on. The multi-rank set is run again
under it in a child pytest (``run_ranks`` spawns the ranks with this environment). Slow: it repeats every
multi-rank test (``.ci/run detail`` runs the same from CI).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)  # the whole multi-rank suite runs inside; pyproject's 600 s is per ordinary test
def test_the_multi_rank_tests_pass_under_the_collective_checker():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                           "multirank and not large_world and not huge", "tests"], cwd=REPO,
                          env=dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL"), capture_output=True, text=True,
                          timeout=3 * 3600)
    assert done.returncode == 0, done.stdout[-6000:]
