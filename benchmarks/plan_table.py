"""The planner's table (docs/memory.md): SeedVR2 3B and 7B at 720p, 1080p and 4K on 1 to 8 GPUs of 24, 48, 80 and
141 GiB, from fake-GPU traces (``python -m examples.seedvr2 plan`` for each cell). Needs the CUDA build of torch.

    python benchmarks/plan_table.py [--models 3b 7b] [--gpus 1 2 3 4 5 6 7 8] [--out plan_table.md]

Traces are shared between cells (they depend on the model, SP degree, clip and settings, not on the GPU count or
memory), and each (model, resolution, GPU count) is searched once against the smallest memory: the answer for a
larger memory is the first of the candidates already tried that fits it. Rows are appended to ``--out`` as they are
done, so a run cut short keeps them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.seedvr2.memory.fake_gpu_runs import CLIPS  # noqa: E402
from examples.seedvr2.memory.planner import GiB, PlanRequest, plan_restore  # noqa: E402

MEMORIES = (24, 48, 80, 141)


def cell(result, memory: int) -> str:
    """The first candidate tried that fits ``memory`` GiB, in a table cell."""
    for c in result.tried:
        if c.peaks.peak <= memory * GiB:
            s = c.settings
            vae = f"tiled {s.vae_tile}" if s.vae_parallel == "tiled" else s.vae_parallel
            return (f"SP {c.sp}, batch {s.batch_frames}, {vae}{', shard' if c.shard else ''}: "
                    f"{c.peaks.peak / GiB:.1f}")
    if result.chosen is None:
        best = min(c.peaks.peak for c in result.tried)
        return f"no ({best / GiB:.1f} needed)"
    return "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["3b", "7b"])
    parser.add_argument("--resolutions", nargs="+", default=["720p", "1080p", "4k"])
    parser.add_argument("--gpus", nargs="+", type=int, default=list(range(1, 9)))
    parser.add_argument("--out", type=Path, default=Path("plan_table.md"))
    args = parser.parse_args(argv)
    header = ("| model | clip | GPUs | " + " | ".join(f"{m} GiB" for m in MEMORIES) + " |\n|"
              + "---|" * (3 + len(MEMORIES)) + "\n")
    args.out.write_text(header)
    cache: dict = {}
    for model in args.models:
        for name in args.resolutions:
            clip = CLIPS[name]
            for gpus in args.gpus:
                t0 = time.time()
                request = PlanRequest(gpus, min(MEMORIES) * GiB, model, clip.width, clip.height, clip.frames)
                result = plan_restore(request, cache=cache)
                row = (f"| {model} | {clip.describe()} | {gpus} | "
                       + " | ".join(cell(result, m) for m in MEMORIES) + " |\n")
                with args.out.open("a") as f:
                    f.write(row)
                print(row.strip(), f"({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
