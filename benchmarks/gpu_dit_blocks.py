"""One prepared device check: SeedVR2 3B (or 7B) blocks and window attention per backend on one GPU.

    python benchmarks/gpu_dit_blocks.py                    # on a CUDA machine: bf16, 3B dims, 2 blocks, 720p x 21 frames
    python benchmarks/gpu_dit_blocks.py --model 7b         # the same with 7B blocks (3072 wide, 24 heads, GELU MLP)
    python benchmarks/gpu_dit_blocks.py --device cpu --small   # smoke run of the same code path on a CPU

For every attention backend that can run on the device it reports: agreement with the per-window SDPA reference
(float32 reference on the same bf16 inputs, a small window set), forward milliseconds of window attention alone over
both layouts of the grid, the attention TFLOP/s (4 * S^2 * heads * head_dim per window segment of length S), and the
milliseconds per DiT block of a 2-block model forward. Writes a markdown table to stdout and, when ``$OUT`` is set,
to ``$OUT/gpu_dit_blocks.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check import Clock  # noqa: E402  (benchmarks/ is on sys.path when this file runs)

import winsp  # noqa: E402
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT  # noqa: E402
from winsp.attention.windows import reference_window_attention, select_backend, window_attention  # noqa: E402
from winsp.runtime.runtime import LocalWindows  # noqa: E402


def _segments(grid, text_len: int, method: str) -> winsp.attention.WindowSegments:
    plan = winsp.planning.plan_schedule([grid], [winsp.make_geometry(method, (4, 3, 3))], 1)[0]
    return LocalWindows(plan, 0, (text_len,)).segments


def _attention_flops(segments: winsp.attention.WindowSegments, heads: int, head_dim: int) -> float:
    return float(sum(4 * (v + t) ** 2 * heads * head_dim for v, t in zip(segments.vid_counts, segments.txt_lengths)))


def _qkv(segments, text_len, heads, head_dim, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    def draw(rows):
        return torch.randn(rows, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    return [draw(segments.total_vid) for _ in range(3)] + [draw(text_len) for _ in range(3)]


def _attend_all(per_layout, layouts, backend: str) -> list:
    """Window attention of every layout's inputs with ``backend`` (one timed unit)."""
    return [window_attention(*x, s, backend=backend) for x, s in zip(per_layout, layouts, strict=True)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small dims and grid (a smoke run)")
    parser.add_argument("--model", choices=("3b", "7b"), default="3b", help="whose blocks (default: 3b)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: CUDA is not available (use --device cpu --small for a smoke run)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    if args.small:
        dims = dict(vid_dim=128, txt_in_dim=64, heads=2, head_dim=64, num_layers=2)
        grid, text_len, iters = (2, 12, 20), 8, 2
    elif args.model == "3b":
        dims = dict(vid_dim=2560, txt_in_dim=5120, heads=20, head_dim=128, num_layers=2)
        grid, text_len, iters = (6, 45, 80), 58, args.iters  # 720p x 21 frames: latent 6 x 90 x 160, patch 1x2x2
    else:
        dims = dict(vid_dim=3072, txt_in_dim=5120, heads=24, head_dim=128, num_layers=2)
        grid, text_len, iters = (6, 45, 80), 58, args.iters
    heads, head_dim = dims["heads"], dims["head_dim"]
    timed = Clock(device).median_ms
    lines = [f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__};"
             f" bf16; SeedVR2 {args.model.upper()} blocks; post-patch grid {grid}, {text_len} text tokens;"
             f" {heads} heads x {head_dim}", "",
             "| backend | max err vs fp32 reference | attention ms (regular + shifted) | attention TFLOP/s |"
             " ms per block (2-block forward) |", "|---|---:|---:|---:|---:|"]

    layouts = [_segments(grid, text_len, m) for m in ("regular", "shifted")]
    check = _segments((2, 10, 14), 5, "shifted")
    backends = [b for b in winsp.attention.available_backends(device)]
    if args.model == "3b":
        config = NaDiTConfig.seedvr2_at_size(**dims, mm_layers=10, rope_dim=dims["head_dim"])
    else:
        config = NaDiTConfig.seedvr2_7b_at_size(**dims)
    torch.manual_seed(0)
    model = SeedVR2NaDiT(config).to(device=device, dtype=dtype).eval()
    t, h, w = grid
    vid = torch.randn(t * h * 2 * w * 2, 33, device=device, dtype=dtype)
    txt = torch.randn(text_len, dims["txt_in_dim"], device=device, dtype=dtype)
    vid_shape = torch.tensor([[t, 2 * h, 2 * w]], device=device)
    txt_shape = torch.tensor([[text_len]], device=device)
    for backend in backends:
        if any(_runnable(backend, device, s, dtype) is False for s in layouts + [check]):
            lines.append(f"| {backend} | cannot run on these windows | | | |")
            continue
        inputs = _qkv(check, 5, heads, head_dim, dtype, device)
        got = window_attention(*inputs, check, backend=backend)
        want = reference_window_attention(*[x.float() for x in inputs], check)
        err = max((g.float() - w_).abs().max().item() for g, w_ in zip(got, want))
        per_layout = [_qkv(s, text_len, heads, head_dim, dtype, device, seed=1) for s in layouts]
        with torch.no_grad():
            ms = timed(partial(_attend_all, per_layout, layouts, backend), warmup=2, iters=iters)
        tflops = sum(_attention_flops(s, heads, head_dim) for s in layouts) / (ms * 1e-3) / 1e12
        model.build_runtime(winsp.DiffusionParallelConfig(attention_backend=backend))
        with torch.no_grad():
            block_ms = timed(lambda: model(vid, txt, vid_shape, txt_shape, torch.tensor([1000.0], device=device)),
                             warmup=1, iters=max(3, iters // 2)) / config.num_layers
        lines.append(f"| {backend} | {err:.2e} | {ms:.2f} | {tflops:.1f} | {block_ms:.2f} |")
    report = "\n".join(lines)
    print(report)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_dit_blocks.md").write_text(report + "\n")
    return 0


def _runnable(backend: str, device: torch.device, segments, dtype) -> bool:
    try:
        return select_backend(device, segments, backend, dtype=dtype) == backend
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
