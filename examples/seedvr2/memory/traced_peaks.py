"""A traced stage's peak bytes (tiled VAE runs traced on one tile) and the weight bytes both planners add."""

from __future__ import annotations

from typing import Optional


def vae_stage_peak(tracer, stage: str, mode: str, clip, tile: Optional[int]) -> int:
    """One VAE stage's traced peak on ``tracer`` (its ``vae_trace``). A tiled run is traced on one tile's clip,
    replicated (every rank runs every tile; tracing every tile of a 4K frame takes minutes), plus the whole-frame
    tensors (:func:`tiled_frame_bytes`); a replicated VAE traces the same at every SP degree."""
    if mode == "tiled":
        from .fake_gpu_runs import Clip

        size = tile or 256
        tile_clip = Clip(clip.frames, min(size, clip.height), min(size, clip.width))
        return tracer.vae_trace(stage, "replicated", tile_clip, None, 1) + tiled_frame_bytes(stage, clip, tracer.dtype)
    return tracer.vae_trace(stage, mode, clip, tile, 1 if mode == "replicated" else tracer.sp)


def tiled_frame_bytes(stage: str, clip, dtype) -> int:
    """What a tiled VAE holds besides one tile's trace: encode, the whole video in, the moments' accumulator and
    result; decode, the video's accumulator and result; and the blend weights (the tile's own input and output are in
    its trace)."""
    import torch

    t, h, w = clip.latent
    frames = 4 * (t - 1) + 1
    element = torch.finfo(dtype).bits // 8
    pixels = frames * clip.height * clip.width * 3 * element  # the video
    latents = t * h * w * 16 * 2 * element  # the moments (mean and log-variance)
    blend = (clip.height * clip.width if stage == "decode" else h * w) * 8
    return blend + (2 * pixels if stage == "decode" else pixels + 2 * latents)


def _weights(model: str, dtype, sp: int, shard: bool) -> tuple[int, int]:
    """(DiT bytes a rank holds between blocks, VAE bytes), from the released models' parameters on the meta device."""
    from ..restore.pipeline import released_models_on_meta

    return weight_bytes(*released_models_on_meta(model, dtype), sp, shard)


def weight_bytes(dit, vae, sp: int, shard: bool) -> tuple[int, int]:
    """(DiT bytes a rank holds between blocks, VAE bytes) of built models (their parameters' sizes; ``shard``: the
    DiT's blocks split over ``sp`` ranks, as ``--shard-weights``)."""
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    dit_total = nbytes(dit.parameters())
    if shard and sp > 1:
        blocks = nbytes(p for b in dit.blocks for p in b.parameters())
        dit_total = dit_total - blocks + -(-blocks // sp)
    return dit_total, nbytes(vae.parameters())
