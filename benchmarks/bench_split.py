"""Every planner side by side: SeedVR2 3B-width DiT forward at SP = 2 against SP = 1, wall and CPU time, interleaved.

Run from the repository root (about 2 minutes on a quiet 2-core machine; one thread a rank):

``OMP_NUM_THREADS=1 python benchmarks/bench_split.py --clips 9x256x384 --repeats 8``

and the other clips of issue 21, the default against head parallelism (about 5 minutes):

``OMP_NUM_THREADS=1 python benchmarks/bench_split.py --clips 9x512x768 1x720x1280 21x480x848 --planners heads auto
--repeats 2``

Model: the released 3B architecture (dim 2560, 20 heads x 128, SwiGLU, mm layers) with 2 blocks and seeded random
weights, float32; input: one clip of ``frames x height x width`` pixels (latent ``(1 + (f - 1) / 4, h / 8, w / 8)``,
1x2x2 patches), 58 text tokens. Two gloo processes (one thread each) load the model once and keep one runtime per
planner; every round runs each configuration once, in an order rotated from round to round: SP = 1 (rank 0 alone,
rank 1 waits at a barrier), then SP = 2 under each planner (``lpt``, ``locality``, ``split``, ``heads``: head
parallelism, and ``auto``: the default). An SP = 2 forward's wall time is the slower rank's; CPU time is the
process's (all threads), reported for the slower rank and summed over both ranks (against SP = 1's one process: the
parallel overhead). Figures: min and median over rounds; ``auto / heads`` is the per-round ratio's median (and max).
``--json FILE`` writes every figure plus each plan's per-layout statistics (``benchmarks/cost_model.py --fit-wall``
refits the planner's cost constants on them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import winsp  # noqa: E402
import winsp.planning.costs  # noqa: E402
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT  # noqa: E402
from winsp.comm.redistribute import Transition  # noqa: E402
from winsp.planning.balance import exchange_rows  # noqa: E402
from winsp.testing import run_ranks  # noqa: E402

TEXT_TOKENS = 58
PLANNERS = ("lpt", "locality", "split", "heads", "auto")


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


def plan_stats(plans) -> list[dict]:
    """Per layer: the slowest rank's rows and pairs, the in-window exchange and the transition into the layer."""
    out = []
    for i, plan in enumerate(plans):
        moved = 0
        if i and plans[i - 1] is not plan:
            t = Transition(plans[i - 1], plan)
            off = t.count_matrix - np.diag(np.diag(t.count_matrix))
            moved = int(max(off.sum(axis=0).max(), off.sum(axis=1).max()))
        out.append({"rows": max(plan.rank_rows), "pairs": max(plan.rank_attention), "rank_rows": list(plan.rank_rows),
                    "split_windows": len(plan.window_holders), "exchange_rows": float(exchange_rows(plan).max()),
                    "transition_rows": moved, "row_imbalance": plan.row_imbalance,
                    "attention_imbalance": plan.attention_imbalance})
    return out


def _timed(model, args) -> tuple[float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        model(*args)
    return time.perf_counter() - start, time.process_time() - start_cpu


def _rank(rank: int, world_size: int, clip, layers: int, planners, repeats: int, costs=None) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = _config(layers)
    model = SeedVR2NaDiT(cfg).eval()
    args = _inputs(clip, cfg)
    t, h, w = args[2][0].tolist()
    grids = [(t, h // 2, w // 2)]  # 1x2x2 patches
    runtimes, stats = {}, {}
    for name in ("sp1", *planners):
        cfg_p = winsp.DiffusionParallelConfig(ulysses_degree=1 if name == "sp1" else world_size,
                                              planner="lpt" if name == "sp1" else name, costs=costs)
        runtimes[name] = model.build_runtime(cfg_p)
        stats[name] = plan_stats(runtimes[name].plans(grids))
    configs = list(runtimes)
    wall = {k: [] for k in configs}
    cpu = {k: [] for k in configs}

    def run(name: str) -> None:
        object.__setattr__(model, "_winsp_runtime", runtimes[name])  # switch planners on the same model
        dist.barrier()
        if name != "sp1" or rank == 0:
            w_s, c_s = _timed(model, args)
            wall[name].append(w_s)
            cpu[name].append(c_s)
        dist.barrier()

    for name in configs:  # warm: plans, indices, allocator
        run(name)
    for name in configs:
        wall[name].clear()
        cpu[name].clear()
    for r in range(repeats):
        for i in range(len(configs)):
            run(configs[(i + r) % len(configs)])
    return {"wall": wall, "cpu": cpu, "stats": stats, "grids": grids}


def measure(clip, layers: int = 2, repeats: int = 3, planners=PLANNERS, costs=None) -> dict:
    res = run_ranks(_rank, 2, clip, layers, tuple(planners), repeats, costs, timeout=3600)
    a, b = res
    out = {"clip": list(clip), "grids": a["grids"], "layers": layers, "repeats": repeats, "stats": a["stats"],
           "wall": {"sp1": a["wall"]["sp1"]}, "cpu": {"sp1": a["cpu"]["sp1"]}, "cpu_total": {"sp1": a["cpu"]["sp1"]}}
    for name in planners:
        out["wall"][name] = [max(x, y) for x, y in zip(a["wall"][name], b["wall"][name])]
        out["cpu"][name] = [max(x, y) for x, y in zip(a["cpu"][name], b["cpu"][name])]
        out["cpu_total"][name] = [x + y for x, y in zip(a["cpu"][name], b["cpu"][name])]
    return out


def summary(r: dict) -> str:
    mn = lambda v: min(v)  # noqa: E731
    md = statistics.median
    w, c, ct = r["wall"], r["cpu"], r["cpu_total"]
    lines = [f"#### {'x'.join(map(str, r['clip']))} (post-patch grid {tuple(r['grids'][0])}, {r['layers']} layers, "
             f"{r['repeats']} rounds)", "",
             "| config | wall min | wall median | SP1/SP2 wall (min, median) | CPU slower rank (min, median) "
             "| CPU both ranks / SP1 (median) | split windows per layout | imbalance (rows, attention) |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for name in w:
        st = r["stats"][name][:2]
        speed = "" if name == "sp1" else f"{mn(w['sp1']) / mn(w[name]):.2f}x, {md(w['sp1']) / md(w[name]):.2f}x"
        total = "" if name == "sp1" else f"{md(ct[name]) / md(c['sp1']):.2f}"
        lines.append(f"| {name} | {mn(w[name]):.2f} s | {md(w[name]):.2f} s | {speed} | {mn(c[name]):.2f} s, "
                     f"{md(c[name]):.2f} s | {total} | {', '.join(str(s['split_windows']) for s in st)} | "
                     + "; ".join(f"{s['row_imbalance']:.3f}, {s['attention_imbalance']:.3f}" for s in st) + " |")
    if "auto" in w and "heads" in w:
        ratio = [x / y for x, y in zip(w["auto"], w["heads"])]
        lines += ["", f"auto / heads wall per round: median {md(ratio):.3f}, max {max(ratio):.3f}; "
                  f"min auto / min heads {mn(w['auto']) / mn(w['heads']):.3f}"]
    if "auto" in w:
        sp = [x / y for x, y in zip(w["sp1"], w["auto"])]
        lines.append(f"SP1 / SP2 auto wall per round: {', '.join(f'{s:.2f}' for s in sp)}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", nargs="+", default=["9x256x384"], help="frames x height x width, pixels")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--planners", nargs="+", default=list(PLANNERS), choices=list(winsp.planning.PLANNERS))
    ap.add_argument("--json", type=Path, help="write every figure and plan statistic here")
    ap.add_argument("--costs", choices=("default", "gloo-cpu"), default="default",
                    help="the cost constants auto and split plan with (winsp.planning.costs.DEFAULT_COSTS or GLOO_CPU_COSTS)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for text in args.clips:
        clip = tuple(int(v) for v in text.split("x"))
        costs = winsp.planning.costs.GLOO_CPU_COSTS if args.costs == "gloo-cpu" else None
        r = measure(clip, args.layers, args.repeats, args.planners, costs)
        results.append(r)
        print(summary(r) + "\n", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
