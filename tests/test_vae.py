"""The causal video VAE: parity with the reference, temporal chunking, configuration and checkpoint loading."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from examples.seedvr2.models.vae import CausalVideoVAE, VideoVAEConfig, load_vae_checkpoint, moments_to_latent
from examples.seedvr2.models.vae.context import CausalCache, RunContext
from examples.seedvr2.models.vae.memory import peak_tensor_bytes
from examples.seedvr2.models.vae.model import _chunk_bounds
from tests.helpers import random_video, tiny_vae

GOLDEN = pathlib.Path(__file__).parent / "golden"
PARITY_ATOL = 5e-4


def _golden():
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(GOLDEN / "vae_tiny.safetensors"), "pt") as f:
        config = VideoVAEConfig.from_metadata(f.metadata()["config"])
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    state = {k[len("state."):]: v for k, v in tensors.items() if k.startswith("state.")}
    return config, state, tensors


@pytest.fixture(scope="module")
def golden():
    pytest.importorskip("safetensors")
    config, state, tensors = _golden()
    vae = load_vae_checkpoint(CausalVideoVAE(config).eval(), state)
    return vae, tensors


# ---- parity with the reference ---------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [None, 4])
def test_encode_matches_reference(golden, split):
    vae, g = golden
    vae.set_temporal_chunking(split)
    try:
        latent = vae.encode(g["input.video"].float())
    finally:
        vae.set_temporal_chunking(None)
    expected = g["output.latent_mode" if split is None else "output.latent_mode_sliced"]
    assert latent.shape == expected.shape == (1, 16, 5, 8, 12)
    assert (latent - expected).abs().max().item() <= PARITY_ATOL


@pytest.mark.parametrize("split", [None, 4])
def test_decode_matches_reference(golden, split):
    vae, g = golden
    vae.set_temporal_chunking(split)
    try:
        latent = g["output.latent_mode" if split is None else "output.latent_mode_sliced"]
        decoded = vae.decode(latent)
    finally:
        vae.set_temporal_chunking(None)
    expected = g["output.decoded" if split is None else "output.decoded_sliced"]
    assert decoded.shape == expected.shape == (1, 3, 17, 64, 96)
    assert (decoded - expected).abs().max().item() <= PARITY_ATOL


# ---- temporal chunking ----------------------------------------------------------------------------------------


def test_chunk_bounds_follow_the_reference_split():
    # Encoder, split 4: the first frame rides with the first 4 frames, then 4 frames (one latent frame) a chunk.
    assert _chunk_bounds(17, 4) == [(0, 5), (5, 9), (9, 13), (13, 17)]
    # Decoder, split 4 -> 1 latent frame a chunk, the first latent frame riding with the first.
    assert _chunk_bounds(5, 1) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert _chunk_bounds(5, 4) == [(0, 5)]  # short clips run whole, as in the reference
    assert _chunk_bounds(21, 8) == [(0, 9), (9, 17), (17, 21)]


def test_carried_state_is_kernel_minus_stride_frames():
    vae = tiny_vae()
    cache = CausalCache()
    with torch.no_grad():
        vae.encoder(random_video(5, 16, 16), RunContext(cache=cache))
    enc = vae.encoder
    assert cache.tails[enc.conv_in].shape[2] == 2  # 3-frame kernel, stride 1
    assert cache.tails[enc.down_blocks[1].downsamplers[0].conv].shape[2] == 1  # 3-frame kernel, stride 2
    assert enc.down_blocks[0].downsamplers[0].conv not in cache.tails  # spatial-only downsampler
    assert enc.down_blocks[1].resnets[0].conv1 in cache.tails


@pytest.mark.parametrize("split", [4, 8])
def test_chunked_equals_whole_clip(split):
    vae = tiny_vae()
    video = random_video(21, 16, 24)
    whole = vae.encode(video)
    decoded_whole = vae.decode(whole)
    vae.set_temporal_chunking(split)
    chunked = vae.encode(video)
    decoded_chunked = vae.decode(whole)
    assert chunked.shape == whole.shape == (1, 16, 6, 2, 3)
    assert decoded_chunked.shape == decoded_whole.shape == video.shape
    assert (chunked - whole).abs().max().item() < 1e-5
    assert (decoded_chunked - decoded_whole).abs().max().item() < 1e-5


def test_chunking_bounds_activation_memory():
    vae = tiny_vae()
    video = random_video(25, 8, 8)
    with peak_tensor_bytes() as whole:
        latent = vae.encode(video)
    vae.set_temporal_chunking(4)
    with peak_tensor_bytes() as chunked:
        vae.encode(video)
    assert chunked.peak < 0.4 * whole.peak
    vae.set_temporal_chunking(None)
    with peak_tensor_bytes() as whole_dec:
        vae.decode(latent)
    vae.set_temporal_chunking(4)
    with peak_tensor_bytes() as chunked_dec:
        vae.decode(latent)
    assert chunked_dec.peak < 0.4 * whole_dec.peak


def test_chunk_size_must_map_to_whole_latent_frames():
    vae = tiny_vae()
    with pytest.raises(ValueError, match="multiple of the temporal downsample factor 4"):
        vae.set_temporal_chunking(6)
    with pytest.raises(ValueError, match="positive integer"):
        vae.set_temporal_chunking(0)


# ---- encode / decode contract ------------------------------------------------------------------------------------


def test_single_frame_and_sampling():
    vae = tiny_vae()
    video = random_video(1, 16, 16)
    mode = vae.encode(video)
    assert mode.shape == (1, 16, 1, 2, 2)
    one = vae.encode(video, sample=True, generator=torch.Generator().manual_seed(5))
    two = vae.encode(video, sample=True, generator=torch.Generator().manual_seed(5))
    other = vae.encode(video, sample=True, generator=torch.Generator().manual_seed(6))
    assert torch.equal(one, two) and not torch.equal(one, other) and not torch.equal(one, mode)
    moments = vae.encode_moments(video)
    std = torch.exp(0.5 * moments[:, 16:].clamp(-30, 20))
    noise = torch.randn(mode.shape, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(one, mode + std * noise)
    # the samples are centred on the mode: the mean of n draws is within 5 standard errors of it, everywhere
    n = 400
    draws = torch.stack([moments_to_latent(moments, sample=True, generator=torch.Generator().manual_seed(100 + i))
                         for i in range(n)])
    assert ((draws.mean(0) - mode).abs() <= 5 * std / n**0.5).all()
    assert vae.decode(mode).shape == (1, 3, 1, 16, 16)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((1, 3, 16, 16, 16), "frames \\(dim 2\\) must be 1 \\+ 4k"),
        ((1, 3, 5, 20, 16), "height \\(dim 3\\)"),
        ((1, 3, 5, 16, 12), "width \\(dim 4\\)"),
        ((1, 4, 5, 16, 16), "4 channels \\(dim 1\\)"),
        ((3, 5, 16, 16), "batch, channels, frames, height, width"),
    ],
)
def test_bad_video_shapes_are_named(shape, message):
    with pytest.raises(ValueError, match=message):
        tiny_vae().encode(torch.zeros(shape))


def test_bad_latent_shape_is_named():
    with pytest.raises(ValueError, match="8 channels \\(dim 1\\)"):
        tiny_vae().decode(torch.zeros(1, 8, 2, 2, 2))


# ---- configuration ----------------------------------------------------------------------------------------------


def test_config_from_reference_metadata_and_released_values():
    pytest.importorskip("safetensors")
    config, _, _ = _golden()
    assert config.block_out_channels == [16, 16, 32, 32] and config.norm_num_groups == 4
    released = VideoVAEConfig.seedvr2()
    assert released.block_out_channels == [128, 256, 512, 512]
    assert (released.norm_num_groups, released.latent_channels, released.layers_per_block) == (32, 16, 2)
    assert (released.spatial_downsample_factor, released.temporal_downsample_factor) == (8, 4)
    assert VideoVAEConfig.from_metadata(json.dumps(released.to_dict())) == released


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"colour": 1}, "unknown keys \\['colour'\\]"),
        ({"act_fn": "gelu"}, "act_fn"),
        ({"inflation_mode": "stretch"}, "inflation_mode"),
        ({"block_out_channels": [16, 18, 32, 32]}, "block_out_channels\\[1\\]=18"),
        ({"down_block_types": ["DownEncoderBlock2D"] * 4}, "DownEncoderBlock2D"),
        ({"up_block_types": ["UpDecoderBlock3D"] * 3}, "up_block_types has 3 entries"),
        ({"temporal_scale_num": 4}, "temporal_scale_num"),
        ({"temporal_downsample_factor": 8}, "temporal_downsample_factor=8"),
        ({"spatial_downsample_factor": 16}, "spatial_downsample_factor=16"),
        ({"latent_channels": 0}, "latent_channels"),
        ({"use_quant_conv": "yes"}, "use_quant_conv"),
    ],
)
def test_config_rejects_bad_values(overrides, message):
    values = VideoVAEConfig(block_out_channels=[16, 16, 32, 32], norm_num_groups=4).to_dict()
    values.update(overrides)
    with pytest.raises(ValueError, match=message):
        VideoVAEConfig.from_dict(values)


def test_quant_convs_are_built_when_asked():
    vae = CausalVideoVAE(VideoVAEConfig(
        block_out_channels=[8, 8], norm_num_groups=4, temporal_scale_num=1, spatial_downsample_factor=2,
        temporal_downsample_factor=2, down_block_types=["DownEncoderBlock3D"] * 2,
        up_block_types=["UpDecoderBlock3D"] * 2, use_quant_conv=True, use_post_quant_conv=True,
    ))
    keys = vae.state_dict()
    assert keys["quant_conv.weight"].shape == (32, 32, 1, 1, 1)
    assert keys["post_quant_conv.weight"].shape == (16, 16, 1, 1, 1)
    latent = vae.encode(random_video(3, 4, 4))
    assert latent.shape == (1, 16, 2, 2, 2) and vae.decode(latent).shape == (1, 3, 3, 4, 4)


# ---- checkpoints ------------------------------------------------------------------------------------------------


def test_meta_built_released_vae_has_the_checkpoint_layout():
    with torch.device("meta"):
        vae = CausalVideoVAE(VideoVAEConfig.seedvr2())
    expected = json.loads((GOLDEN / "seedvr2_vae_keys.json").read_text())["keys"]
    ours = {k: list(v.shape) for k, v in vae.state_dict().items()}
    assert set(ours) == set(expected), sorted(set(ours) ^ set(expected))
    assert ours == expected


def test_meta_built_vae_takes_checkpoint_tensors(golden):
    _, state, _ = _golden()
    with torch.device("meta"):
        vae = CausalVideoVAE(VideoVAEConfig(block_out_channels=[16, 16, 32, 32], norm_num_groups=4))
    load_vae_checkpoint(vae, state)
    loaded = vae.state_dict()
    assert all(not t.is_meta for t in loaded.values())
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def _tiny_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_vae().state_dict().items()}


def test_loader_names_missing_unexpected_and_misshaped_keys():
    state = _tiny_state()
    del state["decoder.conv_out.bias"]
    state["decoder.extra.weight"] = torch.zeros(1)
    state["encoder.conv_in.weight"] = torch.zeros(16, 3, 1, 3, 3)
    with pytest.raises(ValueError) as info:
        load_vae_checkpoint(tiny_vae(), state)
    message = str(info.value)
    assert "missing keys: decoder.conv_out.bias" in message
    assert "unexpected keys: decoder.extra.weight" in message
    assert "encoder.conv_in.weight: checkpoint (16, 3, 1, 3, 3) vs model (16, 3, 3, 3, 3)" in message


def test_loader_reads_safetensors_and_torch_files(tmp_path):
    state = _tiny_state()
    target = tiny_vae(seed=1)
    torch.save(state, tmp_path / "vae.pth")
    load_vae_checkpoint(target, tmp_path / "vae.pth")
    assert all(torch.equal(target.state_dict()[k], v) for k, v in state.items())
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file(state, str(tmp_path / "vae.safetensors"))
    target = load_vae_checkpoint(tiny_vae(seed=2), str(tmp_path / "vae.safetensors"))
    assert all(torch.equal(target.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="unsupported file type '.npz'"):
        (tmp_path / "vae.npz").write_bytes(b"")
        load_vae_checkpoint(target, tmp_path / "vae.npz")


class _Payload:
    """Unpickling this would create a marker file: a stand-in for arbitrary code in a crafted checkpoint."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_loader_refuses_pickled_code(tmp_path):
    marker = tmp_path / "code_ran"
    torch.save({"encoder.conv_in.weight": _Payload(str(marker))}, tmp_path / "evil.pth")
    with pytest.raises(ValueError, match="refused to load"):
        load_vae_checkpoint(tiny_vae(), tmp_path / "evil.pth")
    assert not marker.exists()
    assert not os.path.exists(marker)
