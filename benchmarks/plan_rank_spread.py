"""How far rank 0's trace (what ``python -m examples.seedvr2 plan`` reads) is from the heaviest rank's: the 3B DiT step
and the wavefront VAE's encode and decode of one 21-frame batch, traced on every rank of SP degrees that do not split
the windows evenly. Needs the CUDA build of torch (no GPU).

    python benchmarks/plan_rank_spread.py 720p 3 7      # clip (720p, 1080p, 4k), then SP degrees

Prints each rank's peak of live device bytes (GiB) per stage and the seconds each trace took.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.seedvr2.memory.fake_gpu_runs import CLIPS, Clip, dit_rank, vae_rank  # noqa: E402
from winsp.testing.fake_gpu import run_fake_gpu  # noqa: E402


def main(argv: list[str]) -> int:
    whole = CLIPS[argv[0]]
    clip = Clip(min(21, whole.frames), whole.height, whole.width)  # the planner's default batch
    for sp in map(int, argv[1:]):
        runs = [("DiT", dit_rank, ("3b", clip.latent), {})]
        runs += [(f"VAE wavefront {stage}", vae_rank, ("wavefront", clip), {"stage": stage})
                 for stage in ("encode", "decode")]
        for name, fn, args, kwargs in runs:
            start = time.time()
            report = run_fake_gpu(fn, sp, *args, check=False, **kwargs)
            peaks = [report.ranks[r].peak_bytes / 2**30 for r in sorted(report.ranks)]
            print(f"{clip.describe()} SP {sp} {name}: " + ", ".join(f"{p:.2f}" for p in peaks)
                  + f" GiB (rank 0 {peaks[0]:.2f}, max {max(peaks):.2f}; {time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
