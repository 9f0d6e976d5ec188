"""Sharded inference weights (``--shard-weights``): per-rank memory, forward time against replicated weights, and the
cost model's prediction for an 8-GPU NVLink node.

Run from the repository root: ``OMP_NUM_THREADS=1 python benchmarks/bench_shard_weights.py`` (all three parts, one
run; ``--part memory|time|predict`` for one). Two gloo ranks on the CPU, each in a fresh process per measurement:

* memory: the released 3B architecture at full width (dim 2560, 20 heads x 128, SwiGLU) in bf16 with ``--layers``
  of its 32 blocks (default 8: the shared machine cannot hold two replicated full 3B ranks; the blocks' share scales
  with the count), seeded random weights streamed to a safetensors file, loaded replicated
  (:func:`load_dit_checkpoint`) or sharded (:func:`load_sharded_dit`, each rank reading its chunks), then one forward
  on a 720p frame's latent (90 x 160 -> 3600 tokens, window SP 2). Reported per rank: the RSS rise from before the
  load to after the forward (weights, activations, slack), the peak RSS (VmHWM), and the bytes of block weights held;
  the figure of merit is the rise's sharded / replicated ratio against what the weights alone predict.
* time: the same width with 2 blocks, SP 2, forwards at 9 x 256 x 384 and 9 x 512 x 768 pixels (latent 3 x 32 x 48
  and 3 x 64 x 96), median of ``--repeats`` after a warm-up, replicated vs sharded with and without prefetch. On
  gloo the gathers are real copies through loopback sockets on the same 2 cores that compute, so prefetch can hide
  only what the cores are not already busy with; the machine is shared and noisy.
* predict: :mod:`benchmarks.cost_model`'s H100/H200 figures for one 8-GPU NVLink node: the forward with replicated
  weights, and with sharded ones (each block all-gathered: (P - 1) / P of its bytes into every GPU over NVLink)
  without overlap and with the gather fully hidden behind the previous block (bounded below by the link time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30


def config(layers: int):
    from examples.seedvr2.models.dit import NaDiTConfig

    return NaDiTConfig.seedvr2_at_size(vid_dim=2560, txt_in_dim=5120, heads=20, head_dim=128, num_layers=layers,
                                       mm_layers=min(layers, 10), rope_dim=128)


def write_checkpoint(path: Path, layers: int) -> None:
    from examples.seedvr2.models.dit import SeedVR2NaDiT
    from tests.streamed_checkpoint import write_safetensors_streamed

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in SeedVR2NaDiT(config(layers)).state_dict().items()}
    write_safetensors_streamed(path, shapes, torch.bfloat16, seed=0)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _inputs(cfg, latent: tuple[int, int, int], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t, h, w = latent
    return {"vid": torch.randn(t * h * w, cfg.vid_in_channels, generator=g, dtype=torch.float32),
            "txt": torch.randn(58, cfg.txt_in_dim, generator=g), "vid_shape": torch.tensor([[t, h, w]]),
            "txt_shape": torch.tensor([[58]]), "timestep": torch.tensor([1000.0])}


def _forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs["vid"].to(torch.bfloat16), inputs["txt"].to(torch.bfloat16), inputs["vid_shape"],
                     inputs["txt_shape"], inputs["timestep"])


def _load(path: str, layers: int, sharded: bool):
    import winsp
    from examples.seedvr2.models.dit import SeedVR2NaDiT, load_dit_checkpoint
    from examples.seedvr2.weights.sharded import load_sharded_dit
    from winsp.comm.group import SPGroup

    with torch.device("meta"):
        model = SeedVR2NaDiT(config(layers)).to(torch.bfloat16)
    if sharded:
        held = load_sharded_dit(model, path, SPGroup.world()).shard_bytes
    else:
        load_dit_checkpoint(model, path)
        held = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    model.eval().build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=SPGroup.world().size),
                               group=SPGroup.world())
    return model, held


def _rank_memory(rank: int, world: int, path: str, layers: int, sharded: bool) -> dict:
    before = _status("VmRSS")
    model, held = _load(path, layers, sharded)
    _forward(model, _inputs(model.config, (1, 90, 160)))
    return {"rise": _status("VmRSS") - before, "peak": _status("VmHWM"), "held": held}


MODES = ("replicated", "sharded, prefetch", "sharded, no prefetch")


def _rank_time(rank: int, world: int, path: str, latents: list, repeats: int) -> dict:
    """Median forward seconds of each mode, the modes interleaved run by run so that the machine's noise falls on
    all of them alike (a replicated and a sharded model live side by side; prefetch is switched on the latter)."""
    from examples.seedvr2.weights.sharded import sharded_weights_of

    whole, _ = _load(path, 2, False)
    sharded, _ = _load(path, 2, True)
    gatherer = sharded_weights_of(sharded)
    times = {mode: {} for mode in MODES}
    for latent in latents:
        inputs = _inputs(whole.config, tuple(latent))
        runs = {mode: [] for mode in MODES}
        for repeat in range(repeats + 1):  # the first round warms up (plans, allocator)
            for mode in MODES:
                gatherer.prefetch = mode != "sharded, no prefetch"
                model = whole if mode == "replicated" else sharded
                start = time.perf_counter()
                _forward(model, inputs)
                if repeat:
                    runs[mode].append(time.perf_counter() - start)
        for mode in MODES:
            times[mode][tuple(latent)] = runs[mode]
    return times


def part_memory(folder: Path, layers: int) -> None:
    from winsp.testing import run_ranks

    path = folder / f"dit3b_width_{layers}_layers.safetensors"
    write_checkpoint(path, layers)
    print(f"\n## memory: 3B width, {layers} of 32 blocks, bf16, 2 gloo ranks, one 720p frame (3600 tokens)")
    print("| weights | block weights held / rank | RSS rise / rank (load + forward) | peak RSS / rank |")
    print("|---|---|---|---|")
    found = {}
    for sharded in (False, True):
        rows = run_ranks(_rank_memory, 2, str(path), layers, sharded, timeout=1800)
        found[sharded] = rows
        name = "sharded" if sharded else "replicated"
        cells = [" / ".join(f"{r[key] / GIB:.3f}" for r in rows) for key in ("held", "rise", "peak")]
        print(f"| {name} | {cells[0]} GiB | {cells[1]} GiB | {cells[2]} GiB |")
    whole, half = found[False][0]["held"], found[True][0]["held"]
    saved = statistics.mean(r["rise"] for r in found[False]) - statistics.mean(r["rise"] for r in found[True])
    print(f"\nblock weights held: sharded / replicated = {half / whole:.3f}; RSS rise saved by sharding "
          f"{saved / GIB:.3f} GiB a rank, {saved / (whole - half):.2f}x the {((whole - half) / GIB):.3f} GiB the "
          f"weights alone predict (two gathered blocks, {2 * whole / layers / GIB:.3f} GiB, stay in flight)")
    path.unlink()


def part_time(folder: Path, repeats: int) -> None:
    from winsp.testing import run_ranks

    path = folder / "dit3b_width_2_layers.safetensors"
    write_checkpoint(path, 2)
    latents = [(3, 32, 48), (3, 64, 96)]
    labels = {(3, 32, 48): "9x256x384", (3, 64, 96): "9x512x768"}
    print(f"\n## forward time: 3B width, 2 blocks, bf16, SP 2 on gloo, median of {repeats} interleaved runs "
          f"(seconds, rank 0; every run of each rank in brackets)")
    print("| input | replicated | sharded, prefetch | sharded, no prefetch | prefetch / replicated | "
          "no prefetch / replicated |")
    print("|---|---|---|---|---|---|")
    rows = run_ranks(_rank_time, 2, str(path), latents, repeats, timeout=3600)
    medians = {mode: {k: statistics.median(v) for k, v in rows[0][mode].items()} for mode in MODES}
    for latent in latents:
        r, p, n = (medians[m][latent] for m in MODES)
        print(f"| {labels[latent]} | {r:.3f} | {p:.3f} | {n:.3f} | {p / r:.2f} | {n / r:.2f} |")
    for mode in MODES:
        print(f"{mode}: " + "; ".join(f"{labels[k]} " + " / ".join(
            "[" + ", ".join(f"{t:.2f}" for t in row[mode][k]) + "]" for row in rows) for k in latents))
    path.unlink()


def part_predict() -> None:
    from benchmarks import cost_model as cm

    net, dev, p = cm.NVLINK_NODE, cm.H200, 8
    print(f"\n## prediction: {net.name}, P = {p}, H100/H200 published figures (benchmarks/cost_model.py)")
    print("| model | input | replicated forward | sharded, no overlap | sharded, gather hidden | block gather | "
          "weights / GPU replicated -> sharded |")
    print("|---|---|---|---|---|---|---|")
    from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT

    for model, name in ((cm.SEEDVR2_3B, "3b"), (cm.SEEDVR2_7B, "7b")):
        with torch.device("meta"):
            dit = SeedVR2NaDiT(NaDiTConfig.released(name))
        weights = sum(t.numel() for t in dit.parameters()) * cm.BF16
        blocks = sum(t.numel() for t in dit.blocks.parameters()) * cm.BF16
        block_bytes = max(sum(t.numel() for t in b.parameters()) for b in dit.blocks) * cm.BF16
        gather = net.latency + block_bytes * (p - 1) / p / net.bytes_per_s
        for res in ("720p", "1080p", "4K"):
            for frames in (1, 21):
                h, w = cm.RESOLUTIONS[res]
                grid = (cm.FRAMES[frames], h, w)
                pred = cm.predict_window_sp(model, grid, p, "lpt", net, dev)
                layer = pred.layer
                hidden = max(layer, pred.comm + gather)  # the gather shares the link with the layer's own exchange
                sharded_weights = weights - blocks + blocks / p + 2 * block_bytes
                print(f"| {model.name} | {res}, {frames} frame{'s' if frames > 1 else ''} | "
                      f"{layer * model.layers * 1e3:.1f} ms | {(layer + gather) * model.layers * 1e3:.1f} ms | "
                      f"{hidden * model.layers * 1e3:.1f} ms | {gather * 1e3:.2f} ms | "
                      f"{weights / 1e9:.1f} -> {sharded_weights / 1e9:.1f} GB |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("memory", "time", "predict", "all"), default="all")
    parser.add_argument("--layers", type=int, default=8, help="3B blocks in the memory part (default 8)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC')}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as folder:
        if args.part in ("memory", "all"):
            part_memory(Path(folder), args.layers)
        if args.part in ("time", "all"):
            part_time(Path(folder), args.repeats)
    if args.part in ("predict", "all"):
        part_predict()


if __name__ == "__main__":
    main()
