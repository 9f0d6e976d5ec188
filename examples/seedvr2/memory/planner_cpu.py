"""``python -m examples.seedvr2 plan --device cpu``: what a CPU restore needs in host RAM per rank, from the CPU twin.

The same search as the GPU planner (:func:`.planner.plan_restore`: SP degrees that divide the rank count, temporal
batches, VAE modes, ``--shard-weights``, fastest first), with each stage traced by the CPU twin
(:mod:`.cpu_twin`: the real model built on fake CPU tensors, planning on real ones, as rank 0 of a fake process group
of the SP degree) instead of the fake GPU. What differs from the GPU planner's figures:

- no CUDA context, cuBLAS workspace or NCCL constants; instead the resident set of this process once it has imported
  what a restore imports (Python, torch, the models' code, PyAV) and run the restore's kernels once at a tiny size
  (their code pages), measured here before any tracing (:func:`measure_baseline`);
- no allocator overhead (the CPU allocator returns large freed blocks to the system), but the unfolded input of the
  CPU's 3-D convolution is counted at the op (:func:`.cpu_twin.unfold_bytes`);
- the input frames live in the same memory: the batch's float32 frames are held through the DiT and the decode (the
  encode's trace makes its own), and the prefetch thread reads up to two more of this rank's batches meanwhile;
- the default dtype is restore's on the CPU (fp32), and ``--demo`` plans the embedded tiny demo weights.

The twin does not see oneDNN's scratch buffers, the allocator's fragmentation, nor the video decoder's and encoder's
own buffers; ``tests/test_plan_cpu.py`` sets the answer against the measured peak RSS of the restore it plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["CpuTracer", "measure_baseline", "cpu_assumptions"]

#: the prefetch thread's read-ahead of input batches (its queue's one, and the one it is reading)
PREFETCHED_BATCHES = 2

_BASELINE: list[int] = []


def measure_baseline(dtype: torch.dtype = torch.float32) -> int:
    """This process's resident set once it holds what a restore rank holds before its models: the imports (torch,
    the models' code, the media modules with PyAV; the plan command imports the command line's first, as
    :mod:`examples.seedvr2.cli.plan` does) and the code pages of the kernels a restore runs
    (a real restore of a 5-frame 32x32 clip through the tiny demo models, in ``dtype``: the same modules and kernels
    as the released ones, at a size whose tensors are negligible). Measured once, before any tracing, and kept."""
    if not _BASELINE:
        import gc

        from ..media import reading as media  # noqa: F401 - imported for their resident pages, as a restore does
        from ..models.demo import demo_models, demo_text_embeds
        from ..restore.pipeline import SeedVR2Pipeline
        from .cpu_twin import current_rss

        dit, vae = demo_models("cpu", dtype)
        with torch.no_grad():
            SeedVR2Pipeline(dit, vae, "replicated").restore_batch(torch.zeros(3, 5, 32, 32), demo_text_embeds(), 0,
                                                                  0, "none")
        del dit, vae
        gc.collect()
        _BASELINE.append(current_rss())
    return _BASELINE[0]


def cpu_assumptions(baseline: int) -> str:
    """The CPU plan's ``assumes:`` line, with the measured ``baseline``."""
    return (f"a rank's process holds {baseline / 2**30:.2f} GiB before its models (this process's resident set after "
            f"restore's imports and a tiny real restore, measured); the CPU's 3-D convolutions unfold their input "
            f"(counted at the op); no allocator cache; the batch's float32 frames held through the DiT and decode, "
            f"up to {PREFETCHED_BATCHES} more batches read ahead; tiled VAE traced on one tile plus the whole-frame "
            f"tensors")


def _build(model: str, demo: bool, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The DiT and the VAE in ``dtype``, built where the caller is (the meta device, or under the twin's fake mode,
    where ``.to(dtype)`` cannot swap a fake parameter: they are built in ``dtype`` instead)."""
    from ..models.dit import NaDiTConfig, SeedVR2NaDiT
    from ..models.vae import CausalVideoVAE, VideoVAEConfig

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if demo:
            from ..models.demo import DEMO_DIT_CONFIGS, demo_vae_config

            dit, vae = SeedVR2NaDiT(DEMO_DIT_CONFIGS[model]), CausalVideoVAE(VideoVAEConfig(**demo_vae_config()))
        else:
            dit, vae = SeedVR2NaDiT(NaDiTConfig.released(model)), CausalVideoVAE(VideoVAEConfig.seedvr2())
    finally:
        torch.set_default_dtype(previous)
    return dit.eval(), vae.eval()


def _sp_group(sp: int):
    """The twin's SP group: the fake world of ``sp`` ranks, or a single rank."""
    import torch.distributed as dist

    from winsp.comm.group import SPGroup

    return SPGroup(dist.group.WORLD if sp > 1 else None)


@dataclass
class CpuTracer:
    """The CPU twin's traces of rank 0 of an SP group of ``sp`` ranks, cached in ``cache`` by what they depend on;
    the same interface as :class:`.planner.Tracer`."""

    model: str
    sp: int
    dtype: torch.dtype
    cache: dict = field(default_factory=dict)
    demo: bool = False

    def _trace(self, key: tuple, fn) -> int:
        if key not in self.cache:
            from .cpu_twin import cpu_twin

            with cpu_twin(0, self.sp) as trace:
                fn(trace)
            self.cache[key] = trace.peak_bytes
        return self.cache[key]

    def weights(self, shard: bool) -> tuple[int, int]:
        key = ("cpu weights", self.model, self.demo, str(self.dtype), self.sp, shard)
        if key not in self.cache:
            from .traced_peaks import weight_bytes

            with torch.device("meta"):
                self.cache[key] = weight_bytes(*_build(self.model, self.demo, self.dtype), self.sp, shard)
        return self.cache[key]

    def extra(self) -> int:
        return measure_baseline(self.dtype)

    def with_overhead(self, nbytes: int) -> int:
        return nbytes

    def held_input(self, clip, batches: int, stage: str) -> int:
        """The batch's float32 frames (held by the restore loop; the encode's trace makes its own) and the batches
        read ahead."""
        frames = 3 * clip.frames * clip.height * clip.width * 4
        ahead = min(max(batches - 1, 0), PREFETCHED_BATCHES) * frames
        return ahead + (0 if stage == "VAE encode" else frames)

    def dit(self, latent: tuple[int, int, int], shard: bool) -> int:
        """One DiT step's peak, the built model's weights included (counted from the built model on, as
        :meth:`.planner.Tracer.dit`)."""

        def run(trace) -> None:
            import winsp
            from winsp.utils.phases import planning_phase

            from .fake_gpu_runs import TEXT_TOKENS

            dit, _ = _build(self.model, self.demo, self.dtype)
            group = _sp_group(self.sp)
            if shard:
                from ..weights.sharded import shard_loaded_dit

                shard_loaded_dit(dit, group)
            dit.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=self.sp), group=group)
            trace.peak_bytes = trace.live_bytes
            cfg = dit.config
            tokens = 16 if self.demo else TEXT_TOKENS  # the demo's random prompt, or the shipped embeddings
            t, h, w = latent
            vid = torch.randn(t * h * w, cfg.vid_in_channels, dtype=self.dtype)
            txt = torch.randn(tokens, cfg.txt_in_dim, dtype=self.dtype)
            with planning_phase("request shapes"):  # host values, real under the twin
                shapes = torch.tensor([[t, h, w]]), torch.tensor([[tokens]])
            with torch.no_grad():
                dit(vid, txt, *shapes, torch.full((1,), 1000.0))

        return self._trace(("cpu dit", self.model, self.demo, self.sp, str(self.dtype), latent, shard), run)

    def vae(self, stage: str, mode: str, clip, tile: Optional[int]) -> int:
        from .traced_peaks import vae_stage_peak

        return vae_stage_peak(self, stage, mode, clip, tile)

    def vae_trace(self, stage: str, mode: str, clip, tile: Optional[int], sp: int) -> int:
        """One VAE stage in ``mode`` (the pipeline's temporal chunks of 4 latent frames), the VAE's weights included."""

        def run(trace) -> None:
            from ..models.vae.modes import make_vae_runner
            from ..restore.pipeline import causal_frame_count
            from .fit import tile_overlap

            _, vae = _build(self.model, self.demo, self.dtype)
            vae.set_temporal_chunking(4)
            group = _sp_group(self.sp)
            run_mode = "replicated" if mode in ("height", "wavefront") and group.size == 1 else mode
            size = tile or 256
            runner = make_vae_runner(run_mode, vae, group=group, tile_size=size, overlap=tile_overlap(size))
            trace.peak_bytes = trace.live_bytes  # from the built model on (a bf16 build passes through float32)
            with torch.no_grad():
                if stage == "encode":
                    runner.encode(torch.randn(1, 3, causal_frame_count(clip.frames), clip.height, clip.width,
                                              dtype=self.dtype))
                else:
                    t, h, w = clip.latent
                    runner.decode(torch.randn(1, vae.config.latent_channels, t, h, w, dtype=self.dtype))

        if sp != self.sp:
            return CpuTracer(self.model, sp, self.dtype, self.cache, self.demo).vae_trace(stage, mode, clip, tile, sp)
        return self._trace(("cpu vae", self.demo, sp, str(self.dtype), stage, mode, clip, tile), run)
