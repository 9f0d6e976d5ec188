"""Strided neighbourhoods (sliding tile attention): halo bytes against Ulysses, attention work per rank, and the
SP = 2 / SP = 1 forward speed-up of a CPU stack.

Run from the repository root: ``python benchmarks/bench_strided.py`` (both parts; ``--only table`` or ``--only
speedup``; the speed-up takes minutes, one thread a rank; ``--tiny`` smoke-runs it on a small grid).

1. **Bytes and work per layer**, from the real plans (:func:`winsp.planning.halo.choose_blocks`, the cut every rank
   runs): a strided layer receives the k and v rows of its halo; Ulysses runs four all-to-alls (q, k, v in, the
   output back) of the same ``[N, C]`` activations, each sending ``(P - 1) / P`` of it off-rank. Totals over all
   ranks, so the ratio depends on neither C nor the dtype. Attention work is query x key pairs of the
   neighbourhoods; the table gives the heaviest rank's against the mean. The grid is HunyuanVideo 1.5's 720p x 121
   frames latent, ``GRID`` = (31, 45, 80): (121 - 1) / 4 + 1 = 31 frames of a 4x temporal VAE, 720 / 16 = 45 and
   1280 / 16 = 80 of a 16x spatial one, patch 1. The sliding tile layer is ``Neighborhood.sliding_tile(TILE, TILES)``:
   FastVideo's STA tile for HunyuanVideo, (6, 8, 8), with a window of 3 tiles per axis (kernel (18, 24, 24)); the
   table also lists a (4, 4, 4) tile. Each P is planned twice: with the default costs (an NVLink node, where a halo
   row weighs 3 % of a row's work; of the cuts predicted within ``TIME_TOLERANCE`` of the fastest the planner takes the
   fewest halo rows) and with ``PCIE_COSTS`` (links 18x slower). The cut is a product of per-axis runs
   ``(pt, ph, pw) at unit`` or a nested one (boxes in rank order).
2. **Speed-up.** A stack of 4 attention blocks (C = 256, 4 heads x 64, MLP 4x, float32) of sliding tile attention
   ``Neighborhood.sliding_tile((2, 4, 4), (1, 3, 3))`` (kernel (2, 12, 12), stride (2, 4, 4)) on four latent frames
   of 720p, (4, 45, 80) (``--tiny``: (2, 12, 16)), SP = 1 and SP = 2 on gloo, one thread a rank, interleaved;
   medians of warm forwards in wall and CPU seconds (the slower rank at SP = 2). The layout is
   ``bench_neighborhood.py``'s speed-up stack with the strided layer in place of (3, 7, 7).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import winsp  # noqa: E402
from winsp.planning.costs import DEFAULT_COSTS, PCIE_COSTS  # noqa: E402
from winsp.planning.halo import NeighborhoodBlocks, block_halo_rows, block_work, choose_blocks  # noqa: E402

#: HunyuanVideo 1.5 at 720p x 121 frames, latent (t, h, w) (see the module docstring)
GRID = (31, 45, 80)
#: FastVideo's STA tile for HunyuanVideo and a window of 3 tiles per axis
TILE, TILES = (6, 8, 8), (3, 3, 3)
DEGREES = tuple(range(2, 9))


def sta_layer(tile=TILE, tiles=TILES) -> winsp.Neighborhood:
    """The sliding tile layer the table and the balance test use."""
    return winsp.Neighborhood.sliding_tile(tile, tiles)


#: the planner's cost constants the table plans with: NVLink (the default) and PCIe 4.0 x16
COSTS = {"NVLink": DEFAULT_COSTS, "PCIe": PCIE_COSTS}


def cut_label(grid, blocks) -> str:
    """A product cut's ``(pt, ph, pw)`` and unit, or a nested cut's boxes (``t0-t1 x h0-h1 x w0-w1``)."""
    if isinstance(blocks, NeighborhoodBlocks):
        return f"{blocks.splits} at {blocks.unit}"
    return "nested: " + ", ".join(" x ".join(f"{lo}-{hi}" for lo, hi in box) for box in blocks.rank_boxes(grid))


def layer_figures(grid, geometry: winsp.Neighborhood, p: int, costs=DEFAULT_COSTS) -> dict:
    """The real plan's cut at ``p`` ranks (weighed with ``costs``): halo rows, halo / Ulysses bytes, heaviest rank's
    work / mean."""
    blocks = choose_blocks([grid], [geometry], p, costs)
    rows = block_halo_rows(grid, blocks, geometry)
    work = np.asarray(block_work(grid, blocks, geometry), np.float64)
    halo = sum(h for _, h in rows)
    n = math.prod(grid)
    return {"cut": cut_label(grid, blocks), "halo": halo,
            "ratio": (2 * halo) / (4 * n * (p - 1) / p),  # k and v rows received vs four all-to-alls of [N, C]
            "largest": max(h / max(o, 1) for o, h in rows), "work": float(work.max() / work.mean())}


def table(tiles=((TILE, TILES), ((4, 4, 4), TILES))) -> tuple[str, dict]:
    lines = ["| tile x tiles (kernel) | P | costs | cut (t x h x w) | halo rows (all ranks) | largest halo / own "
             "| halo / Ulysses bytes | heaviest / mean work |", "|---|---|---|---|---|---|---|---|"]
    figures = {}
    for tile, k in tiles:
        geom = sta_layer(tile, k)
        for p in DEGREES:
            for name, costs in COSTS.items():
                f = figures[(tile, p, name)] = layer_figures(GRID, geom, p, costs)
                lines.append(f"| {tile} x {k} ({geom.kernel}) | {p} | {name} | {f['cut']} | {f['halo']} "
                             f"| {f['largest']:.3f} | {f['ratio']:.3f} | {f['work']:.4f} |")
    return "\n".join(lines), figures


# ---- speed-up --------------------------------------------------------------------------------------------------

SPEED_GRID, TINY_GRID = (4, 45, 80), (2, 12, 16)
SPEED_LAYER = dict(tile=(2, 4, 4), tiles=(1, 3, 3))
# the block stack and its width are bench_neighborhood.py's speed-up stack (C = 256, 4 heads, 4 blocks)
from benchmarks.bench_neighborhood import DIM, LAYERS, _stack  # noqa: E402


def _time_rank(rank, world_size, repeats, grid):
    import torch

    torch.set_num_threads(1)
    forward = _stack([sta_layer(**SPEED_LAYER)] * LAYERS, winsp.comm.SPGroup.world(), grid)
    x = torch.randn(math.prod(grid), DIM, generator=torch.Generator().manual_seed(1))
    wall, cpu = [], []
    with torch.no_grad():
        forward(x)  # warm: plans, halos, index tensors
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            forward(x)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def speedup(repeats: int = 5, grid=SPEED_GRID) -> dict:
    """{P: (wall, CPU)} medians, the slower rank's, best of two interleaved rounds."""
    from winsp.testing import run_ranks

    res: dict = {}
    for _ in range(2):
        for p in (1, 2):
            ranks = run_ranks(_time_rank, p, repeats, grid, timeout=1200)
            wall, cpu = max(r[0] for r in ranks), max(r[1] for r in ranks)
            best = res.get(p)
            res[p] = (wall, cpu) if best is None else (min(best[0], wall), min(best[1], cpu))
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["table", "speedup"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help=f"the speed-up on {TINY_GRID} (a smoke run)")
    args = parser.parse_args()
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.only in (None, "table"):
        text, figures = table()
        print(f"grid {GRID} (HunyuanVideo 1.5, 720p x 121 frames, latent)\n")
        print(text)
    if args.only in (None, "speedup"):
        grid = TINY_GRID if args.tiny else SPEED_GRID
        geom = sta_layer(**SPEED_LAYER)
        (w1, c1), (w2, c2) = (res := speedup(args.repeats, grid))[1], res[2]
        print(f"\ngrid {grid}: {LAYERS} blocks of sliding tile attention (kernel {geom.kernel}, stride {geom.stride}), "
              f"C = {DIM}")
        print("\n| SP = 1 wall / CPU (s) | SP = 2 wall / CPU (s) | speed-up wall | speed-up CPU |\n|---|---|---|---|")
        print(f"| {w1:.3f} / {c1:.3f} | {w2:.3f} / {c2:.3f} | {w1 / w2:.2f}x | {c1 / c2:.2f}x |")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
