"""Two designs for one window split across g ranks, timed on gloo: head-parallel (winsp) against query-parallel.

Run from the repository root: ``OMP_NUM_THREADS=1 python benchmarks/bench_split_exchange.py`` (about a minute).
One window of ``W`` video rows plus 58 text rows, 20 heads x 128 (SeedVR2 3B), float32, its rows split evenly over
``g`` ranks (one thread each). Per call, interleaved, median of the repeats, the slowest rank:

* head-parallel (:func:`winsp.attention.split.split_attention`): an all-to-all of q, k, v (each rank's rows for the
  others' heads), whole-window attention for ``20 / g`` heads, an all-to-all of the output back;
* query-parallel: an all-gather of k, v (each rank's rows to every other), attention of the rank's own query rows
  (and, on the first rank, the text queries) against all keys, every head.

Also printed: the bytes each rank receives per call in each design.
"""

from __future__ import annotations

import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import winsp  # noqa: E402
from winsp.attention.split import SplitAttention, split_attention  # noqa: E402
from winsp.geometry.layout import build_layout  # noqa: E402
from winsp.testing import run_ranks  # noqa: E402

HEADS, HEAD_DIM, TEXT = 20, 128, 58


def _query_parallel(q, k, v, qt, kt, vt, sizes, group, first: bool):
    kv = group.all_gather_rows(torch.stack([k, v], dim=1), sizes)  # [W, 2, H, d]
    keys = torch.cat([kv[:, 0], kt]).transpose(0, 1)
    values = torch.cat([kv[:, 1], vt]).transpose(0, 1)
    queries = torch.cat([q, qt]) if first else q
    return F.scaled_dot_product_attention(queries.transpose(0, 1), keys, values).transpose(0, 1)


def _rank(rank: int, world: int, rows: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    group = winsp.comm.SPGroup.world()
    lay = build_layout([(1, 1, rows)], winsp.FixedWindows((1, 1, rows)))
    cuts = [rows * r // world for r in range(world + 1)]
    plan = winsp.planning.Plan(lay, world, rank_pieces=[[(0, a, b)] for a, b in pairwise(cuts)])
    split = SplitAttention.build(plan, rank, HEADS, (TEXT,)).to("cpu")
    mine = cuts[rank + 1] - cuts[rank]
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(mine, HEADS, HEAD_DIM, generator=g) for _ in range(3))
    qt, kt, vt = (torch.randn(TEXT, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9)) for _ in range(3))
    sizes = [b - a for a, b in pairwise(cuts)]
    times = {"head": [], "query": []}
    with torch.inference_mode():
        for i in range(repeats + 1):
            for name in ("head", "query"):
                group.all_reduce_sum_(torch.zeros(1))  # start together
                start = time.perf_counter()
                if name == "head":
                    split_attention(q, k, v, qt, kt, vt, split, group, HEAD_DIM ** -0.5)
                else:
                    _query_parallel(q, k, v, qt, kt, vt, sizes, group, rank == 0)
                if i:
                    times[name].append(time.perf_counter() - start)
    bytes_head = 4 * (sum(split.in_recv_sizes) + sum(split.out_recv_sizes)) * HEAD_DIM - 4 * (
        split.in_recv_sizes[rank] + split.out_recv_sizes[rank]) * HEAD_DIM
    bytes_query = 4 * 2 * (rows - mine) * HEADS * HEAD_DIM
    return {"times": times, "bytes": {"head": bytes_head, "query": bytes_query}}


def main() -> None:
    print("| window rows | g | head-parallel | query-parallel | query / head | MB received per rank: head, query |")
    print("|---:|---:|---:|---:|---:|---|")
    for rows in (384, 1536):
        for world in (2, 4):
            res = run_ranks(_rank, world, rows, 7, timeout=600)
            med = {n: statistics.median(max(r["times"][n][i] for r in res) for i in range(7)) for n in ("head", "query")}
            mb = {n: max(r["bytes"][n] for r in res) / 1e6 for n in ("head", "query")}
            print(f"| {rows} | {world} | {med['head'] * 1e3:.1f} ms | {med['query'] * 1e3:.1f} ms "
                  f"| {med['query'] / med['head']:.2f} | {mb['head']:.1f}, {mb['query']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
