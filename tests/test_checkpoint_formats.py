"""Every checkpoint format users hold, written here from a known state dict and read back: plain and scaled fp8,
GGUF (F32/F16/BF16 and the quantised types), for the DiT (3B and 7B architectures) and the VAE, with the strict key
checks kept; fp8 and GGUF Linear weights stay packed (``weights="stored"``) and give the same output as expanded ones.

Tolerances: a tensor read back is within its format's resolution of the original, as a fraction of the tensor's
max-abs (F32 exact; F16 / BF16 one rounding; Q8_0 1/100; Q6_K / Q5_x 1/20; Q4_x 1/8: above the errors measured on
Gaussian data, 0.004, 0.016-0.04, 0.05-0.08). The tiny model's output relative to the fp32 model's (norm of the
difference over the norm) is allowed about twice what was measured on the 3B and 7B tiny models (OUTPUT_TOLERANCE;
measured: F16 0.03%, BF16 0.24%, Q8_0 0.37%, Q6_K 1.5%, Q5_x 2.9-3.1%, Q4_x 6.0-6.5%, plain float8_e4m3fn 3.7%
(3 mantissa bits, and the small weights of a plain cast fall into e4m3's subnormals), float8_e5m2 7.8%, e4m3 with
a per-tensor scale 2.6%). The packed path must equal the expanded one to float rounding (1e-5).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from examples.seedvr2.checkpoints.file import read_checkpoint_file
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT, load_dit_checkpoint
from examples.seedvr2.checkpoints.gguf_dequant import BLOCK_LAYOUTS, dequantize_blocks
from examples.seedvr2.checkpoints.quantized_linear import PackedWeight, QuantizedLinear
from examples.seedvr2.models.vae import load_vae_checkpoint
from tests.helpers import assert_close, random_video, tiny_vae
from tests.test_dit import random_batch, read_golden, run

gguf = pytest.importorskip("gguf")
from tests.gguf_writers import quantize, write_gguf  # noqa: E402  (needs gguf)

GOLDEN = Path(__file__).parent / "golden"
FP8_KINDS = [k for k in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, k)]
#: max |read - original| / max |original| per GGUF type (see the module docstring)
TYPE_TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 1e-2, "Q6_K": 5e-2, "Q5_0": 5e-2, "Q5_1": 5e-2,
                  "Q5_K": 5e-2, "Q4_0": 0.125, "Q4_1": 0.125, "Q4_K": 0.125}
OUTPUT_TOLERANCE = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q6_K": 3e-2, "Q5_0": 6e-2, "Q5_1": 6e-2,
                    "Q5_K": 6e-2, "Q4_0": 0.12, "Q4_1": 0.12, "Q4_K": 0.12, "float8_e4m3fn": 6e-2,
                    "float8_e5m2": 0.15, "weights=fp8": 5e-2}


_GOLDEN_CACHE: dict = {}


def _golden(model: str):
    """(config, state, fp32 output, batch) of the tiny ``model`` ("3b"/"7b"), built once per session."""
    if model not in _GOLDEN_CACHE:
        meta, state, _, _ = read_golden(GOLDEN / f"nadit{model}_tiny.safetensors")
        cfg = NaDiTConfig.from_metadata(meta)
        reference = SeedVR2NaDiT(cfg).eval()
        load_dit_checkpoint(reference, state)
        batch = random_batch(cfg, [(1, 12, 16)], [5], [500.0], seed=7)
        _GOLDEN_CACHE[model] = (cfg, state, run(reference, batch), batch)
    return _GOLDEN_CACHE[model]


@pytest.fixture(params=["3b", "7b"])
def golden(request):
    return _golden(request.param)


def _fresh(cfg, dtype=torch.float32):
    with torch.device("meta"):
        return SeedVR2NaDiT(cfg).to(dtype)


def _relative(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _is_matrix(key, value) -> bool:
    return value.dim() == 2 and value.shape[-1] % 32 == 0


# ---- the block decoders ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(BLOCK_LAYOUTS))
def test_torch_decoders_match_the_gguf_package_bit_for_bit(kind):
    block, size = BLOCK_LAYOUTS[kind]
    rng = np.random.default_rng(sum(map(ord, kind)))
    raw = rng.integers(0, 256, size=(9, size), dtype=np.uint8)
    halves = rng.uniform(-2, 2, size=(9, 2)).astype(np.float16).view(np.uint8)  # finite scales
    if kind == "Q6_K":
        raw[:, 208:210] = halves[:, :2]
    else:
        raw[:, 0:4] = halves
    expected = gguf.quants.dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType[kind]).reshape(-1)
    got = dequantize_blocks(torch.from_numpy(raw), kind, 9 * block).numpy()
    np.testing.assert_array_equal(got, expected)


def test_decoder_refuses_wrong_sizes():
    with pytest.raises(ValueError, match="do not hold 64 values"):
        dequantize_blocks(torch.zeros(30, dtype=torch.uint8), "Q8_0", 64)


# ---- GGUF files, tensor by tensor --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(TYPE_TOLERANCE))
def test_gguf_tensor_round_trip_in_torch_layout(tmp_path, kind):
    torch.manual_seed(0)
    state = {"blocks.0.attn.proj_qkv.vid.weight": torch.randn(48, 512), "blocks.0.mlp.bias": torch.randn(512),
             "vid_out.proj.weight": torch.randn(3, 2, 256)}
    path = tmp_path / "m.gguf"
    write_gguf(path, state, lambda k, v: kind if v.dim() > 1 else "F32")
    layout = {t.name: t.shape.tolist() for t in gguf.GGUFReader(str(path)).tensors}
    assert layout["blocks.0.attn.proj_qkv.vid.weight"] == [512, 48]  # GGUF lists dims innermost first
    read = read_checkpoint_file(path)
    assert set(read) == set(state)
    for key, original in state.items():
        value = read[key]
        if kind in BLOCK_LAYOUTS and original.dim() > 1:
            assert isinstance(value, PackedWeight) and value.kind == kind
            value = value.dequantize()
        assert tuple(value.shape) == tuple(original.shape), key
        tol = TYPE_TOLERANCE[kind] if original.dim() > 1 else 0.0
        err = (value.float() - original).abs().max().item() / original.abs().max().item()
        assert err <= tol, (key, err)


def test_hand_packed_k_blocks_decode_as_the_gguf_package_reads_them():
    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        back = gguf.quants.dequantize(quantize(x, kind), gguf.GGMLQuantizationType[kind])
        assert np.abs(back - x).max() / np.abs(x).max() <= TYPE_TOLERANCE[kind], kind


def test_gguf_prefix_and_original_shape_metadata(tmp_path):
    conv = torch.randn(8, 4, 2, 4, 4)  # 1024 values: stored flattened as [4, 256] like the ComfyUI-GGUF tool does
    path = tmp_path / "m.gguf"
    write_gguf(path, {"model.diffusion_model.a.weight": conv}, lambda k, v: "Q8_0", flatten=lambda k, v: True)
    read = read_checkpoint_file(path)
    assert list(read) == ["a.weight"] and read["a.weight"].shape == (8, 4, 2, 4, 4)
    assert (read["a.weight"].dequantize() - conv).abs().max() <= conv.abs().max() * TYPE_TOLERANCE["Q8_0"]


def test_gguf_unsupported_type_is_refused_by_name(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch="seedvr2")
    writer.add_tensor("a.weight", np.zeros((4, 84), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ValueError, match=r"'a\.weight' is stored as Q2_K.*supported: F32, F16, BF16, Q8_0"):
        read_checkpoint_file(path)


def test_gguf_is_read_without_the_gguf_package(tmp_path, monkeypatch):
    """The header is parsed here (the package trusts a file's counts); the package only writes the test files."""
    path = tmp_path / "m.gguf"
    write_gguf(path, {"a": torch.arange(3.0)}, lambda k, v: "F32")
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert torch.equal(read_checkpoint_file(path)["a"], torch.arange(3.0))


def test_damaged_gguf_is_one_value_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, {"a.weight": torch.randn(4, 64)}, lambda k, v: "Q8_0")
    data = path.read_bytes()
    for cut in (3, 30, len(data) - 40):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="not a readable GGUF file|truncated"):
            read_checkpoint_file(path)


# ---- the DiT from every format -----------------------------------------------------------------------------------


def _gguf_dit(tmp_path, state, kind):
    """``state`` as GGUF: matrices in ``kind`` (K types flattened to 256-value rows when theirs do not fit), the
    rest F32, as the repack tools store them."""
    path = tmp_path / f"dit_{kind}.gguf"
    block = BLOCK_LAYOUTS.get(kind, (1, 0))[0]

    def kind_of(key, value):
        if value.dim() == 2 and value.numel() % block == 0 and (value.shape[-1] % block == 0 or block == 256):
            return kind
        return "F32"

    write_gguf(path, state, kind_of, flatten=lambda k, v: kind_of(k, v) == kind and block == 256
               and v.shape[-1] % 256 != 0)
    return path


#: every type on the 3B architecture, a float, an 8-bit, a 5-bit and a K type on the 7B one (keeps the run short)
DIT_CASES = [("3b", k) for k in ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")] + \
    [("7b", k) for k in ("BF16", "Q8_0", "Q5_1", "Q4_K")]


@pytest.mark.parametrize("model, kind", DIT_CASES)
def test_gguf_dit_output_and_packed_equals_expanded(tmp_path, model, kind):
    cfg, state, reference, batch = _golden(model)
    path = _gguf_dit(tmp_path, state, kind)
    lines = []
    packed = load_dit_checkpoint(_fresh(cfg), path, report=lines.append)
    expanded = load_dit_checkpoint(_fresh(cfg), path, weights="compute")
    layers = [m for m in packed.modules() if isinstance(m, QuantizedLinear)]
    if kind in BLOCK_LAYOUTS:
        assert layers and all(m.kind == kind for m in layers), lines
        assert "Linear weights packed" in lines[0]
    else:
        assert not layers
    assert not any(isinstance(m, QuantizedLinear) for m in expanded.modules())
    out = run(packed, batch)
    assert_close(out, run(expanded, batch), 1e-5)
    rel = _relative(out, reference)
    assert rel <= OUTPUT_TOLERANCE[kind], rel


@pytest.mark.skipif(not FP8_KINDS, reason="this torch has no float8")
@pytest.mark.parametrize("fp8", FP8_KINDS)
def test_plain_fp8_dit_is_read_as_stored_and_stays_fp8(golden, tmp_path, fp8):
    cfg, state, reference, batch = golden
    dtype = getattr(torch, fp8)
    path = tmp_path / "dit_fp8.safetensors"
    cast = {k: (v.to(dtype) if v.dim() == 2 else v) for k, v in state.items()}
    save_file(cast, str(path))
    lines = []
    model = load_dit_checkpoint(_fresh(cfg), path, report=lines.append)
    layer = model.blocks[1].attn.proj_qkv.for_vid()
    assert isinstance(layer, QuantizedLinear) and layer.kind == fp8 and layer.packed.dtype == torch.uint8
    matrices = sum(v.dim() == 2 for v in state.values())
    assert f"{matrices} fp8 tensors without scales (value as stored)" in lines[0], lines
    key = "blocks.1.attn.proj_qkv.vid.weight" if "blocks.1.attn.proj_qkv.vid.weight" in state else \
        "blocks.1.attn.proj_qkv.all.weight"
    assert torch.equal(layer.expanded_weight(torch.float32), cast[key].float())  # value as stored, scale 1
    expanded = load_dit_checkpoint(_fresh(cfg), path, weights="compute")
    out = run(model, batch)
    assert_close(out, run(expanded, batch), 1e-5)
    assert _relative(out, reference) <= OUTPUT_TOLERANCE[fp8]
    model.to(torch.bfloat16)  # the packed bytes survive a dtype cast of the module, and expand to bf16
    assert layer.packed.dtype == torch.uint8 and torch.equal(layer.expanded_weight(torch.float32), cast[key].float())
    assert _relative(run(model, batch, torch.bfloat16), out) <= 3e-2


@pytest.mark.skipif(not FP8_KINDS, reason="this torch has no float8")
def test_weights_fp8_converts_a_wide_checkpoint_and_halves_bf16(golden):
    cfg, state, reference, batch = golden
    model = load_dit_checkpoint(_fresh(cfg), state, weights="fp8")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(m.kind == "float8_e4m3fn" for m in layers) and len(linears) == 1  # vid_in.proj
    assert _relative(run(model, batch), reference) <= OUTPUT_TOLERANCE["weights=fp8"]
    packed = sum(m.packed.numel() for m in layers)
    assert packed * 2 == sum(m.out_features * m.in_features for m in layers) * 2  # 1 byte a value, bf16 has 2


def test_strict_keys_hold_for_gguf(golden, tmp_path):
    cfg, state, _, _ = golden
    first = next(k for k in state if k.endswith(".weight") and state[k].dim() == 2 and k != "vid_in.proj.weight")
    path = _gguf_dit(tmp_path, {k: v for k, v in state.items() if k != first}, "Q8_0")
    with pytest.raises(ValueError, match=f"missing keys: {first}"):
        load_dit_checkpoint(_fresh(cfg), path)
    path = _gguf_dit(tmp_path, dict(state, extra=torch.ones(32, 32)), "Q8_0")
    with pytest.raises(ValueError, match="unexpected keys: extra"):
        load_dit_checkpoint(_fresh(cfg), path)


# ---- the VAE -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gguf-Q8_0", "gguf-F16", "fp8"])
def test_vae_from_gguf_and_plain_fp8(tmp_path, fmt):
    source = tiny_vae()
    state = source.state_dict()
    if fmt == "fp8":
        if not FP8_KINDS:
            pytest.skip("this torch has no float8")
        path = tmp_path / "vae_fp8.safetensors"
        stored = {k: (v.to(torch.float8_e4m3fn) if v.dim() > 1 else v) for k, v in state.items()}
        save_file(stored, str(path))
        tol = 0.2  # measured 10.7%: the tiny VAE's small weights (median 0.023) are e4m3 subnormals; exact below
    else:
        kind = fmt.split("-")[1]
        path = tmp_path / "vae.gguf"
        # 5-D conv weights as the repack tool stores them: flattened, torch shape in the metadata
        write_gguf(path, state, lambda k, v: kind if v.dim() > 1 and v.numel() % 256 == 0 else "F32",
                   flatten=lambda k, v: v.dim() > 1 and v.numel() % 256 == 0)
        tol = 2e-2
    target = tiny_vae(seed=5)
    lines = []
    load_vae_checkpoint(target, path, report=lines.append)
    assert lines, "a converted VAE checkpoint is reported"
    if fmt == "fp8":  # value as stored: every fp8 number exactly, in the model's dtype
        key = next(k for k, v in stored.items() if v.dim() > 1)
        assert torch.equal(target.state_dict()[key], stored[key].float())
    video = random_video(1, 16, 16)
    with torch.no_grad():
        ref, out = source.encode(video), target.encode(video)
    ref = ref.latent_dist.mode() if hasattr(ref, "latent_dist") else ref
    out = out.latent_dist.mode() if hasattr(out, "latent_dist") else out
    assert _relative(out, ref) <= tol


# ---- resident memory ---------------------------------------------------------------------------------------------


def _resident(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("fmt, weights", [("bf16", "stored"), ("fp8", "stored"), ("Q4_K", "stored"),
                                          ("Q8_0", "stored"), ("Q8_0", "compute"), ("bf16", "fp8")])
def test_resident_weight_estimate_matches_the_loaded_model(tmp_path, fmt, weights):
    from examples.seedvr2.models.dit import packable_dit_weights
    from examples.seedvr2.weights.footprint import resident_weight_bytes

    cfg, state, _, _ = _golden("3b")
    if fmt == "bf16":
        path = tmp_path / "dit.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(path))
    elif fmt == "fp8":
        path = tmp_path / "dit.safetensors"
        save_file({k: (v.to(torch.float8_e4m3fn) if v.dim() == 2 else v) for k, v in state.items()}, str(path))
    else:
        path = _gguf_dit(tmp_path, state, fmt)
    model = load_dit_checkpoint(_fresh(cfg, torch.bfloat16), path, weights=weights)
    packable = packable_dit_weights(_fresh(cfg))
    estimate = resident_weight_bytes(str(path), compute_dtype=torch.bfloat16, weights=weights, packable=packable)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    per_call = max((m.out_features * m.in_features * 2 for m in layers), default=0)  # one layer expanded to bf16
    rope = sum(m.freqs.numel() * 2 for m in model.modules() if hasattr(m, "exact_frequencies"))  # fp32, not bf16
    assert estimate - per_call + rope == _resident(model)
    # the ratios the README quotes: Linear weights in fp8 take half of bf16, Q4_K 144/512 of it
    linear = sum(m.out_features * m.in_features * 2 for m in layers)
    if fmt in ("fp8",) or weights == "fp8":
        assert sum(m.packed.numel() for m in layers) * 2 == linear
    if fmt == "Q4_K":
        assert sum(m.packed.numel() for m in layers) * 512 == linear * 144


def test_fuzzed_gguf_files_only_ever_raise_one_line_value_errors(tmp_path):
    import random
    import warnings

    base_path = tmp_path / "base.gguf"
    write_gguf(base_path, {"a.weight": torch.randn(4, 64), "b": torch.randn(3), "c": torch.randn(2, 2, 64)},
               lambda k, v: {"a.weight": "Q8_0", "b": "F32", "c": "F16"}[k], flatten=lambda k, v: k == "c")
    base = base_path.read_bytes()
    rng = random.Random(20)
    refused = 0
    for i in range(150):
        kind = rng.choice(["truncated", "mutated", "random"])
        if kind == "truncated":
            data = base[: rng.randrange(len(base))]
        elif kind == "random":
            data = b"GGUF" + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
        else:
            mutated = bytearray(base)
            for _ in range(rng.randrange(1, 6)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            data = bytes(mutated)
        path = tmp_path / f"case{i}.gguf"
        path.write_bytes(data)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                state = read_checkpoint_file(path)
            except ValueError as err:
                refused += 1
                assert str(path) in str(err) and "\n" not in str(err).strip(), (kind, str(err))
            except Exception as err:  # noqa: BLE001 - this is what the test is looking for
                pytest.fail(f"case {i} ({kind}, {len(data)} bytes) escaped as {type(err).__name__}: {err}")
            else:
                assert all(isinstance(v, (torch.Tensor, PackedWeight)) for v in state.values())
        path.unlink()
    assert refused > 75


def test_memory_plan_counts_packed_weights_at_their_stored_size(tmp_path):
    """The CLI's weight term (``_model_sizes``) reads the headers: an fp8 DiT file counts one byte a Linear value
    with ``--weights stored``, two (bf16) with ``--weights compute``; the VAE is always in the compute dtype."""
    import argparse

    from examples.seedvr2.cli import _model_sizes
    from examples.seedvr2.models.dit import packable_dit_weights

    _, state, _, _ = _golden("3b")  # many of its keys are the released 3B's
    with torch.device("meta"):
        released = packable_dit_weights(SeedVR2NaDiT(NaDiTConfig.seedvr2_3b()))
    dit = tmp_path / "dit_fp8.safetensors"
    save_file({k: (v.to(torch.float8_e4m3fn) if v.dim() == 2 else v) for k, v in state.items()}, str(dit))
    vae = tmp_path / "vae.safetensors"
    save_file({"encoder.conv_in.bias": torch.ones(128)}, str(vae))

    def weight_bytes(weights):
        args = argparse.Namespace(model="3b", dit_checkpoint=str(dit), vae_checkpoint=str(vae), weights=weights)
        return _model_sizes(args, False, torch.bfloat16)[2]

    shared = [v.numel() for k, v in state.items() if k in released]
    assert len(shared) > 20
    assert weight_bytes("compute") - weight_bytes("stored") == sum(shared) - max(shared) * 2


@pytest.mark.slow
def test_restore_from_gguf_checkpoints_stays_close_to_the_reference(tmp_path):
    """The whole one-step restore (tests/golden/restore_tiny, 9 frames of 256x448) with the DiT from a Q8_0 GGUF (kept
    packed) and the VAE from a Q8_0 GGUF (5-D convolutions flattened as the repack tool does): the video within 0.2
    of the reference output (pixel range [-1, 1]; measured 0.093) and 3% relative (measured 1.5%). Slow: about 85 s
    on the loaded 2-core machine."""
    from examples.seedvr2.models.dit import NaDiTConfig as Config
    from examples.seedvr2.pipeline import SeedVR2Pipeline
    from examples.seedvr2.models.vae import CausalVideoVAE, VideoVAEConfig
    from tests.test_pipeline import _golden as restore_golden
    from tests.test_pipeline import golden_inputs

    tensors, meta = restore_golden()
    dit_path, vae_path = tmp_path / "dit.gguf", tmp_path / "vae.gguf"
    dit_state = {k[4:]: v for k, v in tensors.items() if k.startswith("dit.")}
    vae_state = {k[4:]: v for k, v in tensors.items() if k.startswith("vae.")}
    write_gguf(dit_path, dit_state, lambda k, v: "Q8_0" if _is_matrix(k, v) else "F32")
    write_gguf(vae_path, vae_state, lambda k, v: "Q8_0" if v.dim() > 1 and v.numel() % 256 == 0 else "F32",
               flatten=lambda k, v: v.dim() > 1 and v.numel() % 256 == 0)
    with torch.device("meta"):
        dit = SeedVR2NaDiT(Config.from_metadata(meta["dit_config"]))
        vae = CausalVideoVAE(VideoVAEConfig.from_metadata(meta["vae_config"]))
    load_dit_checkpoint(dit, dit_path)
    load_vae_checkpoint(vae, vae_path)
    assert any(isinstance(m, QuantizedLinear) for m in dit.modules())
    video, txt, noise = golden_inputs()
    out = SeedVR2Pipeline(dit.eval(), vae.eval()).restore(video, txt, noise=noise)
    ref = tensors["output.video"].float()
    err = (out - ref).abs().max().item()
    rel = _relative(out, ref)
    assert err <= 0.2 and rel <= 3e-2, (err, rel)


@pytest.mark.parametrize("model", ["3b", "7b"])
def test_gguf_shapes_land_on_the_released_manifest(tmp_path, model):
    """The released key names and shapes (tests/golden/seedvr2_*_dit_keys.json) through a GGUF file: every tensor of
    up to 1M values written as GGUF stores it (dims innermost first) comes back in the manifest's torch shape."""
    import json

    manifest = json.loads((GOLDEN / f"seedvr2_{model}_dit_keys.json").read_text())["keys"]
    small = {k: torch.zeros(shape) for k, shape in manifest.items() if 0 < np.prod(shape) <= 2**20}
    assert any(v.dim() == 2 and v.shape[0] != v.shape[1] for v in small.values())  # a non-square matrix is in
    path = tmp_path / "dit.gguf"
    write_gguf(path, small, lambda k, v: "Q8_0" if v.dim() == 2 and v.shape[-1] % 32 == 0 else "F16")
    stored = {t.name: t.shape.tolist() for t in gguf.GGUFReader(str(path)).tensors}
    read = read_checkpoint_file(path)
    for key in small:
        assert stored[key] == list(reversed(manifest[key])), key
        assert tuple(read[key].shape) == tuple(manifest[key]), key
