"""Sliding tile attention (STA) in diffusers' HunyuanVideo 1.5, on one device: the processor a user swaps in.

STA with tile ``tile`` and ``tiles`` tiles per axis cuts the latent grid into tiles. A video query attends to the video
keys of the ``tiles`` tiles around its own tile on each axis, a window of tiles that is shifted inward at the grid's
borders so that it stays in the grid, and to the sample's valid text. A valid text query attends to the whole video
and the valid text, as in the model's own joint attention; a padding text query attends to nothing (SDPA gives it
zeros, as it does in the model's processor). Everything else is the model's processor: its projections, QK norms and
RoPE on the video rows.

The mask is written here from that definition, densely, for ``F.scaled_dot_product_attention``: this is the untouched
single-device model that ``examples/hunyuanvideo15/adapter.py`` runs on several ranks. On a grid that is a whole
number of tiles per axis it is NATTEN's ``kernel = tile * tiles, stride = tile`` neighbourhood (``winsp.Neighborhood``);
on a ragged grid the two differ at the last tile (module README).

:func:`hunyuanvideo15_sta_setting` gives the setting of the released model at 720p x 121 frames, read from diffusers'
defaults and HunyuanVideo 1.5's public STA parameters.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["sta_mask", "SlidingTileAttnProcessor", "use_sliding_tile_attention", "hunyuanvideo15_sta_setting",
           "HUNYUANVIDEO15_TILE", "HUNYUANVIDEO15_TILES"]

# HunyuanVideo 1.5's own STA parameters (Tencent-Hunyuan/HunyuanVideo-1.5,
# hyvideo/models/transformers/hunyuanvideo_1_5_transformer.py, the default attn_param of its sparse "flex-block-attn"
# mode, which SSTA's selected tiles build on): tile_size [6, 8, 8] latent tokens, win_size [[3, 3, 3]] tiles.
HUNYUANVIDEO15_TILE = (6, 8, 8)
HUNYUANVIDEO15_TILES = (3, 3, 3)


def _axis_tiles(n: int, tile: int, tiles: int, axis: str, device) -> Tensor:
    """``[n, n]``: whether key position j lies in the window of tiles of query position i, on one axis."""
    count = math.ceil(n / tile)
    if tiles > count:
        raise ValueError(f"sliding tile attention: axis {axis} has {n} positions, {count} tile(s) of {tile}, fewer "
                         f"than the window's {tiles} tiles")
    own = torch.arange(n, device=device) // tile
    first = (own - tiles // 2).clamp(0, count - tiles)  # the window's first tile, kept inside the grid
    return (own[None, :] >= first[:, None]) & (own[None, :] < first[:, None] + tiles)


def sta_mask(grid: tuple[int, int, int], tile: tuple[int, int, int], tiles: tuple[int, int, int],
             device: Optional[torch.device] = None) -> Tensor:
    """``[N, N]`` boolean, ``N = T * H * W`` row-major: whether video query i may attend to video key j under STA."""
    if len(grid) != 3 or len(tile) != 3 or len(tiles) != 3:
        raise ValueError(f"sliding tile attention: grid, tile and tiles are (t, h, w) each, got {grid}, {tile}, "
                         f"{tiles}")
    t, h, w = (_axis_tiles(n, s, k, a, device) for n, s, k, a in zip(grid, tile, tiles, "thw", strict=True))
    return (t[:, None, None, :, None, None] & h[None, :, None, None, :, None]
            & w[None, None, :, None, None, :]).reshape(math.prod(grid), math.prod(grid))


class SlidingTileAttnProcessor:
    """A processor for ``HunyuanVideo15TransformerBlock.attn``: the model's joint attention, its video x video part
    restricted to sliding tiles. ``grid`` (the post-patch latent grid) is set before each forward by the hook that
    :func:`use_sliding_tile_attention` installs."""

    def __init__(self, tile: tuple[int, int, int], tiles: tuple[int, int, int]) -> None:
        self.tile, self.tiles = tuple(tile), tuple(tiles)
        self.grid: Optional[tuple[int, int, int]] = None

    def __call__(self, attn: nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor,
                 attention_mask: Tensor, image_rotary_emb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb

        if self.grid is None or math.prod(self.grid) != hidden_states.shape[1]:
            raise ValueError(f"SlidingTileAttnProcessor: grid {self.grid} does not describe the "
                             f"{hidden_states.shape[1]} video tokens (install it with use_sliding_tile_attention)")

        def heads(x: Tensor) -> Tensor:
            return x.unflatten(2, (attn.heads, -1))

        q = apply_rotary_emb(attn.norm_q(heads(attn.to_q(hidden_states))), image_rotary_emb, sequence_dim=1)
        k = apply_rotary_emb(attn.norm_k(heads(attn.to_k(hidden_states))), image_rotary_emb, sequence_dim=1)
        v = heads(attn.to_v(hidden_states))
        q = torch.cat([q, attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))], 1)
        k = torch.cat([k, attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))], 1)
        v = torch.cat([v, heads(attn.add_v_proj(encoder_hidden_states))], 1)

        n_video, n_text = hidden_states.shape[1], encoder_hidden_states.shape[1]
        valid = torch.cat([attention_mask.new_ones(attention_mask.shape[0], n_video, dtype=torch.bool),
                           attention_mask.bool()], 1)  # [B, N + n]: the video and the valid text
        pairs = valid[:, :, None] & valid[:, None, :]
        pairs[:, :n_video, :n_video] &= sta_mask(self.grid, self.tile, self.tiles, q.device)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=pairs[:, None]).transpose(1, 2).flatten(2)
        video, text = out.split([n_video, n_text], 1)
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text)


def use_sliding_tile_attention(model: nn.Module, tile: tuple[int, int, int],
                               tiles: tuple[int, int, int]) -> nn.Module:
    """Give every transformer block of a ``HunyuanVideo15Transformer3DModel`` sliding tile attention, in place."""
    processors = []
    for block in model.transformer_blocks:
        processors.append(SlidingTileAttnProcessor(tile, tiles))
        block.attn.set_processor(processors[-1])
    c = model.config

    def note_grid(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        grid = (x.shape[2] // c.patch_size_t, x.shape[3] // c.patch_size, x.shape[4] // c.patch_size)
        for p in processors:
            p.grid = grid

    model.register_forward_pre_hook(note_grid, with_kwargs=True)
    return model


def hunyuanvideo15_sta_setting(frames: int = 121, height: int = 720, width: int = 1280) -> dict:
    """HunyuanVideo 1.5's STA layer at ``frames`` x ``height`` x ``width`` pixels: the latent grid, tile, kernel and
    the attention's heads, from diffusers' defaults (the VAE's compression, the transformer's patch and heads) and
    HunyuanVideo 1.5's STA parameters (:data:`HUNYUANVIDEO15_TILE`, :data:`HUNYUANVIDEO15_TILES`)."""
    from examples.swin3d import import_torchvision

    import_torchvision()  # diffusers imports transformers, which imports torchvision (shimmed beside a CPU torch)
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    vae = {k: p.default for k, p in inspect.signature(AutoencoderKLHunyuanVideo15.__init__).parameters.items()}
    dit = {k: p.default for k, p in inspect.signature(HunyuanVideo15Transformer3DModel.__init__).parameters.items()}
    st, ss = vae["temporal_compression_ratio"], vae["spatial_compression_ratio"]
    latent = ((frames - 1) // st + 1, height // ss, width // ss)  # the pipeline's prepare_latents
    grid = (latent[0] // dit["patch_size_t"], latent[1] // dit["patch_size"], latent[2] // dit["patch_size"])
    kernel = tuple(t * k for t, k in zip(HUNYUANVIDEO15_TILE, HUNYUANVIDEO15_TILES, strict=True))
    return dict(grid=grid, tile=HUNYUANVIDEO15_TILE, tiles=HUNYUANVIDEO15_TILES, kernel=kernel,
                stride=HUNYUANVIDEO15_TILE, heads=dit["num_attention_heads"], head_dim=dit["attention_head_dim"],
                layers=dit["num_layers"], compression=(st, ss, ss),
                patch=(dit["patch_size_t"], dit["patch_size"], dit["patch_size"]))


if __name__ == "__main__":
    print(hunyuanvideo15_sta_setting())
