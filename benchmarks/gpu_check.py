"""One-shot GPU check of SeedVR2 on winsp: the 3B DiT at real size, the VAE, every attention backend, bf16 vs fp32.

    python benchmarks/gpu_check.py                     # one CUDA GPU (H100/H200: about 3-5 minutes, budget 8)
    python benchmarks/gpu_check.py --dry-run           # the same code at tiny sizes on the CPU (seconds)

Sections, each timed with CUDA events (wall clock on the CPU), median of the timed runs after a warm-up:

* ``dit``: the SeedVR2 3B DiT at real width (2560, 20 heads x 128, 32 layers, seeded random weights), bf16, one
  forward (SP = 1, the default backend) at 720p x 21 frames (latent 6 x 90 x 160, post-patch grid 6 x 45 x 80) and
  at a 1080p image (1920 x 1072, the largest multiple of 16: post-patch 1 x 67 x 120); forward ms, peak memory of
  the forward above the resident weights, and the peak in all.
* ``bf16_vs_fp32``: the same 720p x 21 forward with fp32 weights (TF32 off) against the bf16 one: relative L2 and max
  absolute difference of the output.
* ``vae``: the released VAE architecture (seeded random weights), bf16, encode of a 720p x 21-frame clip and decode of
  its latent: ms and peak memory each (on an out-of-memory error it retries with temporal chunks of 4 frames and
  says so).
* ``attention``: one layer of the 720p x 21 grid (shifted windows, 20 heads x 128, 58 text tokens), bf16 q/k/v:
  grouped SDPA with only the flash kernel allowed ("flash SDPA"), batched SDPA, the packed varlen kernels
  (``torch_varlen``, ``flash_varlen`` when flash-attn is installed), ``flex`` without and with a ``score_mod`` (an
  ALiBi-like decay over the rows' grid positions); ms, TFLOP/s and the max difference from the float32 per-window
  reference (with the same score_mod for the flex one). A backend that cannot run says why.
* ``memory_constants``: the constants the memory planner (``python -m examples.seedvr2 plan``) states, measured: CUDA
  context, cuBLAS workspaces, and the caching allocator's overhead (the 720p x 21 DiT forward's reserved peak over the
  fake-GPU trace's peak of live bytes for the same forward).
* ``neighborhood``: one neighborhood layer (3D kernel, dilation, causal time, text rows) as rank 1 of a 2-rank plan
  sees it (its own rows and received halo), without a process group: the ``flex`` backend (compiled FlexAttention,
  block mask) against the tiled path, forward and backward, bf16 and float32 (and float32 with a relative position
  bias); NATTEN's kernels too where libnatten is installed. Max difference of output and gradients from the float32
  tiled path, and ms. On the CPU (dry run) flex runs forward only.

Writes ``gpu_check.json`` (all figures, environment, errors) and ``gpu_check.md`` (the tables) to the folder
``--out`` (created if missing; default ``$OUT`` when set, else ``./gpu_check_out`` for a real run and a new temporary
folder for a dry run, never the current directory itself), and says where; the JSON is rewritten after every
section, so a run cut short keeps what it measured. A section that fails records its error and the others still run; sections that would start after
``--budget-s`` seconds are skipped and say so. Exit code 0 when every section ran, 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Mapping, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import winsp  # noqa: E402
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT  # noqa: E402
from examples.seedvr2.models.vae import CausalVideoVAE, VideoVAEConfig  # noqa: E402
from winsp.attention.backends import explain_backend  # noqa: E402
from winsp.attention.windows import reference_window_attention, window_attention  # noqa: E402
from winsp.runtime.runtime import LocalWindows  # noqa: E402

TEXT_TOKENS = 58
ATTENTION_BACKENDS = ("flash SDPA", "batched_sdpa", "torch_varlen", "flash_varlen", "flex", "flex + score_mod")


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the real sizes, or the dry run's tiny ones (same code, same sections)."""

    dit: dict
    video_latent: tuple[int, int, int]  # 720p x 21 frames, latent (t, h, w)
    image_latent: tuple[int, int, int]  # 1080p image, latent
    vae: dict
    vae_clip: tuple[int, int, int]  # frames, height, width in pixels
    heads: int
    head_dim: int
    warmup: int
    iters: int
    attention_iters: int
    neighborhood: dict


REAL = Sizes(
    dit=dict(vid_dim=2560, txt_in_dim=5120, heads=20, head_dim=128, num_layers=32, mm_layers=10, rope_dim=128),
    video_latent=(6, 90, 160), image_latent=(1, 134, 240),
    vae={}, vae_clip=(21, 720, 1280), heads=20, head_dim=128, warmup=1, iters=3, attention_iters=10,
    neighborhood=dict(grid=(6, 48, 64), kernel=(3, 7, 7), dilation=(1, 2, 1), heads=8, head_dim=64, text=32, iters=5),
)
DRY = Sizes(
    dit=dict(vid_dim=64, txt_in_dim=32, heads=2, head_dim=32, num_layers=2, mm_layers=1, rope_dim=32),
    video_latent=(2, 12, 20), image_latent=(1, 10, 16),
    vae=dict(block_out_channels=[16, 16, 32, 32], norm_num_groups=8), vae_clip=(5, 32, 48),
    heads=2, head_dim=32, warmup=1, iters=2, attention_iters=2,
    neighborhood=dict(grid=(3, 10, 12), kernel=(2, 3, 3), dilation=(1, 2, 1), heads=2, head_dim=16, text=4, iters=1),
)


class Clock:
    """Median milliseconds of ``fn`` after ``warmup`` calls: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median_ms(self, fn, *, warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        samples = []
        for _ in range(iters):
            if self.device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                torch.cuda.synchronize(self.device)
                samples.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        samples.sort()
        return samples[len(samples) // 2]


class Memory:
    """Peak allocated bytes of a block (CUDA allocator); None on the CPU, where the allocator keeps no peak."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None


def _sci(entry: dict, key: str) -> str:
    """``entry[key]`` in scientific notation for the report table ("" when absent)."""
    return "" if key not in entry else format(entry[key], ".2e")


def _gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**30, 3)


# ---------------------------------------------------------------------------------------------------- DiT


def _dit_inputs(latent, config: NaDiTConfig, device, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    t, h, w = latent
    vid = torch.randn(t * h * w, config.vid_in_channels, generator=g).to(device, dtype)
    txt = torch.randn(TEXT_TOKENS, config.txt_in_dim, generator=g).to(device, dtype)
    # the shapes are host tensors (the DiT plans with their values); the timestep lives on the device
    return (vid, txt, torch.tensor([[t, h, w]]), torch.tensor([[TEXT_TOKENS]]),
            torch.full((1,), 1000.0, device=device))


def _build_dit(sizes: Sizes, device, dtype) -> SeedVR2NaDiT:
    config = NaDiTConfig.seedvr2_at_size(**sizes.dit)
    torch.manual_seed(0)
    with torch.device(device):
        model = SeedVR2NaDiT(config)  # built on the device: no 13 GB detour through host memory
    model = model.to(device=device, dtype=dtype).eval()
    model.build_runtime(winsp.DiffusionParallelConfig())
    return model


def _dit_forward(model, inputs, clock: Clock, memory: Memory, sizes: Sizes) -> dict:
    with torch.no_grad():
        before = memory.allocated()
        memory.reset()
        out = model(*inputs)
        clock.sync()
        peak = memory.peak()
        ms = clock.median_ms(lambda: model(*inputs), warmup=sizes.warmup - 1 if sizes.warmup else 0,
                             iters=sizes.iters)
    return {"forward_ms": round(ms, 2), "peak_gib": _gib(peak),
            "peak_above_weights_gib": None if peak is None else _gib(peak - before),
            "output_shape": list(out.shape)}, out


def section_dit(sizes, device, clock, memory, state) -> dict:
    config = NaDiTConfig.seedvr2_at_size(**sizes.dit)
    model = _build_dit(sizes, device, torch.bfloat16)
    result = {"config": {k: sizes.dit[k] for k in ("vid_dim", "heads", "head_dim", "num_layers")},
              "dtype": "bfloat16", "weights_gib": _gib(sum(p.numel() * p.element_size() for p in model.parameters())),
              "text_tokens": TEXT_TOKENS, "backend": None}
    for name, latent in (("720p x 21 frames", sizes.video_latent), ("1080p image", sizes.image_latent)):
        inputs = _dit_inputs(latent, config, device, torch.bfloat16, seed=1)
        figures, out = _dit_forward(model, inputs, clock, memory, sizes)
        t, h, w = latent
        figures["post_patch_grid"] = [t, h // 2, w // 2]
        result[name] = figures
        if name == "720p x 21 frames":
            state["bf16_video_out"] = out.float().cpu()
        del inputs, out
    result["backend"] = model.runtime.execution_path if hasattr(model.runtime, "execution_path") else None
    del model
    memory.reset()
    return result


def section_bf16_vs_fp32(sizes, device, clock, memory, state) -> dict:
    if "bf16_video_out" not in state:
        raise RuntimeError("needs the dit section's bf16 output, which it did not produce")
    config = NaDiTConfig.seedvr2_at_size(**sizes.dit)
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model = _build_dit(sizes, device, torch.float32)  # same seed: the bf16 model's weights before the cast
        inputs = _dit_inputs(sizes.video_latent, config, device, torch.float32, seed=1)
        with torch.no_grad():
            t0 = time.perf_counter()
            want = model(*inputs).float()
            clock.sync()
            ms = (time.perf_counter() - t0) * 1e3
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
    got = state["bf16_video_out"].to(want.device)
    diff = got - want
    result = {"input": "720p x 21 frames", "fp32_forward_ms_one_run": round(ms, 1),
              "relative_l2": float(diff.norm() / want.norm()), "max_abs": float(diff.abs().max()),
              "fp32_output_abs_max": float(want.abs().max())}
    del model, inputs, want, got, diff
    memory.reset()
    return result


# ---------------------------------------------------------------------------------------------------- VAE


def section_vae(sizes, device, clock, memory, state) -> dict:
    torch.manual_seed(0)
    with torch.device(device):
        vae = CausalVideoVAE(VideoVAEConfig(**sizes.vae))
    vae = vae.to(device=device, dtype=torch.bfloat16).eval()
    frames, height, width = sizes.vae_clip
    g = torch.Generator().manual_seed(2)
    clip = (torch.rand(1, 3, frames, height, width, generator=g) * 2 - 1).to(device, torch.bfloat16)
    result = {"clip": [frames, height, width], "dtype": "bfloat16", "temporal_chunk": None}

    def measure(fn):
        memory.reset()
        before = memory.allocated()
        out = fn()
        clock.sync()
        peak = memory.peak()
        ms = clock.median_ms(fn, warmup=0, iters=max(1, sizes.iters - 1))
        return out, {"ms": round(ms, 1), "peak_gib": _gib(peak),
                     "peak_above_inputs_gib": None if peak is None else _gib(peak - before)}

    try:
        latent, result["encode"] = measure(partial(vae.encode, clip))
        video, result["decode"] = measure(partial(vae.decode, latent))
    except torch.OutOfMemoryError as error:
        result["first_attempt"] = f"out of memory without temporal chunks: {str(error).splitlines()[0]}"
        memory.reset()
        vae.set_temporal_chunking(4)
        result["temporal_chunk"] = 4
        latent, result["encode"] = measure(partial(vae.encode, clip))
        video, result["decode"] = measure(partial(vae.decode, latent))
    result["latent_shape"], result["decoded_shape"] = list(latent.shape), list(video.shape)
    del vae, clip, latent, video
    memory.reset()
    return result


# ---------------------------------------------------------------------------------------------------- attention


def _layer(sizes: Sizes):
    t, h, w = sizes.video_latent
    grid = (t, h // 2, w // 2)
    plan = winsp.planning.plan_schedule([grid], [winsp.make_geometry("shifted", (4, 3, 3))], 1)[0]
    return grid, LocalWindows(plan, 0, (TEXT_TOKENS,)).segments


def _flops(segments, heads: int, head_dim: int) -> float:
    return float(sum(4 * (v + t) ** 2 * heads * head_dim for v, t in zip(segments.vid_counts, segments.txt_lengths)))


def _decay_score_mod(rows: int, heads: int, device):
    """ALiBi-like: subtract a per-head slope times the distance of the two rows' positions in the local order."""
    position = torch.arange(rows, device=device, dtype=torch.float32)
    slope = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)

    def decay(score, head, q, k):
        return score - slope[head] * (position[q] - position[k]).abs()
    return decay


def _sdpa_flash_only(device):
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def section_attention(sizes, device, clock, memory, state) -> dict:
    grid, segments = _layer(sizes)
    heads, head_dim = sizes.heads, sizes.head_dim
    g = torch.Generator().manual_seed(3)
    draw = lambda rows: torch.randn(rows, heads, head_dim, generator=g).to(device, torch.bfloat16)  # noqa: E731
    qkv = [draw(segments.total_vid) for _ in range(3)] + [draw(TEXT_TOKENS) for _ in range(3)]
    mod = _decay_score_mod(segments.total_vid, heads, device)
    with torch.no_grad():
        reference = reference_window_attention(*[x.float() for x in qkv], segments)
        reference_mod = reference_window_attention(*[x.float() for x in qkv], segments, score_mod=mod)
    flops = _flops(segments, heads, head_dim)
    result = {"grid": list(grid), "windows": len(segments.vid_counts), "video_rows": segments.total_vid,
              "text_tokens": TEXT_TOKENS, "heads": heads, "head_dim": head_dim, "dtype": "bfloat16",
              "gflop": round(flops / 1e9, 2), "backends": {}}
    for label in ATTENTION_BACKENDS:
        backend = {"flash SDPA": "grouped_sdpa", "flex + score_mod": "flex"}.get(label, label)
        score_mod = mod if label == "flex + score_mod" else None
        want = reference_mod if score_mod is not None else reference
        entry: dict = {"backend": backend}
        try:
            explain_backend(device, segments, backend, dtype=torch.bfloat16, modded=score_mod is not None)
        except ValueError as error:
            entry["unavailable"] = str(error)
            result["backends"][label] = entry
            continue
        kernel = _sdpa_flash_only(device) if label == "flash SDPA" else nullcontext()

        call = partial(window_attention, *qkv, segments, backend=backend, score_mod=score_mod)
        try:
            with torch.no_grad(), kernel:
                got = call()
                ms = clock.median_ms(call, warmup=sizes.warmup, iters=sizes.attention_iters)
            entry.update(ms=round(ms, 3), tflops=round(flops / (ms * 1e-3) / 1e12, 2),
                         max_err_vs_fp32_reference=max(float((a.float() - b).abs().max()) for a, b in zip(got, want)))
            if label == "flash SDPA" and device.type != "cuda":
                entry["note"] = "CPU: SDPA's default kernel (flash is CUDA only)"
        except Exception as error:  # a kernel that refuses these shapes is a figure too
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        result["backends"][label] = entry
    return result


# ---------------------------------------------------------------------------------------------------- neighborhood

NEIGHBORHOOD_RUNS = ("flex bf16", "flex fp32", "flex fp32 + rpb", "natten bf16", "natten fp32")


def section_neighborhood(sizes, device, clock, memory, state) -> dict:
    from winsp.attention.halo.backends import libnatten_available
    from winsp.attention.halo.flex import build_flex_neighborhood, flex_video_queries
    from winsp.attention.halo.layer import _text_index, _video_queries, neighborhood_rpb_score_mod
    from winsp.attention.halo.natten import natten_boxes, natten_video_queries
    from winsp.attention.score_mods import ScoreMods
    from winsp.planning.halo import HaloExchange, neighborhood_plan

    cfg = sizes.neighborhood
    grid, heads, dim, text = cfg["grid"], cfg["heads"], cfg["head_dim"], cfg["text"]
    geom = winsp.Neighborhood(cfg["kernel"], cfg["dilation"], causal=(True, False, False))
    plan = neighborhood_plan([grid], [geom], 2)
    halo = HaloExchange(plan, 1, geom).to(device)
    txt_sample = torch.zeros(text, dtype=torch.int64, device=device)
    flex = build_flex_neighborhood(halo, geom, plan.layout.grids, txt_sample, device)
    boxes, natten_why = natten_boxes(halo, geom, plan.layout.grids, (text,), device)
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(rows, heads, dim, generator=g).to(device)
            for rows in (halo.num_rows, halo.num_keys, halo.num_keys, text, text)]
    table = (torch.randn(heads, *(2 * k - 1 for k in geom.kernel), generator=g) * 0.5).to(device)
    weight = torch.randn(halo.num_rows, heads, dim, generator=g).to(device)
    backward = device.type == "cuda"  # FlexAttention has no CPU backward
    scale = dim ** -0.5

    def run(kernel, dtype, rpb):
        x = [t.to(dtype).requires_grad_(backward) for t in base]
        tab = table.clone().requires_grad_(backward and rpb)
        mods = ScoreMods(neighborhood_rpb_score_mod(tab, halo, geom)) if rpb else None
        txt = (x[3], x[4], _text_index(txt_sample, 1))
        with torch.enable_grad() if backward else torch.no_grad():
            out = kernel(x[0], x[1], x[2], txt, mods)
            grads = torch.autograd.grad((out.float() * weight).sum(), x + ([tab] if rpb else [])) if backward else []
        return out.float(), [gr.float() for gr in grads]

    tiled = lambda q, k, v, txt, mods: _video_queries(q, k, v, txt, halo, scale, mods)  # noqa: E731
    kernels = {"flex": lambda q, k, v, txt, mods: flex_video_queries(flex, q, k, v, txt, scale, mods),
               "natten": lambda q, k, v, txt, mods: natten_video_queries(boxes, q, k, v, txt, scale)}
    reference = {rpb: run(tiled, torch.float32, rpb) for rpb in (False, True)}
    result = {"grid": list(grid), "kernel": list(geom.kernel), "dilation": list(geom.dilation), "causal": "t",
              "rank": "1 of 2", "own_rows": halo.num_rows, "key_rows": halo.num_keys, "heads": heads,
              "head_dim": dim, "text_tokens": text, "backward": backward, "runs": {}}
    for label in NEIGHBORHOOD_RUNS:
        name, dtype_name, *extra = label.split()
        dtype, rpb = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name], bool(extra)
        entry: dict = {}
        if name == "natten" and not libnatten_available():
            entry["unavailable"] = "natten with libnatten is not installed"
        elif name == "natten" and boxes is None:
            entry["unavailable"] = natten_why
        elif name == "natten" and device.type != "cuda":
            entry["unavailable"] = "NATTEN's kernels run on CUDA"
        if "unavailable" in entry:
            result["runs"][label] = entry
            continue
        try:
            out, grads = run(kernels[name], dtype, rpb)
            want, want_grads = reference[rpb]
            entry["max_err_out"] = float((out - want).abs().max())
            if grads:
                entry["max_rel_err_grads"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                                                 for a, b in zip(grads, want_grads))
            entry["ms"] = round(clock.median_ms(partial(run, kernels[name], dtype, rpb), warmup=1,
                                                iters=cfg["iters"]), 3)
            entry["tiled_ms"] = round(clock.median_ms(partial(run, tiled, dtype, rpb), warmup=1,
                                                      iters=cfg["iters"]), 3)
        except Exception as error:
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        result["runs"][label] = entry
    memory.reset()
    return result


# ---------------------------------------------------------------------------------------------------- report

def section_memory_constants(sizes, device, clock, memory, state) -> dict:
    """What the planner (``python -m examples.seedvr2 plan``) states as constants, measured: the CUDA context (memory
    the driver reports used beyond what the caching allocator reserved), the cuBLAS workspaces (allocated by a first
    bf16 matmul after the workspaces are released), and the allocator's overhead on the DiT forward (reserved peak
    over the fake-GPU trace's peak of live bytes for the same forward, when this torch can trace)."""
    from examples.seedvr2.memory import planner as plan

    result = {"stated": {"cuda_context_mib": plan.CUDA_CONTEXT_BYTES / 2**20,
                         "cublas_workspace_mib": plan.CUBLAS_WORKSPACE_BYTES / 2**20,
                         "nccl_mib": plan.NCCL_BYTES / 2**20, "allocator_overhead": plan.ALLOCATOR_OVERHEAD},
              "nccl": "not measured (one process; run the planner's figure against a multi-rank restore)"}
    if device.type != "cuda":
        result["measured"] = "nothing: no CUDA device (dry run)"
        return result
    memory.reset()
    free, total = torch.cuda.mem_get_info(device)
    result["cuda_context_mib"] = round((total - free - torch.cuda.memory_reserved(device)) / 2**20, 1)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
        before = torch.cuda.memory_allocated(device)
        a = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
        (a @ a).sum().item()
        result["cublas_workspace_mib"] = round((torch.cuda.memory_allocated(device) - before - 2 * a.nbytes - 2)
                                               / 2**20, 1)
        del a
    # the allocator's overhead: a real forward's reserved peak against the trace's live-byte peak
    config = NaDiTConfig.seedvr2_at_size(**sizes.dit)
    model = _build_dit(sizes, device, torch.bfloat16)
    inputs = _dit_inputs(sizes.video_latent, config, device, torch.bfloat16, seed=1)
    memory.reset()
    with torch.no_grad():
        model(*inputs)
    torch.cuda.synchronize(device)
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    result["dit_720p"] = {"max_allocated_gib": _gib(allocated), "max_reserved_gib": _gib(reserved)}
    del model, inputs
    memory.reset()
    try:
        from winsp.testing.fake_gpu import run_fake_gpu

        def traced(rank, world):
            with torch.device("meta"):
                dit = SeedVR2NaDiT(config)
            dit = dit.to_empty(device="cuda").to(torch.bfloat16).eval()
            fake_inputs = _dit_inputs(sizes.video_latent, config, "cuda", torch.bfloat16, seed=1)
            with torch.no_grad():
                dit(*fake_inputs)

        peak = run_fake_gpu(traced, 1, check=False).ranks[0].peak_bytes
        result["dit_720p"]["traced_peak_gib"] = _gib(peak)
        result["allocator_overhead"] = round(reserved / peak - 1, 3)
        result["traced_vs_allocated"] = round(allocated / peak - 1, 3)
    except Exception as error:  # noqa: BLE001 - the measured figures above still stand
        result["trace_error"] = f"{type(error).__name__}: {error}"
    return result


SECTIONS = (("dit", section_dit), ("bf16_vs_fp32", section_bf16_vs_fp32), ("attention", section_attention),
            ("neighborhood", section_neighborhood), ("vae", section_vae),
            ("memory_constants", section_memory_constants))


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# gpu_check ({'dry run, tiny sizes, CPU' if report['dry_run'] else 'real sizes'})", "",
             f"{env['device_name']}; torch {env['torch']}; CUDA {env['cuda']}; {env['date_utc']}; "
             f"total {report['total_s']:.0f} s", ""]
    dit = report["sections"].get("dit", {})
    if "error" not in dit and dit:
        lines += [f"SeedVR2 3B DiT, {dit['config']['num_layers']} layers, width {dit['config']['vid_dim']}, bf16, "
                  f"SP = 1, weights {dit['weights_gib']} GiB", "",
                  "| input | post-patch grid | forward ms | peak GiB | above weights GiB |", "|---|---|---:|---:|---:|"]
        for name in ("720p x 21 frames", "1080p image"):
            f = dit[name]
            lines.append(f"| {name} | {' x '.join(map(str, f['post_patch_grid']))} | {f['forward_ms']} | "
                         f"{f['peak_gib']} | {f['peak_above_weights_gib']} |")
        lines.append("")
    cmp_ = report["sections"].get("bf16_vs_fp32", {})
    if cmp_ and "error" not in cmp_:
        lines += [f"bf16 vs fp32 DiT output ({cmp_['input']}): relative L2 {cmp_['relative_l2']:.2e}, "
                  f"max abs {cmp_['max_abs']:.2e} (fp32 output max {cmp_['fp32_output_abs_max']:.2e})", ""]
    vae = report["sections"].get("vae", {})
    if vae and "error" not in vae:
        lines += [f"VAE, bf16, clip {' x '.join(map(str, vae['clip']))} (frames x h x w), temporal chunk "
                  f"{vae['temporal_chunk']}", "", "| step | ms | peak GiB | above inputs GiB |", "|---|---:|---:|---:|"]
        for step in ("encode", "decode"):
            lines.append(f"| {step} | {vae[step]['ms']} | {vae[step]['peak_gib']} | "
                         f"{vae[step]['peak_above_inputs_gib']} |")
        lines.append("")
    att = report["sections"].get("attention", {})
    if att and "error" not in att:
        lines += [f"One attention layer: grid {' x '.join(map(str, att['grid']))}, shifted, {att['windows']} windows, "
                  f"{att['heads']} heads x {att['head_dim']}, {att['text_tokens']} text tokens, bf16, "
                  f"{att['gflop']} GFLOP", "",
                  "| backend | ms | TFLOP/s | max err vs fp32 reference | |", "|---|---:|---:|---:|---|"]
        for label, e in att["backends"].items():
            note = e.get("unavailable") or e.get("error") or e.get("note", "")
            lines.append(f"| {label} | {e.get('ms', '')} | {e.get('tflops', '')} | "
                         f"{'' if 'max_err_vs_fp32_reference' not in e else format(e['max_err_vs_fp32_reference'], '.2e')}"
                         f" | {note} |")
        lines.append("")
    nbh = report["sections"].get("neighborhood", {})
    if nbh and "error" not in nbh:
        lines += [f"One neighborhood layer, rank {nbh['rank']}: grid {' x '.join(map(str, nbh['grid']))}, kernel "
                  f"{nbh['kernel']}, dilation {nbh['dilation']}, causal {nbh['causal']}, {nbh['own_rows']} own rows, "
                  f"{nbh['key_rows']} key rows, {nbh['heads']} heads x {nbh['head_dim']}, {nbh['text_tokens']} text "
                  f"tokens; {'forward + backward' if nbh['backward'] else 'forward only'}, vs the float32 tiled path",
                  "", "| run | ms | tiled ms | max err out | max rel err grads | |", "|---|---:|---:|---:|---:|---|"]
        for label, e in nbh["runs"].items():
            lines.append(f"| {label} | {e.get('ms', '')} | {e.get('tiled_ms', '')} | {_sci(e, 'max_err_out')} | "
                         f"{_sci(e, 'max_rel_err_grads')} | {e.get('unavailable') or e.get('error', '')} |")
        lines.append("")
    for name, body in report["sections"].items():
        if "error" in body or "skipped" in body:
            lines.append(f"- {name}: {body.get('error') or body.get('skipped')}")
    return "\n".join(lines).rstrip() + "\n"


def _environment(device: torch.device) -> dict:
    return {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or "cpu", "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def output_folder(given: Optional[Path], dry_run: bool, env: Mapping[str, str]) -> Path:
    """Where the reports go: ``--out``, else ``$OUT``, else ``./gpu_check_out`` (a real run, kept to be read), else a
    new temporary folder (a dry run, whose tiny figures are only a check of the code path)."""
    if given is not None:
        return given
    if env.get("OUT"):
        return Path(env["OUT"])
    if dry_run:
        import tempfile

        return Path(tempfile.mkdtemp(prefix="gpu_check_dry_run_"))
    return Path("gpu_check_out")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (tests the code path)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for gpu_check.json and .md, created if missing (default: $OUT when set, else "
                             "./gpu_check_out, or a new temporary folder for --dry-run)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no section after this many seconds (default 420: the check ends under 8 min)")
    parser.add_argument("--sections", nargs="+", choices=[n for n, _ in SECTIONS], default=[n for n, _ in SECTIONS])
    args = parser.parse_args(argv)
    out = output_folder(args.out, args.dry_run, os.environ)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        device, sizes = torch.device("cpu"), DRY
    else:
        if not torch.cuda.is_available():
            print("error: CUDA is not available; use --dry-run for the CPU run at tiny sizes", file=sys.stderr)
            return 2
        device, sizes = torch.device("cuda"), REAL
    clock, memory, state = Clock(device), Memory(device), {}
    start = time.perf_counter()
    report = {"dry_run": args.dry_run, "environment": _environment(device), "sections": {}, "total_s": 0.0}
    json_path, md_path = out / "gpu_check.json", out / "gpu_check.md"
    for name, fn in SECTIONS:
        if name not in args.sections:
            continue
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            report["sections"][name] = {"skipped": f"not started: {elapsed:.0f} s elapsed, budget {args.budget_s:.0f} s"}
            continue
        t0 = time.perf_counter()
        try:
            body = fn(sizes, device, clock, memory, state)
        except Exception as error:
            body = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
            memory.reset()
        body["section_s"] = round(time.perf_counter() - t0, 1)
        report["sections"][name] = body
        report["total_s"] = round(time.perf_counter() - start, 1)
        json_path.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
        print(f"[gpu_check] {name}: {'error' if 'error' in body else 'done'} in {body['section_s']} s", flush=True)
    report["total_s"] = round(time.perf_counter() - start, 1)
    json_path.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    text = markdown(report)
    md_path.write_text(text)
    print(text)
    print(f"wrote {json_path} and {md_path}")
    return 0 if all("error" not in b and "skipped" not in b for b in report["sections"].values()) else 1


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
