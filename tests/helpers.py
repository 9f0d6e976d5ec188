"""Small models and inputs shared by the tests and benchmarks (``from tests.helpers import tiny_vae``)."""

from __future__ import annotations

import torch

from examples.seedvr2.models.vae import CausalVideoVAE, VideoVAEConfig

__all__ = ["tiny_vae", "random_video", "assert_close"]


def tiny_vae(seed: int = 0) -> CausalVideoVAE:
    """The golden file's tiny VAE architecture (channels [16, 16, 32, 32]) with weights drawn from ``seed``.

    The GroupNorm affines are moved away from their 1/0 initialisation so that they take part in every check.
    """
    torch.manual_seed(seed)
    vae = CausalVideoVAE(VideoVAEConfig(block_out_channels=[16, 16, 32, 32], norm_num_groups=4)).eval()
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.3, 0.3)
    return vae


def random_video(frames: int, height: int, width: int, seed: int = 1) -> torch.Tensor:
    """A uniform random clip ``[1, 3, frames, height, width]`` in [-1, 1], drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, frames, height, width, generator=g) * 2 - 1


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Same dtype and shape, and max |actual - expected| <= tol (compared in float64)."""
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if actual.numel():
        err = (actual.double() - expected.double()).abs().max().item()
        assert err <= tol, f"max abs error {err} > {tol}"
