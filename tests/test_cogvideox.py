"""diffusers' CogVideoX transformer parallelised by one plan (``examples/cogvideox``): the text replicated on every
rank, the video split over the ranks in global layers (head-parallel), RoPE on the video rows only. Exact against
the untouched diffusers model (output, every parameter gradient and the input gradients; float64, training mode,
dropout off) at SP 2 and 3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import winsp
from examples.adapter_lines import model_specific_lines
from winsp.testing import check_parallel

pytest.importorskip("diffusers")

HEADS, HEAD_DIM, TEXT = 3, 16, 5


def make_cogvideox():
    from examples.swin3d import import_torchvision

    import_torchvision()  # diffusers imports transformers, which imports torchvision (shimmed beside a CPU torch)
    from diffusers import CogVideoXTransformer3DModel

    return CogVideoXTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=12, num_layers=2, patch_size=2, max_text_seq_length=TEXT,
        use_rotary_positional_embeddings=True).double()


def parallel_cogvideox(original, world_size: int):
    from examples.cogvideox.adapter import cogvideox_plan

    config = winsp.DiffusionParallelConfig(ulysses_degree=world_size, planner="split")
    return winsp.parallelize(original, cogvideox_plan(original), config)


def cogvideox_inputs() -> dict:
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    frames, height, width = 3, 6, 4  # latent; post-patch grid (3, 3, 2)
    rope = get_3d_rotary_pos_embed(HEAD_DIM, ((0, 0), (height // 2, width // 2)), (height // 2, width // 2), frames)
    return dict(hidden_states=torch.randn(1, frames, 4, height, width, dtype=torch.float64).requires_grad_(),
                encoder_hidden_states=torch.randn(1, TEXT, 12, dtype=torch.float64).requires_grad_(),
                timestep=torch.tensor([0.4], dtype=torch.float64), image_rotary_emb=rope, return_dict=False)


@pytest.mark.parametrize("sp", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_cogvideox_with_replicated_text_and_split_global_layers_is_exact_at_sp_2_and_3(sp):
    # diffusers' apply_rotary_emb computes in float32 (x.float()), so every gradient that flows through RoPE is rounded
    # to float32 there: where the split attention's float64 sums (in another order) fall on either side of a float32
    # rounding boundary, the gradients differ by one float32 ulp (1.2e-7 relative). Gradients are compared at that
    # precision; the output, which RoPE reaches only through float64 attention, at the float64 default.
    report = check_parallel(make_cogvideox, parallel_cogvideox, cogvideox_inputs, world_sizes=(sp,), train=True,
                            timeout=400, rtol=1e-6)
    assert report.ok and report.max_error("param") > 0
    assert report.max_error("output") < 1e-12


def test_one_rank_equals_diffusers_and_the_adapter_is_short():
    from examples.cogvideox.adapter import cogvideox_plan

    torch.manual_seed(0)
    original, model = make_cogvideox(), make_cogvideox()
    model.load_state_dict(original.state_dict())
    winsp.parallelize(model, cogvideox_plan(model))
    inputs = cogvideox_inputs()
    torch.testing.assert_close(model(**inputs)[0], original(**inputs)[0], rtol=1e-12, atol=1e-12)
    assert model_specific_lines(str(Path(__file__).parents[1] / "examples" / "cogvideox" / "adapter.py")) <= 15
    from diffusers import CogVideoXTransformer3DModel

    absolute = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, num_layers=1, in_channels=4,
                                           time_embed_dim=8, text_embed_dim=8, sample_width=4, sample_height=4,
                                           sample_frames=1)  # the 2b's sin-cos positions
    with pytest.raises(ValueError, match="RoPE models only"):
        cogvideox_plan(absolute)


def _rope_float64(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers' apply_rotary_emb (use_real, pairs interleaved) without its cast to float32."""
    cos, sin = (f[None, None] if sequence_dim == 2 else f[None, :, None] for f in freqs_cis)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return x * cos + torch.stack([-imag, real], -1).flatten(3) * sin


def make_cogvideox_rope_float64():
    import diffusers.models.embeddings as embeddings

    import examples.cogvideox.adapter as adapter

    embeddings.apply_rotary_emb = adapter.apply_rotary_emb = _rope_float64  # in both models: RoPE in float64
    return make_cogvideox()


def cogvideox_inputs_float64() -> dict:
    inputs = cogvideox_inputs()
    return {**inputs, "image_rotary_emb": tuple(t.double() for t in inputs["image_rotary_emb"])}


@pytest.mark.slow
def test_with_rope_in_float64_every_gradient_is_exact_to_float64():
    """The float32 RoPE is the only reason the gradients above are compared at 1e-6: with diffusers' apply_rotary_emb
    replaced in both models by the same formula in float64, every gradient is exact at the float64 default."""
    report = check_parallel(make_cogvideox_rope_float64, parallel_cogvideox, cogvideox_inputs_float64,
                            world_sizes=(2, 3), train=True, timeout=400)
    assert report.ok and report.max_error("param") > 0
