"""The adapters on the fake GPU (winsp.testing.fake_gpu): torchvision's Swin3D, Hugging Face's Swin V2, the hourglass
U-net and the NATTEN video model (its halo path), each parallelised with its example adapter and run in bf16 on CUDA
as every rank of P: the same collectives on every rank, 0 device syncs and 0 device mismatches in compute.

Needs the CUDA build of torch (no GPU); skipped on a CPU-only build, and per model when its package is missing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import winsp

pytestmark = [pytest.mark.fake_gpu, pytest.mark.timeout(600)]


def _run(rank: int, world: int, build, make_input, parallelize) -> dict:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # meta dry runs a model cannot take, data_ptr of fake tensors
        # built on the host (real weights; torch's initialisers read values) and moved, as a checkpoint is loaded
        model = build().to("cuda", torch.bfloat16).eval()
        x = make_input().to("cuda")
        config = winsp.DiffusionParallelConfig(ulysses_degree=world) if world > 1 else None
        model = parallelize(model, config)
        with torch.no_grad():
            out = model(x)
    out = out if isinstance(out, torch.Tensor) else out[0]
    return {"shape": tuple(out.shape), "dtype": out.dtype, "device": str(out.device)}


def _check(report) -> None:
    assert report.problems() == []
    results = {r: t.result for r, t in report.ranks.items()}
    assert len({str(v) for v in results.values()}) == 1, results  # every rank returns the whole output
    for trace in report.ranks.values():
        assert trace.result["device"] == "cuda:0" and trace.result["dtype"] == torch.bfloat16
        assert trace.device_syncs_in_compute() == [] and trace.mismatches == []
    if report.world_size > 1:
        assert all(len(t.collectives) > 0 for t in report.ranks.values())


def _hourglass():
    from examples.hourglass import HourglassNet, parallelize

    return (HourglassNet, lambda: torch.randn(1, 2, 8, 6, 3, dtype=torch.bfloat16),
            lambda m, c: parallelize(m, c) if c is not None else m)


def _swin3d():
    pytest.importorskip("torchvision")
    from torchvision.models.video import swin3d_t

    from examples.swin3d.adapter import parallelize

    return (lambda: swin3d_t(weights=None), lambda: torch.randn(1, 3, 4, 56, 56, dtype=torch.bfloat16),
            lambda m, c: parallelize(m, c) if c is not None else m)


def _swinv2():
    pytest.importorskip("transformers")
    from examples.swinv2.adapter import parallelize
    from examples.swinv2.parity import import_swinv2, tiny_config

    _, model_cls = import_swinv2()
    return (lambda: model_cls(tiny_config()), lambda: torch.randn(2, 3, 32, 32, dtype=torch.bfloat16),
            lambda m, c: parallelize(m, c) if c is not None else m)


def _natten_video():
    pytest.importorskip("natten")
    from examples.natten_video.adapter import parallelize
    from examples.natten_video.model import NATVideoConfig, random_model

    return (lambda: random_model(NATVideoConfig()), lambda: torch.randn(1, 4, 8, 12, 4, dtype=torch.bfloat16),
            lambda m, c: parallelize(m, c) if c is not None else m)


MODELS = {"hourglass": _hourglass, "swin3d": _swin3d, "swinv2": _swinv2, "natten_video": _natten_video}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_adapter_on_the_fake_gpu(name, world):
    from winsp.testing.fake_gpu import run_fake_gpu

    build, make_input, parallelize = MODELS[name]()
    report = run_fake_gpu(_run, world, build, make_input, parallelize)
    _check(report)
    if name == "natten_video" and world > 1:  # the halo path: each neighborhood layer exchanges halos
        for block in range(3):
            assert any(c.op == "all_to_all" and c.layer == f"NATVideo.blocks.{block}.attn"
                       for c in report.ranks[0].collectives), block
