"""Distributed checkpoints of a window-parallel model sharded by FSDP2: model and optimizer state saved with
``winsp.save_checkpoint`` (``torch.distributed.checkpoint`` and a manifest) on a (dp, sp) = (2, 2) mesh, resumed on (1, 2), and the next step equals an
uninterrupted run's (and the original model's in one process)."""

from __future__ import annotations

import pytest

from tests import fsdp_cases as cases
from winsp.testing import run_ranks

TIMEOUT = 600.0


@pytest.mark.slow  # about 30 s: two 4-rank worlds and a 2-rank one (the default run stays under 10 minutes)
def test_save_on_2x2_resume_on_1x2_takes_the_same_next_step(tmp_path):
    path = str(tmp_path / "checkpoint")
    uninterrupted = run_ranks(cases.dcp_save_case, 4, 2, 2, path, timeout=TIMEOUT)
    resumed = run_ranks(cases.dcp_resume_case, 2, 1, 2, path, timeout=TIMEOUT)
    reference = cases.dcp_single_process_reference()
    assert resumed[0]["moved"] > 1e-3  # the resumed model started elsewhere: the checkpoint was loaded
    for got in [r["params"] for r in resumed] + uninterrupted:
        assert got.keys() == reference.keys()
        for name, want in reference.items():
            assert (got[name] - want).abs().max().item() <= 1e-12 * max(want.abs().max().item(), 1.0), name
    for name in reference:  # every rank of both runs holds the same whole parameters
        assert (resumed[0]["params"][name] - uninterrupted[0][name]).abs().max().item() <= 1e-12
