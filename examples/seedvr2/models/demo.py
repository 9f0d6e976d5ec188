"""Embedded demo weights and a synthetic sample clip, so the command line works anywhere without checkpoints.

The demo models have the architecture of a released SeedVR2 DiT (the 3B's by default, or the 7B's) and of the VAE
at a tiny size (the configurations of the reference golden files: a 4-layer, 96-wide DiT and a 16/32-channel VAE,
about 1.9 M parameters in all). Their
weights are the modules' own initialisation drawn from a fixed seed at run time, and the "prompt" is random, so the
whole pipeline (resize, VAE, window-parallel DiT, decode, colour fix, encode to file) runs in seconds, identically on
every rank and every run. It restores nothing: the output is what random weights make of the input.
"""

from __future__ import annotations

import os

import torch

from .dit import NaDiTConfig, SeedVR2NaDiT
from .vae import CausalVideoVAE, VideoVAEConfig

__all__ = [
    "DEMO_SEED",
    "DEMO_DIT_CONFIG",
    "DEMO_DIT_CONFIGS",
    "DEMO_VAE_CONFIG",
    "DEMO_TEXT_TOKENS",
    "DEMO_VAE_CHANNELS_ENV",
    "demo_models",
    "demo_vae_config",
    "demo_text_embeds",
    "sample_frames",
]

DEMO_SEED = 20250601
DEMO_TEXT_TOKENS = 16

#: the golden files' tiny DiT: the 3B architecture at 4 layers of width 96 (3 heads of 32)
DEMO_DIT_CONFIG = NaDiTConfig.seedvr2_at_size(
    vid_dim=96, txt_in_dim=64, heads=3, head_dim=32, num_layers=4, mm_layers=2, rope_dim=32
)
#: the tiny DiT of each released model (the 7B's is the 7B golden file's: the same size, the 7B architecture)
DEMO_DIT_CONFIGS = {
    "3b": DEMO_DIT_CONFIG,
    "7b": NaDiTConfig.seedvr2_7b_at_size(vid_dim=96, txt_in_dim=64, heads=3, head_dim=32, num_layers=4),
}

DEMO_VAE_CONFIG = dict(
    block_out_channels=[16, 16, 32, 32],
    norm_num_groups=4,
    layers_per_block=2,
    latent_channels=16,
    temporal_scale_num=2,
    spatial_downsample_factor=8,
    temporal_downsample_factor=4,
)

#: a benchmark hook: ``SEEDVR2_DEMO_VAE_CHANNELS=128,256,512,512`` gives the demo VAE these widths (the released
#: ones, say) with random weights, so the command can be timed with a VAE of real cost and no checkpoint
DEMO_VAE_CHANNELS_ENV = "SEEDVR2_DEMO_VAE_CHANNELS"


def demo_vae_config() -> dict:
    """The demo VAE's configuration: :data:`DEMO_VAE_CONFIG`, with the widths of ``$SEEDVR2_DEMO_VAE_CHANNELS``
    when it is set (four positive widths; 32 norm groups when every width is a multiple of 32, else 4)."""
    text = os.environ.get(DEMO_VAE_CHANNELS_ENV, "").strip()
    if not text:
        return dict(DEMO_VAE_CONFIG)
    try:
        channels = [int(v) for v in text.split(",")]
    except ValueError:
        channels = []
    base = DEMO_VAE_CONFIG["block_out_channels"]
    if len(channels) != len(base) or min(channels) < 4 or any(c % 4 for c in channels):
        raise ValueError(f"{DEMO_VAE_CHANNELS_ENV} must be {len(base)} comma-separated widths, each a positive "
                         f"multiple of 4 (the released VAE: 128,256,512,512), got {text!r}")
    groups = 32 if all(c % 32 == 0 for c in channels) else 4
    return {**DEMO_VAE_CONFIG, "block_out_channels": channels, "norm_num_groups": groups}


def demo_models(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, model: str = "3b"
) -> tuple[SeedVR2NaDiT, CausalVideoVAE]:
    """The tiny DiT of ``model``'s architecture ("3b" or "7b") and the tiny VAE (:func:`demo_vae_config`), with
    weights drawn from :data:`DEMO_SEED` (the global RNG is left untouched)."""
    if model not in DEMO_DIT_CONFIGS:
        raise ValueError(f"model must be one of {sorted(DEMO_DIT_CONFIGS)}, got {model!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DEMO_SEED)
        dit = SeedVR2NaDiT(DEMO_DIT_CONFIGS[model])
        vae = CausalVideoVAE(VideoVAEConfig(**demo_vae_config()))
    return dit.to(device=device, dtype=dtype).eval(), vae.to(device=device, dtype=dtype).eval()


def demo_text_embeds(tokens: int = DEMO_TEXT_TOKENS) -> torch.Tensor:
    """A fixed random "prompt embedding" ``[tokens, 64]`` for the demo DiTs (both take 64-wide text)."""
    generator = torch.Generator().manual_seed(DEMO_SEED + 1)
    return torch.randn(tokens, DEMO_DIT_CONFIG.txt_in_dim, generator=generator)


def sample_frames(num_frames: int = 9, height: int = 64, width: int = 96) -> torch.Tensor:
    """A small synthetic, slightly blurred clip ``uint8 [t, h, w, 3]``: a sky-to-ground gradient, a striped
    block and a ball moving across. Deterministic (no RNG); used for the shipped sample files and smoke tests."""
    t = torch.arange(num_frames, dtype=torch.float32)[:, None, None]
    y = torch.linspace(0, 1, height)[None, :, None]
    x = torch.linspace(0, 1, width)[None, None, :]
    sky = torch.stack([0.35 + 0.3 * y, 0.55 + 0.2 * y, 0.95 - 0.5 * y], dim=-1).expand(num_frames, height, width, 3)
    frame = sky.clone()
    stripes = ((x * width / 6).floor() % 2 == 0).float() * 0.25 + 0.55
    block = (x > 0.55) & (x < 0.9) & (y > 0.45) & (y < 0.85)
    frame = torch.where(block[..., None].expand_as(frame), (stripes[..., None] * torch.tensor([0.9, 0.5, 0.3])), frame)
    cx = 0.15 + 0.6 * t / max(num_frames - 1, 1)
    ball = ((x - cx) * width) ** 2 + ((y - 0.35) * height) ** 2 < (0.18 * height) ** 2
    frame = torch.where(ball[..., None].expand_as(frame), torch.tensor([0.95, 0.85, 0.2]).expand_as(frame), frame)
    # a mild box blur: the "degradation" a restorer would undo
    chw = frame.permute(0, 3, 1, 2)
    chw = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(chw, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    return chw.permute(0, 2, 3, 1).clamp(0, 1).mul(255).round().to(torch.uint8)
