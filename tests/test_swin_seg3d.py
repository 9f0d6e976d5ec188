"""A 3D segmentation network (``examples/swin_seg3d``: a Swin encoder on volumes whose stages end with a patch merge,
every stage output feeding a CNN decoder through skip connections) made parallel as one region whose last step is a
grid change, each skip gathered once; and the refusals that name a wrong region end or a wrong layout."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import winsp
from examples.adapter_lines import model_specific_lines
from examples.swin_seg3d.adapter import seg_plan
from examples.swin_seg3d.model import SegNet3d
from winsp.runtime.request import WindowRequest
from winsp.testing import check_parallel


def make_model() -> SegNet3d:
    return SegNet3d().double()


def make_parallel(model, world_size: int):
    return winsp.parallelize(model, seg_plan(model), winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def make_inputs():  # grids 4 x 8 x 8 (4 windows), 2 x 4 x 4 (one window: ranks without one), then 1 x 2 x 2
    return torch.randn(1, 1, 8, 16, 16, dtype=torch.float64).requires_grad_()


def test_the_segmentation_network_equals_the_original_in_outputs_and_every_gradient():
    report = check_parallel(make_model, make_parallel, make_inputs, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0 and report.max_error("input") > 0
    params = [name for (kind, name) in report.items if kind == "param"]
    assert len(params) == len(list(make_model().parameters()))


def test_its_adapter_is_at_most_15_lines():
    assert model_specific_lines(str(Path(__file__).parents[1] / "examples" / "swin_seg3d" / "adapter.py")) <= 15


def test_each_stage_output_is_gathered_once_and_the_merges_run_on_local_rows(monkeypatch):
    torch.manual_seed(0)
    original = make_model()
    model = winsp.parallelize(copy.deepcopy(original), seg_plan(original))
    gathered, merged = [], []
    gather = WindowRequest.gather
    monkeypatch.setattr(WindowRequest, "gather", lambda self, x: gathered.append(tuple(x.shape)) or gather(self, x))
    model.encoder.stages[1].merge.register_forward_pre_hook(lambda m, a: merged.append(tuple(a[0].shape)))
    x = make_inputs()
    torch.testing.assert_close(model(x), original(x), rtol=0, atol=1e-12)
    assert gathered == [(32, 16), (4, 32)]  # stage 0's output (2 x 4 x 4, 16 channels), the last merge's (1 x 2 x 2)
    assert merged == [(1, 32, 1, 1, 16)]  # this rank's rows, as one sample
    assert model._winsp_runtime.layer_names[-1] == "(rows after encoder.stages.1.merge)"
