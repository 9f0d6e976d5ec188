"""``python -m examples.seedvr2 plan``: will a restore fit on N GPUs? Answered from a fake-GPU trace of the real model.

The released DiT and VAE are built at full width and depth on fake CUDA tensors (:mod:`winsp.testing.fake_gpu`:
shapes and dtypes, no values, no GPU) and one temporal batch is run through each stage as rank 0 of the SP group. The
trace's peak of live device bytes per stage, plus the resident weights of the other model, plus stated constants, is
the stage's need per rank. Settings are tried best first: the longest temporal batch first; for each batch the exact
VAE modes on every SP degree that divides the GPU count (:func:`sp_degrees`: fastest first by the ideal-SP rounds,
ties to the smaller degree), in :func:`.fit.candidate_settings`' order, whole weights before
``--shard-weights``; then the tiled VAE likewise. The first that fits is printed, with each stage's peak and what does
not fit by how much.

Assumptions, stated (and printed): each GPU also holds the CUDA context, cuBLAS workspaces and, with several ranks,
NCCL's buffers (the ``*_BYTES`` constants below; ``benchmarks/gpu_check.py`` measures them on a real GPU); the CUDA
caching allocator rounds blocks up and keeps freed blocks cached (``ALLOCATOR_OVERHEAD`` on the traced bytes).
Tiled VAE runs are traced on one tile (a clip of the tile's size) and the whole-frame input and output tensors are
added (tracing every tile of a 4K frame takes minutes). ``--shard-weights`` holds 1/P of the DiT blocks plus the two
gathered blocks (the running one and the prefetched one).

Needs the CUDA build of torch (no GPU): on a CPU-only build it says so in one line. ``--device cpu`` answers for a
CPU restore instead, in host RAM per rank, on any torch: the same search, each stage traced by the CPU twin
(:mod:`.planner_cpu`, which states what differs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from .traced_peaks import _weights, tiled_frame_bytes, vae_stage_peak, weight_bytes  # noqa: F401 - their home was here

__all__ = ["PlanRequest", "StagePeaks", "plan_restore", "parse_bytes", "ASSUMPTIONS"]

GiB = 2**30
MiB = 2**20
#: the CUDA context of one process (kernels loaded lazily; measured 0.3-0.6 GiB on recent drivers)
CUDA_CONTEXT_BYTES = 512 * MiB
#: cuBLAS and cuBLASLt workspaces (torch's default on Hopper: 32 MiB each)
CUBLAS_WORKSPACE_BYTES = 64 * MiB
#: NCCL's buffers for the SP group's communicator (a few MiB per channel and peer; with several ranks only)
NCCL_BYTES = 384 * MiB
#: the caching allocator's rounding (512 B blocks, 2 MiB segments) and its cached free blocks, on the traced peak
ALLOCATOR_OVERHEAD = 0.10

ASSUMPTIONS = (
    f"CUDA context {CUDA_CONTEXT_BYTES / MiB:.0f} MiB, cuBLAS workspaces {CUBLAS_WORKSPACE_BYTES / MiB:.0f} MiB, NCCL "
    f"buffers {NCCL_BYTES / MiB:.0f} MiB (several ranks only) a GPU; the caching allocator's rounding and cache "
    f"+{ALLOCATOR_OVERHEAD:.0%} on traced bytes; tiled VAE traced on one tile plus the whole-frame tensors"
)

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``24g``, ``141 GiB`` -> bytes (GB and G read as GiB, as GPU specs do)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 80GiB")
    unit = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2).upper()]
    return int(float(match.group(1)) * unit)


@dataclass(frozen=True)
class PlanRequest:
    gpus: int
    gpu_memory: int
    model: str
    width: int
    height: int
    frames: int
    dtype: str = "bf16"
    device: str = "cuda"  # "cpu": host RAM per rank of a CPU run, from the CPU twin (:mod:`.planner_cpu`)
    demo: bool = False  # the embedded tiny demo weights (``restore --demo``; CPU only)


@dataclass
class StagePeaks:
    """Per-rank bytes of one candidate: resident weights and each stage's peak (weights included)."""

    weights: int
    dit: int
    vae_encode: int
    vae_decode: int
    extra: int  # the constants (context, workspaces, NCCL)

    @property
    def peak(self) -> int:
        return max(self.dit, self.vae_encode, self.vae_decode)

    def stages(self) -> dict[str, int]:
        return {"weights": self.weights, "DiT": self.dit, "VAE encode": self.vae_encode,
                "VAE decode": self.vae_decode}


@dataclass
class Tracer:
    """Fake-GPU traces of rank 0, cached by what they depend on; and what a GPU holds besides them."""

    model: str
    sp: int
    dtype: object
    cache: dict = field(default_factory=dict)  # shared between tracers: keys name the model and SP degree

    def _trace(self, key, fn, *args, world: Optional[int] = None, **kwargs) -> int:
        if key not in self.cache:
            from winsp.testing.fake_gpu import run_fake_gpu

            report = run_fake_gpu(fn, world or self.sp, *args, ranks=[0], check=False, **kwargs)
            trace = report.ranks[0]
            if trace.error is not None:
                raise RuntimeError(f"the fake-GPU trace of {key} failed: {trace.error}")
            self.cache[key] = trace.peak_bytes
        return self.cache[key]

    def weights(self, shard: bool) -> tuple[int, int]:
        """(DiT bytes a rank holds between blocks, VAE bytes)."""
        return _weights(self.model, self.dtype, self.sp, shard)

    def extra(self) -> int:
        """What a rank holds besides the traced bytes: the stated constants."""
        return CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + (NCCL_BYTES if self.sp > 1 else 0)

    def with_overhead(self, nbytes: int) -> int:
        """Traced bytes as the allocator holds them."""
        return int(nbytes * (1 + ALLOCATOR_OVERHEAD))

    def held_input(self, clip, batches: int, stage: str) -> int:
        """Input frames held in this memory during ``stage`` besides the traced ones, for a rank whose group restores
        ``batches`` temporal batches (none on the GPU: they stay on the host)."""
        return 0

    def dit(self, latent: tuple[int, int, int], shard: bool) -> int:
        """The DiT step's peak (resident weights included), counted from the built model on: a sharded model is built
        whole here and then sharded, which a checkpoint load (``load_sharded_dit``) never holds."""
        from winsp.testing.fake_gpu import fake_gpu

        from .fake_gpu_runs import dit_rank

        key = ("dit", self.model, self.sp, str(self.dtype), latent, shard)
        if key not in self.cache:
            with fake_gpu(0, self.sp) as trace:
                restart = lambda: setattr(trace, "peak_bytes", trace.live_bytes)  # noqa: E731
                dit_rank(0, self.sp, self.model, latent, shard_weights=shard, dtype=self.dtype, on_built=restart)
            self.cache[key] = trace.peak_bytes
        return self.cache[key]

    def vae(self, stage: str, mode: str, clip, tile: Optional[int]) -> int:
        return vae_stage_peak(self, stage, mode, clip, tile)

    def vae_trace(self, stage: str, mode: str, clip, tile: Optional[int], sp: int) -> int:
        """The traced peak of one VAE stage in ``mode`` on ``sp`` ranks (rank 0)."""
        from .fake_gpu_runs import vae_rank

        return self._trace(("vae", sp, str(self.dtype), stage, mode, clip, tile), vae_rank, mode, clip, world=sp,
                           dtype=self.dtype, stage=stage)


def stage_peaks(tracer, request: PlanRequest, settings, shard: bool) -> StagePeaks:
    """Each stage's per-rank need for one temporal batch of ``settings`` (a :class:`.fit.RunSettings`), from
    ``tracer`` (a :class:`Tracer`, or :class:`.planner_cpu.CpuTracer` for a CPU run)."""
    from ..restore.temporal import DEFAULT_OVERLAP
    from .fake_gpu_runs import Clip

    frames = min(settings.batch_frames, request.frames)
    clip = Clip(frames, request.height, request.width)
    dit_w, vae_w = tracer.weights(shard)
    extra = tracer.extra()
    batches = _batch_count(request.frames, settings.batch_frames, settings.overlap if settings.overlap is not None
                           else DEFAULT_OVERLAP)
    rounds = -(-batches // (request.gpus // tracer.sp))  # the batches this rank's group restores
    held = lambda stage: tracer.held_input(clip, rounds, stage)  # noqa: E731
    mode = settings.vae_parallel
    dit = tracer.dit(clip.latent, shard)  # the DiT's weights and one step's activations
    encode = tracer.vae("encode", mode, clip, settings.vae_tile)
    decode = tracer.vae("decode", mode, clip, settings.vae_tile)
    # resident the whole time: the other model's weights
    return StagePeaks(weights=dit_w + vae_w + extra, dit=tracer.with_overhead(dit) + vae_w + extra + held("DiT"),
                      vae_encode=tracer.with_overhead(encode) + dit_w + extra + held("VAE encode"),
                      vae_decode=tracer.with_overhead(decode) + dit_w + extra + held("VAE decode"), extra=extra)


@dataclass
class Candidate:
    """One way to run: SP degree (ranks a group; ``gpus // sp`` groups take whole temporal batches), the run settings
    (a :class:`.fit.RunSettings`), whether the DiT's weights are sharded, and the traced stage peaks."""

    sp: int
    settings: object
    shard: bool
    peaks: StagePeaks

    def flags(self, gpus: int) -> str:
        return (f"{self.settings.flags()}{' --shard-weights' if self.shard else ''} --sp-size {self.sp}"
                f" (--ranks {gpus})")

    def describe(self) -> str:
        return f"SP {self.sp}, {self.settings.describe()}{', sharded weights' if self.shard else ''}"


@dataclass
class PlanResult:
    request: PlanRequest
    tried: list  # Candidate, in the order tried
    chosen: Optional[Candidate]


def sp_degrees(gpus: int, batches: int) -> list[int]:
    """The SP degrees (divisors of ``gpus``) fastest first for a clip of ``batches`` temporal batches: groups of ``sp``
    ranks take whole batches, so a batch round costs ``1/sp`` (ideal SP) and there are ``ceil(batches / groups)``
    rounds; ties go to the smaller degree (less communication)."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    return sorted(divisors, key=lambda d: (-(-batches // (gpus // d)) / d, d))


def _batch_count(frames: int, batch: int, overlap: int) -> int:
    if frames <= batch:
        return 1
    return 1 + -(-(frames - batch) // (batch - overlap))


def make_tracer(request: PlanRequest, sp: int, dtype, cache: dict):
    """The fake-GPU :class:`Tracer`, or the CPU twin's for ``request.device == "cpu"``."""
    if request.device == "cpu":
        from .planner_cpu import CpuTracer

        return CpuTracer(request.model, sp, dtype, cache, demo=request.demo)
    return Tracer(request.model, sp, dtype, cache)


def plan_restore(request: PlanRequest, *, max_batch: Optional[int] = None, report=None,
                 cache: Optional[dict] = None) -> PlanResult:
    """Try the ways to run on ``request.gpus`` GPUs fastest first until one fits ``request.gpu_memory``: the longest
    temporal batch first; for each batch the exact VAE modes on every SP degree (:func:`sp_degrees`), in
    :func:`.fit.candidate_settings`' order, whole DiT weights before sharded, then the approximate tiled VAE
    (tiles of 512, then 256 pixels) likewise. ``cache`` (a dict) keeps traces between
    calls (the traces do not depend on the GPU count or memory). ``request.device == "cpu"`` traces with the CPU twin
    (:class:`.planner_cpu.CpuTracer`) instead of the fake GPU."""
    import torch

    from ..restore.temporal import DEFAULT_BATCH_FRAMES, DEFAULT_OVERLAP
    from .fit import PinnedSettings, candidate_settings

    dtype = getattr(torch, _DTYPES[request.dtype])
    default_batch = max_batch or DEFAULT_BATCH_FRAMES
    batches = _batch_count(request.frames, default_batch, DEFAULT_OVERLAP)
    cache = {} if cache is None else cache
    tried: list[Candidate] = []
    degrees = sp_degrees(request.gpus, batches)
    by_degree = {sp: list(candidate_settings(request.frames, request.height // 8, sp, PinnedSettings(),
                                             default_batch=default_batch, default_overlap=DEFAULT_OVERLAP,
                                             frame_size=(request.height, request.width))) for sp in degrees}
    batch_order = list(dict.fromkeys(s.batch_frames for sp in degrees for s in by_degree[sp]))
    batch_order.sort(reverse=True)
    for batch in batch_order:  # a shorter batch recomputes more overlap frames: more ranks a group first
        for tiled in (False, True):  # the exact VAE modes on every SP degree before the approximate tiled one
            for sp in degrees:
                tracer = make_tracer(request, sp, dtype, cache)
                for settings in by_degree[sp]:
                    if settings.batch_frames != batch or (settings.vae_parallel == "tiled") != tiled \
                            or settings.vae_tile not in (None, 512, 256):
                        continue  # two tile sizes keep the search short; smaller tiles only trade quality
                    for shard in ([False, True] if sp > 1 else [False]):
                        candidate = Candidate(sp, settings, shard, stage_peaks(tracer, request, settings, shard))
                        tried.append(candidate)
                        if report is not None:
                            report(f"  tried {candidate.describe()}: peak {candidate.peaks.peak / GiB:.1f} GiB")
                        if candidate.peaks.peak <= request.gpu_memory:
                            return PlanResult(request, tried, candidate)
    return PlanResult(request, tried, None)
