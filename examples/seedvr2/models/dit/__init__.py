"""SeedVR2's diffusion transformers (NaDiT: the 3B ``models/dit_v2`` and 7B ``models/dit`` architectures) on the winsp
window runtime."""

from .config import NaDiTConfig
from .loader import load_dit_checkpoint, normalize_checkpoint_keys, packable_dit_weights, read_state_dict
from .model import SeedVR2NaDiT

__all__ = ["NaDiTConfig", "SeedVR2NaDiT", "load_dit_checkpoint", "normalize_checkpoint_keys", "read_state_dict",
           "packable_dit_weights"]
