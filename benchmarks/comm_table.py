"""Communication and balance tables for window-aligned SP on SeedVR2 3B's windows, from the real plans.

Run from the repository root: ``python -m benchmarks.comm_table`` or ``python benchmarks/comm_table.py``
(``--planners lpt locality``, both by default).

Table 1 compares, per layout transition, the rows and bytes Plan A really moves (the off-diagonal sum of the
transition's count matrix) with what Ulysses moves per attention layer: four all-to-alls (q, k, v in, output back)
of an [N, D] activation, each sending (P - 1) / P of it off-rank, i.e. 4 * N * D * (P - 1) / P elements.
Both figures are totals over all ranks, in bf16 (2 bytes) with the 3B hidden size D = 2560.

Table 2 is the balance of each layout under each planner: the largest rank's tokens over the ideal lower bound
max(largest window, ceil(N / P)).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import winsp  # noqa: E402
from winsp.comm.redistribute import Transition  # noqa: E402

NUM_WINDOWS = (4, 3, 3)  # SeedVR2 3B's window counts (regular and shifted layers alternate)
HIDDEN = 2560  # SeedVR2 3B hidden size
BYTES_PER_ELEMENT = 2  # bf16
DEGREES = (2, 4, 8)
# post-patch (T, H, W) token grids: 45 or 121 frames -> 12 or 31 latent frames, 8x spatial VAE x 2x2 patches
SHAPES = {
    "720p x45": (12, 45, 80),
    "1080p x45": (12, 68, 120),
    "1440p x45": (12, 90, 160),
    "4K x121": (31, 135, 240),
}


@dataclass(frozen=True)
class CommRow:
    shape: str
    grid: tuple[int, int, int]
    world_size: int
    planner: str
    direction: str
    tokens: int
    rows_moved: int
    window_bytes: int
    ulysses_bytes: float

    @property
    def ratio(self) -> float:
        return self.window_bytes / self.ulysses_bytes


@dataclass(frozen=True)
class BalanceRow:
    shape: str
    grid: tuple[int, int, int]
    world_size: int
    planner: str
    layout: str
    windows: int
    max_rank_tokens: int
    ideal_lower_bound: int

    @property
    def imbalance(self) -> float:
        return self.max_rank_tokens / self.ideal_lower_bound


def ulysses_bytes(tokens: int, world_size: int, hidden: int = HIDDEN) -> float:
    """Bytes Ulysses moves off-rank per attention layer (all ranks together): 4 * N * D * (P - 1) / P elements."""
    return 4 * tokens * hidden * (world_size - 1) / world_size * BYTES_PER_ELEMENT


def collect(shapes: dict = SHAPES, degrees=DEGREES, hidden: int = HIDDEN,
            planners=("lpt",)) -> tuple[list[CommRow], list[BalanceRow]]:
    """Plan every shape at every degree under both layouts; read the moved rows and the balance off the plans."""
    schedule = [winsp.make_geometry("regular", NUM_WINDOWS), winsp.make_geometry("shifted", NUM_WINDOWS)]
    comm: list[CommRow] = []
    balance: list[BalanceRow] = []
    for name, grid in shapes.items():
        for p in degrees:
            for planner in planners:
                plans = dict(zip(("regular", "shifted"), winsp.planning.plan_schedule([grid], schedule, p, planner)))
                tokens = plans["regular"].layout.num_tokens
                for src, dst in (("regular", "shifted"), ("shifted", "regular")):
                    moved = Transition(plans[src], plans[dst]).rows_moved
                    comm.append(CommRow(name, grid, p, planner, f"{src} -> {dst}", tokens, moved,
                                        moved * hidden * BYTES_PER_ELEMENT, ulysses_bytes(tokens, p, hidden)))
                for layout, plan in plans.items():
                    balance.append(BalanceRow(name, grid, p, planner, layout, plan.layout.num_windows,
                                              max(plan.rank_token_counts), plan.ideal_lower_bound))
    return comm, balance


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def comm_markdown(rows: list[CommRow]) -> str:
    lines = [
        "| shape | grid (T,H,W) | P | planner | transition | tokens N | rows moved | moved / N | window SP MiB "
        "| Ulysses MiB / layer | ratio |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.shape} | {r.grid} | {r.world_size} | {r.planner} | {r.direction} | {r.tokens:,} | {r.rows_moved:,} "
            f"| {r.rows_moved / r.tokens:.3f} | {_mib(r.window_bytes)} | {_mib(r.ulysses_bytes)} | {r.ratio:.3f} |"
        )
    return "\n".join(lines)


def balance_markdown(rows: list[BalanceRow]) -> str:
    lines = [
        "| shape | grid (T,H,W) | P | planner | layout | windows | max rank tokens | ideal lower bound | imbalance |",
        "|---|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.shape} | {r.grid} | {r.world_size} | {r.planner} | {r.layout} | {r.windows} | {r.max_rank_tokens:,} "
            f"| {r.ideal_lower_bound:,} | {r.imbalance:.4f} |"
        )
    return "\n".join(lines)


def tables_markdown(shapes: dict = SHAPES, degrees=DEGREES, hidden: int = HIDDEN, planners=("lpt",)) -> str:
    """Both tables as one markdown text (what the script prints)."""
    comm, balance = collect(shapes, degrees, hidden, planners)
    return "\n".join([
        f"### Bytes moved per layout transition (bf16, D = {hidden}, windows {NUM_WINDOWS})",
        "",
        "window SP: rows that change rank in one transition x D x 2 bytes (all ranks); "
        "Ulysses: 4 x N x D x (P-1)/P x 2 bytes per attention layer.",
        "",
        comm_markdown(comm),
        "",
        f"### Balance ({', '.join(planners)}; max rank tokens / max(largest window, ceil(N / P)))",
        "",
        balance_markdown(balance),
    ])


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="rows moved per transition and balance, per planner")
    ap.add_argument("--planners", nargs="+", default=list(winsp.planning.PLANNERS), choices=list(winsp.planning.PLANNERS))
    print(tables_markdown(planners=tuple(ap.parse_args(argv).planners)))


if __name__ == "__main__":
    main()
