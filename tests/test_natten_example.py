"""examples/natten_video: a model written with natten's functional API equals its one-plan winsp version.

Outputs are compared with natten itself (float32, its CPU flex path). natten has no backward (and no float64) on a
CPU machine, so for every gradient the original model runs with ``natten.na3d`` replaced by the dense oracle of
``tests/na_oracle.py`` (itself checked against natten's forward), in float64, at SP = 1, 2 and 3.
"""

from __future__ import annotations

import copy

import pytest
import torch

import winsp
from winsp.testing import run_ranks

natten = pytest.importorskip("natten", reason="natten is not installed: pip install -e '.[natten]'")

from examples.natten_video.adapter import parallelize  # noqa: E402
from examples.natten_video.model import NATVideoConfig, random_model  # noqa: E402
from tests.na_oracle import dense_na3d  # noqa: E402

CONFIG = NATVideoConfig(dim=16, heads=2)  # head_dim 8: natten's CPU path wants a power of two >= 8
VIDEO = (2, 4, 7, 10, 4)  # two clips; 7 x 10 does not divide by 2 or 3


def _video(dtype=torch.float32):
    return torch.randn(*VIDEO, generator=torch.Generator().manual_seed(5), dtype=dtype)


def test_parallel_model_equals_natten_in_float32():
    model = random_model(CONFIG).eval()
    x = _video()
    with torch.no_grad():
        expected = model(x)
        out = parallelize(copy.deepcopy(model))(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_without_meta_kernels_the_order_is_recorded_once_from_a_real_forward_said_in_one_line():
    model = parallelize(random_model(CONFIG).eval())
    with pytest.warns(UserWarning) as record, torch.no_grad():
        model(_video())
        model(_video())
    said = [str(w.message) for w in record if "winsp.parallelize" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0]
    assert "NATVideo cannot run on meta tensors" in said[0] and "recorded once from a no-grad forward" in said[0]
    stated = random_model(CONFIG).eval()
    plan = model._winsp_parallel.plan
    winsp.parallelize(stated, winsp.ParallelPlan(**{**plan.__dict__, "forward_order": ("blocks",)}))
    with pytest.warns(UserWarning, match="NATVideo cannot run on meta tensors .*checked step by step"), torch.no_grad():
        stated(_video())


def _grads(model, x):
    out = model(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, x.grad.clone()


def _reference(monkeypatch=None):
    model = random_model(CONFIG).double()
    x = _video(torch.float64).requires_grad_(True)
    return _grads(model, x)


def _rank(rank, world_size):
    model = parallelize(random_model(CONFIG).double(), winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    x = _video(torch.float64).requires_grad_(True)
    out, grads, _ = _grads(model, x)
    winsp.sync_gradients(model)
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def oracle_natten(monkeypatch):
    monkeypatch.setattr(natten, "na3d", dense_na3d)


def _check(results, ref_out, ref_grads):
    for out, grads in results:
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-10, atol=1e-10, msg=name)


def test_every_gradient_at_one_rank(oracle_natten):
    ref_out, ref_grads, _ = _reference()
    model = parallelize(random_model(CONFIG).double())
    out, grads, _ = _grads(model, _video(torch.float64).requires_grad_(True))
    _check([(out, grads)], ref_out, ref_grads)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_gradient_on_ranks(oracle_natten, world_size):
    ref_out, ref_grads, _ = _reference()
    _check(run_ranks(_rank, world_size, timeout=240), ref_out, ref_grads)
