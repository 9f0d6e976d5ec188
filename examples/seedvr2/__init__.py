"""SeedVR2 (ByteDance, Apache-2.0) as the reference model on winsp: NaDiT DiT, causal video VAE, restore pipeline, CLI.

Names are imported lazily, so ``from examples.seedvr2 import NaDiTConfig`` does not pull in video I/O (PyAV).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "NaDiTConfig": ".models.dit",
    "SeedVR2NaDiT": ".models.dit",
    "load_dit_checkpoint": ".models.dit",
    "VideoVAEConfig": ".models.vae",
    "CausalVideoVAE": ".models.vae",
    "load_vae_checkpoint": ".models.vae",
    "SeedVR2Pipeline": ".restore.pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
