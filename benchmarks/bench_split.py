"""SP = 2 against SP = 1 forward time of a SeedVR2 3B-width DiT on gloo CPU ranks: whole windows against the default.

Run from the repository root (a few minutes; one thread a rank):
``OMP_NUM_THREADS=1 python benchmarks/bench_split.py --clips 9x256x384 --repeats 3``.

Model: the released 3B architecture (dim 2560, 20 heads x 128, SwiGLU, mm layers) with 2 blocks and seeded random
weights, float32; input: one clip of ``frames x height x width`` pixels (post-patch grid ``(1 + (f - 1) / 4,
h / 16, w / 16)``), 58 text tokens. Runs are interleaved (SP = 1, SP = 2 with ``planner="lpt"``, SP = 2 with the
default ``"auto"``, repeated), and each configuration reports the median of its warm forwards, in wall seconds and
in CPU seconds of the process (all its threads: compute and gloo's copies, not time spent waiting, so it is far less
disturbed by other jobs on a loaded machine but does not count waits for a slower peer or the wire). The SP = 2
figure is the slower rank's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import winsp  # noqa: E402
from winsp.testing import run_ranks  # noqa: E402
from examples.seedvr2.dit import NaDiTConfig, SeedVR2NaDiT  # noqa: E402

TEXT_TOKENS = 58


def _config(layers: int) -> NaDiTConfig:
    return NaDiTConfig.seedvr2_at_size(vid_dim=2560, txt_in_dim=5120, heads=20, head_dim=128, num_layers=layers,
                                       mm_layers=layers, rope_dim=128)


def _inputs(clip: tuple[int, int, int], cfg: NaDiTConfig):
    f, h, w = clip
    shape = (1 + (f - 1) // 4, h // 8, w // 8)  # latent (T, H, W): 4x temporal, 8x spatial VAE
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape[0] * shape[1] * shape[2], cfg.vid_in_channels, generator=g),
            torch.randn(TEXT_TOKENS, cfg.txt_in_dim, generator=g), torch.tensor([shape]),
            torch.tensor([[TEXT_TOKENS]]), torch.tensor([500.0]))


def _timed(model, args, runs: int) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds (this process, all its threads: compute and gloo's copies, not its waits)."""
    wall, cpu = [], []
    with torch.inference_mode():
        model(*args)  # warm: plans, indices, allocator
        for _ in range(runs):
            start, start_cpu = time.perf_counter(), time.process_time()
            model(*args)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def _rank(rank: int, world_size: int, clip, layers: int, planner: str, runs: int) -> dict:
    torch.manual_seed(0)
    cfg = _config(layers)
    model = SeedVR2NaDiT(cfg).eval()
    runtime = model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size, planner=planner))
    args = _inputs(clip, cfg)
    times, cpu = _timed(model, args, runs)
    t, h, w = args[2][0].tolist()
    plans = runtime.plans([(t, h // 2, w // 2)])  # 1x2x2 patches
    return {"times": times, "cpu": cpu, "rows": [p.rank_rows for p in plans[:2]],
            "split": [len(p.window_holders) for p in plans[:2]], "imbalance": [p.imbalance for p in plans[:2]]}


def measure(clip, layers: int, repeats: int, runs: int) -> dict:
    out = {"sp1": [], "lpt": [], "auto": []}
    cpu = {"sp1": [], "lpt": [], "auto": []}
    info = {}
    for _ in range(repeats):
        res = run_ranks(_rank, 1, clip, layers, "lpt", runs, timeout=1800)
        out["sp1"] += res[0]["times"]
        cpu["sp1"] += res[0]["cpu"]
        for planner in ("lpt", "auto"):
            res = run_ranks(_rank, 2, clip, layers, planner, runs, timeout=1800)
            out[planner] += [max(a, b) for a, b in zip(res[0]["times"], res[1]["times"])]
            cpu[planner] += [max(a, b) for a, b in zip(res[0]["cpu"], res[1]["cpu"])]
            info[planner] = {k: res[0][k] for k in ("rows", "split", "imbalance")}
    med = {k: statistics.median(v) for k, v in out.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {"clip": clip, "median_s": med, "all_s": out, "info": info, "median_cpu_s": med_cpu, "all_cpu_s": cpu,
            "speedup": {k: med["sp1"] / med[k] for k in ("lpt", "auto")},
            "cpu_speedup": {k: med_cpu["sp1"] / med_cpu[k] for k in ("lpt", "auto")}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", nargs="+", default=["9x256x384"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (each starts fresh processes)")
    ap.add_argument("--runs", type=int, default=2, help="timed warm forwards per process")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for text in args.clips:
        clip = tuple(int(v) for v in text.split("x"))
        r = measure(clip, args.layers, args.repeats, args.runs)
        m, c = r["median_s"], r["median_cpu_s"]
        print(f"{text}: wall SP=1 {m['sp1']:.2f} s, SP=2 lpt {m['lpt']:.2f} s ({r['speedup']['lpt']:.2f}x), "
              f"SP=2 auto {m['auto']:.2f} s ({r['speedup']['auto']:.2f}x); CPU (slowest rank) SP=1 {c['sp1']:.2f} s, "
              f"lpt {c['lpt']:.2f} s ({r['cpu_speedup']['lpt']:.2f}x), auto {c['auto']:.2f} s "
              f"({r['cpu_speedup']['auto']:.2f}x); {r['info']}; all wall {r['all_s']}; all CPU {r['all_cpu_s']}",
              flush=True)


if __name__ == "__main__":
    main()
