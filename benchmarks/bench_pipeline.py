"""Seconds per stage of the SeedVR2 restore pipeline (demo-sized models) on the CPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_pipeline.py [--frames 9] [--height 64] [--width 96] [--repeats 3]
        [--world 1 2] [--json out.json]

Stages are those of the command line: read (decode an H.264 file made here), prepare (resize/crop to the working
size), encode (VAE), DiT (one step), decode (VAE), colour fix (wavelet), write (H.264 encode). For each stage the
median over ``--repeats`` runs of the process CPU time and of the wall time is printed; at ``--world`` > 1 the ranks
run under ``winsp.testing.run_ranks`` (gloo) and the slowest rank's figures are shown, for the VAE replicated and
height-sharded. The models are the embedded demo models (the golden files' tiny architecture), so the figures show
the pipeline's own overheads and the split of work between stages, not SeedVR2 3B speed.

    OMP_NUM_THREADS=1 python benchmarks/bench_pipeline.py --stream [--height 32] [--width 48] [--repeats 3]

Long clips (the command line as a user runs it, in subprocesses, demo weights): peak RSS of restoring a 40- and a
160-frame clip at the same settings (their ratio shows memory no longer follows the clip's length); frames/s of one
process against ``torchrun --nproc-per-node 4 --sp-size 2`` (2 temporal groups x window SP 2) on a 160-frame clip; and
the seam check: mean absolute frame-to-frame difference of the restored clip at batch boundaries against the range
seen inside batches (``--overlap`` 5, the default, 4 and 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from examples.seedvr2.media.color_fix import wavelet_color_fix  # noqa: E402
from examples.seedvr2.models.demo import demo_models, demo_text_embeds, sample_frames  # noqa: E402
from examples.seedvr2.media import frames_to_model, model_to_frames, plan_geometry, read_media, write_media  # noqa: E402
from examples.seedvr2.pipeline import SeedVR2Pipeline  # noqa: E402
from winsp.testing import run_ranks  # noqa: E402

STAGES = ("read", "prepare", "encode", "DiT", "decode", "colour fix", "write")


class Clock:
    """Process CPU seconds and wall seconds of each stage of one run."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    def run(self, stage: str, fn):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        self.cpu[stage] = time.process_time() - c0
        self.wall[stage] = time.perf_counter() - w0
        return out


def one_run(pipe: SeedVR2Pipeline, src: str, dst: str, rank: int) -> Clock:
    clock = Clock()
    media = clock.run("read", lambda: read_media(src))
    geometry = plan_geometry((media.height, media.width))
    video = clock.run("prepare", lambda: frames_to_model(media.frames, geometry))
    latent = clock.run("encode", lambda: pipe.encode(video))
    txt = demo_text_embeds()
    restored = clock.run("DiT", lambda: pipe.denoise(latent, txt, generator=torch.Generator().manual_seed(0)))
    out = clock.run("decode", lambda: pipe.decode(restored, media.num_frames))
    fixed = clock.run("colour fix", lambda: wavelet_color_fix(out.transpose(0, 1), video.transpose(0, 1)))
    frames = model_to_frames(fixed.transpose(0, 1), geometry)
    if rank == 0:
        clock.run("write", lambda: write_media(dst, frames, media.fps, overwrite=True))  # the same file each run
    else:
        clock.cpu["write"] = clock.wall["write"] = 0.0
    return clock


def bench(rank: int, world: int, src: str, vae_parallel: str, repeats: int) -> dict:
    """Median CPU / wall seconds per stage on this rank (a warm-up run first)."""
    from winsp.comm.group import SPGroup

    torch.set_num_threads(1)
    dit, vae = demo_models()
    pipe = SeedVR2Pipeline(dit, vae, vae_parallel, group=SPGroup.world())
    dst = os.path.join(os.path.dirname(src), f"out_{world}_{vae_parallel}.mp4")
    one_run(pipe, src, dst, rank)  # warm-up (imports, plan caches)
    clocks = [one_run(pipe, src, dst, rank) for _ in range(repeats)]
    return {
        "cpu": {s: statistics.median(c.cpu[s] for c in clocks) for s in STAGES},
        "wall": {s: statistics.median(c.wall[s] for c in clocks) for s in STAGES},
    }


# ---- long clips ---------------------------------------------------------------------------------------------------

PREFIX = "python -m examples.seedvr2: "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(args: list, nproc: int = 1) -> str:
    """Run the command line (as ``python -m`` or under torchrun); return its summary line."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    result = subprocess.run(launcher + ["-m", "examples.seedvr2", "restore", *map(str, args), "--quiet",
                                        "--overwrite"], cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr)
    return [line for line in result.stderr.splitlines() if line.startswith(PREFIX)][-1]


def _field(summary: str, name: str) -> list[float]:
    if name == "frames/s":
        return [float(summary.split(" frames/s")[0].split()[-1])]
    return [float(v) for v in summary.split(name)[1].split("GiB")[0].split()]


def seam_check(height: int, width: int, frames: int, batch_frames: int, overlap: int) -> dict:
    """Mean |frame t+1 - frame t| of a restored synthetic clip (demo weights, streamed), split into transitions at
    batch boundaries (from the first blended frame to the first frame after the blend) and inside batches."""
    from examples.seedvr2.restore.temporal import plan_temporal_batches

    torch.set_num_threads(1)
    dit, vae = demo_models()
    pipe = SeedVR2Pipeline(dit, vae)
    video = sample_frames(frames, height, width).permute(0, 3, 1, 2).float() / 127.5 - 1  # [t, 3, h, w]
    out = torch.stack(list(pipe.restore_stream(iter(video), demo_text_embeds(), batch_frames=batch_frames,
                                               overlap=overlap, seed=0)))
    diffs = (out[1:] - out[:-1]).abs().mean(dim=(1, 2, 3)) * 127.5  # in 8-bit levels
    plan = plan_temporal_batches(frames, batch_frames, overlap)
    boundary = set()
    for batch in plan[1:]:  # transitions t -> t+1 that involve a blended frame or the first frame after the blend
        boundary.update(range(batch.start - 1, batch.start + batch.blend))
    inside = [float(d) for t, d in enumerate(diffs) if t not in boundary]
    at = [float(d) for t, d in enumerate(diffs) if t in boundary]
    return {"inside": (min(inside), statistics.median(inside), max(inside)), "boundary": (min(at), max(at))}


def stream_main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clips = {}
        for frames in (40, 160):
            clips[frames] = os.path.join(tmp, f"clip{frames}.mp4")
            write_media(clips[frames], sample_frames(frames, args.height, args.width).numpy(), Fraction(24))
        out = os.path.join(tmp, "out.mp4")
        rss = {n: statistics.median(_field(run_cli([clips[n], "-o", out]), "peak RSS per rank")[0]
                                    for _ in range(args.repeats)) for n in (40, 160)}
        print(f"peak RSS (GiB, median of {args.repeats}): 40 frames {rss[40]:.3f}, 160 frames {rss[160]:.3f}, "
              f"ratio {rss[160] / rss[40]:.3f}")
        one = [_field(run_cli([clips[160], "-o", out]), "frames/s")[0] for _ in range(args.repeats)]
        mesh = [run_cli([clips[160], "-o", out, "--sp-size", "2"], nproc=4) for _ in range(args.repeats)]
        fps4 = [_field(s, "frames/s")[0] for s in mesh]
        print(f"frames/s, 160 frames (median of {args.repeats}): one process {statistics.median(one):.2f}, "
              f"4 ranks = 2 groups x SP 2 {statistics.median(fps4):.2f}, ratio "
              f"{statistics.median(fps4) / statistics.median(one):.3f}; per-rank peak RSS at 4 ranks "
              f"{_field(mesh[-1], 'peak RSS per rank')} GiB")
    for overlap in (5, 4, 0):
        seam = seam_check(args.height, args.width, 61, 21, overlap)
        lo, med, hi = seam["inside"]
        print(f"seam check, overlap {overlap}: inside batches min {lo:.2f} median {med:.2f} max {hi:.2f}; "
              f"at boundaries min {seam['boundary'][0]:.2f} max {seam['boundary'][1]:.2f} (8-bit levels)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--stream", action="store_true", help="the long-clip figures instead (see above)")
    args = parser.parse_args()
    if args.stream:
        return stream_main(args)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "clip.mp4")
        write_media(src, sample_frames(args.frames, args.height, args.width).numpy(), Fraction(24))
        for world in args.world:
            modes = ("replicated",) if world == 1 else ("replicated", "height")
            for mode in modes:
                if world == 1:
                    per_rank = [bench(0, 1, src, mode, args.repeats)]
                else:
                    per_rank = run_ranks(bench, world, src, mode, args.repeats, timeout=1200.0)
                worst = {k: {s: max(r[k][s] for r in per_rank) for s in STAGES} for k in ("cpu", "wall")}
                results[f"SP={world} VAE {mode}"] = worst

    print(f"clip: {args.frames} frames {args.width}x{args.height}, demo models, torch {torch.__version__}, "
          f"{args.repeats} repeats (median), slowest rank")
    header = "| run | " + " | ".join(STAGES) + " | total |"
    print(header)
    print("|" + "---|" * (len(STAGES) + 2))
    for name, figures in results.items():
        for kind in ("cpu", "wall"):
            cells = [f"{figures[kind][s]:.3f}" for s in STAGES]
            print(f"| {name} ({kind} s) | " + " | ".join(cells) + f" | {sum(figures[kind].values()):.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
