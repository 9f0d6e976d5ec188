"""The latent video DiT (``SpaceTime``) and the 3D segmentation network (a region ending with a grid change, skips)
on the fake GPU (winsp.testing.fake_gpu) in bf16 at P = 2 and 3: the same collectives on every rank, no device sync
and no device mismatch in compute, every rank returning the whole output."""

from __future__ import annotations

import warnings

import pytest
import torch

import winsp

pytestmark = [pytest.mark.fake_gpu, pytest.mark.timeout(600)]


def _video():
    from examples.latent_video.adapter import video_plan
    from examples.latent_video.model import LatentVideoDiT

    inputs = (torch.randn(1, 2, 3, 4, 4), torch.tensor([0.5]))
    return LatentVideoDiT, inputs, lambda m: video_plan()


def _segmentation():
    from examples.swin_seg3d.adapter import seg_plan
    from examples.swin_seg3d.model import SegNet3d

    return SegNet3d, (torch.randn(1, 1, 8, 16, 16),), seg_plan


def _run(rank: int, world: int, name: str) -> dict:
    torch.manual_seed(0)
    build, inputs, plan = {"video": _video, "segmentation": _segmentation}[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build().to("cuda", torch.bfloat16).eval()
        model = winsp.parallelize(model, plan(model), winsp.DiffusionParallelConfig(ulysses_degree=world))
        with torch.no_grad():
            out = model(*(x.to("cuda", torch.bfloat16) for x in inputs))
    return {"shape": tuple(out.shape), "dtype": out.dtype, "device": str(out.device)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["video", "segmentation"])
def test_on_the_fake_gpu(name, world):
    from winsp.testing.fake_gpu import run_fake_gpu

    report = run_fake_gpu(_run, world, name)
    assert report.problems() == []
    assert len({str(t.result) for t in report.ranks.values()}) == 1
    for trace in report.ranks.values():
        assert trace.result["device"] == "cuda:0" and trace.result["dtype"] == torch.bfloat16
        assert trace.device_syncs_in_compute() == [] and trace.mismatches == []
        assert len(trace.collectives) > 0
