"""torchvision's swin3d_t window-parallel through ``examples.swin3d``: time and memory at SP = 2 vs 1, and the rows
a stage boundary moves against an all-gather of the same activations.

    OMP_NUM_THREADS=1 python benchmarks/bench_swin3d.py [--frames 16] [--size 112] [--repeats 3]
    python benchmarks/bench_swin3d.py --comm [--frames 32] [--size 224] [--world 2 4 8]

Timing: an eval forward in float32, batch 1, one thread a rank, the median of ``--repeats`` after one warm-up (wall
and process CPU seconds: on a loaded machine the CPU time per rank shows the split of work better); SP = 1
is the untouched torchvision model in one process, SP = 2 two gloo ranks (the slowest rank's median). Peak memory is
each process's peak RSS above its RSS just before the first forward (``ru_maxrss``: the model, inputs and imports are
in the baseline). ``--comm`` plans only (numpy, no processes): for each of the three patch mergings, the rows moved
by winsp's sharded step against the rows an all-gather of the stage's activations moves (every rank receives every
row it does not hold: ``N * (P - 1)``), with LPT plans relabelled per stage as the runtime does.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import winsp  # noqa: E402
from examples.swin3d import import_torchvision, parallelize, swin3d_plan  # noqa: E402
from winsp.planning.hierarchy import GridStep, _place_stage, grid_sources, stage_grids  # noqa: E402
from winsp.planning.schedule import plan_schedule  # noqa: E402
from winsp.testing import run_ranks  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _time_forward(rank: int, world_size: int, shape, repeats: int) -> dict:
    torch.set_num_threads(1)
    import_torchvision()
    from torchvision.models.video import swin3d_t

    torch.manual_seed(0)
    model = swin3d_t(weights=None).eval()
    if world_size > 1:
        model = parallelize(model, winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    x = torch.randn(shape)
    base = _rss_mb()
    times, cpu = [], []
    with torch.no_grad():
        for i in range(repeats + 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            model(x)
            if i:
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"median_s": statistics.median(times), "cpu_s": statistics.median(cpu), "peak_above_base_mb": peak - base}


def _comm(frames: int, size: int, worlds, planner: str) -> None:
    import_torchvision()
    from torchvision.models.video import swin3d_t

    plan = swin3d_plan(swin3d_t(weights=None))
    grids = [(frames // 2, size // 4, size // 4)]
    model_grids, laid = stage_grids(plan.stages, grids)
    print(f"swin3d_t, clip {frames} x {size} x {size}: stage grids {[g[0] for g in model_grids]} "
          f"(laid out {[g[0] for g in laid]}), planner {planner!r}")
    print("| P | boundary | rows in stage | all-gather rows N*(P-1) | winsp rows moved (stage planned alone) | "
          "winsp rows moved (as the runtime places the stage) | ratio to all-gather |")
    print("|---|---|---|---|---|---|---|")
    for world in worlds:
        prev = None
        for s, stage in enumerate(plan.stages):
            plans = plan_schedule(laid[s], stage.layers, world, planner)
            if s:
                sources, _ = grid_sources(stage, model_grids[s - 1], laid[s - 1], model_grids[s], laid[s])
                relabelled = _place_stage(prev, plans, sources, planner)
                plain = GridStep.build(prev, plans[0], sources, None, 1, 0, torch.device("cpu")).rows_moved
                moved = GridStep.build(prev, relabelled[0], sources, None, 1, 0, torch.device("cpu")).rows_moved
                n = sum(t * h * w for t, h, w in model_grids[s - 1])
                print(f"| {world} | {s - 1} -> {s} | {n} | {n * (world - 1)} | {plain} | {moved} | "
                      f"{moved / (n * (world - 1)):.3f} |")
                plans = relabelled
            prev = plans[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--comm", action="store_true")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--planner", default="lpt", choices=winsp.planning.PLANNERS)
    args = parser.parse_args()
    if args.comm:
        _comm(args.frames, args.size, args.world, args.planner)
        return
    shape = (1, 3, args.frames, args.size, args.size)
    one = run_ranks(_time_forward, 1, shape, args.repeats, timeout=1800)[0]
    two = run_ranks(_time_forward, 2, shape, args.repeats, timeout=1800)
    slowest = max(r["median_s"] for r in two)
    print(f"swin3d_t eval forward, float32, input {shape}, one thread a rank (load average {os.getloadavg()[0]:.1f})")
    print(f"SP=1 (untouched torchvision): {one['median_s']:.2f} s wall, {one['cpu_s']:.2f} s CPU, peak RSS above "
          f"baseline {one['peak_above_base_mb']:.0f} MB")
    print(f"SP=2 (winsp): {slowest:.2f} s wall (slowest rank), CPU per rank {[round(r['cpu_s'], 2) for r in two]} s, "
          f"peak RSS above baseline per rank {[round(r['peak_above_base_mb']) for r in two]} MB")
    print(f"time ratio SP2/SP1: {slowest / one['median_s']:.2f}")


if __name__ == "__main__":
    main()
