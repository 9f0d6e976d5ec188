"""Resident weight memory and DiT forward time by checkpoint format: bf16 against fp8 and GGUF kept packed.

Run from the repository root: ``OMP_NUM_THREADS=2 python benchmarks/bench_weights.py`` (needs the ``gguf`` extra).
Model: the released 3B architecture at full width (dim 2560, 20 heads x 128, SwiGLU) with 2 blocks, seeded random
weights (std 0.02). The checkpoint is written once in each format; then each format is loaded in a fresh process into
a bf16 model (``weights="stored"``; bf16 with ``"compute"``) and measured there:

* weights: the bytes the loaded model holds (parameters and buffers, packed ones at their stored size), and the rise
  of the process's resident set from before the load to after the forwards (weights, touched; activations; one
  expanded layer; allocator slack; safetensors maps the file, so RSS right after a load would miss its pages);
* forward: median seconds of a bf16 forward over one sample of pre-patch (1, 32, 48) = 384 video tokens and 32 text
  tokens (3 runs after a warm-up), and its ratio to bf16. The per-call expansion costs the same whatever the token
  count, so its share falls as the tokens per call grow.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FORMATS = ("bf16", "fp8_e4m3fn", "gguf_Q8_0", "gguf_Q5_K", "gguf_Q4_K")
LAYERS = 2


def config():
    from examples.seedvr2.models.dit import NaDiTConfig

    return NaDiTConfig.seedvr2_at_size(vid_dim=2560, txt_in_dim=5120, heads=20, head_dim=128, num_layers=LAYERS,
                                       mm_layers=LAYERS, rope_dim=128)


def _gguf_type(kind: str, key: str, value) -> str:
    """The GGUF type of one tensor: ``kind`` for matrices whose rows split into 256-wide blocks, else F32."""
    return kind if value.dim() == 2 and value.shape[-1] % 256 == 0 else "F32"


def write_checkpoints(directory: Path) -> dict[str, Path]:
    from safetensors.torch import save_file

    from examples.seedvr2.models.dit import SeedVR2NaDiT
    from tests.gguf_writers import write_gguf

    torch.manual_seed(0)
    model = SeedVR2NaDiT(config())
    state = {k: (torch.randn_like(v) * 0.02 if v.dim() == 2 else v) for k, v in model.state_dict().items()}
    del model
    paths = {}
    for fmt in FORMATS:
        path = directory / (f"{fmt}.gguf" if fmt.startswith("gguf") else f"{fmt}.safetensors")
        if fmt == "bf16":
            save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(path))
        elif fmt == "fp8_e4m3fn":
            save_file({k: (v.to(torch.float8_e4m3fn) if v.dim() == 2 else v.to(torch.bfloat16))
                       for k, v in state.items()}, str(path))
        else:
            kind = fmt.split("_", 1)[1]
            write_gguf(path, state, partial(_gguf_type, kind))
        paths[fmt] = path
    return paths


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(fmt: str, path: str) -> dict:
    """Load ``path`` into a bf16 model in this process and time its forward (called in a fresh process)."""
    from examples.seedvr2.models.dit import SeedVR2NaDiT, load_dit_checkpoint

    cfg = config()
    before = _rss()
    with torch.device("meta"):
        model = SeedVR2NaDiT(cfg).to(torch.bfloat16)
    load_dit_checkpoint(model, path, weights="compute" if fmt == "bf16" else "stored", report=lambda line: None)
    model.eval()
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    g = torch.Generator().manual_seed(1)
    shape = (1, 32, 48)
    vid = torch.randn(shape[0] * shape[1] * shape[2], cfg.vid_in_channels, generator=g).bfloat16()
    txt = torch.randn(32, cfg.txt_in_dim, generator=g).bfloat16()
    args = (vid, txt, torch.tensor([shape]), torch.tensor([[32]]), torch.tensor([500.0]))
    times = []
    with torch.no_grad():
        model(*args)
        for _ in range(3):
            start = time.perf_counter()
            model(*args)
            times.append(time.perf_counter() - start)
    return {"format": fmt, "held": held, "rss": _rss() - before, "forward": statistics.median(times)}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--measure":
        print(json.dumps(measure(sys.argv[2], sys.argv[3])))
        return
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_checkpoints(Path(tmp))
        rows = []
        for fmt in FORMATS:
            out = subprocess.run([sys.executable, __file__, "--measure", fmt, str(paths[fmt])], check=True,
                                 capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            rows[-1]["file"] = paths[fmt].stat().st_size
    base = rows[0]
    print(f"3B width, {LAYERS} blocks, bf16 compute on CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average before {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}, "
          f"after {os.getloadavg()[0]:.1f}")
    print("| format | file MiB | weights held MiB | vs bf16 | RSS rise MiB | forward s | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['file'] / 2**20:.0f} | {r['held'] / 2**20:.0f} | {r['held'] / base['held']:.2f} | "
              f"{r['rss'] / 2**20:.0f} | {r['forward']:.3f} | {r['forward'] / base['forward']:.2f} |")


if __name__ == "__main__":
    main()
