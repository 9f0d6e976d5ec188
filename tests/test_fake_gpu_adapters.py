"""The adapters on the fake GPU (winsp.testing.fake_gpu): torchvision's Swin3D, Hugging Face's Swin V2, the hourglass
U-net, the NATTEN video model (its halo path) and the divided space-time video transformer (toy size only), each
parallelised with its example adapter and run in bf16 on CUDA as every rank of P: the same collectives on every rank,
0 device syncs and 0 device mismatches in compute.

Two sizes: toy (P = 1, 2, 3; P = 1 runs the untouched model) and real (P = 1, 2, 4, the adapter at every P; P = 2 in
the default fake-GPU run, 1 and 4 under ``-m slow``):

- Swin3D-T (``swin3d_t``) on a 1 x 3 x 32 x 224 x 224 clip, torchvision's Kinetics-400 recipe;
- Swin V2-T as released as ``swinv2-tiny-patch4-window8-256`` (embed 96, depths 2-2-6-2, window 8) on 256 x 256;
- the hourglass at widths 128-256-512 (64-wide heads), windows (2, 8, 8) shifted by (1, 4, 4), on an (8, 64, 64) token
  grid: 8 frames of a 256 x 256 video in 4 x 4 patches. Larger grids are out of the example's reach, not winsp's: its
  window attention builds a dense N x N mask on the host (5.7 GB at a 720p latent's 75,600 tokens), and winsp's
  order-recording dry run runs that forward once;
- the NATTEN video model on a 720p x 21-frame latent's token grid (21, 45, 80) with 16 channels, width 256, 4 heads of
  64, four (3, 7, 7) neighbourhood blocks (plain, dilated (1, 2, 2), causal in time, plain): the grid and kernel of
  ``benchmarks/bench_neighborhood.py``. natten here has no libnatten, so on CUDA its layers take winsp's flex backend,
  which runs uncompiled on the fake GPU and so materialises the scores: its peak bytes are not a GPU's.

Needs the CUDA build of torch (no GPU); skipped on a CPU-only build, and per model when its package is missing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import winsp

pytestmark = [pytest.mark.fake_gpu, pytest.mark.timeout(600)]


def _run(rank: int, world: int, build, make_input, parallelize, parallel_at_one: bool = False) -> dict:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # meta dry runs a model cannot take, data_ptr of fake tensors
        # built on the host (real weights; torch's initialisers read values) and moved, as a checkpoint is loaded
        model = build().to("cuda", torch.bfloat16).eval()
        x = make_input().to("cuda")
        parallel = world > 1 or parallel_at_one
        config = winsp.DiffusionParallelConfig(ulysses_degree=world) if parallel else None
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


def _divided_video():
    from examples.divided_video.adapter import parallelize
    from examples.divided_video.model import DividedVideoTransformer

    return (DividedVideoTransformer, lambda: torch.randn(1, 3, 3, 4, 6, dtype=torch.bfloat16),
            lambda m, c: parallelize(m, c) if c is not None else m)


MODELS = {"hourglass": _hourglass, "swin3d": _swin3d, "swinv2": _swinv2, "natten_video": _natten_video,
          "divided_video": _divided_video}


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


# ---- real sizes (module docstring) ---------------------------------------------------------------------------------

def _swin3d_real():
    pytest.importorskip("torchvision")
    from torchvision.models.video import swin3d_t

    from examples.swin3d.adapter import parallelize

    return (lambda: swin3d_t(weights=None), lambda: torch.randn(1, 3, 32, 224, 224, dtype=torch.bfloat16),
            parallelize, (1, 400))


def _swinv2_real():
    pytest.importorskip("transformers")
    from examples.swinv2.adapter import parallelize
    from examples.swinv2.parity import import_swinv2

    config_cls, model_cls = import_swinv2()
    config = config_cls(image_size=256, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                        window_size=8)
    return (lambda: model_cls(config), lambda: torch.randn(1, 3, 256, 256, dtype=torch.bfloat16), parallelize,
            (1, 64, 768))


def _hourglass_real():
    from examples.hourglass import HourglassNet, parallelize

    return (lambda: HourglassNet(dims=(128, 256, 512), heads=(2, 4, 8), window=(2, 8, 8), shift=(1, 4, 4),
                                 dropout=0.0),
            lambda: torch.randn(1, 8, 64, 64, 3, dtype=torch.bfloat16), parallelize, (1, 8, 64, 64, 3))


def _natten_video_real():
    pytest.importorskip("natten")
    from examples.natten_video.adapter import parallelize
    from examples.natten_video.model import NATVideoConfig, random_model

    k = (3, 7, 7)
    config = NATVideoConfig(in_channels=16, out_channels=16, dim=256, heads=4,
                            blocks=((k, (1, 1, 1), (False, False, False)), (k, (1, 2, 2), (False, False, False)),
                                    (k, (1, 1, 1), (True, False, False)), (k, (1, 1, 1), (False, False, False))))
    return (lambda: random_model(config), lambda: torch.randn(1, 21, 45, 80, 16, dtype=torch.bfloat16), parallelize,
            (1, 21, 45, 80, 16))


REAL = {"hourglass": _hourglass_real, "swin3d": _swin3d_real, "swinv2": _swinv2_real,
        "natten_video": _natten_video_real}


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(REAL))
def test_adapter_at_real_size_on_the_fake_gpu(name, world):
    from winsp.testing.fake_gpu import run_fake_gpu

    build, make_input, parallelize, shape = REAL[name]()
    report = run_fake_gpu(_run, world, build, make_input, parallelize, True)
    _check(report)
    assert report.ranks[0].result["shape"] == shape
    if world == 1:
        assert all(not t.collectives for t in report.ranks.values())
    if name == "natten_video" and world > 1:
        for block in range(4):
            assert any(c.op == "all_to_all" and c.layer == f"NATVideo.blocks.{block}.attn"
                       for c in report.ranks[0].collectives), block
