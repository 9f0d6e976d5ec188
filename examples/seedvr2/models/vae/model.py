"""The SeedVR2 causal video VAE: encoder, decoder and the temporal chunking that bounds their memory.

Shapes: a video is [b, 3, t, h, w] in [-1, 1] with t = 1 + 4k and h, w multiples of 8 (released config); its
latent is [b, 16, 1 + k, h / 8, w / 8]. Time is causal (the first frame is encoded on its own, every later
group of 4 frames into one latent frame), and everything spatial is per frame, so a clip can be processed in
temporal chunks that carry only a few frames of convolution context between them and give the same result.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import NORM_EPS, DownEncoderBlock3D, MidBlock3D, UpDecoderBlock3D
from .config import VideoVAEConfig
from .context import CausalCache, HeightBands, RunContext
from .layers import CausalConv3d, frame_group_norm

__all__ = ["CausalVideoVAE", "Encoder3D", "Decoder3D"]

LOGVAR_RANGE = (-30.0, 20.0)


class Encoder3D(nn.Module):
    """Video -> posterior moments [b, 2 * latent_channels, t', h', w'] (mean, then log-variance)."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        channels, groups = config.block_out_channels, config.norm_num_groups
        self.conv_in = CausalConv3d(config.in_channels, channels[0], 3, spatial_padding=1)
        self.down_blocks = nn.ModuleList()
        previous = channels[0]
        for i, width in enumerate(channels):
            self.down_blocks.append(
                DownEncoderBlock3D(
                    previous, width, num_layers=config.layers_per_block, groups=groups,
                    downsample=i < config.num_blocks - 1,
                    temporal_down=config.encoder_block_downsamples_time(i),
                )
            )
            previous = width
        self.mid_block = MidBlock3D(channels[-1], groups)
        self.conv_norm_out = nn.GroupNorm(groups, channels[-1], eps=NORM_EPS)
        self.conv_out = CausalConv3d(channels[-1], 2 * config.latent_channels, 3, spatial_padding=1)

    def forward(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        x = self.conv_in(x, ctx)
        for block in self.down_blocks:
            x = block(x, ctx)
        x = self.mid_block(x, ctx)
        return self.conv_out(F.silu(frame_group_norm(x, self.conv_norm_out, ctx)), ctx)


class Decoder3D(nn.Module):
    """Latent [b, latent_channels, t', h', w'] -> video [b, out_channels, t, h, w]."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        channels, groups = config.block_out_channels, config.norm_num_groups
        self.conv_in = CausalConv3d(config.latent_channels, channels[-1], 3, spatial_padding=1)
        self.mid_block = MidBlock3D(channels[-1], groups)
        self.up_blocks = nn.ModuleList()
        previous = channels[-1]
        for i, width in enumerate(reversed(channels)):
            self.up_blocks.append(
                UpDecoderBlock3D(
                    previous, width, num_layers=config.layers_per_block + 1, groups=groups,
                    upsample=i < config.num_blocks - 1,
                    temporal_up=config.decoder_block_upsamples_time(i),
                )
            )
            previous = width
        self.conv_norm_out = nn.GroupNorm(groups, channels[0], eps=NORM_EPS)
        self.conv_out = CausalConv3d(channels[0], config.out_channels, 3, spatial_padding=1)

    def forward(self, z: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        x = self.conv_in(z, ctx)
        x = self.mid_block(x, ctx)
        for block in self.up_blocks:
            x = block(x, ctx)
        return self.conv_out(F.silu(frame_group_norm(x, self.conv_norm_out, ctx)), ctx)


def _chunk_bounds(frames: int, chunk: int | None) -> list[tuple[int, int]]:
    """Causal chunks of a clip: the first frame plus ``chunk`` frames, then ``chunk`` frames at a time."""
    if chunk is None or frames - 1 <= chunk:
        return [(0, frames)]
    bounds = [(0, 1 + chunk)]
    start = 1 + chunk
    while start < frames:
        bounds.append((start, min(start + chunk, frames)))
        start += chunk
    return bounds


class CausalVideoVAE(nn.Module):
    """SeedVR2's causal video VAE (``encoder.*``, ``decoder.*`` keys of the released ``ema_vae.pth``)."""

    def __init__(self, config: VideoVAEConfig) -> None:
        super().__init__()
        if not isinstance(config, VideoVAEConfig):
            raise TypeError(f"CausalVideoVAE expects a VideoVAEConfig, got {type(config).__name__}")
        self.config = config
        self.encoder = Encoder3D(config)
        self.decoder = Decoder3D(config)
        latent = config.latent_channels
        self.quant_conv = CausalConv3d(2 * latent, 2 * latent, 1) if config.use_quant_conv else None
        self.post_quant_conv = CausalConv3d(latent, latent, 1) if config.use_post_quant_conv else None
        self.temporal_chunk: int | None = None

    # ---- chunking ----------------------------------------------------------------------------------------

    def set_temporal_chunking(self, split_size: int | None) -> None:
        """Process clips in causal temporal chunks of ``split_size`` video frames (``split_size / 4`` latent
        frames when decoding); None processes the whole clip at once. The released inference uses 4.

        The encoder sees the first frame together with the first chunk, then one chunk at a time; the decoder
        likewise sees the first latent frame with the first ``split_size / 4`` latent frames. Each causal
        convolution carries its last ``kernel - stride`` input frames to the next chunk, so the result equals
        the whole-clip result while activations are bounded by one chunk.
        """
        if split_size is not None:
            factor = self.config.temporal_downsample_factor
            if isinstance(split_size, bool) or not isinstance(split_size, int) or split_size < 1:
                raise ValueError(f"split_size must be a positive integer or None, got {split_size!r}")
            if split_size % factor:
                raise ValueError(
                    f"split_size={split_size} must be a multiple of the temporal downsample factor {factor} "
                    f"(each chunk must map to whole latent frames)"
                )
        self.temporal_chunk = split_size

    def _run_chunked(
        self, x: torch.Tensor, chunk: int | None, step: Callable[[torch.Tensor, RunContext], torch.Tensor],
        bands: HeightBands | None,
    ) -> torch.Tensor:
        bounds = _chunk_bounds(x.shape[2], chunk)
        if len(bounds) == 1:
            return step(x, RunContext(cache=None, bands=bands))
        cache = CausalCache()
        outputs = []
        for i, (start, stop) in enumerate(bounds):
            cache.first = i == 0
            outputs.append(step(x[:, :, start:stop], RunContext(cache=cache, bands=bands)))
        return torch.cat(outputs, dim=2)

    # ---- validation --------------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    def validate_video(self, video: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the dimension if ``video`` is not [b, in_channels, 1 + 4k, 8m, 8n]."""
        cfg = self.config
        if not isinstance(video, torch.Tensor):
            raise TypeError(f"video must be a torch.Tensor, got {type(video).__name__}")
        if video.dim() != 5:
            raise ValueError(f"video must be [batch, channels, frames, height, width], got shape {tuple(video.shape)}")
        b, c, t, h, w = video.shape
        if c != cfg.in_channels:
            raise ValueError(f"video has {c} channels (dim 1) but the VAE takes {cfg.in_channels}")
        tf, sf = cfg.temporal_downsample_factor, cfg.spatial_downsample_factor
        if t < 1 or (t - 1) % tf:
            raise ValueError(f"video frames (dim 2) must be 1 + {tf}k for the causal VAE, got {t}")
        if h < sf or h % sf:
            raise ValueError(f"video height (dim 3) must be a positive multiple of {sf}, got {h}")
        if w < sf or w % sf:
            raise ValueError(f"video width (dim 4) must be a positive multiple of {sf}, got {w}")

    def validate_latent(self, latent: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the dimension if ``latent`` is not [b, latent_channels, t', h', w']."""
        if not isinstance(latent, torch.Tensor):
            raise TypeError(f"latent must be a torch.Tensor, got {type(latent).__name__}")
        if latent.dim() != 5:
            raise ValueError(
                f"latent must be [batch, channels, frames, height, width], got shape {tuple(latent.shape)}"
            )
        if latent.shape[1] != self.config.latent_channels:
            raise ValueError(
                f"latent has {latent.shape[1]} channels (dim 1) but the VAE has {self.config.latent_channels}"
            )
        if min(latent.shape[2:]) < 1:
            raise ValueError(f"latent frames, height and width must be positive, got shape {tuple(latent.shape)}")

    # ---- encode / decode ---------------------------------------------------------------------------------

    def _encode_step(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        moments = self.encoder(x, ctx)
        return moments if self.quant_conv is None else self.quant_conv(moments, ctx)

    def _decode_step(self, z: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z, ctx)
        return self.decoder(z, ctx)

    def encode_moments(self, video: torch.Tensor, *, bands: HeightBands | None = None) -> torch.Tensor:
        """Posterior moments [b, 2 * latent_channels, t', h', w']: the mean, then the log-variance channels.

        ``bands`` is for height sharding (see :mod:`.sharding`): ``video`` then holds this rank's rows only.
        """
        self.validate_video(video)
        with torch.no_grad():
            return self._run_chunked(video.to(self.dtype), self.temporal_chunk, self._encode_step, bands)

    def encode(
        self, video: torch.Tensor, *, sample: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Latent of ``video`` [b, 3, t, h, w] in [-1, 1]: the posterior mean, or a draw from it when ``sample``."""
        moments = self.encode_moments(video)
        return moments_to_latent(moments, sample=sample, generator=generator)

    def decode(self, latent: torch.Tensor, *, bands: HeightBands | None = None) -> torch.Tensor:
        """Video [b, 3, t, h, w] (nominally in [-1, 1]) of ``latent`` [b, 16, t', h', w'], t = 4 (t' - 1) + 1."""
        self.validate_latent(latent)
        chunk = None if self.temporal_chunk is None else self.temporal_chunk // self.config.temporal_downsample_factor
        with torch.no_grad():
            return self._run_chunked(latent.to(self.dtype), chunk, self._decode_step, bands)


def moments_to_latent(
    moments: torch.Tensor, *, sample: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The diagonal Gaussian's mean, or ``mean + std * noise`` (log-variance clamped to [-30, 20]) when ``sample``.

    The noise is drawn on the generator's device (a CPU generator gives the same draw whatever device the model
    runs on) and moved to the latent's.
    """
    mean, logvar = moments.chunk(2, dim=1)
    if not sample:
        return mean
    std = torch.exp(0.5 * logvar.clamp(*LOGVAR_RANGE))
    device = mean.device if generator is None else generator.device
    noise = torch.randn(mean.shape, generator=generator, device=device, dtype=mean.dtype).to(mean.device)
    return mean + std * noise
