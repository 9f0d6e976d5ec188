"""Community checkpoints: fp16/bf16 repacks cast to the model's dtypes with a one-line report; fp8 read with its
per-tensor scales (or as stored without), kept packed or dequantised (more formats: test_checkpoint_formats.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from examples.seedvr2.checkpoints.dtypes import match_model_dtypes
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT, load_dit_checkpoint
from examples.seedvr2.models.dit.rope import pixel_frequencies
from examples.seedvr2.models.vae import load_vae_checkpoint
from tests.helpers import tiny_vae
from tests.test_dit import read_golden

TINY_7B = Path(__file__).parent / "golden" / "nadit7b_tiny.safetensors"
FP8 = getattr(torch, "float8_e4m3fn", None)


@pytest.fixture(scope="module")
def golden7b():
    return read_golden(TINY_7B)


def _fresh(meta, dtype=torch.float32, on_meta=False):
    if on_meta:
        with torch.device("meta"):
            return SeedVR2NaDiT(NaDiTConfig.from_metadata(meta)).to(dtype)
    return SeedVR2NaDiT(NaDiTConfig.from_metadata(meta)).to(dtype)


@pytest.mark.parametrize("half, suffix", [(torch.bfloat16, ".safetensors"), (torch.float16, ".pth")])
def test_half_precision_dit_is_cast_to_model_dtype_and_reported(golden7b, tmp_path, half, suffix):
    meta, state, _, _ = golden7b
    path = tmp_path / f"dit{suffix}"
    halved = {k: v.to(half) for k, v in state.items()}
    save_file(halved, str(path)) if suffix == ".safetensors" else torch.save(halved, path)
    lines = []
    model = load_dit_checkpoint(_fresh(meta), path, report=lines.append)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[half]
    assert len(lines) == 1 and f"{len(state) - 4} tensors {name} -> fp32" in lines[0], lines
    assert "4 RoPE frequency buffers" in lines[0]
    w = model.blocks[2].mlp.txt.proj_out.weight
    assert w.dtype == torch.float32
    assert torch.allclose(w, halved["blocks.2.mlp.txt.proj_out.weight"].float(), rtol=0, atol=0)
    # rounded frequencies (402.1 stored as 402 in bf16) are replaced by the exact values
    assert torch.allclose(model.blocks[0].attn.rope.freqs, pixel_frequencies(16), rtol=0, atol=1e-6)


def test_bf16_checkpoint_into_bf16_meta_model_stays_bf16(golden7b, tmp_path):
    meta, state, _, _ = golden7b
    path = tmp_path / "dit.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(path))
    lines = []
    model = load_dit_checkpoint(_fresh(meta, torch.bfloat16, on_meta=True), path, report=lines.append)
    assert model.vid_in.proj.weight.dtype == torch.bfloat16 and not model.vid_in.proj.weight.is_meta
    assert model.blocks[1].attn.rope.freqs.dtype == torch.float32
    assert lines == ["DiT checkpoint: nothing else cast; 4 RoPE frequency buffers set to their exact float32 values"]


def test_matching_dtypes_report_nothing(golden7b):
    meta, state, _, _ = golden7b
    lines = []
    load_dit_checkpoint(_fresh(meta), state, report=lines.append)
    assert lines == []


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
def test_fp8_scale_under_an_unknown_name_is_named_not_ignored(golden7b, tmp_path):
    meta, state, _, _ = golden7b
    path = tmp_path / "dit_fp8.safetensors"
    packed = {k: (v.to(FP8) if v.dim() == 2 else v) for k, v in state.items()}
    packed["blocks.0.attn.proj_out.txt.weight_scaling"] = torch.ones(1)  # not a layout this loader knows
    save_file(packed, str(path))
    with pytest.raises(ValueError, match=r"unexpected keys: blocks\.0\.attn\.proj_out\.txt\.weight_scaling"):
        load_dit_checkpoint(_fresh(meta), path)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("layout", ["comfy", "suffix"])
def test_fp8_with_per_tensor_scales_is_dequantised(golden7b, tmp_path, layout):
    meta, state, _, _ = golden7b
    packed = {}
    for key, value in state.items():
        if value.dim() != 2:
            packed[key] = value
            continue
        scale = value.abs().max() / 448.0  # e4m3's largest finite value
        packed[key] = (value / scale).to(FP8)
        stem, _, leaf = key.rpartition(".")
        packed[f"{stem}.scale_{leaf}" if layout == "comfy" else f"{key}_scale"] = scale.reshape(1)
    if layout == "comfy":
        packed["scaled_fp8"] = torch.empty(0, dtype=FP8)
    path = tmp_path / "dit_fp8.safetensors"
    save_file(packed, str(path))
    lines = []
    model = load_dit_checkpoint(_fresh(meta), path, report=lines.append, weights="compute")
    matrices = sum(v.dim() == 2 for v in state.values())
    assert len(lines) == 1 and f"{matrices} tensors float8_e4m3fn -> fp32" in lines[0]
    assert f"{matrices} fp8 tensors with their per-tensor scales" in lines[0]
    w, ref = model.blocks[1].attn.proj_qkv.vid.weight, state["blocks.1.attn.proj_qkv.vid.weight"]
    assert (w - ref).abs().max().item() <= ref.abs().max().item() / 8  # e4m3 keeps 3 mantissa bits
    kept = load_dit_checkpoint(_fresh(meta), path)  # weights="stored": the same values, kept in fp8
    layer = kept.blocks[1].attn.proj_qkv.vid
    assert layer.kind == "float8_e4m3fn" and torch.equal(layer.expanded_weight(torch.float32), w)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
def test_fp8_scale_that_is_not_one_number_is_refused(golden7b):
    meta, state, _, _ = golden7b
    bad = dict(state)
    bad["vid_out.proj.weight"] = state["vid_out.proj.weight"].to(FP8)
    bad["vid_out.proj.scale_weight"] = torch.ones(64)
    with pytest.raises(ValueError, match="scale_weight.*not one floating-point number"):
        match_model_dtypes(bad, _fresh(meta), what="DiT checkpoint")


def test_fp16_vae_is_cast_and_reported(tmp_path):
    vae = tiny_vae()
    state = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in vae.state_dict().items()}
    path = tmp_path / "vae_fp16.safetensors"
    save_file(state, str(path))
    lines = []
    target = tiny_vae(seed=1)
    load_vae_checkpoint(target, path, report=lines.append)
    floats = sum(v.is_floating_point() for v in state.values())
    assert lines == [f"VAE checkpoint: cast {floats} tensors fp16 -> fp32 to the model's dtypes"]
    name, param = next(iter(target.named_parameters()))
    assert param.dtype == torch.float32 and torch.equal(param, state[name].float())
