"""SeedVR2's causal video VAE (8x spatial, 4x temporal, 16 latent channels) with chunked, sharded and tiled runs.

* :class:`CausalVideoVAE` / :class:`VideoVAEConfig`: the model; ``set_temporal_chunking(4)`` is the released
  inference setting (causal temporal chunks with carried convolution state, same result as the whole clip).
* :func:`load_vae_checkpoint`: strict loading from ``.safetensors`` / ``.pth`` (no pickled code) or a dict.
* :func:`encode_sharded` / :func:`decode_sharded`: height split over a window-SP group (exact).
* :func:`encode_tiled` / :func:`decode_tiled`: overlapping tiles on one device (approximate, bounded memory).
* :func:`encode_wavefront` / :func:`decode_wavefront`: consecutive causal chunks on the group's ranks at once
  (time x height, :func:`choose_split`; exact).
* :func:`make_vae_runner`: the execution modes by name ("replicated", "height", "tiled", "wavefront").
"""

from .config import VideoVAEConfig
from .loader import load_vae_checkpoint
from .memory import peak_tensor_bytes
from .model import CausalVideoVAE, moments_to_latent
from .modes import VAE_MODES, VAERunner, make_vae_runner
from .sharding import decode_sharded, encode_sharded
from .tiling import decode_tiled, encode_tiled
from .wavefront import VAESplit, choose_split, decode_wavefront, encode_wavefront

__all__ = [
    "VideoVAEConfig",
    "CausalVideoVAE",
    "load_vae_checkpoint",
    "moments_to_latent",
    "encode_sharded",
    "decode_sharded",
    "encode_tiled",
    "decode_tiled",
    "encode_wavefront",
    "decode_wavefront",
    "VAESplit",
    "choose_split",
    "VAE_MODES",
    "VAERunner",
    "make_vae_runner",
    "peak_tensor_bytes",
]
