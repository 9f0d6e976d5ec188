"""Which SP plan wins where: an alpha-beta communication model plus a per-layer compute model of SeedVR2 3B and 7B.

Run from the repository root: ``python benchmarks/cost_model.py`` (prints the crossover tables of
``benchmarks/README.md``), ``--fit-gloo FILE`` to refit the communication constants on the JSON that
``benchmarks/bench_transition.py --json FILE`` writes, ``--detail`` for per-layer figures, ``--fit-wall FILE`` to refit
the planner's own constants (:mod:`winsp.planning.costs`: a row, a pair, a row moved, a collective) on the forward wall
times that ``benchmarks/bench_split.py --json FILE`` measures for every planner.

What is modelled, per layer, with nothing overlapped (communication and compute add up):

- **Ulysses** (head-sharded attention): every rank holds N / P rows of the linears; the 4 all-to-alls of q, k, v and
  the output each send (P - 1) / P of a ``[N / P, D]`` bf16 tensor off-rank, plus a local copy in and out. Heads must
  be shared out: with H % P != 0 a rank computes ceil(H / P) heads (padding), and P > H is impossible.
- **window SP** (``planner="lpt"`` or ``"locality"``): every rank keeps all heads and computes its own windows; its
  time is the slowest rank's linears (its tokens) plus attention (sum over its windows of (n + text)^2). Between
  layers with different layouts (31 of the 32 3B layers, 35 of the 36 7B layers) one all-to-all whose time is set by
  the largest per-rank send or receive of the real count matrix, plus two local row gathers. Each layer also
  all-reduces the replicated text outputs (58 rows, float32).

The placement figures (rank tokens, per-rank attention, per-rank send/receive) come from winsp's real plans, computed
here for every grid and degree (overlap edges give the count matrix without building 1M-token index arrays).

Constants: GPU figures are **published** numbers, not measured here (no GPU was lent to this session): H100/H200 SXM
dense bf16 peak 989 TFLOP/s, HBM 3.35 / 4.8 TB/s, NVLink 4 450 GB/s per direction per GPU, 400 Gb/s (50 GB/s)
InfiniBand NDR per GPU across nodes, NCCL collective latencies of tens of microseconds. The GEMM and attention
efficiencies and the elementwise share (45 % GEMMs / 53 % elementwise in published eager SeedVR2 profiles) are also
published-figure assumptions. The gloo fit (:func:`fit_gloo`) is **measured** on this project's 2-core CPU: it checks
that the model's form (a fixed cost + local gathers + the largest per-rank transfer) explains the measured CPU
transition and Ulysses times; its constants describe gloo on loopback, not a GPU network.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import winsp  # noqa: E402
from winsp.geometry.layout import build_layout  # noqa: E402
from winsp.planning.costs import (  # noqa: E402
    ATTENTION_EFFICIENCY,
    ELEMENTWISE_PER_GEMM,
    GEMM_EFFICIENCY,
    NVLINK_BYTES_PER_S,
    NVLINK_LATENCY_S,
    PEAK_BF16_FLOPS,
)
from winsp.planning.locality import locality_placement, overlap_edges  # noqa: E402

BF16 = 2
NUM_WINDOWS = (4, 3, 3)  # both SeedVR2 models


# ---- the models ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """The per-layer shape of a SeedVR2 DiT (configs_3b / configs_7b main.yaml of the reference)."""

    name: str
    dim: int
    heads: int
    head_dim: int
    layers: int
    mlp: str  # "swiglu" (3B) or "gelu" (7B)
    expand: int = 4
    text_tokens: int = 58  # the shipped positive prompt embedding

    @property
    def mlp_hidden(self) -> int:
        if self.mlp == "swiglu":  # 2/3 of the expanded width, rounded up to a multiple of 256
            return 256 * math.ceil(int(2 * self.dim * self.expand / 3) / 256)
        return self.dim * self.expand

    @property
    def linear_flops_per_token(self) -> float:
        """q, k, v, output projections and the MLP (multiply-adds x 2) of one video row in one layer."""
        inner = self.heads * self.head_dim
        mats = 3 if self.mlp == "swiglu" else 2
        return 2.0 * (3 * self.dim * inner + inner * self.dim + mats * self.dim * self.mlp_hidden)

    def attention_flops(self, window_tokens: np.ndarray) -> float:
        """QK^T and AV over windows of these sizes, each with the prompt appended."""
        n = window_tokens.astype(np.float64) + self.text_tokens
        return float(4.0 * (n * n).sum() * self.heads * self.head_dim)


SEEDVR2_3B = ModelSpec("SeedVR2 3B", dim=2560, heads=20, head_dim=128, layers=32, mlp="swiglu")
SEEDVR2_7B = ModelSpec("SeedVR2 7B", dim=3072, heads=24, head_dim=128, layers=36, mlp="gelu")


@dataclass(frozen=True)
class Device:
    """Compute side of one GPU (published figures and assumed efficiencies)."""

    name: str = "H100/H200 SXM"
    peak_flops: float = PEAK_BF16_FLOPS  # dense bf16, published (winsp.planning.costs: the default planner weighs the same)
    hbm_bytes_per_s: float = 4.8e12  # H200 (H100: 3.35e12), published
    gemm_efficiency: float = GEMM_EFFICIENCY  # assumed: large bf16 GEMMs reach 60 % of peak
    attention_efficiency: float = ATTENTION_EFFICIENCY  # assumed: FlashAttention-class kernels on ~1-4K-token windows
    elementwise_per_gemm: float = ELEMENTWISE_PER_GEMM  # published eager SeedVR2 profile: 53 % elementwise vs 45 % GEMMs

    def layer_compute(self, model: ModelSpec, rows: float, attention_flops: float) -> float:
        gemm = rows * model.linear_flops_per_token / (self.peak_flops * self.gemm_efficiency)
        return gemm * (1 + self.elementwise_per_gemm) + attention_flops / (self.peak_flops * self.attention_efficiency)

    def copy(self, nbytes: float) -> float:
        """A gather / permute of ``nbytes``: read and write once."""
        return 2 * nbytes / self.hbm_bytes_per_s


@dataclass(frozen=True)
class Network:
    """Alpha-beta model of one all-to-all: ``latency + largest per-rank transfer / bandwidth``."""

    name: str
    bytes_per_s: float  # per GPU, one direction
    latency: float  # seconds per collective

    def all_to_all(self, max_rank_bytes: float) -> float:
        return self.latency + max_rank_bytes / self.bytes_per_s

    def all_reduce(self, nbytes: float, p: int) -> float:
        return self.latency + 2 * (p - 1) / p * nbytes / self.bytes_per_s if p > 1 else 0.0


NVLINK_NODE = Network("one 8-GPU NVLink node", bytes_per_s=NVLINK_BYTES_PER_S, latency=NVLINK_LATENCY_S)
MULTI_NODE = Network("nodes, 50 GB/s per GPU", bytes_per_s=50e9, latency=40e-6)
H200 = Device()


# ---- what the plans say -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlacementStats:
    """Per-layout figures of one plan pair (regular, shifted) that the cost model needs."""

    max_rank_rows: tuple[int, int]  # per layout, the slowest rank's tokens ...
    max_rank_attention: tuple[float, float]  # ... and its attention sum of (n + text)^2 (in units of tokens^2)
    max_transfer_rows: tuple[int, int]  # largest per-rank send or receive, regular -> shifted and back
    rows_moved: int
    local_rows: int  # the largest rank's rows (the local gathers of a transition touch them)


@lru_cache(maxsize=None)
def placement_stats(grid: tuple[int, int, int], p: int, planner: str, text_tokens: int = 58) -> PlacementStats:
    layouts = [build_layout([grid], winsp.make_geometry(m, NUM_WINDOWS)) for m in ("regular", "shifted")]
    placed = locality_placement(layouts, {(0, 1): 1}, p) if planner == "locality" else [None, None]
    owners = [winsp.planning.Plan(lay, p, rank_windows=rw).window_owner for lay, rw in zip(layouts, placed)]
    rows, attn = [], []
    for lay, own in zip(layouts, owners):
        rows.append(np.bincount(own, weights=lay.token_counts, minlength=p))
        n = lay.token_counts.astype(np.float64) + text_tokens
        attn.append(np.bincount(own, weights=n * n, minlength=p))
    ea, eb, ew = overlap_edges(*layouts)
    count = np.zeros((p, p), dtype=np.int64)
    np.add.at(count, (owners[0][ea], owners[1][eb]), ew)
    off = count - np.diag(np.diag(count))
    fwd = int(max(off.sum(axis=1).max(), off.sum(axis=0).max()))
    return PlacementStats(
        max_rank_rows=tuple(int(r.max()) for r in rows),
        max_rank_attention=tuple(float(a.max()) for a in attn),
        max_transfer_rows=(fwd, fwd),  # the way back moves the transposed matrix: same largest send/receive
        rows_moved=int(off.sum()),
        local_rows=int(max(r.max() for r in rows)),
    )


# ---- per-layer and per-forward time ------------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    scheme: str
    compute: float  # per layer (mean over the layouts), seconds
    comm: float  # per layer (transitions spread over the layers), seconds

    @property
    def layer(self) -> float:
        return self.compute + self.comm

    def forward(self, model: ModelSpec) -> float:
        return self.layer * model.layers


def predict_ulysses(model: ModelSpec, grid, p: int, net: Network, dev: Device = H200) -> Prediction | None:
    """Head-sharded attention; None when P exceeds the head count."""
    if p > model.heads:
        return None
    n = math.prod(grid)
    layouts = [build_layout([grid], winsp.make_geometry(m, NUM_WINDOWS)) for m in ("regular", "shifted")]
    head_share = math.ceil(model.heads / p) / model.heads  # padded heads when H % P != 0
    attn = np.mean([model.attention_flops(lay.token_counts) for lay in layouts]) * head_share
    compute = dev.layer_compute(model, n / p, 0.0) + attn / (dev.peak_flops * dev.attention_efficiency)
    if p == 1:
        return Prediction("Ulysses", compute, 0.0)
    shard = (n / p + model.text_tokens) * model.dim * BF16
    comm = 4 * (net.all_to_all(shard * (p - 1) / p) + 2 * dev.copy(shard))
    return Prediction("Ulysses", compute, comm)


def predict_window_sp(model: ModelSpec, grid, p: int, planner: str, net: Network, dev: Device = H200) -> Prediction:
    s = placement_stats(tuple(grid), p, planner, model.text_tokens)
    unit = 4.0 * model.heads * model.head_dim  # attention FLOPs per (n + text)^2
    compute = float(np.mean([dev.layer_compute(model, rows, attn * unit)
                             for rows, attn in zip(s.max_rank_rows, s.max_rank_attention)]))
    if p == 1:
        return Prediction(planner, compute, 0.0)
    transitions_per_layer = (model.layers - 1) / model.layers
    row_bytes = model.dim * BF16
    transition = net.all_to_all(s.max_transfer_rows[0] * row_bytes) + 2 * dev.copy(s.local_rows * row_bytes)
    text = net.all_reduce(model.text_tokens * model.dim * 4, p)
    return Prediction(planner, compute, transitions_per_layer * transition + text)


def predictions(model: ModelSpec, grid, p: int, net: Network, dev: Device = H200) -> dict[str, Prediction]:
    out = {"Ulysses": predict_ulysses(model, grid, p, net, dev),
           "LPT": predict_window_sp(model, grid, p, "lpt", net, dev),
           "locality": predict_window_sp(model, grid, p, "locality", net, dev)}
    return {k: v for k, v in out.items() if v is not None}


# ---- settings and the crossover table ----------------------------------------------------------------------

RESOLUTIONS = {"480p": (30, 53), "720p": (45, 80), "1080p": (68, 120), "1440p": (90, 160), "4K": (135, 240)}
FRAMES = {1: 1, 21: 6, 45: 12, 121: 31}  # video frames -> latent frames (4x temporal VAE)
DEGREES = {NVLINK_NODE.name: (2, 4, 8), MULTI_NODE.name: (16, 32, 64)}


def crossover_rows(model: ModelSpec, net: Network, degrees, resolutions=RESOLUTIONS, frames=FRAMES):
    rows = []
    for res, (h, w) in resolutions.items():
        for f, t in frames.items():
            grid = (t, h, w)
            for p in degrees:
                preds = predictions(model, grid, p, net)
                ranked = sorted(preds.items(), key=lambda kv: kv[1].forward(model))
                rows.append(dict(res=res, frames=f, grid=grid, p=p, preds=preds, winner=ranked[0][0],
                                 margin=ranked[1][1].forward(model) / ranked[0][1].forward(model) - 1))
    return rows


_SHORT = {"Ulysses": "Uly", "LPT": "LPT", "locality": "loc"}


def _cell(row: dict, model: ModelSpec) -> str:
    """The winner, then how much slower each other scheme's forward is (``=`` within 0.5 %)."""
    preds = row["preds"]
    best = preds[row["winner"]].forward(model)
    others = []
    for name in ("Ulysses", "LPT", "locality"):
        if name == row["winner"]:
            continue
        if name not in preds:
            others.append(f"{_SHORT[name]} n/a")
            continue
        extra = preds[name].forward(model) / best - 1
        others.append(f"{_SHORT[name]} " + ("=" if extra < 0.005 else f"+{extra * 100:.0f}%"))
    return f"**{_SHORT[row['winner']]}** {best * 1e3:,.0f} ms; " + ", ".join(others)


def crossover_markdown(model: ModelSpec, net: Network, degrees) -> str:
    """One row per (resolution, frames), one column per degree: the fastest scheme, its forward, the others' excess."""
    rows = crossover_rows(model, net, degrees)
    head = "| resolution | frames | " + " | ".join(f"P = {p}" for p in degrees) + " |"
    lines = [head, "|---|---:|" + "---|" * len(degrees)]
    by = {(r["res"], r["frames"], r["p"]): r for r in rows}
    for res in RESOLUTIONS:
        for f in FRAMES:
            cells = [_cell(by[(res, f, p)], model) for p in degrees]
            lines.append(f"| {res} | {f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(models=None, nets=None) -> str:
    """How often each scheme wins per (model, network), and the median margin of locality over LPT."""
    models = models or (SEEDVR2_3B, SEEDVR2_7B)
    nets = nets or (NVLINK_NODE, MULTI_NODE)
    lines = ["| model | network | P | settings | Ulysses wins | LPT wins | locality wins | LPT and locality within 0.5 % "
             "| locality vs LPT forward (median, best, worst) |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for model in models:
        for net in nets:
            rows = crossover_rows(model, net, DEGREES[net.name])
            wins = {k: sum(r["winner"] == k for r in rows) for k in ("Ulysses", "LPT", "locality")}
            gain = np.array([r["preds"]["locality"].forward(model) / r["preds"]["LPT"].forward(model) - 1
                             for r in rows]) * 100
            close = sum(abs(g) < 0.5 for g, r in zip(gain, rows) if r["winner"] != "Ulysses")
            lines.append(f"| {model.name} | {net.name} | {', '.join(map(str, DEGREES[net.name]))} | {len(rows)} "
                         f"| {wins['Ulysses']} | {wins['LPT']} | {wins['locality']} | {close} "
                         f"| {np.median(gain):+.1f}%, {gain.min():+.1f}%, {gain.max():+.1f}% |")
    return "\n".join(lines)


def detail_markdown(model: ModelSpec, net: Network, grid, degrees) -> str:
    lines = ["| P | scheme | compute / layer | comm / layer | layer | forward | comm share |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for p in degrees:
        for name, pr in predictions(model, grid, p, net).items():
            lines.append(f"| {p} | {name} | {pr.compute * 1e3:.2f} ms | {pr.comm * 1e3:.2f} ms | {pr.layer * 1e3:.2f} ms "
                         f"| {pr.forward(model) * 1e3:,.0f} ms | {pr.comm / pr.layer * 100:.1f}% |")
    return "\n".join(lines)


# ---- calibration on the gloo measurements ------------------------------------------------------------------

def fit_gloo(measured: list[dict], key: str = "min_times") -> dict:
    """Least-squares fit of ``t = c + k_copy * local_bytes + max_rank_bytes / B`` on bench_transition's JSON.

    Each measured row gives three points: the LPT and locality transitions (one all-to-all of the largest per-rank
    send or receive, two gathers of the local rows) and the Ulysses layer (four all-to-alls of (P-1)/P of a
    ``[N/P, D]`` shard, each with its copies). ``key`` picks the minima (default, least disturbed by other jobs) or
    the medians (``"times"``). Returns the constants and the model / measured ratio of each point.
    """
    xs, ys, labels = [], [], []
    for r in measured:
        d, p, n = r["hidden"], r["P"], r["tokens"]
        row = d * 4  # float32 on gloo
        for pl in ("lpt", "locality"):
            c = r["counts"][pl]
            xs.append([1.0, 2 * c["max_local_rows"] * row, c["max_transfer_rows"] * row])
            ys.append(r[key][pl])
            labels.append((r["shape"], p, pl))
        shard = math.ceil(n / p) * row
        xs.append([4.0, 4 * 2 * shard, 4 * shard * (p - 1) / p])
        ys.append(r[key]["ulysses"])
        labels.append((r["shape"], p, "ulysses"))
    x, y = np.asarray(xs), np.asarray(ys)
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)  # relative-error least squares
    pred = x @ coef
    return {"fixed_s": coef[0], "copy_s_per_byte": coef[1],
            "bandwidth_bytes_per_s": 1 / coef[2] if coef[2] > 0 else float("inf"),
            "points": [(lab, yy, pp) for lab, yy, pp in zip(labels, y, pred)]}


def fit_markdown(fit: dict) -> str:
    lines = [f"fitted on gloo: fixed {fit['fixed_s'] * 1e3:.2f} ms per collective, local copy "
             f"{1 / fit['copy_s_per_byte'] / 1e9 if fit['copy_s_per_byte'] > 0 else float('inf'):.2f} GB/s, "
             f"transfer {fit['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s", "",
             "| shape | P | exchange | measured | model | model / measured |", "|---|---:|---|---:|---:|---:|"]
    for (shape, p, what), y, pr in fit["points"]:
        lines.append(f"| {shape} | {p} | {what} | {y * 1e3:.2f} ms | {pr * 1e3:.2f} ms | {pr / y:.2f} |")
    return "\n".join(lines)


# ---- the planner's constants, refitted on measured wall time ------------------------------------------------

WALL_FEATURES = ("row_s", "pair_s", "moved_row_s", "latency_s", "fixed_s")


def wall_features(stats: list[dict], world_size: int) -> list[float]:
    """What one forward's wall time is made of under a plan, per :data:`WALL_FEATURES` (``bench_split``'s stats).

    Summed over layers: the slowest rank's rows and attention pairs, the rows' worth its in-window exchanges and the
    transition into the layer move, and the collectives (two per layer with split windows, one per transition that
    moves rows, the text all-reduce; one all-gather at the end); plus one fixed term per forward.
    """
    rows = sum(s["rows"] for s in stats)
    pairs = sum(s["pairs"] for s in stats)
    moved = sum(s["exchange_rows"] + s["transition_rows"] for s in stats)
    coll = 0
    if world_size > 1:
        coll = sum(2 * (s["split_windows"] > 0) + (s["transition_rows"] > 0) + 1 for s in stats) + 1
    return [float(rows), float(pairs), float(moved), float(coll), 1.0]


def fit_wall(records: list[dict], key: str = "min", measure: str = "wall") -> dict:
    """Non-negative relative-error least squares of measured forward wall times on :func:`wall_features`.

    ``records`` is the JSON ``benchmarks/bench_split.py --json`` writes (several clips make the row and pair terms
    separable). ``key``: ``"min"`` (default, least disturbed by other jobs) or ``"median"``; ``measure``: ``"wall"``
    (what users wait for) or ``"cpu"`` (the slower rank's CPU time: a loaded machine's fallback, blind to waits and
    latency). Returns the constants,
    a :class:`winsp.planning.costs.CostConstants` built from them (float32 rows of the measured width) and each point's
    model / measured ratio.
    """
    import statistics

    from winsp.planning.costs import CostConstants

    xs, ys, labels = [], [], []
    for r in records:
        for name, times in r[measure].items():
            p = 1 if name == "sp1" else 2
            xs.append(wall_features(r["stats"][name], p))
            ys.append(min(times) if key == "min" else statistics.median(times))
            labels.append(("x".join(map(str, r["clip"])), name))
    x, y = np.asarray(xs), np.asarray(ys)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:  # drop the most negative term and refit until every constant is >= 0
        sol, *_ = np.linalg.lstsq(x[:, active] / y[:, None], np.ones_like(y), rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    width = 2560
    fitted = dict(zip(WALL_FEATURES, coef.tolist()))
    costs = CostConstants(row_s=fitted["row_s"], pair_s=fitted["pair_s"], byte_s=fitted["moved_row_s"] / (4 * width),
                          latency_s=fitted["latency_s"], row_bytes=4 * width)
    return {"constants": fitted, "costs": costs, "measure": measure,
            "points": [(lab, yy, pp) for lab, yy, pp in zip(labels, y, x @ coef)]}


def fit_wall_markdown(fit: dict) -> str:
    c = fit["constants"]
    lines = [f"fitted on {fit['measure']} time: row {c['row_s'] * 1e6:.2f} us, pair {c['pair_s'] * 1e9:.3f} ns, row moved "
             f"{c['moved_row_s'] * 1e6:.2f} us, collective {c['latency_s'] * 1e3:.2f} ms, fixed {c['fixed_s']:.3f} s "
             f"per forward", "", "| clip | config | measured | model | model / measured |", "|---|---|---:|---:|---:|"]
    for (clip, name), y, pr in fit["points"]:
        lines.append(f"| {clip} | {name} | {y:.2f} s | {pr:.2f} s | {pr / y:.2f} |")
    return "\n".join(lines)


def vae_split_points(data: dict, measure: str = "wall") -> list[dict]:
    """The (clip, encode/decode, split, speed-up) points of a VAE split fit: the rows of
    ``benchmarks/vae_split_walls.json``, or of the JSON ``benchmarks/bench_vae.py --scaling --json`` writes
    (``measure``: ``wall`` speed-up, or ``busy_cpu``: blind to the wavefront's fill, which is waiting). Speed-ups are
    over one rank on one thread, each rank's budget: what a machine with a core (or GPU) per rank sees (the
    ``*_speedup_1thread`` figures where a file has both baselines)."""
    if "rows" in data:
        return [dict(r, speedup=r["wall_speedup"]) for r in data["rows"]]
    points = []
    for row in data.get("scaling", {}).values():
        if "splits" not in row:
            continue
        for what in ("encode", "decode"):
            key = f"{what}_busy_cpu_speedup"
            if measure == "wall":
                key = f"{what}_speedup_1thread" if f"{what}_speedup_1thread" in row else f"{what}_speedup"
            points.append({"clip": row["clip"], "what": what, "split": row["splits"][what], "speedup": row[key],
                           "world": row.get("world", 2)})
    return points


def fit_vae_split(points: list[dict]) -> dict:
    """Non-negative relative-error least squares of the wavefront's split model
    (:func:`examples.seedvr2.models.vae.wavefront.split_cost`): measured time over one rank's (1 / speed-up) minus the ideal
    share s (busiest time rank's frames x largest band of r rows) = ``height_comm`` x (H - 1) + ``height_halo`` x s x
    edges / r^2 + ``time_comm`` x (T - 1). Points with more ranks than the machine has cores are left out."""
    from examples.seedvr2.models.vae.wavefront import VAESplit, clip_chunk_frames, split_cost

    rows_x, rows_y, labels = [], [], []
    for p in points:
        if p.get("world", 2) > (os.cpu_count() or 2):
            continue
        frames, height, _ = p["clip"]
        split = VAESplit(*p["split"])
        chunks = clip_chunk_frames(frames)[p["what"] == "decode"]
        cost = partial(split_cost, split, chunks, height // 8, height_comm=0.0, height_halo=0.0, time_comm=0.0)
        ideal = cost()
        measured = 1.0 / p["speedup"]
        # each constant's term, from the model itself: its cost with that constant at 1 less the ideal share
        rows_x.append([cost(height_comm=1.0) - ideal, cost(height_halo=1.0) - ideal, cost(time_comm=1.0) - ideal])
        rows_y.append((measured, ideal))
        labels.append((f"{frames}x{height}x{p['clip'][2]}", p["what"], f"{split.time}x{split.height}"))
    x = np.asarray(rows_x, dtype=float)
    measured = np.asarray([m for m, _ in rows_y])
    ideal = np.asarray([i for _, i in rows_y])
    active, coef = [0, 1, 2], np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] / measured[:, None], (measured - ideal) / measured, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    model = ideal + x @ coef
    return {"height_comm": float(coef[0]), "height_halo": float(coef[1]), "time_comm": float(coef[2]),
            "points": [(lab, 1 / m, 1 / pr) for lab, m, pr in zip(labels, measured, model, strict=True)]}


def fit_vae_split_markdown(fit: dict) -> str:
    lines = [f"fitted: height_comm {fit['height_comm']:.4f}, height_halo {fit['height_halo']:.4f}, time_comm "
             f"{fit['time_comm']:.4f} (of one rank's run: per extra height rank; per band edge over the band's rows "
             f"squared, times its share; per extra time rank)", "",
             "| clip | pass | split T x H | measured speed-up | model |", "|---|---|---|---:|---:|"]
    for (clip, what, split), measured, model in fit["points"]:
        lines.append(f"| {clip} | {what} | {split} | {measured:.2f}x | {model:.2f}x |")
    return "\n".join(lines)


def restore_prediction(degrees=(2, 4, 8), vae_shares=(0.3, 0.5, 0.7), grid=(6, 45, 80), frames: int = 21,
                       latent_rows: int = 90) -> list[dict]:
    """Whole-restore speed-up on one NVLink node: the DiT's best window-SP plan from this model (3B, ``grid``) and the
    VAE wavefront's fitted split model (:func:`examples.seedvr2.models.vae.wavefront.split_cost`, constants fitted on gloo
    CPU runs) combined for a VAE share ``v`` of the one-GPU time: ``1 / ((1 - v) / s_DiT + v / s_VAE)``. The input
    decoding and output encoding run on background threads and are left out. The VAE share on a GPU was not measured
    here, hence several."""
    from examples.seedvr2.models.vae.wavefront import choose_split, clip_chunk_frames, split_cost

    def dit(p: int) -> float:
        return min(pr.forward(SEEDVR2_3B) for pr in predictions(SEEDVR2_3B, grid, p, NVLINK_NODE).values()
                   if pr is not None)

    chunks = clip_chunk_frames(frames)[0]
    rows = []
    for p in degrees:
        split = choose_split(p, chunks, latent_rows)
        s_dit, s_vae = dit(1) / dit(p), 1.0 / split_cost(split, chunks, latent_rows)
        rows.append({"p": p, "dit": s_dit, "vae": s_vae, "split": f"{split.time}x{split.height}",
                     "whole": {v: 1.0 / ((1 - v) / s_dit + v / s_vae) for v in vae_shares}})
    return rows


def restore_prediction_markdown(rows: list[dict], reference=(1.24, 1.85, 2.03)) -> str:
    shares = list(rows[0]["whole"])
    lines = ["| GPUs | DiT (window SP) | VAE (split) | " + " | ".join(f"restore, VAE {v:.0%} of 1 GPU" for v in shares)
             + " | vLLM-Omni draft |", "|---:|---:|---:|" + "---:|" * len(shares) + "---:|"]
    for r, ref in zip(rows, reference, strict=False):
        lines.append(f"| {r['p']} | {r['dit']:.2f}x | {r['vae']:.2f}x ({r['split']}) | "
                     + " | ".join(f"{r['whole'][v]:.2f}x" for v in shares) + f" | {ref:.2f}x |")
    return "\n".join(lines)


def _read_json(ap: argparse.ArgumentParser, flag: str, path: Path):
    """The JSON in ``path``, or one error line naming ``flag`` and the file (exit code 2) when it is missing or no
    JSON."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        ap.exit(2, f"{ap.prog}: error: {flag}: file not found: {path}\n")
    except IsADirectoryError:
        ap.exit(2, f"{ap.prog}: error: {flag}: {path} is a folder, not a JSON file\n")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        ap.exit(2, f"{ap.prog}: error: {flag}: cannot read {path} as JSON ({type(error).__name__}: "
                   f"{' '.join(str(error).split())[:160]})\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit-gloo", type=Path, help="JSON written by benchmarks/bench_transition.py --json")
    ap.add_argument("--detail", action="store_true", help="per-layer figures at 4K x 121 frames")
    ap.add_argument("--fit-wall", type=Path, nargs="+", help="JSON files written by benchmarks/bench_split.py "
                    "--json: refit the planner's cost constants (winsp.planning.costs) on measured wall time")
    ap.add_argument("--fit-on", choices=("wall", "cpu"), default="wall",
                    help="with --fit-wall: fit wall time (default) or the slower rank's CPU time (a loaded machine)")
    ap.add_argument("--fit-vae", type=Path, nargs="+", help="benchmarks/vae_split_walls.json, or JSON files written "
                    "by benchmarks/bench_vae.py --scaling --json: refit the VAE wavefront's split constants")
    ap.add_argument("--predict-restore", action="store_true",
                    help="whole-restore speed-up on an 8-GPU node (3B, 720p x 21 frames) from the DiT and VAE models")
    args = ap.parse_args(argv)
    if args.predict_restore:
        print(restore_prediction_markdown(restore_prediction()))
        return
    if args.fit_vae:
        points = [p for path in args.fit_vae for p in vae_split_points(_read_json(ap, "--fit-vae", path),
                                                                       "busy_cpu" if args.fit_on == "cpu" else "wall")]
        print(fit_vae_split_markdown(fit_vae_split(points)))
        return
    if args.fit_wall:
        records = [r for path in args.fit_wall for r in _read_json(ap, "--fit-wall", path)]
        print(fit_wall_markdown(fit_wall(records, measure=args.fit_on)))
        return
    if args.fit_gloo:
        print(fit_markdown(fit_gloo(_read_json(ap, "--fit-gloo", args.fit_gloo))))
        return
    print(summary_markdown())
    for model in (SEEDVR2_3B, SEEDVR2_7B):
        for net in (NVLINK_NODE, MULTI_NODE):
            print(f"\n#### {model.name}, {net.name}\n")
            print(crossover_markdown(model, net, DEGREES[net.name]))
            if args.detail:
                print()
                print(detail_markdown(model, net, (31, 135, 240), DEGREES[net.name]))


if __name__ == "__main__":
    main()
