"""torchvision's swin3d_t, all four stages window-parallel through ``examples.swin3d.parallelize``, equals the untouched
torchvision model (float64): logits, every stage's output, every parameter gradient and the input gradient after
``loss.backward()`` + ``winsp.sync_gradients(model)``, all <= 1e-9 relative.

Default run: one world of 3 ranks, SP = 2 on ranks {0, 1} in training mode (stochastic depth per sample at p = 0.5) on
a 4 x 32 x 32 clip (stage-0 grid 2 x 8 x 8: padded to whole 7 x 7 windows), then SP = 3 in eval mode on 4 x 56 x 56
(grid 2 x 14 x 14: whole windows, shifted), batch 2 in both. SP = 4 on longer clips, and the same check through
``winsp.testing.check_parallel`` at SP = 2 and 3, are marked slow.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from examples.swin3d.compare import STAGES, compare_with_torchvision, parallelize_with_stages, swin3d_t_with_stages
from winsp.comm.group import new_subgroup
from winsp.testing import check_parallel, run_ranks

if importlib.util.find_spec("torchvision") is None:
    pytest.skip("torchvision is not installed (pip install -e '.[test]')", allow_module_level=True)

TOL = 1e-9


def _check(report: dict) -> None:
    for key in ("logits", "input_grad", "param_grad") + STAGES:
        assert report[key] <= TOL, (key, report)


def _sp2_train_sp3_eval(rank: int, world_size: int) -> dict:
    groups = {2: new_subgroup([0, 1]), 3: new_subgroup([0, 1, 2])}
    out = {}
    if rank < 2:
        out[2] = compare_with_torchvision(rank, 2, (2, 3, 4, 32, 32), True, group=groups[2])
    out[3] = compare_with_torchvision(rank, 3, (2, 3, 4, 56, 56), False, group=groups[3])
    return out


def test_swin3d_sp2_train_padded_and_sp3_eval_whole_windows():
    reports = run_ranks(_sp2_train_sp3_eval, 3, timeout=600)[0]
    _check(reports[2])
    _check(reports[3])


@pytest.mark.slow
@pytest.mark.parametrize("shape, train", [((2, 3, 8, 56, 56), True), ((2, 3, 6, 40, 72), False)])
def test_swin3d_sp4(shape, train):
    _check(run_ranks(compare_with_torchvision, 4, shape, train, timeout=900)[0])


def _clip_4x32x32():
    return torch.randn(2, 3, 4, 32, 32, dtype=torch.float64).requires_grad_()


@pytest.mark.slow
def test_swin3d_check_parallel_train_padded():
    """The same bar through winsp.testing.check_parallel (every rank's logits, stage outputs, 173 parameter gradients
    and the input gradient against the original run once in the parent process)."""
    report = check_parallel(swin3d_t_with_stages, parallelize_with_stages, _clip_4x32x32, world_sizes=(2, 3),
                            train=True, timeout=900)
    assert report.ok and report.max_error("param") > 0  # compared, not skipped
