"""Neighborhood layers: halo bytes against Ulysses, planning time, and the SP = 2 / SP = 1 forward speed-up.

Run from the repository root: ``python benchmarks/bench_neighborhood.py`` (all three parts; ``--only table``,
``--only planning`` or ``--only speedup`` for one; the speed-up takes a few minutes, one thread a rank).

1. **Bytes per layer.** A neighborhood layer receives the k and v rows of its halo (the rows its block's queries
   reach that other ranks own, from the real plan's cut); Ulysses runs four all-to-alls (q, k, v in, the output
   back) of the same [N, C] activations, each sending (P - 1) / P of it off-rank. Both are totals over all ranks,
   so the ratio does not depend on C or the dtype. Grids are post-patch (T, H, W) token grids of 21 latent frames
   (81 video frames of a 4x temporal VAE) at 16x spatial downsampling: 720p (21, 45, 80), 1080p (21, 68, 120),
   4K (21, 135, 240). Kernels: 1D (1, 1, k) along w, 2D (1, k, k), 3D (k, k, k).
2. **Planning** a 32-layer schedule mixing neighborhood (3D 7), SeedVR2 regular / shifted window and global layers
   at 4K x 21 on P = 8, in a fresh process (cold: nothing cached, imports excluded).
3. **Speed-up.** A stack of 4 attention blocks (C = 256, 4 heads x 64, MLP 4x, float32) on a (4, 24, 32) grid, once
   with 3D neighborhood layers (3, 7, 7) and once with whole windows (FixedWindows (4, 12, 16): 4 windows, 2 a rank
   at SP = 2, no transitions: whole windows' best case); ``--speedup-grid 720p``: on (4, 45, 80), four latent
   frames of 720p, against windows (4, 15, 20) (12 windows, 6 a rank), SP = 1 and SP = 2 on gloo, one thread a rank,
   interleaved; medians of warm forwards in wall and CPU seconds (the slower rank at SP = 2). Inference: each
   neighborhood layer's halo exchange runs in the background while the tiles that need no halo are computed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import winsp  # noqa: E402
from winsp.planning.halo import block_halo_rows, choose_splits  # noqa: E402

SHAPES = {"720p x21": (21, 45, 80), "1080p x21": (21, 68, 120), "4K x21": (21, 135, 240)}
KERNELS = (7, 9, 11, 13)
DEGREES = (2, 4, 8)


def kernel_of(dims: int, k: int) -> tuple[int, int, int]:
    return {1: (1, 1, k), 2: (1, k, k), 3: (k, k, k)}[dims]


def halo_ratio(grid, geometry: winsp.Neighborhood, p: int) -> tuple[tuple[int, int, int], int, float, float]:
    """(cut, halo rows over all ranks, halo bytes / Ulysses bytes, the largest rank's halo / its own rows)."""
    splits = choose_splits([grid], [geometry], p)
    rows = block_halo_rows(grid, splits, geometry)
    halo = sum(h for _, h in rows)
    n = math.prod(grid)
    ratio = (2 * halo) / (4 * n * (p - 1) / p)  # k and v rows received against four all-to-alls of [N, C]
    return splits, halo, ratio, max(h / max(o, 1) for o, h in rows)


def table() -> tuple[str, dict]:
    lines = ["| shape | grid | kernel | P | cut (pt, ph, pw) | halo rows (all ranks) | largest halo / own rows "
             "| halo / Ulysses bytes |", "|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for name, grid in SHAPES.items():
        for dims in (1, 2, 3):
            for k in KERNELS:
                geom = winsp.Neighborhood(kernel_of(dims, k))
                for p in DEGREES:
                    splits, halo, ratio, worst = halo_ratio(grid, geom, p)
                    ratios[(name, dims, k, p)] = ratio
                    lines.append(f"| {name} | {grid} | {dims}D {k} | {p} | {splits} | {halo} | {worst:.3f} "
                                 f"| {ratio:.3f} |")
    return "\n".join(lines), ratios


def mixed_schedule(layers: int = 32):
    na = winsp.Neighborhood((7, 7, 7))
    reg, shift = winsp.make_geometry("regular", (4, 3, 3)), winsp.make_geometry("shifted", (4, 3, 3))
    glob = winsp.FixedWindows((21, 135, 240))
    cycle = [na, na, reg, shift, na, glob, reg, shift]
    return [cycle[i % len(cycle)] for i in range(layers)]


def planning_cold(grid=(21, 135, 240), p: int = 8) -> float:
    """Seconds of the first plan_schedule of the mixed schedule in this process."""
    schedule = mixed_schedule()
    start = time.perf_counter()
    plans = winsp.planning.plan_schedule([grid], schedule, p)
    elapsed = time.perf_counter() - start
    assert len({id(x) for x, g in zip(plans, schedule) if isinstance(g, winsp.Neighborhood)}) == 1
    return elapsed


def planning(repeats: int = 5) -> list[float]:
    """Cold planning time in ``repeats`` fresh processes."""
    code = "import benchmarks.bench_neighborhood as b; print(b.planning_cold())"
    root = Path(__file__).resolve().parents[1]
    out = []
    for _ in range(repeats):
        res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(root)})
        out.append(float(res.stdout.strip().splitlines()[-1]))
    return out


# ---- speed-up --------------------------------------------------------------------------------------------------

GRID, WINDOWS, DIM, HEADS, LAYERS = (4, 24, 32), (4, 12, 16), 256, 4, 4
#: ``--speedup-grid 720p``: four latent frames of 720p, SeedVR2-sized windows (12 windows, 6 a rank at SP = 2)
LARGE_GRID, LARGE_WINDOWS = (4, 45, 80), (4, 15, 20)


def _stack(schedule, group, grid=GRID):
    import torch

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
        "norm": torch.nn.LayerNorm(DIM), "qkv": torch.nn.Linear(DIM, 3 * DIM), "proj": torch.nn.Linear(DIM, DIM),
        "mlp": torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(),
                                   torch.nn.Linear(4 * DIM, DIM))}) for _ in range(LAYERS))
    runtime = winsp.WindowRuntime(schedule, group=group)

    def forward(x):
        req = runtime.request([grid], dtype=x.dtype)
        h = req.scatter(x)
        for i, b in enumerate(blocks):
            h = req.to_layer(h, i)
            q, k, v = b["qkv"](b["norm"](h)).view(-1, 3, HEADS, DIM // HEADS).unbind(1)
            out, _ = req.attention(q, k, v, layer=i)
            h = h + b["proj"](out.reshape(h.shape))
            h = h + b["mlp"](h)
        return req.gather(h)

    return forward


def _schedules(windows=WINDOWS):
    return {"neighborhood": [winsp.Neighborhood((3, 7, 7))] * LAYERS,
            "whole windows": [winsp.FixedWindows(windows)] * LAYERS}


def _time_rank(rank, world_size, repeats, grid=GRID, windows=WINDOWS):
    import torch

    torch.set_num_threads(1)
    group = winsp.comm.SPGroup.world()
    x = torch.randn(math.prod(grid), DIM, generator=torch.Generator().manual_seed(1))
    out = {}
    fns = {name: _stack(s, group, grid) for name, s in _schedules(windows).items()}
    with torch.no_grad():
        for fn in fns.values():
            fn(x)  # warm: plans, halos, index tensors
        for name in fns:
            out[name] = ([], [])
        for _ in range(repeats):
            for name, fn in fns.items():
                w0, c0 = time.perf_counter(), time.process_time()
                fn(x)
                out[name][0].append(time.perf_counter() - w0)
                out[name][1].append(time.process_time() - c0)
    return {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in out.items()}


def speedup(repeats: int = 5, grid=GRID, windows=WINDOWS) -> dict:
    from winsp.testing import run_ranks

    res = {}
    for _ in range(2):  # interleave SP = 1 and SP = 2 runs twice; keep each configuration's best median
        for p in (1, 2):
            ranks = run_ranks(_time_rank, p, repeats, grid, windows, timeout=1200)
            for name in ranks[0]:
                wall = max(r[name][0] for r in ranks)
                cpu = max(r[name][1] for r in ranks)
                best = res.get((name, p))
                res[(name, p)] = (wall, cpu) if best is None else (min(best[0], wall), min(best[1], cpu))
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["table", "planning", "speedup"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--speedup-grid", choices=["small", "720p"], default="small",
                        help=f"the speed-up's grid: small {GRID} (windows {WINDOWS}, the default) or 720p "
                             f"{LARGE_GRID} (windows {LARGE_WINDOWS}: four latent frames of a 720p video)")
    args = parser.parse_args()
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.only in (None, "table"):
        text, ratios = table()
        print(text)
        print(f"\n4K x21, P = 8, 3D kernel 7: halo / Ulysses = {ratios[('4K x21', 3, 7, 8)]:.3f} (target <= 0.25); "
              f"largest ratio anywhere: {max(ratios.values()):.3f} (target <= 1)")
    if args.only in (None, "planning"):
        times = planning(args.repeats)
        print(f"\nplanning a 32-layer mixed schedule at 4K x21, P = 8, cold: median {statistics.median(times) * 1e3:.0f}"
              f" ms over {len(times)} fresh processes ({', '.join(f'{t * 1e3:.0f}' for t in times)} ms)")
    if args.only in (None, "speedup"):
        grid, windows = (GRID, WINDOWS) if args.speedup_grid == "small" else (LARGE_GRID, LARGE_WINDOWS)
        res = speedup(args.repeats, grid, windows)
        print(f"\ngrid {grid}: neighborhood (3, 7, 7) vs whole windows {windows}, {LAYERS} blocks, C = {DIM}")
        print("\n| layers | SP = 1 wall / CPU (s) | SP = 2 wall / CPU (s) | speed-up wall | speed-up CPU |")
        print("|---|---|---|---|---|")
        for name in _schedules():
            (w1, c1), (w2, c2) = res[(name, 1)], res[(name, 2)]
            print(f"| {name} | {w1:.3f} / {c1:.3f} | {w2:.3f} / {c2:.3f} | {w1 / w2:.2f}x | {c1 / c2:.2f}x |")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
