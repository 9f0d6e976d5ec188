"""diffusers' HunyuanVideo 1.5 transformer with sliding tile attention (STA), parallelised by one plan
(``examples/hunyuanvideo15``): the joint text stream replicated (its padding left out of attention, as the model's mask
does), the video cut into blocks with halos for NATTEN's ``kernel = tile * tiles, stride = tile``. Exact against the
untouched single-device STA model (``examples/hunyuanvideo15/sta.py``: a dense mask from the STA definition) in the
output, every parameter gradient and the input gradients, float64, at SP 2, 3 and 4 with 5 heads."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import winsp
from examples.adapter_lines import model_specific_lines
from winsp.testing import check_parallel

pytest.importorskip("diffusers")

HEADS, HEAD_DIM = 5, 8  # 5 heads: neither 3 nor 4 divides them (a head-sharded SP could not run at 3 or 4)
TILE, TILES = (2, 1, 2), (3, 3, 3)  # kernel (6, 3, 6), stride (2, 1, 2)
LATENT = (8, 5, 8)  # (T, H, W), patch 1: the post-patch grid, a whole number of tiles per axis
TEXT, GLYPHS, IMAGE = 7, 4, 3  # the three text inputs' tokens; the model joins them, valid ones first


def make_hunyuanvideo15():
    from examples.swin3d import import_torchvision

    import_torchvision()  # diffusers imports transformers, which imports torchvision (shimmed beside a CPU torch)
    from diffusers import HunyuanVideo15Transformer3DModel

    from examples.hunyuanvideo15.sta import use_sliding_tile_attention

    model = HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=12, text_embed_2_dim=10, image_embed_dim=6,
        rope_axes_dim=(2, 2, 4)).double()
    return use_sliding_tile_attention(model, TILE, TILES)


def parallel_hunyuanvideo15(original, world_size: int):
    from examples.hunyuanvideo15.adapter import hunyuanvideo15_sta_plan

    config = winsp.DiffusionParallelConfig(ulysses_degree=world_size)
    return winsp.parallelize(original, hunyuanvideo15_sta_plan(original, TILE, TILES), config)


def _inputs(image: bool) -> dict:
    """One sample; the text and the glyphs padded (the model masks the padding), image tokens (i2v) or zeros (t2v:
    the model masks them all)."""
    randn = lambda *shape: torch.randn(*shape, dtype=torch.float64)  # noqa: E731
    return dict(hidden_states=randn(1, 4, *LATENT).requires_grad_(),
                timestep=torch.tensor([400.0], dtype=torch.float64),
                encoder_hidden_states=randn(1, TEXT, 12).requires_grad_(),
                encoder_attention_mask=torch.tensor([[1] * 5 + [0] * (TEXT - 5)]),
                encoder_hidden_states_2=randn(1, GLYPHS, 10).requires_grad_(),
                encoder_attention_mask_2=torch.tensor([[1] * 2 + [0] * (GLYPHS - 2)]),
                image_embeds=randn(1, IMAGE, 6).requires_grad_() if image else torch.zeros(1, IMAGE, 6,
                                                                                         dtype=torch.float64),
                return_dict=False)


def i2v_inputs() -> dict:
    return _inputs(image=True)


def t2v_inputs() -> dict:
    return _inputs(image=False)


def _rope_float64(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers' apply_rotary_emb (use_real, pairs interleaved) without its cast to float32."""
    cos, sin = (f[None, None] if sequence_dim == 2 else f[None, :, None] for f in freqs_cis)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return x * cos + torch.stack([-imag, real], -1).flatten(3) * sin


def _rms_norm_float64(self, x):
    """diffusers' RMSNorm (with its weight, as the QK norms have) without its float32 variance."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_hunyuanvideo15_float64():
    """The model with diffusers' two float32 steps replaced, in both models alike, by the same formulas in float64."""
    import diffusers.models.embeddings as embeddings
    from diffusers.models.normalization import RMSNorm

    import examples.hunyuanvideo15.adapter as adapter

    embeddings.apply_rotary_emb = adapter.apply_rotary_emb = _rope_float64
    RMSNorm.forward = _rms_norm_float64
    return make_hunyuanvideo15()


@pytest.fixture
def float64_numerics():
    """Puts diffusers' RoPE and RMSNorm back after a test that ran make_hunyuanvideo15_float64 in this process."""
    import diffusers.models.embeddings as embeddings
    from diffusers.models.normalization import RMSNorm

    import examples.hunyuanvideo15.adapter as adapter

    saved = embeddings.apply_rotary_emb, adapter.apply_rotary_emb, RMSNorm.forward
    yield
    embeddings.apply_rotary_emb, adapter.apply_rotary_emb, RMSNorm.forward = saved


# diffusers computes two steps in float32 whatever the model's dtype: RoPE (apply_rotary_emb casts x.float()) and the QK
# RMSNorm's variance (.to(torch.float32)). Their backward rounds every gradient that flows through them to float32, in
# the single-device model as much as in the parallel one, so where the split attention's float64 sums (in another
# order) fall on either side of a float32 rounding boundary, a gradient differs by about one float32 ulp (1e-7
# relative). With those two steps in float64 (in both models alike) every gradient is exact at the float64 default;
# with diffusers' own, the output is, and the gradients are compared at 1e-6.


@pytest.mark.parametrize("sp", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sta_model_is_exact_at_sp_2_and_3(float64_numerics, sp):
    report = check_parallel(make_hunyuanvideo15_float64, parallel_hunyuanvideo15, i2v_inputs, world_sizes=(sp,),
                            train=True, timeout=400)
    assert report.ok and report.max_error("param") > 0


@pytest.mark.slow
def test_sta_model_is_exact_at_sp_4_text_to_video(float64_numerics):
    report = check_parallel(make_hunyuanvideo15_float64, parallel_hunyuanvideo15, t2v_inputs, world_sizes=(4,),
                            train=True, timeout=400)
    assert report.ok and report.max_error("param") > 0


@pytest.mark.slow
def test_with_diffusers_float32_rope_and_norms_the_output_is_exact_at_sp_2_3_4():
    report = check_parallel(make_hunyuanvideo15, parallel_hunyuanvideo15, i2v_inputs, world_sizes=(2, 3, 4),
                            train=True, timeout=600, rtol=1e-6)
    assert report.ok and report.max_error("output") < 1e-12


def test_one_rank_equals_the_sta_model_and_differs_from_full_attention():
    from examples.hunyuanvideo15.adapter import hunyuanvideo15_sta_plan

    torch.manual_seed(0)
    original, model = make_hunyuanvideo15(), make_hunyuanvideo15()
    model.load_state_dict(original.state_dict())
    winsp.parallelize(model, hunyuanvideo15_sta_plan(model, TILE, TILES))
    for make_inputs in (i2v_inputs, t2v_inputs):
        inputs = make_inputs()
        with torch.no_grad():
            sta = original(**inputs)[0]
            torch.testing.assert_close(model(**inputs)[0], sta, rtol=1e-12, atol=1e-12)
    full = make_hunyuanvideo15()
    full.load_state_dict(original.state_dict())
    for block in full.transformer_blocks:  # the model's own processor: full joint attention
        from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

        block.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
    with torch.no_grad():
        assert (full(**inputs)[0] - sta).abs().max() > 1e-3  # STA is a different model


def test_the_adapter_is_at_most_15_lines():
    path = Path(__file__).parents[1] / "examples" / "hunyuanvideo15" / "adapter.py"
    assert model_specific_lines(str(path)) <= 15


def _sta_mask_by_tiles(grid, tile, tiles) -> torch.Tensor:
    """The STA mask by enumeration: the query's tile, the window of ``tiles`` tiles around it with its centre tile
    clamped so that the window stays inside the grid's tiles, and every key whose tile is inside the window."""
    counts = [-(-n // s) for n, s in zip(grid, tile, strict=True)]
    positions = list(itertools.product(*(range(n) for n in grid)))
    mask = torch.zeros(len(positions), len(positions), dtype=torch.bool)
    for i, q in enumerate(positions):
        centre = [min(max(p // s, k // 2), c - 1 - (k - 1 - k // 2)) for p, s, k, c in zip(q, tile, tiles, counts,
                                                                                           strict=True)]
        for j, key in enumerate(positions):
            mask[i, j] = all(0 <= p // s - (m - k // 2) < k
                             for p, s, k, m in zip(key, tile, tiles, centre, strict=True))
    return mask


@pytest.mark.parametrize("grid, tile, tiles", [((4, 6, 6), (2, 2, 3), (1, 3, 2)), ((5, 7, 6), (2, 2, 1), (2, 3, 5))])
def test_the_reference_sta_mask_is_the_window_of_tiles(grid, tile, tiles):
    from examples.hunyuanvideo15.sta import sta_mask

    assert torch.equal(sta_mask(grid, tile, tiles), _sta_mask_by_tiles(grid, tile, tiles))
    with pytest.raises(ValueError, match="axis h has 6 positions, 2 tile"):
        sta_mask((4, 6, 6), (1, 3, 1), (1, 3, 1))


def test_the_setting_of_hunyuanvideo15_at_720p():
    from examples.hunyuanvideo15.sta import hunyuanvideo15_sta_setting

    setting = hunyuanvideo15_sta_setting()
    assert setting["grid"] == (31, 45, 80) and setting["kernel"] == (18, 24, 24) and setting["stride"] == (6, 8, 8)
    assert (setting["heads"], setting["head_dim"], setting["compression"]) == (16, 128, (4, 16, 16))



def test_the_guide_shows_the_whole_adapter():
    root = Path(__file__).parents[1]
    adapter = (root / "examples" / "hunyuanvideo15" / "adapter.py").read_text()
    guide = (root / "docs" / "adopting_a_model.md").read_text()
    shown = guide.split("### Sliding tile attention: HunyuanVideo 1.5")[1].split("```text\n")[1].split("```")[0]
    assert shown == adapter[adapter.index("from diffusers"):]


@pytest.mark.parametrize("p, links", [(2, "NVLink"), (4, "NVLink"), (8, "NVLink"),
                                      pytest.param(8, "PCIe", marks=pytest.mark.slow)])
def test_the_720p_sta_layer_moves_less_than_ulysses_with_balanced_work(p, links):
    """With either links' costs: at P = 8 on NVLink the fastest cut moves 1.04x Ulysses' bytes, and a nested cut
    predicted within TIME_TOLERANCE of it moves less (tests/test_neighborhood_nested.py)."""
    from examples.hunyuanvideo15.figures import sta_layer_figures
    from winsp.planning.costs import DEFAULT_COSTS, PCIE_COSTS

    costs = {"NVLink": DEFAULT_COSTS, "PCIe": PCIE_COSTS}[links]
    # the released layer: grid (31, 45, 80), kernel (18, 24, 24), stride (6, 8, 8)
    figures = sta_layer_figures(p, costs=costs)
    assert figures["ratio"] < 1
    assert figures["ratio_with_text"] < 1 and figures["heaviest_over_mean"] <= 1.05
    assert sum(figures["own_rows"]) == 31 * 45 * 80
