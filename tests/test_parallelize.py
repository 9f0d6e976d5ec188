"""``winsp.parallelize`` / ``unparallelize`` on a small torchvision Video Swin: in place, same state_dict, reversible,
clear errors for plans that do not fit the model, and the request reachable only inside the region (one rank; the
multi-rank parity is ``tests/test_swin3d.py``)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

import winsp
from winsp.testing import check_parallel

if importlib.util.find_spec("torchvision") is None:
    pytest.skip("torchvision is not installed (pip install -e '.[test]')", allow_module_level=True)

from examples.swin3d import SwinAttention3d, import_torchvision, parallelize, swin3d_plan  # noqa: E402

import_torchvision()
from torchvision.models.video.swin_transformer import SwinTransformer3d  # noqa: E402


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SwinTransformer3d(patch_size=[2, 4, 4], embed_dim=8, depths=[2, 2], num_heads=[1, 2],
                             window_size=[2, 3, 3], stochastic_depth_prob=0.5, num_classes=5).double()


def test_parallelize_keeps_parameters_and_state_dict_and_unparallelize_restores():
    model = _tiny()
    reference = copy.deepcopy(model)
    before = model.state_dict(keep_vars=True)
    attn = model.features[0][1].attn
    assert parallelize(model) is model
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert isinstance(model.features[0][1].attn, SwinAttention3d) and model._winsp_runtime.world_size == 1
    model.load_state_dict(_tiny(seed=1).state_dict())  # checkpoints load unchanged
    reference.load_state_dict(_tiny(seed=1).state_dict())
    x = torch.randn(2, 3, 4, 24, 20, dtype=torch.float64)
    for train in (False, True):
        model.train(train), reference.train(train)
        torch.manual_seed(3)
        out = model(x)
        torch.manual_seed(3)
        assert (out - reference(x)).abs().max() < 1e-12
    with pytest.raises(ValueError, match="parallelized already"):
        parallelize(model)
    winsp.unparallelize(model)
    assert model.features[0][1].attn is attn and not hasattr(model, "_winsp_runtime")
    assert not model.features[0]._forward_pre_hooks and not model.features._forward_hooks
    with pytest.raises(ValueError, match="was not parallelized"):
        winsp.unparallelize(model)


def test_plans_that_do_not_fit_the_model_are_refused_and_leave_it_untouched():
    model = _tiny()
    plan = swin3d_plan(model)
    with pytest.raises(ValueError, match="matches 4 modules but the stages list 3 layers"):
        winsp.parallelize(model, winsp.ParallelPlan(**{**plan.__dict__, "stages": plan.stages[:1] + (
            winsp.Stage(plan.stages[1].layers[:1], merge=(1, 2, 2)),)}))
    with pytest.raises(ValueError, match="matches no module"):
        winsp.parallelize(model, winsp.ParallelPlan(**{**plan.__dict__, "attention": "features.*.attention"}))
    with pytest.raises(ValueError, match="Region.start='encoder' is not a module path"):
        winsp.parallelize(model, winsp.ParallelPlan(**{**plan.__dict__, "region": winsp.Region("encoder", "features")}))

    def fresh_attention(original, layer):  # a copy of the parameters: state_dict entries would not be the same tensors
        return copy.deepcopy(original)

    with pytest.raises(ValueError, match="must reuse the original module's parameters"):
        winsp.parallelize(model, winsp.ParallelPlan(**{**plan.__dict__, "make_attention": fresh_attention}))
    assert type(model.features[0][0].attn).__name__ == "ShiftedWindowAttention3d"
    assert not model.features[0][0]._forward_pre_hooks and not hasattr(model, "_winsp_runtime")


def test_current_request_only_inside_the_region():
    with pytest.raises(RuntimeError, match="no winsp request is active"):
        winsp.current_request()
    model = parallelize(_tiny().eval())
    seen = []
    model.features[0][0].norm1.register_forward_hook(lambda m, a, o: seen.append(winsp.current_request()))
    model(torch.randn(1, 3, 2, 12, 12, dtype=torch.float64))
    assert isinstance(seen[0], winsp.runtime.StagedRequest)
    assert winsp.runtime.context.current_request_or_none() is None


def test_the_swin3d_adapter_is_at_most_40_lines():
    from pathlib import Path

    from examples.adapter_lines import model_specific_lines

    assert model_specific_lines(str(Path(__file__).parents[1] / "examples" / "swin3d" / "adapter.py")) <= 40


def test_a_region_that_raises_leaves_no_request_behind():
    model = parallelize(_tiny().eval())

    def fail(module, args):
        raise RuntimeError("boom inside the region")

    handle = model.features[0][1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(1, 3, 2, 12, 12, dtype=torch.float64))
    assert winsp.runtime.context.current_request_or_none() is None
    handle.remove()
    assert model(torch.randn(1, 3, 2, 12, 12, dtype=torch.float64)).shape == (1, 5)


def _tiny_with_stages():
    from examples.swin3d.compare import WithStages

    return WithStages(_tiny(), stages=("features.0", "features.2"))


def _parallel_tiny(original, world_size):
    parallelize(original.module, winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def _clip():
    return torch.randn(2, 3, 6, 28, 36, dtype=torch.float64).requires_grad_()  # grids 3 x 7 x 9: padded windows


@pytest.mark.slow  # the default run checks swin3d_t (tests/test_swin3d.py) and check_parallel on a U-net
def test_check_parallel_on_a_small_video_swin_in_training():
    """winsp.testing.check_parallel at SP = 3 in train mode: logits, both stages' outputs, every parameter gradient
    and the input gradient equal the original's (float64, 1e-9 relative)."""
    report = check_parallel(_tiny_with_stages, _parallel_tiny, _clip, world_sizes=(3,), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0 and len(report.items) > 20


def test_two_attention_layers_under_one_parent_need_an_entry_glob():
    model = nn.Module()
    model.blk = nn.Module()
    model.blk.a1, model.blk.a2 = nn.Linear(2, 2), nn.Linear(2, 2)
    geometry = winsp.SwinWindows((1, 2, 2))
    plan = winsp.ParallelPlan(region=winsp.Region("blk", "blk"), stages=[winsp.Stage([geometry, geometry])],
                              attention="blk.a*", make_attention=lambda original, layer: original)
    with pytest.raises(ValueError, match=r"share the entry module\(s\) \['blk'\]"):
        winsp.parallelize(model, plan)


@pytest.mark.parametrize("path, pattern, expected", [
    ("layers.0.blocks.1", "layers.*.blocks.*", True),
    ("layers.0.blocks.1.attn", "layers.*.blocks.*", False),   # a * never crosses a dot
    ("layers.0.blocks.1.attn", "layers.**.attn", True),
    ("layers.attn", "layers.**.attn", True),                  # ** may span no component
    ("features.[1]", "features.*", True),
    ("features.3", "features.[135]", True),
    ("features.2", "features.[135]", False),
    ("body.down.0.attn", "body.*attn", False),
    ("body.down.0.attn", "body.**.*attn", True),
])
def test_globs_match_path_components(path, pattern, expected):
    from winsp.adoption.parallelize import path_matches

    assert path_matches(path, pattern) is expected


def test_swin_windows_without_clamping_keep_the_configured_window_and_shift():
    geometry = winsp.SwinWindows((1, 4, 4), (0, 2, 2), clamp=False)
    assert geometry.effective((1, 3, 3)) == ((1, 4, 4), (0, 2, 2))
    assert geometry.padded_grid((1, 3, 3)) == (1, 4, 4)
    assert winsp.SwinWindows((1, 4, 4), (0, 2, 2)).effective((1, 3, 3)) == ((1, 3, 3), (0, 0, 0))
    with pytest.raises(ValueError, match="clamp must be a bool"):
        winsp.SwinWindows((1, 4, 4), clamp=1)
