"""examples.swinv2: HF transformers' Swinv2Model, parallelized, equals the untouched model (float64).

One rank against HF's own forward first (the block rewrite: cosine attention, cpb score_mod, padding, shifted
windows), then 2 and 3 gloo ranks: outputs, hidden states of every stage, and after ``winsp.sync_gradients`` every
parameter gradient and the pixel_values gradient, at 32x32 (grid a window multiple) and 36x36 (padding at every
stage, odd grids for patch merging), batch 2, eval and train (per-sample drop path).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import winsp  # noqa: E402
from examples.swinv2 import parallelize, plan  # noqa: E402
from examples.swinv2.hf_import import import_swinv2  # noqa: E402
from examples.swinv2.parity import ALL_CASES, compare_with_original, tiny_config  # noqa: E402
from winsp.comm.group import new_subgroup  # noqa: E402
from winsp.testing import check_parallel, run_ranks  # noqa: E402

OUTPUT_TOL, GRAD_TOL = 1e-9, 1e-9


def _check(results: dict, cases=ALL_CASES) -> None:
    assert set(results) == set(cases)
    for case, r in results.items():
        assert r["grad_presence_mismatch"] == [], case
        assert r["stages_compared"] == 3, case
        for key in ("last_hidden_state", "pooler_output", "hidden_states"):
            assert r[key] <= OUTPUT_TOL, (case, key, r[key])
        assert r["parameter_grad"] <= GRAD_TOL, (case, r["worst_parameter"], r["parameter_grad"])
        assert r["pixel_grad"] <= GRAD_TOL, (case, r["pixel_grad"])


def test_one_rank_equals_hf():
    _check(compare_with_original(0, 1))


# The default run splits the four cases between SP = 3 (the world) and SP = 2 (a subgroup of the same spawned world:
# one transformers import per rank, the expensive part), so that each degree sees a padded and an unpadded image, eval
# and train; the full matrix at both is `slow`, SP = 4 `large_world`.
SPLIT = {2: ((32, False), (36, True)), 3: ((36, False), (32, True))}


def _sp3_then_sp2(rank, world_size):
    three = compare_with_original(rank, 3, SPLIT[3])
    pair = new_subgroup([0, 1])  # every rank of the world creates it
    return three, compare_with_original(rank, 2, SPLIT[2], group=pair) if rank < 2 else None


@pytest.mark.multirank
def test_sp2_and_sp3_equal_hf():
    results = run_ranks(_sp3_then_sp2, 3, timeout=300)
    for three, _ in results:
        _check(three, SPLIT[3])
    for _, two in results[:2]:
        _check(two, SPLIT[2])
    assert results[2][1] is None


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_equal_hf_every_case(world_size):
    for r in run_ranks(compare_with_original, world_size, timeout=600):
        _check(r)


@pytest.mark.multirank
@pytest.mark.large_world
def test_four_ranks_equal_hf():
    for r in run_ranks(compare_with_original, 4, timeout=600):
        _check(r)


def test_one_model_serves_images_of_many_sizes():
    """One parallelized model, many image sizes in a row (float64, eval, one rank): smaller than config.image_size
    (HF keeps its window and pads: 8x8 gives a 2x2 grid padded to 4x4, whose pad tokens take part), non-square, and
    pairs whose grids pad to the same laid grid (16x16 then 8x8; 32x44 then 20x52), which once reused a stale
    prepared grid change."""
    _, model_cls = import_swinv2()
    torch.manual_seed(0)
    original = model_cls(tiny_config()).double().eval()
    with torch.no_grad():
        for p in original.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = parallelize(copy.deepcopy(original))
    for height, width in ((16, 16), (8, 8), (32, 44), (20, 52), (4, 4), (36, 36)):
        x = torch.randn(2, 3, height, width, dtype=torch.float64)
        with torch.no_grad():
            got, want = model(x), original(x)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=0, atol=1e-9)
        torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=0, atol=1e-9)


def test_plan_follows_hf_clamping_shift_and_merge_order():
    _, model_cls = import_swinv2()
    model = model_cls(tiny_config())  # stage grids 8, 4, 2 with window 4: shift only where the grid exceeds it
    stages = plan(model).stages
    assert [[(g.window_size, g.shift) for g in st.layers] for st in stages] == [
        [((1, 4, 4), (0, 0, 0)), ((1, 4, 4), (0, 2, 2))],
        [((1, 4, 4), (0, 0, 0)), ((1, 4, 4), (0, 0, 0))],
        [((1, 2, 2), (0, 0, 0)), ((1, 2, 2), (0, 0, 0))],
    ]
    assert [st.merge for st in stages] == [(1, 1, 1), (1, 2, 2), (1, 2, 2)]
    assert stages[1].order == ((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))  # HF: h offset varies first
    assert stages[1].layers[0].padded_grid((1, 5, 3)) == (1, 8, 4)  # whole windows, HF's maybe_pad
    assert stages[2].layers[0].padded_grid((1, 1, 1)) == (1, 2, 2)  # HF's window, never re-clamped to the grid
    deep = model_cls(tiny_config(depths=(2, 12), num_heads=(2, 4)))  # two-digit block indices (Swin V2-B has 18)
    assert [len(st.layers) for st in plan(deep).stages] == [2, 12]
    parallelize(deep)
    assert sum(isinstance(m, winsp.adoption.Swapped) for m in deep.modules()) == 14 + 1


def test_train_mode_really_drops_paths():
    """The train cases above compare something drop path changed (else they would repeat the eval case)."""
    _, model_cls = import_swinv2()
    torch.manual_seed(0)
    model = model_cls(tiny_config(drop_path_rate=0.3)).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    torch.manual_seed(1)
    train = model.train()(x).last_hidden_state
    assert (train - model.eval()(x).last_hidden_state).abs().max() > 1e-3


def test_state_dict_and_unparallelize():
    _, model_cls = import_swinv2()
    torch.manual_seed(0)
    model = model_cls(tiny_config()).double().eval()
    before = dict(model.state_dict(keep_vars=True))
    x = torch.randn(1, 3, 36, 36, dtype=torch.float64)
    expected = model(x)
    parallelize(model)
    after = dict(model.state_dict(keep_vars=True))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # the same tensors
    assert model._winsp_runtime is not None
    with pytest.raises(ValueError, match="parallelized already"):
        parallelize(model)
    out = model(x)
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.pooler_output, expected.pooler_output, rtol=0, atol=1e-12)
    winsp.unparallelize(model)
    assert type(model.encoder.layers[0].blocks[0]).__name__ == "Swinv2Layer"
    torch.testing.assert_close(model(x).last_hidden_state, expected.last_hidden_state, rtol=0, atol=0)


def test_refuses_what_it_cannot_reproduce():
    _, model_cls = import_swinv2()
    with pytest.raises(ValueError, match="hidden_dropout_prob"):
        parallelize(model_cls(tiny_config(hidden_dropout_prob=0.1)))
    with pytest.raises(ValueError, match="Swinv2Model"):
        parallelize(torch.nn.Linear(2, 2))
    model = parallelize(model_cls(tiny_config()))
    for flag in ("output_hidden_states", "output_attentions"):
        with pytest.raises(ValueError, match=flag):
            model(torch.randn(1, 3, 32, 32), **{flag: True})


def test_the_readme_states_the_adapter_line_count():
    """The count in examples/swinv2/README.md is the measured one (issue 14 asks for it; it must not drift)."""
    from pathlib import Path

    from examples.adapter_lines import model_specific_lines

    root = Path(__file__).parents[1] / "examples" / "swinv2"
    lines = model_specific_lines(str(root / "adapter.py"))
    assert f"**{lines} lines**" in (root / "README.md").read_text()


@pytest.mark.slow
def test_flex_backend_equals_hf_in_inference():
    """The cpb score_mod also runs under FlexAttention (vmap over scalar indices; CPU flex is inference-only)."""
    _, model_cls = import_swinv2()
    torch.manual_seed(0)
    model = model_cls(tiny_config()).double().eval()
    x = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x).last_hidden_state
        parallelize(model, winsp.DiffusionParallelConfig(attention_backend="flex"))
        torch.testing.assert_close(model(x).last_hidden_state, expected, rtol=0, atol=1e-9)
    assert "flex" in model._winsp_runtime.execution_path


def _hf_model():
    _, model_cls = import_swinv2()
    return model_cls(tiny_config(drop_path_rate=0.3)).double()


def _parallel_hf(original, world_size):
    return parallelize(original, winsp.DiffusionParallelConfig(ulysses_degree=world_size) if world_size > 1 else None)


def _pixels():
    return (torch.randn(2, 3, 36, 36, dtype=torch.float64).requires_grad_(),)


@pytest.mark.slow
@pytest.mark.multirank
def test_check_parallel_agrees():
    """winsp's own checker, independently of compare_with_original: train mode, padded grids, SP = 2."""
    report = check_parallel(_hf_model, _parallel_hf, _pixels, world_sizes=(2,), train=True)
    assert report.ok and ("param", "encoder.layers.0.blocks.1.attention.self.logit_scale") in report.items
    assert ("input", "args[0]") in report.items and report.max_error("output") <= 1e-9
