"""Measured cost of one layout transition on gloo CPU ranks: LPT plan vs locality plan vs a Ulysses layer's exchange.

Run from the repository root: ``python benchmarks/bench_transition.py`` (``--world-sizes 2 4 8``, ``--hidden 128``,
``--repeats 15``). Each world size is one set of spawned gloo processes (:func:`winsp.testing.run_ranks`). Inside the
same processes, interleaved, each repeat times:

- the regular -> shifted transition under the LPT plans (``winsp`` redistribution: gather, one variable-split
  all-to-all, gather);
- the same transition under the locality plans;
- a Ulysses-style exchange of the same activation: the four equal-split all-to-alls of head-sharded attention
  (q, k, v in, output back), each over a ``[N / P, D]`` tensor.

A repeat is bracketed by barriers, so a time is the slowest rank's. Medians are reported with their ratios, and the
ratios of the minima (less sensitive to other jobs on a shared machine). Grids are
the real post-patch grids (45 frames -> 12 latent frames); only the hidden size is scaled down (float32, D = 128 by
default instead of bf16 D = 2560: 512 instead of 5120 bytes a row), so that 8 ranks fit on 2 cores.

The counts (rows moved, bytes, largest per-rank send / receive, peers per rank) are read off the count matrices and
do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import winsp  # noqa: E402
from winsp.comm.redistribute import Transition, redistribute_rows  # noqa: E402
from winsp.planning.schedule import plan_schedule  # noqa: E402

NUM_WINDOWS = (4, 3, 3)  # SeedVR2 3B
SHAPES = {  # post-patch (T, H, W) grids of 45-frame clips
    "480p x45": (12, 30, 53),
    "720p x45": (12, 45, 80),
    "1080p x45": (12, 68, 120),
}
PLANNERS = ("lpt", "locality")


@dataclass(frozen=True)
class TransitionCounts:
    """Machine-independent figures of one transition, from its count matrix."""

    tokens: int
    rows_moved: int
    max_send_rows: int  # largest off-rank send of one rank
    max_recv_rows: int
    mean_peers: float  # ranks each rank sends to, on average
    max_peers: int
    max_local_rows: int  # the largest rank's rows (the two local gathers of a transition touch them)

    @property
    def max_transfer_rows(self) -> int:
        """The largest per-rank send or receive: what sets an all-to-all's time."""
        return max(self.max_send_rows, self.max_recv_rows)

    @classmethod
    def of(cls, transition: Transition) -> "TransitionCounts":
        c = transition.count_matrix.copy()
        np.fill_diagonal(c, 0)
        peers = (c > 0).sum(axis=1)
        return cls(int(transition.src.layout.num_tokens), int(c.sum()), int(c.sum(axis=1).max()),
                   int(c.sum(axis=0).max()), float(peers.mean()), int(peers.max()),
                   int(max(transition.src.rank_token_counts)))


def transition_counts(grid, world_size: int, planner: str) -> TransitionCounts:
    geoms = [winsp.make_geometry("regular", NUM_WINDOWS), winsp.make_geometry("shifted", NUM_WINDOWS)]
    reg, shift = plan_schedule([grid], geoms, world_size, planner)
    return TransitionCounts.of(Transition(reg, shift))


def _rank_main(rank: int, world_size: int, shapes: dict, hidden: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.manual_seed(rank)
    group = winsp.comm.SPGroup(dist.group.WORLD)
    geoms = [winsp.make_geometry("regular", NUM_WINDOWS), winsp.make_geometry("shifted", NUM_WINDOWS)]
    out = {}
    for name, grid in shapes.items():
        ops = {}
        for planner in PLANNERS:
            reg, shift = plan_schedule([grid], geoms, world_size, planner)
            step = Transition(reg, shift).for_rank(rank).to("cpu")  # index build outside the timing
            x = torch.randn(reg.rank_token_counts[rank], hidden)
            ops[planner] = (lambda x=x, step=step: redistribute_rows(x, step, group))
        n_local = -(-reg.layout.num_tokens // world_size)
        heads = torch.randn(world_size, n_local, max(1, hidden // world_size))  # head-sharded q (or k, v, out)

        def ulysses(h=heads):
            for _ in range(4):
                dist.all_to_all_single(torch.empty_like(h), h)

        ops["ulysses"] = ulysses
        times = {k: [] for k in ops}
        for i in range(repeats + 1):
            order = list(ops)[i % len(ops):] + list(ops)[:i % len(ops)]
            for k in order:
                dist.barrier()
                t0 = time.perf_counter()
                ops[k]()
                dist.barrier()
                if i:  # the first round warms up
                    times[k].append(time.perf_counter() - t0)
        out[name] = {k: (statistics.median(v), min(v)) for k, v in times.items()}
    return out


def measure(world_sizes=(2, 4, 8), shapes: dict = SHAPES, hidden: int = 128, repeats: int = 15) -> list[dict]:
    from winsp.testing import run_ranks

    rows = []
    for p in world_sizes:
        per_rank = run_ranks(_rank_main, p, shapes, hidden, repeats, timeout=1800.0)
        for name, grid in shapes.items():
            t = per_rank[0][name]
            rows.append({"shape": name, "grid": grid, "P": p, "hidden": hidden,
                         **{f"t_{k}": v[0] for k, v in t.items()}, **{f"min_{k}": v[1] for k, v in t.items()},
                         **{f"c_{pl}": transition_counts(grid, p, pl) for pl in PLANNERS}})
    return rows


def markdown(rows: list[dict], hidden: int) -> str:
    lines = [
        "| shape | P | LPT transition | locality transition | Ulysses layer (4 a2a) | locality / LPT "
        "| LPT / Ulysses | locality / Ulysses | loc / LPT (min) | LPT / Uly (min) | loc / Uly (min) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['P']} | {r['t_lpt'] * 1e3:.2f} ms | {r['t_locality'] * 1e3:.2f} ms "
            f"| {r['t_ulysses'] * 1e3:.2f} ms | {r['t_locality'] / r['t_lpt']:.2f} "
            f"| {r['t_lpt'] / r['t_ulysses']:.2f} | {r['t_locality'] / r['t_ulysses']:.2f} "
            f"| {r['min_locality'] / r['min_lpt']:.2f} | {r['min_lpt'] / r['min_ulysses']:.2f} "
            f"| {r['min_locality'] / r['min_ulysses']:.2f} |")
    lines += [
        "",
        "| shape | P | planner | rows moved / N | MiB moved (bf16, D = 2560) | max send rows | max recv rows "
        "| peers per rank (mean / max) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for pl in PLANNERS:
            c: TransitionCounts = r[f"c_{pl}"]
            lines.append(
                f"| {r['shape']} | {r['P']} | {pl} | {c.rows_moved / c.tokens:.3f} "
                f"| {c.rows_moved * 2560 * 2 / 2**20:,.1f} | {c.max_send_rows:,} | {c.max_recv_rows:,} "
                f"| {c.mean_peers:.2f} / {c.max_peers} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, help="also write the figures here (input of cost_model.py --fit-gloo)")
    args = ap.parse_args(argv)
    rows = measure(tuple(args.world_sizes), SHAPES, args.hidden, args.repeats)
    print(markdown(rows, args.hidden))
    if args.json:
        args.json.write_text(json.dumps([to_json(r) for r in rows], indent=1))


def to_json(row: dict) -> dict:
    return {"shape": row["shape"], "grid": list(row["grid"]), "P": row["P"], "hidden": row["hidden"],
            "tokens": row["c_lpt"].tokens,
            "times": {k: row[f"t_{k}"] for k in (*PLANNERS, "ulysses")},
            "min_times": {k: row[f"min_{k}"] for k in (*PLANNERS, "ulysses")},
            "counts": {pl: {**asdict(row[f"c_{pl}"]), "max_transfer_rows": row[f"c_{pl}"].max_transfer_rows}
                       for pl in PLANNERS}}


if __name__ == "__main__":
    main()
