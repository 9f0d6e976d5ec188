"""SeedVR2 7B NaDiT (the reference's ``models/dit``): config, key layout, golden parity at SP = 1..4, packing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import winsp
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT, load_dit_checkpoint, normalize_checkpoint_keys
from examples.seedvr2.models.dit.rope import RotaryEmbedding3d, pixel_frequencies, unit_positions
from tests.test_dit import random_batch, read_golden, run, split_batch
from winsp.testing import run_ranks

GOLDEN = Path(__file__).parent / "golden"
TINY_7B = GOLDEN / "nadit7b_tiny.safetensors"
TIMEOUT = 240.0

# three samples with different grids and text lengths; regular and shifted windows clip differently in each
PACKED = dict(shapes=[(3, 18, 24), (1, 10, 8), (2, 8, 30)], text_lengths=[5, 3, 8], timesteps=[999.0, 250.0, 17.5])
PAIR = dict(shapes=[(5, 12, 14), (2, 20, 6)], text_lengths=[9, 1], timesteps=[700.0, 3.0])
BATCHES = {"packed_three": (PACKED, 0), "packed_pair": (PAIR, 1)}  # name -> (spec, seed)


def _golden_model():
    meta, state, inputs, expected = read_golden(TINY_7B)
    model = SeedVR2NaDiT(NaDiTConfig.from_metadata(meta)).eval()
    load_dit_checkpoint(model, state)
    return model, inputs, expected


def _batch(model, spec, seed):
    return random_batch(model.config, spec["shapes"], spec["text_lengths"], spec["timesteps"], seed=seed)


@pytest.fixture(scope="module")
def golden7b():
    return read_golden(TINY_7B)


@pytest.fixture(scope="module")
def model7b():
    return _golden_model()[0]


# ---------------------------------------------------------------------------------------------- config
def test_config_7b_values():
    cfg = NaDiTConfig.seedvr2_7b()
    assert cfg.architecture == "dit"
    assert (cfg.vid_dim, cfg.heads, cfg.head_dim, cfg.num_layers, cfg.txt_in_dim) == (3072, 24, 128, 36, 5120)
    assert (cfg.mlp_type, cfg.mlp_hidden_dim, cfg.vid_out_norm, cfg.txt_in_norm) == ("normal", 12288, None, None)
    assert (cfg.rope_kind, cfg.rope_input_dim, cfg.rope_freqs_per_axis, cfg.rotary_span) == ("rope3d", 64, 10, 60)
    assert cfg.mm_layers is None and cfg.rope_type is None and not cfg.last_layer_video_only
    assert cfg.window == ((4, 3, 3),) * 36 and cfg.window_method[35] == "720pswin_by_size_bysize"
    sharing = cfg.stream_sharing(35)
    assert not (sharing.qkv or sharing.qk_norm or sharing.mlp or sharing.ada)
    # the 3B keeps its switches
    cfg3 = NaDiTConfig.seedvr2_3b()
    assert (cfg3.architecture, cfg3.rope_kind, cfg3.last_layer_video_only) == ("dit_v2", "mmrope3d", True)
    assert not cfg3.stream_sharing(9).mlp and cfg3.stream_sharing(10) == dataclasses.replace(
        cfg3.stream_sharing(10), qkv=True, qk_norm=True, mlp=True, ada=True)


def test_config_7b_round_trips(golden7b):
    raw = json.loads(golden7b[0]["config"])
    cfg = NaDiTConfig.from_metadata(golden7b[0])
    assert NaDiTConfig(**raw) == cfg and cfg.architecture == "dit"
    assert NaDiTConfig(**cfg.to_dict()) == cfg
    assert "mm_layers" not in cfg.to_dict() and "qk_rope" not in NaDiTConfig.seedvr2_3b().to_dict()
    assert NaDiTConfig(**NaDiTConfig.seedvr2_7b().to_dict()) == NaDiTConfig.seedvr2_7b()
    # dataclasses.replace passes every field back in: it must keep working for both architectures
    assert dataclasses.replace(cfg, shared_mlp=True).stream_sharing(0).mlp
    assert dataclasses.replace(NaDiTConfig.seedvr2_3b(), mm_layers=4).separate_stream_weights(3)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"mm_layers": 2}, "mm_layers"),                 # a 3B key with qk_rope
        ({"rope_dim": 32}, "rope_dim"),
        ({"rope_type": "mmrope3d"}, "rope_type"),
        ({"vid_out_norm": "fusedrms"}, "vid_out_norm"),
        ({"txt_in_norm": "fusedln"}, "txt_in_norm"),
        ({"qk_rope": "yes"}, "qk_rope"),
        ({"shared_mlp": 1}, "shared_mlp"),
        ({"temporal_window_size": 4}, "temporal_window_size"),
        ({"temporal_shifted": True}, "temporal_shifted"),
        ({"rope_scaling": 2}, "rope_scaling"),           # unknown keys are refused as for the 3B
        ({"head_dim": 8}, "head_dim // 2"),              # RoPE over 4 channels cannot cover 3 axes
    ],
)
def test_config_7b_refuses_bad_keys(golden7b, change, key):
    raw = json.loads(golden7b[0]["config"])
    with pytest.raises(ValueError, match=key.replace("/", r"\/")):
        NaDiTConfig(**{**raw, **change})


def test_config_7b_keys_without_qk_rope_are_refused(golden7b):
    raw = json.loads(golden7b[0]["config"])
    del raw["qk_rope"]
    with pytest.raises(ValueError, match="qk_rope"):
        NaDiTConfig(**raw)  # shared_mlp/shared_qkv without qk_rope: neither architecture
    raw = {k: v for k, v in raw.items() if k not in ("shared_mlp", "shared_qkv")}
    with pytest.raises(ValueError, match="mm_layers"):
        NaDiTConfig(**raw)  # then it reads as a 3B config, which needs mm_layers


# ---------------------------------------------------------------------------------------------- key layout
def test_meta_7b_key_set_matches_released_checkpoint():
    manifest = json.loads((GOLDEN / "seedvr2_7b_dit_keys.json").read_text())["keys"]
    with torch.device("meta"):
        model = SeedVR2NaDiT(NaDiTConfig.seedvr2_7b())
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    renamed = normalize_checkpoint_keys({k: torch.empty(0) for k in manifest})
    expected = {new: manifest[old] for old, new in zip(manifest, renamed)}
    assert len(manifest) == 1128
    assert set(ours) == set(expected), sorted(set(ours) ^ set(expected))[:10]
    assert {k: v for k, v in ours.items() if v != expected[k]} == {}
    # the one documented rename is the only difference, and it applies to every block
    assert sum(".attn.rope.rope.freqs" in k for k in manifest) == 36
    assert ours["blocks.0.attn.rope.freqs"] == [10]
    # no weight sharing anywhere, and the last block keeps its text MLP and text modulation
    assert not any(".all." in k for k in ours)
    assert "blocks.35.mlp.txt.proj_in.weight" in ours and "blocks.35.ada.txt.mlp_gate" in ours
    assert not any(k.startswith("vid_out_norm") or k.startswith("vid_out_ada") for k in ours)
    assert sum(v.numel() for v in model.state_dict().values()) == 8_239_608_232


def test_7b_checkpoint_does_not_load_into_3b_model(golden7b):
    model3b = SeedVR2NaDiT(NaDiTConfig.from_metadata(read_golden()[0]))
    with pytest.raises(ValueError, match="missing keys: .*vid_out_norm|unexpected keys"):
        load_dit_checkpoint(model3b, golden7b[1])


def test_7b_pth_checkpoint_loads_strictly(golden7b, tmp_path):
    path = tmp_path / "seedvr2_ema_7b_tiny.pth"
    torch.save(golden7b[1], path)
    model = load_dit_checkpoint(SeedVR2NaDiT(NaDiTConfig.from_metadata(golden7b[0])).eval(), path)
    assert torch.allclose(model.blocks[3].mlp.txt.proj_in.weight, golden7b[1]["blocks.3.mlp.txt.proj_in.weight"])
    broken = dict(golden7b[1])
    del broken["blocks.3.ada.txt.mlp_gate"]
    torch.save(broken, path)
    with pytest.raises(ValueError, match="missing keys: blocks.3.ada.txt.mlp_gate"):
        load_dit_checkpoint(SeedVR2NaDiT(NaDiTConfig.from_metadata(golden7b[0])), path)


def test_truncated_7b_checkpoint_keeps_the_new_last_blocks_text_path(golden7b):
    """The 7B's last block is complete, so loading the first 2 of 4 blocks keeps block 1's text MLP weights."""
    meta, state, _, _ = golden7b
    cfg = dataclasses.replace(NaDiTConfig.from_metadata(meta), num_layers=2, block_type="mmdit_sr", window=(4, 3, 3),
                              window_method=list(NaDiTConfig.from_metadata(meta).window_method[:2]))
    with pytest.raises(ValueError, match="allow_truncated"):
        load_dit_checkpoint(SeedVR2NaDiT(cfg), state)
    model = load_dit_checkpoint(SeedVR2NaDiT(cfg), state, allow_truncated=True)
    assert torch.equal(model.blocks[1].mlp.txt.proj_in.weight, state["blocks.1.mlp.txt.proj_in.weight"])


# ---------------------------------------------------------------------------------------------- RoPE
def test_pixel_frequencies_match_the_checkpoint_buffer(golden7b):
    stored = golden7b[1]["blocks.0.attn.rope.rope.freqs"]
    assert torch.allclose(pixel_frequencies(16), stored, rtol=0, atol=1e-5)
    assert RotaryEmbedding3d(64, "rope3d").freqs.shape == (10,)
    assert not RotaryEmbedding3d(64, "rope3d").rotates_text and RotaryEmbedding3d(64).rotates_text


def test_unit_positions_equal_linspace():
    for n in range(1, 200):
        d = torch.arange(n)
        got = unit_positions(d, torch.full_like(d, n))
        assert (got - torch.linspace(-1, 1, n)).abs().max().item() <= 1e-7, n


@pytest.mark.parametrize("layer", [0, 1])
def test_request_window_shape_matches_layout(model7b, layer):
    req = model7b.build_runtime(None).request(grids=[(3, 9, 12), (1, 5, 4), (2, 4, 15)], text_lengths=[5, 3, 8])
    req.scatter(torch.zeros(3 * 9 * 12 + 5 * 4 + 2 * 4 * 15, 1), layer)
    layout = req.plan(layer).layout
    expected = torch.from_numpy(layout.window_shape.repeat(layout.token_counts, axis=0))
    assert torch.equal(req.window_shape, expected)


# ---------------------------------------------------------------------------------------------- one rank
def test_golden_parity_7b(model7b, golden7b):
    _, _, inputs, expected = golden7b
    err = (run(model7b, inputs) - expected).abs().max().item()
    assert err <= 1e-4, err


def test_packed_batch_equals_samples_alone(model7b):
    for spec, seed in BATCHES.values():
        batch = _batch(model7b, spec, seed=seed)
        alone = torch.cat([run(model7b, s) for s in split_batch(batch)])
        assert (run(model7b, batch) - alone).abs().max().item() <= 1e-5, spec


def test_last_block_text_modulation_reaches_video_but_text_mlp_does_not(model7b):
    """The 7B's last block modulates its text before attention (the 3B's does not); its text MLP output is unused."""
    small = _batch(model7b, PAIR, seed=5)
    base = run(model7b, small)
    last = model7b.blocks[-1]
    with torch.no_grad():
        saved = last.ada.txt.attn_scale.clone(), last.mlp.txt.proj_in.weight.clone()
        try:
            last.mlp.txt.proj_in.weight.mul_(3.0)
            assert (run(model7b, small) - base).abs().max().item() <= 1e-6
            last.ada.txt.attn_scale.add_(0.5)
            assert (run(model7b, small) - base).abs().max().item() > 1e-3
        finally:
            last.ada.txt.attn_scale.copy_(saved[0])
            last.mlp.txt.proj_in.weight.copy_(saved[1])


# ---------------------------------------------------------------------------------------------- SP = 2, 3, 4 (5, 7)
def _rank_main(rank: int, world_size: int, small: bool = False) -> dict:
    model, inputs, expected = _golden_model()
    runtime = model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    assert runtime.world_size == world_size and runtime.rank == rank
    golden = run(model, inputs)
    out = {"path": runtime.execution_path, "golden_err": (golden - expected).abs().max().item()}
    for name, (spec, seed) in BATCHES.items():
        if small and spec is not PAIR:
            continue
        batch = _batch(model, spec, seed=seed)
        out[name] = run(model, batch)
        out[name + "_alone"] = torch.cat([run(model, s) for s in split_batch(batch)])
    return out


@pytest.fixture(scope="module")
def single_rank_packed(model7b):
    return {name: run(model7b, _batch(model7b, spec, seed=seed)) for name, (spec, seed) in BATCHES.items()}


def _check_ranks(results, world_size, reference):
    for rank, res in enumerate(results):
        assert f"{world_size} ranks" in res["path"], res["path"]
        assert res["golden_err"] <= 1e-4, (rank, res["golden_err"])
        for key in [k for k in res if k in BATCHES]:
            alone = res[key + "_alone"]
            assert (res[key] - alone).abs().max().item() <= 1e-5, (rank, key)
            assert (res[key] - reference[key]).abs().max().item() <= 1e-5, (rank, key)
            assert (res[key] - results[0][key]).abs().max().item() <= 1e-6, (rank, key)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_7b_sp_matches_golden_and_single_rank(world_size, single_rank_packed):
    _check_ranks(run_ranks(_rank_main, world_size, timeout=TIMEOUT), world_size, single_rank_packed)


@pytest.mark.multirank
@pytest.mark.large_world
@pytest.mark.parametrize("world_size", [5, 7])
def test_7b_sp_degrees_that_do_not_divide_heads(world_size, single_rank_packed):
    """24 heads (3 in the tiny config) rule out head-sharded SP at 5 and 7; window SP runs any degree."""
    _check_ranks(run_ranks(_rank_main, world_size, timeout=2 * TIMEOUT, small=True), world_size, single_rank_packed)


# ---------------------------------------------------------------------------------------------- pipeline and CLI
def _read_frames(path):
    from examples.seedvr2.media import read_media

    return read_media(str(path)).frames.astype(int)


def test_cli_model_7b_with_demo_weights(tmp_path, capsys):
    from examples.seedvr2 import cli
    from tests.test_cli import make_png

    src = make_png(tmp_path / "in.png")
    outs = {m: tmp_path / f"out_{m}.png" for m in ("3b", "7b")}
    for model, out in outs.items():
        assert cli.main(["restore", src, "-o", str(out), "--model", model, "--quiet"]) == 0
        err = capsys.readouterr().err
        assert f"| DEMO {model.upper()} fp32" in err, err  # the summary names the architecture that ran
    # two architectures, two different results from the same input and seed
    assert abs(_read_frames(outs["3b"]) - _read_frames(outs["7b"])).max() > 0


def test_cli_model_7b_with_half_precision_checkpoints(tmp_path, capsys, monkeypatch, golden7b):
    """bf16 DiT and fp16 VAE files (the community repacks, here of the tiny golden weights standing in for the 7B's)
    load strictly through ``--model 7b``, say what was cast, and give what the pipeline gives from the same files."""
    from safetensors.torch import save_file

    from examples.seedvr2 import cli
    from examples.seedvr2.media import frames_to_model, model_to_frames, plan_geometry, read_media
    from examples.seedvr2.pipeline import SeedVR2Pipeline
    from examples.seedvr2.models.vae import VideoVAEConfig
    from tests.helpers import tiny_vae
    from tests.test_cli import make_png

    meta, state, _, _ = golden7b
    tiny_dit_cfg = NaDiTConfig.from_metadata(meta)
    vae = tiny_vae()
    monkeypatch.setattr(NaDiTConfig, "seedvr2_7b", classmethod(lambda cls: tiny_dit_cfg))
    monkeypatch.setattr(VideoVAEConfig, "seedvr2", classmethod(lambda cls: vae.config))
    dit_path, vae_path = tmp_path / "dit_bf16.safetensors", tmp_path / "vae_fp16.pth"
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(dit_path))
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in vae.state_dict().items()}, vae_path)
    embeds = tmp_path / "emb.safetensors"
    txt = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    save_file({"pos": txt}, str(embeds))

    src = make_png(tmp_path / "in.png", h=32, w=48)
    out = tmp_path / "out.png"
    code = cli.main(["restore", src, "-o", str(out), "--model", "7b", "--dit-checkpoint", str(dit_path),
                     "--vae-checkpoint", str(vae_path), "--text-embeds", str(embeds), "--seed", "4",
                     "--color-fix", "none", "--quiet"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "DiT checkpoint: cast " in err and "bf16 -> fp32" in err and "RoPE frequency buffers" in err, err
    assert "VAE checkpoint: cast " in err and "fp16 -> fp32" in err, err
    assert "SeedVR2 7B" in err.strip().splitlines()[-1]

    lines = []
    pipe = SeedVR2Pipeline.from_checkpoints(dit_path, vae_path, model="7b", report=lines.append)
    assert pipe.dit.config == tiny_dit_cfg and len(lines) == 2
    geometry = plan_geometry((32, 48))
    video = frames_to_model(read_media(src).frames, geometry)
    expected = model_to_frames(pipe.restore_batch(video, txt, 0, 4), geometry)  # the CLI's noise: keyed by clip position
    assert abs(_read_frames(out) - expected.astype(int)).max() <= 1


@pytest.mark.slow  # the default run's budget
@pytest.mark.multirank
def test_cli_model_7b_three_ranks_torchrun(tmp_path):
    from examples.seedvr2 import cli
    from tests.test_cli import make_mp4, probe, run_cli

    src = make_mp4(tmp_path / "in.mp4", t=5, h=32, w=48)
    single, triple = tmp_path / "single.mp4", tmp_path / "triple.mp4"
    result = run_cli("restore", src, "-o", triple, "--model", "7b", "--quiet", nproc=3)
    assert result.returncode == 0, result.stderr
    assert "SP 3" in result.stderr and "| DEMO 7B fp32" in result.stderr
    assert cli.main(["restore", src, "-o", str(single), "--model", "7b", "--quiet"]) == 0
    assert probe(triple) == probe(single)
    assert abs(_read_frames(single) - _read_frames(triple)).max() <= 1
