"""Split windows under the default planner: balance, bytes against Ulysses, planning time, GPU crossover predictions.

Run from the repository root: ``python benchmarks/split_table.py`` (a few seconds; prints the tables of
``benchmarks/README.md``). SeedVR2 3B windows ((4, 3, 3), regular and shifted layers alternating), one clip per case,
post-patch grids (``1 + (frames - 1) / 4`` latent frames, 16x spatial downsampling).

1. Balance: per case and P, whether each layout splits windows, and the largest rank's rows and attention pairs
   against a perfect split (:attr:`winsp.planning.Plan.row_imbalance`, :attr:`~winsp.planning.Plan.attention_imbalance`;
   ``imbalance`` is the worse) of the default (``"auto"``) against whole windows (LPT); rows moved per layer also for
   the ``"heads"`` plan (head parallelism with split windows: its exchanges plus the transitions between layouts).
2. Bytes per layer, in rows of the hidden state summed over ranks: the transition into the layer's layout (rows that
   change rank) plus its in-window exchanges (:func:`winsp.planning.balance.exchange_rows`), averaged over the two
   layouts, against Ulysses' four all-to-alls (``4 N (P - 1) / P``). Bytes are these rows times ``D x 2`` (bf16).
3. Planning time of a 32-layer schedule on a cache miss (median of 5).
4. GPU predictions (not measurements) of one layer from :mod:`benchmarks.cost_model`'s constants: Ulysses, the
   ``"heads"`` plan, whole windows (LPT) and the default.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import winsp  # noqa: E402
from winsp.comm.redistribute import Transition  # noqa: E402
from winsp.planning.balance import exchange_rows, predicted_compute, predicted_exchange  # noqa: E402
from winsp.planning.costs import DEFAULT_COSTS  # noqa: E402

CASES = {
    "9x256x384": (3, 16, 24), "9x512x768": (3, 32, 48), "720p image": (1, 45, 80), "1080p image": (1, 68, 120),
    "480p x21": (6, 30, 53), "720p x45": (12, 45, 80), "4K x121": (31, 135, 240),
}
DEGREES = (2, 4, 8)
SCHEDULE = [winsp.make_geometry(m, (4, 3, 3)) for m in ("regular", "shifted")]


def layer_rows(plans) -> float:
    """Rows moved per layer (summed over ranks): transition in plus in-window exchanges, mean of the two layouts."""
    moved = Transition(plans[0], plans[1]).rows_moved  # the way back moves as many rows
    return (2 * moved + sum(float(exchange_rows(p).sum()) for p in plans)) / 2


def predicted_layer(plans) -> float:
    """Predicted GPU seconds of one layer (mean of the two layouts): compute, exchanges and the transition."""
    c = DEFAULT_COSTS
    if plans[0].world_size == 1:
        return float(np.mean([predicted_compute(p) for p in plans]))
    t = Transition(plans[0], plans[1])
    off = t.count_matrix - np.diag(np.diag(t.count_matrix))
    transfer = max(off.sum(axis=0).max(), off.sum(axis=1).max()) * c.row_bytes * c.byte_s + c.latency_s
    return float(np.mean([predicted_compute(p) + predicted_exchange(p) for p in plans])) + transfer


def predicted_ulysses(grid, p: int, heads: int = 20) -> float:
    c = DEFAULT_COSTS
    n = math.prod(grid)
    lays = [winsp.geometry.build_layout([grid], g) for g in SCHEDULE]
    pairs = np.mean([float((lay.token_counts.astype(np.float64) ** 2).sum()) for lay in lays])
    compute = n / p * c.row_s + pairs * math.ceil(heads / p) / heads * c.pair_s
    if p == 1:
        return compute
    return compute + 4 * (c.latency_s + n / p * (p - 1) / p * c.row_bytes * c.byte_s)


def balance_markdown() -> str:
    lines = ["| case | grid | P | rows / rank | split windows (reg, shift) | default rows, attention (reg; shift) "
             "| whole (LPT) rows, attention (reg; shift) | rows moved / layer default | LPT | heads plan | Ulysses "
             "| default / Ulysses |",
             "|---|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|"]
    both = lambda ps: "; ".join(f"{pl.row_imbalance:.3f}, {pl.attention_imbalance:.3f}" for pl in ps)  # noqa: E731
    for name, grid in CASES.items():
        n = math.prod(grid)
        for p in DEGREES:
            auto = winsp.planning.plan_schedule([grid], SCHEDULE, p)
            lpt = winsp.planning.plan_schedule([grid], SCHEDULE, p, "lpt")
            heads = winsp.planning.plan_schedule([grid], SCHEDULE, p, "heads")
            uly = 4 * n * (p - 1) / p
            rows = layer_rows(auto)
            lines.append(
                f"| {name} | {grid} | {p} | {n // p} | {len(auto[0].window_holders)}, {len(auto[1].window_holders)} "
                f"| {both(auto)} | {both(lpt)} | {rows:,.0f} | {layer_rows(lpt):,.0f} | {layer_rows(heads):,.0f} "
                f"| {uly:,.0f} | {rows / uly:.2f} |")
    return "\n".join(lines)


def crossover_markdown() -> str:
    lines = ["| case | P | Ulysses (predicted) | heads plan (predicted) | whole windows, LPT (predicted) "
             "| default (predicted) | fastest |", "|---|---:|---:|---:|---:|---:|---|"]
    for name, grid in CASES.items():
        for p in DEGREES:
            t = {"default": predicted_layer(winsp.planning.plan_schedule([grid], SCHEDULE, p)),
                 "Ulysses": predicted_ulysses(grid, p),
                 "LPT": predicted_layer(winsp.planning.plan_schedule([grid], SCHEDULE, p, "lpt")),
                 "heads plan": predicted_layer(winsp.planning.plan_schedule([grid], SCHEDULE, p, "heads"))}
            best = min(t, key=t.get)  # the default first: a tie with LPT (the same plans) names the default
            lines.append(f"| {name} | {p} | {t['Ulysses'] * 1e6:,.0f} us | {t['heads plan'] * 1e6:,.0f} us "
                         f"| {t['LPT'] * 1e6:,.0f} us | {t['default'] * 1e6:,.0f} us | {best} |")
    return "\n".join(lines)


def planning_time(grid=(31, 135, 240), p: int = 8, layers: int = 32, repeats: int = 5) -> float:
    schedule = [SCHEDULE[i % 2] for i in range(layers)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        winsp.planning.plan_schedule([grid], schedule, p)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    print("#### Balance and rows moved per layer\n")
    print(balance_markdown())
    print("\n#### One layer on one NVLink node, SeedVR2 3B (cost-model PREDICTIONS, not measurements)\n")
    print(crossover_markdown())
    print(f"\nplanning a 32-layer 4K x 121 schedule at P = 8 on a miss: {planning_time() * 1e3:.0f} ms (median of 5)")


if __name__ == "__main__":
    main()
