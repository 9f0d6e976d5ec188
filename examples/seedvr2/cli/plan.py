"""``python -m examples.seedvr2 plan``: the command line of the memory planner (:mod:`..memory.planner`).

It imports the restore command first: a CPU plan measures what a restore rank holds, the command line's modules
included (:func:`~examples.seedvr2.memory.planner_cpu.measure_baseline`).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Optional, Sequence

from ..memory.planner import _DTYPES, ASSUMPTIONS, GiB, PlanRequest, PlanResult, parse_bytes, plan_restore
from . import restore  # noqa: F401 - imported for its resident pages, as a restore does

__all__ = ["main", "build_parser", "parse_request", "format_result"]


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
        from ..memory.planner_cpu import cpu_assumptions

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

        from ..memory.planner_cpu import measure_baseline

        measure_baseline(getattr(torch, _DTYPES[request.dtype]))  # before any tracing: what a restore rank holds
    result = plan_restore(request, report=lambda line: print(line, file=sys.stderr))
    print(format_result(result))
    return 0 if result.chosen is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
