"""SeedVR2 NaDiT forward on CPU: the winsp path at one rank against a plain implementation, and per-rank memory.

Run from the repository root: ``OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_dit.py --benchmark-only -q -s``.
Model and input: the tiny 3B-architecture golden model (4 blocks, dim 96, 3 heads x 32) on its golden input,
one sample of post-patch grid (5, 32, 56) = 8960 tokens in 27 windows, 17 text tokens.

* ``plain``: the same blocks and weights driven by :class:`PlainContext`, which keeps rows in canonical order and
  gathers each layer's windows itself (as the reference does) with no winsp runtime, planner or request at all.
* ``winsp``: :class:`SeedVR2NaDiT.forward` at SP = 1 (scatter, per-layer ``to_layer``, request attention, gather).
  Goal: at most 5% slower than ``plain``.
* Per-rank peak activation memory at SP = 1, 2, 4 (gloo ranks, one process each): the rise of the process's peak
  resident set over its resident set just before a warm forward. Goal: about 1/P of SP = 1. Measured for the tiny
  3B- and 7B-architecture golden models (same size and input).
* 7B against 3B blocks at equal width (SP = 1): the two architectures at dim 256 (4 heads x 64), 4 blocks each, seeded
  random weights, the golden input's shape; forward time per block and the 7B / 3B ratio.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import winsp  # noqa: E402
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT, load_dit_checkpoint  # noqa: E402
from examples.seedvr2.models.dit.layers import Modulation  # noqa: E402
from examples.seedvr2.models.dit.patch import PatchIn  # noqa: E402
from winsp.testing import run_ranks  # noqa: E402

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "nadit3b_tiny.safetensors"
GOLDEN_7B = GOLDEN.with_name("nadit7b_tiny.safetensors")
OVERHEAD_GOAL = 1.05
MEMORY_WORLD_SIZES = (1, 2, 4)


# ---------------------------------------------------------------------------------------------- model and input
def load_golden(path: Path = GOLDEN):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        cfg = NaDiTConfig.from_metadata(f.metadata())
        state = {k[6:]: f.get_tensor(k) for k in f.keys() if k.startswith("state.")}
        inputs = {k[6:]: f.get_tensor(k) for k in f.keys() if k.startswith("input.")}
    model = SeedVR2NaDiT(cfg).eval()
    load_dit_checkpoint(model, state)
    inputs["vid"], inputs["txt"] = inputs["vid"].float(), inputs["txt"].float()
    return model, inputs


# ---------------------------------------------------------------------------------------------- plain forward
class PlainContext:
    """A :class:`~examples.seedvr2.models.dit.block.BlockContext` without winsp: canonical row order, one device.

    Per distinct window geometry it precomputes (once) the window-order permutation of the canonical rows, the
    windows grouped by (video length, sample), and the window-local RoPE tables; attention gathers rows into window
    order, runs SDPA per group of equal windows, scatters back and averages each sample's text over its windows.
    """

    def __init__(self, model: SeedVR2NaDiT, grids, text_lengths, emb_slots: torch.Tensor) -> None:
        self.model, self.grids, self.text_lengths = model, grids, list(text_lengths)
        self.emb_slots = emb_slots
        counts = [t * h * w for t, h, w in grids]
        self.row_sample = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor(counts))
        self.txt_sample = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor(self.text_lengths))
        self.txt_start = [sum(self.text_lengths[:s]) for s in range(len(grids))]
        self.txt_position = torch.cat([torch.arange(n) for n in self.text_lengths])
        self._layouts: dict = {}
        self._tables: dict = {}
        self._layer = 0

    def enter_layer(self, layer: int) -> None:
        self._layer = layer

    def _key(self):
        cfg = self.model.config
        return cfg.window_method[self._layer], cfg.window[self._layer]

    def _layout(self):
        key = self._key()
        found = self._layouts.get(key)
        if found is not None:
            return found
        geometry = winsp.make_geometry(*key)
        order, groups, offset = [], {}, 0
        for s, (t, h, w) in enumerate(self.grids):
            ids = torch.arange(t * h * w).reshape(t, h, w) + offset
            for box in geometry.slices((t, h, w)):
                block = ids[box]
                groups.setdefault((block.numel(), s), []).append(block.reshape(-1))
            offset += t * h * w
        group_list = []
        for (length, s), members in groups.items():
            group_list.append((len(members), length, s))
            order.extend(members)
        perm = torch.cat(order)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        # canonical window-local coordinates (for RoPE)
        local = torch.empty(perm.numel(), 3, dtype=torch.long)
        offset = 0
        for t, h, w in self.grids:
            for bt, bh, bw in geometry.slices((t, h, w)):
                tt, hh, ww = torch.meshgrid(torch.arange(bt.start, bt.stop), torch.arange(bh.start, bh.stop),
                                            torch.arange(bw.start, bw.stop), indexing="ij")
                rows = ((tt * h + hh) * w + ww).reshape(-1) + offset
                local[rows] = torch.stack([tt - bt.start, hh - bh.start, ww - bw.start], -1).reshape(-1, 3)
            offset += t * h * w
        windows_per_sample = torch.tensor([len(geometry.slices(g)) for g in self.grids])
        found = (perm, inverse, group_list, local, windows_per_sample)
        self._layouts[key] = found
        return found

    def vid_rows(self, per_sample):
        return per_sample if per_sample.shape[0] == 1 else per_sample[self.row_sample]

    def txt_rows(self, per_sample):
        return per_sample if per_sample.shape[0] == 1 else per_sample[self.txt_sample]

    def rope_vid(self, rope):
        key = ("vid",) + self._key()
        if key not in self._tables:
            local = self._layout()[3].clone()
            local[:, 0] += torch.tensor(self.text_lengths)[self.row_sample]
            self._tables[key] = rope.tables(local, self.model.config.head_dim)
        return self._tables[key]

    def rope_txt(self, rope):
        if "txt" not in self._tables:
            self._tables["txt"] = rope.tables(self.txt_position[:, None].expand(-1, 3), self.model.config.head_dim)
        return self._tables["txt"]

    def attention(self, q_v, k_v, v_v, q_t, k_t, v_t, *, layer: int, text_output: bool = True):
        perm, inverse, groups, _, windows_per_sample = self._layout()
        q_w, k_w, v_w = q_v[perm], k_v[perm], v_v[perm]
        heads, dim = q_v.shape[1:]
        vid_out, txt_sum = [], torch.zeros_like(q_t)
        row = 0
        for count, length, s in groups:
            n_txt, start = self.text_lengths[s], self.txt_start[s]
            q, k, v = (torch.cat([vid[row:row + count * length].view(count, length, heads, dim),
                                  txt[start:start + n_txt].expand(count, n_txt, heads, dim)], dim=1).transpose(1, 2)
                       for vid, txt in ((q_w, q_t), (k_w, k_t), (v_w, v_t)))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
            vid_out.append(out[:, :length].reshape(count * length, heads, dim))
            txt_sum[start:start + n_txt] += out[:, length:].sum(0)
            row += count * length
        txt_out = txt_sum / windows_per_sample[self.txt_sample].to(txt_sum.dtype)[:, None, None]
        return torch.cat(vid_out)[inverse], (txt_out if text_output else None)


def plain_forward(model: SeedVR2NaDiT, vid, txt, vid_shape, txt_shape, timestep) -> torch.Tensor:
    """The NaDiT forward with the model's own layers but no winsp runtime (single device, canonical order)."""
    shapes, text_lengths, timestep = model._check_inputs(vid, txt, vid_shape, txt_shape, timestep)
    plan = model._patch_plan(shapes, vid.device)
    x = model.vid_in(PatchIn.patchify(vid, plan))
    txt = model.txt_in(txt)
    emb_slots = Modulation.split_embedding(model.emb_in(timestep, x.dtype), model.config.vid_dim)
    ctx = PlainContext(model, plan.grids, text_lengths, emb_slots)
    for i, block in enumerate(model.blocks):
        ctx.enter_layer(i)
        x, txt = block(x, txt, ctx)
    if model.vid_out_norm is not None:
        scale, shift = model.vid_out_ada.scale_shift("out", emb_slots[:, 0])
        x = model.vid_out_norm(x) * ctx.vid_rows(scale) + ctx.vid_rows(shift)
    return model.vid_out.unpatchify(model.vid_out(x), plan)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def golden_model():
    model, inputs = load_golden()
    args = (inputs["vid"], inputs["txt"], inputs["vid_shape"], inputs["txt_shape"], inputs["timestep"])
    with torch.no_grad():
        ours, plain = model(*args), plain_forward(model, *args)
    err = (ours - plain).abs().max().item()
    assert err <= 1e-5, f"plain forward disagrees with the winsp forward by {err}"
    return model, args


# ---------------------------------------------------------------------------------------------- SP = 1 speed
@pytest.mark.parametrize("path", ["winsp", "plain"])
def test_forward_sp1(benchmark, golden_model, path):
    model, args = golden_model
    fn = model if path == "winsp" else (lambda *a: plain_forward(model, *a))
    with torch.no_grad():
        benchmark.pedantic(fn, args=args, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["execution_path"] = model.runtime.execution_path if path == "winsp" else "plain, no runtime"


def test_winsp_overhead_vs_plain(benchmark, golden_model, goal_report):
    """Interleaved runs of both paths (min of 7 each), so machine noise hits both alike.

    (pytest-benchmark times the whole interleaved measurement once; the figure that matters is the printed ratio.)
    """
    model, args = golden_model
    times = {"winsp": [], "plain": []}

    def interleaved():
        with torch.no_grad():
            for _ in range(7):
                for name, fn in (("winsp", model), ("plain", lambda *a: plain_forward(model, *a))):
                    start = time.perf_counter()
                    fn(*args)
                    times[name].append(time.perf_counter() - start)

    benchmark.pedantic(interleaved, rounds=1, iterations=1)
    ratio = min(times["winsp"]) / min(times["plain"])
    print(f"\nSP=1 forward: winsp {min(times['winsp']) * 1e3:.1f} ms, plain {min(times['plain']) * 1e3:.1f} ms, "
          f"ratio {ratio:.3f} (goal <= {OVERHEAD_GOAL}); path: {model.runtime.execution_path}")
    goal_report.goal("NaDiT tiny golden forward, SP=1 winsp / plain (min of 7)", ratio, OVERHEAD_GOAL, unit="x")


# ---------------------------------------------------------------------------------------------- memory per rank
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory_rank(rank: int, world_size: int, golden: Path = GOLDEN) -> dict:
    model, inputs = load_golden(golden)
    runtime = model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    args = (inputs["vid"], inputs["txt"], inputs["vid_shape"], inputs["txt_shape"], inputs["timestep"])
    with torch.no_grad():
        model(*args)  # warm: plans, index tensors, allocator
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
        before = _status_kib("VmRSS")
        model(*args)
        peak = _status_kib("VmHWM")
    rows = runtime.request(grids=[(5, 32, 56)], text_lengths=[17]).plan(0).rank_token_counts[rank]
    return {"rise_mib": (peak - before) / 1024, "rows": int(rows), "path": runtime.execution_path}


@pytest.mark.parametrize("golden, label", [(GOLDEN, "NaDiT"), (GOLDEN_7B, "NaDiT 7B-architecture")],
                         ids=["3b", "7b"])
def test_activation_memory_per_rank(benchmark, goal_report, golden, label):
    """(pytest-benchmark times the whole measurement once; the figures that matter are the printed ratios.)"""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed activations go back to the OS at once
    results = {}

    def measure():
        for p in MEMORY_WORLD_SIZES:
            results[p] = run_ranks(_memory_rank, p, timeout=300, golden=golden)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    base = max(r["rise_mib"] for r in results[1])
    lines = []
    for p, per_rank in results.items():
        worst = max(r["rise_mib"] for r in per_rank)
        lines.append(
            f"SP={p}: per-rank peak activation rise {[round(r['rise_mib'], 1) for r in per_rank]} MiB, "
            f"max {worst:.1f} MiB = {worst / base:.3f} x SP=1 (ideal {1 / p:.3f}); "
            f"rows per rank {[r['rows'] for r in per_rank]}; {per_rank[0]['path']}"
        )
        if p > 1:
            goal_report.goal(f"{label} tiny golden forward, SP={p} peak activations / SP=1", worst / base,
                             1.25 / p, unit="x")
    report = "\n".join(lines)
    print("\n" + report)
    goal_report.text(f"{label} per-rank peak activation memory (RSS rise over a warm forward)", report)


# ---------------------------------------------------------------------------------------------- 7B vs 3B blocks
EQUAL_WIDTH = dict(vid_dim=256, txt_in_dim=64, heads=4, head_dim=64, num_layers=4)


def _equal_width_models() -> dict:
    configs = {
        "3b": NaDiTConfig.seedvr2_at_size(**EQUAL_WIDTH, mm_layers=2, rope_dim=EQUAL_WIDTH["head_dim"]),
        "7b": NaDiTConfig.seedvr2_7b_at_size(**EQUAL_WIDTH),
    }
    models = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        models[name] = SeedVR2NaDiT(cfg).eval()
    return models


def test_block_time_7b_vs_3b_equal_width(benchmark, goal_report):
    """Interleaved forwards of both (min of 5 each); per-block time = forward / blocks (the in/out projections are
    under 1% of it). (pytest-benchmark times the whole measurement once; the printed ratio is the figure.)"""
    models = _equal_width_models()
    _, inputs = load_golden()
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(inputs["vid"].shape, generator=g), torch.randn(17, EQUAL_WIDTH["txt_in_dim"], generator=g),
            inputs["vid_shape"], inputs["txt_shape"], inputs["timestep"])
    times = {name: [] for name in models}

    def interleaved():
        with torch.no_grad():
            for _ in range(5):
                for name, model in models.items():
                    start = time.perf_counter()
                    model(*args)
                    times[name].append(time.perf_counter() - start)

    benchmark.pedantic(interleaved, rounds=1, iterations=1)
    per_block = {name: min(t) / EQUAL_WIDTH["num_layers"] * 1e3 for name, t in times.items()}
    params = {name: sum(p.numel() for p in m.blocks[0].parameters()) for name, m in models.items()}
    ratio = per_block["7b"] / per_block["3b"]
    report = (f"dim {EQUAL_WIDTH['vid_dim']}, {EQUAL_WIDTH['heads']} heads x {EQUAL_WIDTH['head_dim']}, 8960 video + "
              f"17 text tokens: 3B block {per_block['3b']:.1f} ms, 7B block {per_block['7b']:.1f} ms, ratio 7B / 3B "
              f"{ratio:.2f}; parameters per block (separate streams) 3B {params['3b']}, 7B {params['7b']}")
    print("\n" + report)
    goal_report.text("7B vs 3B block time at equal width, SP=1, CPU", report)
