"""The old module path of the restore pipeline: it lives in :mod:`examples.seedvr2.restore.pipeline` now.

Its names still import from here (see ``examples/seedvr2/_moved.py``); new code imports them from ``restore``.
"""

from __future__ import annotations

from ._moved import moved_names

#: a name of the old module ``examples.seedvr2.pipeline`` -> the module that defines it now
MOVED: dict[str, str] = {
    **dict.fromkeys(("math", "dataclass", "DEFAULT_BATCH_FRAMES", "DEFAULT_OVERLAP", "TemporalBlender", "clip_noise",
                     "temporal_batches", "causal_frame_count"), "examples.seedvr2.restore.temporal"),
    **dict.fromkeys(("Callable", "Iterable", "Iterator", "Optional", "torch", "stage_clock", "apply_color_fix",
                     "VAE_MODES", "make_vae_runner", "SCALING_FACTOR", "NUM_TIMESTEPS", "LATENT_CHANNELS",
                     "VAE_PARALLEL_MODES", "NonFiniteOutput", "check_finite", "FiniteChecks", "pad_to_causal_length",
                     "sr_condition", "trailing_timesteps", "v_lerp_endpoint", "euler_v_lerp_sample",
                     "released_models_on_meta", "SeedVR2Pipeline"), "examples.seedvr2.restore.pipeline"),
    **dict.fromkeys(("MemoryEstimate", "_HEAP_BLOCK_BYTES",
                     "_VAE_TILED_UNITS_PER_FRAME", "_DIT_UNITS_PER_TOKEN",
                     "_FRAME_COPIES", "heap_area", "vae_work_area",
                     "estimate_restore_bytes"), "examples.seedvr2.memory.estimate"),
}
__getattr__, __dir__ = moved_names(__name__, MOVED)
