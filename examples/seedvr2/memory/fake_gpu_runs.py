"""SeedVR2's GPU paths as fake-GPU rank functions (:mod:`winsp.testing.fake_gpu`): the released models at full width
and depth in bf16 on fake CUDA tensors, for the tests and for the memory planner (:mod:`.planner`).

Each ``*_rank`` function has the signature ``fn(rank, world_size, ...)`` that
:func:`winsp.testing.fake_gpu.run_fake_gpu` calls inside a fake GPU: it builds what it runs on the fake device
(weights have shapes, no values), runs one stage, and returns the output's shape and dtype. Host inputs (shape
tensors, noise, the input video) are real CPU tensors, as in a real run. Needs the CUDA build of torch (no GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["Clip", "CLIPS", "build_dit", "build_vae", "dit_rank", "vae_rank", "pipeline_rank", "TEXT_TOKENS"]

TEXT_TOKENS = 58  # the positive prompt's length in the shipped text embeddings (assets/text_embeds.safetensors)


@dataclass(frozen=True)
class Clip:
    """A clip as the pipeline runs it: ``frames`` of ``height x width`` pixels (sides multiples of 16, as the media
    module crops them), and its latent's (frames, rows, columns): 4x fewer frames past the first, 8x fewer pixels."""

    frames: int
    height: int
    width: int

    def __post_init__(self) -> None:
        if self.height % 16 or self.width % 16 or self.frames < 1:
            raise ValueError(f"a clip needs >= 1 frame and sides that are multiples of 16, got {self}")

    @property
    def latent(self) -> tuple[int, int, int]:
        from ..restore.pipeline import causal_frame_count

        return 1 + (causal_frame_count(self.frames) - 1) // 4, self.height // 8, self.width // 8

    def describe(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


# 1080p is cropped to 1072 rows (the largest multiple of 16), as examples.seedvr2.media does
CLIPS = {"720p": Clip(21, 720, 1280), "1080p": Clip(61, 1072, 1920), "4k": Clip(121, 2160, 3840)}


def _on_fake_cuda(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A module built on the meta device, materialised (without values) on the fake CUDA device in ``dtype``: cast on
    the meta device first, so the device never holds a float32 copy (as a checkpoint load into a bf16 model)."""
    return module.to(dtype).to_empty(device="cuda").eval()


def build_dit(model: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The released ``model``'s DiT (``"3b"``/``"7b"``) at full width and depth on the (fake) CUDA device."""
    from ..models.dit import NaDiTConfig, SeedVR2NaDiT

    with torch.device("meta"):
        dit = SeedVR2NaDiT(NaDiTConfig.released(model))
    return _on_fake_cuda(dit, dtype)


def build_vae(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The released VAE on the (fake) CUDA device."""
    from ..models.vae import CausalVideoVAE, VideoVAEConfig

    with torch.device("meta"):
        vae = CausalVideoVAE(VideoVAEConfig.seedvr2())
    return _on_fake_cuda(vae, dtype)


def _world_group():
    import torch.distributed as dist

    from winsp.comm.group import SPGroup

    return SPGroup(dist.group.WORLD if dist.get_world_size() > 1 else None)


def dit_rank(rank: int, world: int, model: str, latent: tuple[int, int, int], *, shard_weights: bool = False,
             dtype: torch.dtype = torch.bfloat16, on_built: Optional[Callable[[], None]] = None) -> tuple:
    """One DiT forward (one Euler step) over a latent of ``latent`` (frames, rows, columns) on ``world`` ranks.
    ``on_built`` is called once the model is built (and sharded), before the forward (the planner resets the peak
    there: ``--shard-weights`` here shards a whole model, which a checkpoint load never holds)."""
    import winsp

    dit = build_dit(model, dtype)
    group = _world_group()
    if shard_weights:
        from ..weights.sharded import shard_loaded_dit

        shard_loaded_dit(dit, group)
    dit.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world), group=group)
    if on_built is not None:
        on_built()
    cfg = dit.config
    t, h, w = latent
    vid = torch.randn(t * h * w, cfg.vid_in_channels, device="cuda", dtype=dtype)
    txt = torch.randn(TEXT_TOKENS, cfg.txt_in_dim, device="cuda", dtype=dtype)
    timestep = torch.full((1,), 1000.0, device="cuda")
    with torch.no_grad():
        out = dit(vid, txt, torch.tensor([[t, h, w]]), torch.tensor([[TEXT_TOKENS]]), timestep)
    return tuple(out.shape), out.dtype


def vae_rank(rank: int, world: int, mode: str, clip: Clip, *, dtype: torch.dtype = torch.bfloat16,
             stage: str = "both", tile_size: int = 256) -> tuple:
    """Encode and/or decode (``stage``: ``"encode"``, ``"decode"``, ``"both"``) a clip in VAE ``mode`` (the
    pipeline's temporal chunking of 4 latent frames; ``tile_size`` pixels a tile when tiled, with the CLI's overlap)."""
    from ..models.vae.modes import make_vae_runner
    from ..restore.pipeline import causal_frame_count
    from .fit import tile_overlap

    vae = build_vae(dtype)
    vae.set_temporal_chunking(4)
    group = _world_group()
    run_mode = "replicated" if mode in ("height", "wavefront") and group.size == 1 else mode
    runner = make_vae_runner(run_mode, vae, group=group, tile_size=tile_size, overlap=tile_overlap(tile_size))
    frames = causal_frame_count(clip.frames)
    out: tuple = ()
    with torch.no_grad():
        if stage in ("encode", "both"):
            video = torch.randn(1, 3, frames, clip.height, clip.width, device="cuda", dtype=dtype)
            latent = runner.encode(video)
            out += (tuple(latent.shape), latent.dtype)
            del video, latent
        if stage in ("decode", "both"):
            t, h, w = clip.latent
            z = torch.randn(1, vae.config.latent_channels, t, h, w, device="cuda", dtype=dtype)
            video = runner.decode(z)
            out += (tuple(video.shape), video.dtype)
    return out


def pipeline_rank(rank: int, world: int, model: str, clip: Clip, vae_mode: str, *, shard_weights: bool = False,
                  dtype: torch.dtype = torch.bfloat16) -> tuple:
    """The restore pipeline's per-batch compute (:meth:`SeedVR2Pipeline.restore_on_device`: encode, one DiT step,
    decode) of a host clip in [-1, 1], with host noise as the CLI draws it."""
    from ..restore.pipeline import SeedVR2Pipeline

    pipe = SeedVR2Pipeline(build_dit(model, dtype), build_vae(dtype), vae_mode, group=_world_group(),
                           shard_weights=shard_weights)
    video = torch.zeros(3, clip.frames, clip.height, clip.width)
    txt = torch.zeros(TEXT_TOKENS, pipe.txt_in_dim)
    noise = torch.zeros(pipe.latent_shape(clip.frames, clip.height, clip.width))
    restored, _checks = pipe.restore_on_device(video, txt, noise=noise)
    return tuple(restored.shape), restored.dtype
