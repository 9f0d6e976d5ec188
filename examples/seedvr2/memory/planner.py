"""``python -m examples.seedvr2 plan``: will a restore fit on N GPUs? Answered from a fake-GPU trace of the real model.

The released DiT and VAE are built at full width and depth on fake CUDA tensors (:mod:`winsp.testing.fake_gpu`:
shapes and dtypes, no values, no GPU) and one temporal batch is run through each stage as rank 0 of the SP group. The
trace's peak of live device bytes per stage, plus the resident weights of the other model, plus stated constants, is
the stage's need per rank. Settings are tried best first: the longest temporal batch first; for each batch the exact
VAE modes on every SP degree that divides the GPU count (:func:`sp_degrees`: fastest first by the ideal-SP rounds,
ties to the smaller degree), in :func:`.memory_fit.candidate_settings`' order, whole weights before
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
(:mod:`.plan_cpu`, which states what differs).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["PlanRequest", "StagePeaks", "plan_restore", "main", "parse_bytes", "ASSUMPTIONS"]

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
    device: str = "cuda"  # "cpu": host RAM per rank of a CPU run, from the CPU twin (:mod:`.plan_cpu`)
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


def stage_peaks(tracer, request: PlanRequest, settings, shard: bool) -> StagePeaks:
    """Each stage's per-rank need for one temporal batch of ``settings`` (a :class:`.memory_fit.RunSettings`), from
    ``tracer`` (a :class:`Tracer`, or :class:`.plan_cpu.CpuTracer` for a CPU run)."""
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
    (a :class:`.memory_fit.RunSettings`), whether the DiT's weights are sharded, and the traced stage peaks."""

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
    :func:`.memory_fit.candidate_settings`' order, whole DiT weights before sharded, then the approximate tiled VAE
    (tiles of 512, then 256 pixels) likewise. ``cache`` (a dict) keeps traces between
    calls (the traces do not depend on the GPU count or memory). ``request.device == "cpu"`` traces with the CPU twin
    (:class:`.plan_cpu.CpuTracer`) instead of the fake GPU."""
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


def format_result(result: PlanResult) -> str:
    r = result.request
    if r.device == "cpu":
        where = f"{r.gpus} CPU rank(s) of {r.gpu_memory / GiB:.3g} GiB RAM each"
    else:
        where = f"{r.gpus} GPU(s) of {r.gpu_memory / GiB:.0f} GiB"
    lines = [f"plan: SeedVR2-{r.model.upper()}{' demo weights' if r.demo else ''} {r.dtype}, {r.width}x{r.height} x "
             f"{r.frames} frames on {where}"]
    chosen = result.chosen
    f = ".2f" if r.device == "cpu" else ".1f"  # a CPU run's figures are smaller
    if chosen is not None:
        groups = r.gpus // chosen.sp
        lines.append(f"fits: {chosen.describe()} ({groups} group{'s' if groups > 1 else ''} of {chosen.sp})")
        lines.append(f"flags: {'--demo ' if r.demo else ''}{chosen.flags(r.gpus)}")
        lines.append("peak per rank: " + ", ".join(f"{name} {nbytes / GiB:{f}} GiB"
                                                   for name, nbytes in chosen.peaks.stages().items()))
    else:
        best = min(result.tried, key=lambda c: c.peaks.peak)
        unit = "rank" if r.device == "cpu" else "GPU"
        lines.append(f"does not fit: the smallest setting tried ({best.describe()}) needs {best.peaks.peak / GiB:{f}} "
                     f"GiB a rank, {(best.peaks.peak - r.gpu_memory) / GiB:{f}} GiB more than a {unit} has")
    for c in [c for c in result.tried if c.peaks.peak > r.gpu_memory][:6]:
        stage, need = max(((k, v) for k, v in c.peaks.stages().items() if k != "weights"), key=lambda kv: kv[1])
        over = (need - r.gpu_memory) / GiB
        lines.append(f"  no: {c.describe()}: {stage} needs {need / GiB:.2f} GiB ({over:+.2f} GiB)")
    if r.device == "cpu":
        from .planner_cpu import cpu_assumptions

        lines.append("assumes: " + cpu_assumptions(result.tried[0].peaks.extra if result.tried else 0))
    else:
        lines.append("assumes: " + ASSUMPTIONS)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.seedvr2 plan",
                                description="Which restore settings fit N GPUs (or N CPU ranks with --device cpu), "
                                            "from a trace of the model on fake tensors.")
    p.add_argument("--gpus", "--ranks", dest="gpus", type=int, required=True,
                   help="GPUs (ranks of the run: restore's --ranks); with --device cpu, CPU ranks")
    p.add_argument("--gpu-memory", "--memory", dest="gpu_memory", required=True,
                   help="memory of one GPU, e.g. 80GiB; with --device cpu, the RAM one rank may use")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): GPU memory per rank from a fake-GPU trace (needs the CUDA build of torch, no "
                        "GPU); cpu: host RAM per rank of a CPU restore, from the CPU twin (any torch)")
    p.add_argument("--model", choices=("3b", "7b"), default="3b")
    p.add_argument("--demo", action="store_true",
                   help="the embedded tiny demo weights (restore --demo); with --device cpu only")
    p.add_argument("--resolution", required=True, metavar="WxH", help="output size (sides cropped to multiples of 16)")
    p.add_argument("--frames", type=int, required=True)
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                   help="compute dtype (default: restore's: bf16 on the GPU, fp32 on the CPU)")
    return p


def _refuse(message: str) -> SystemExit:
    """Bad usage: one line on stderr, exit 2 (exit 1 means that nothing fits)."""
    print(f"plan: {message}", file=sys.stderr)
    return SystemExit(2)


def parse_request(argv: Sequence[str]) -> PlanRequest:
    args = build_parser().parse_args(argv)
    match = re.fullmatch(r"(\d+)x(\d+)", args.resolution)
    if match is None:
        raise _refuse(f"--resolution must be WxH, got {args.resolution!r}")
    width, height = (int(match.group(1)) // 16 * 16, int(match.group(2)) // 16 * 16)
    if args.gpus < 1 or args.frames < 1 or width < 16 or height < 16:
        raise _refuse("--gpus, --frames and the resolution must be positive (sides of at least 16)")
    if args.demo and args.device != "cpu":
        raise _refuse("--demo plans the tiny demo weights' CPU run; add --device cpu")
    try:
        memory = parse_bytes(args.gpu_memory)
    except ValueError as e:
        raise _refuse(str(e)) from None
    dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    return PlanRequest(args.gpus, memory, args.model, width, height, args.frames, dtype, args.device, args.demo)


def main(argv: Optional[Sequence[str]] = None) -> int:
    request = parse_request(sys.argv[2:] if argv is None else argv)
    if request.device == "cuda":
        from winsp.testing.fake_gpu import cuda_build_available

        if not cuda_build_available():
            import torch

            print(f"plan: needs the CUDA build of torch to trace the model on fake CUDA tensors (no GPU needed); "
                  f"this torch {torch.__version__} is CPU-only (--device cpu plans a CPU run on any torch)",
                  file=sys.stderr)
            return 2
    else:
        import torch

        from .planner_cpu import measure_baseline

        measure_baseline(getattr(torch, _DTYPES[request.dtype]))  # before any tracing: what a restore rank holds
    result = plan_restore(request, report=lambda line: print(line, file=sys.stderr))
    print(format_result(result))
    return 0 if result.chosen is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
