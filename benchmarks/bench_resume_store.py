"""The cost of keeping finished batches for resuming: ``restore`` with its batch store against ``--no-resume-store``.

    python benchmarks/bench_resume_store.py [--clips 1280x720x45] [--rounds 3] [--vae-channels 128,256,512,512]
        [--batch-frames 21] [--overlap 5] [--ranks N] [--json out.json] [--quick]

Makes the synthetic demo clip of each size (H.264, 24 fps), then for ``--rounds`` rounds runs, interleaved, the
whole command with the store (the default) and with ``--no-resume-store``, each as a subprocess from start to exit,
and takes the best (minimum) of the rounds for each. Printed per clip: the wall time and the CLI's ``restore`` stage
(from its closing line) of both, the store's overhead on each, and its disk: the most bytes the store held during the
run (polled every 20 ms) and the figure :func:`examples.seedvr2.restore.batch_store.store_bytes` plans with, both
also per minute of output video. Demo weights (no checkpoints); ``--vae-channels`` gives the demo VAE the released
widths (``128,256,512,512``, the default, through ``SEEDVR2_DEMO_VAE_CHANNELS``) so that the VAE costs what it costs
a user. On a GPU machine the command runs on the GPU as a user's does.

``--quick``: one 96x64x9 clip, one round, the demo VAE's own widths (a smoke test of the script, not a measurement).
The store's target: at most 5 % of the restore's wall time (issue 48).

``--keep-only 1280x720 [1920x1080 ...]``: no restore; times the store alone keeping one minute of output at each size
(24 fps, the ``--batch-frames``/``--overlap`` plan: every batch's final frames and its tail, written as ``restore``
writes them, all kept until the end as a run keeps them), and prints its seconds and GiB per minute of output: the
cost the store adds to a minute of restored video at that size, whatever restores it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_whole_command import make_clip, parse_clip, user_env  # noqa: E402

_STAGES = re.compile(r"\| ([\d.]+)s \(start-up ([\d.]+), read ([\d.]+), load ([\d.]+), restore ([\d.]+)\)")


def _dir_bytes(path: str) -> int:
    total = 0
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    for name in names:
        try:
            total += os.path.getsize(os.path.join(path, name))
        except OSError:
            pass
    return total


def run_once(clip: str, out_dir: str, keep: bool, args: argparse.Namespace, env: dict) -> dict:
    """One whole command; returns its wall time, restore stage and the store's peak bytes."""
    out = os.path.join(out_dir, f"out_{'kept' if keep else 'none'}.mp4")
    for path in (out, out + ".seedvr2-batches"):
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    cmd = [sys.executable, "-m", "examples.seedvr2", "restore", clip, "-o", out, "--demo", "--quiet",
           "--batch-frames", str(args.batch_frames), "--overlap", str(args.overlap)]
    if args.ranks:
        cmd += ["--ranks", str(args.ranks)]
    if not keep:
        cmd.append("--no-resume-store")
    peak = [0]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _dir_bytes(out + ".seedvr2-batches"))
            time.sleep(0.02)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    done.set()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"the command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    stages = _STAGES.search(proc.stderr)
    return {"wall_s": wall, "restore_s": float(stages.group(5)) if stages else None, "peak_store_bytes": peak[0]}


def bench_clip(clip_size: tuple[int, int, int], args: argparse.Namespace, env: dict, directory: str) -> dict:
    from examples.seedvr2.restore.batch_store import store_bytes
    from examples.seedvr2.restore.temporal import causal_frame_count, plan_temporal_batches

    width, height, frames = clip_size
    clip = make_clip(directory, clip_size)
    runs: dict[str, list[dict]] = {"kept": [], "none": []}
    for _ in range(args.rounds):
        for keep in (True, False):
            runs["kept" if keep else "none"].append(run_once(clip, directory, keep, args, env))
    best = {k: {"wall_s": min(r["wall_s"] for r in v),
                "restore_s": min((r["restore_s"] for r in v if r["restore_s"] is not None), default=None)}
            for k, v in runs.items()}
    batch_frames = min(args.batch_frames, causal_frame_count(frames))  # the CLI's clamp to a short clip
    overlap = min(args.overlap, max(0, batch_frames - 1))
    plan = plan_temporal_batches(frames, batch_frames, overlap)
    planned = store_bytes(frames, height, width, overlap, len(plan))
    peak = max(r["peak_store_bytes"] for r in runs["kept"])
    minutes = frames / 24 / 60
    result = {
        "clip": f"{width}x{height}x{frames}", "rounds": args.rounds, "with_store": best["kept"],
        "without_store": best["none"],
        "wall_overhead": best["kept"]["wall_s"] / best["none"]["wall_s"] - 1,
        "restore_overhead": (best["kept"]["restore_s"] / best["none"]["restore_s"] - 1
                             if best["kept"]["restore_s"] and best["none"]["restore_s"] else None),
        "peak_store_bytes": peak, "planned_store_bytes": planned,
        "peak_store_gib_per_minute": peak / 2**30 / minutes, "planned_store_gib_per_minute": planned / 2**30 / minutes,
    }
    return result


def keep_minute(size: str, args: argparse.Namespace, directory: str) -> dict:
    """Keep one minute of ``size`` (WxH) output in a store, batch by batch as ``restore`` keeps it; the writes timed."""
    import numpy as np

    from examples.seedvr2.restore.batch_store import BatchRecord, BatchStore
    from examples.seedvr2.restore.temporal import plan_temporal_batches

    width, height = (int(v) for v in size.lower().split("x"))
    frames = 24 * 60
    plan = plan_temporal_batches(frames, args.batch_frames, args.overlap)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, size=(args.batch_frames, height, width, 3), dtype=np.uint8)  # the frames' pixels
    store = BatchStore(os.path.join(directory, f"keep_{size}.mp4.seedvr2-batches"), (height, width, 3), frames)
    store.pending = {"benchmark": size}
    written = 0
    started = time.perf_counter()
    for batch in plan:  # final: the frames the cross-fade released; tail: those held for the next batch's overlap
        held_back = plan[batch.index + 1].blend if batch.index + 1 < len(plan) else 0
        final = pool[: batch.stop - held_back - written]
        tail = pool[:held_back]
        store.write_batch(BatchRecord(batch.index, batch.stop - held_back, written + len(final), final, tail))
        written += len(final)
    assert written == frames, (written, frames)
    seconds = time.perf_counter() - started
    held = _dir_bytes(store.directory)
    store.remove()
    return {"size": size, "batches": len(plan), "frames_kept": written, "keep_s_per_minute": seconds,
            "store_gib_per_minute": held / 2**30}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=parse_clip, nargs="+", default=[parse_clip("1280x720x45")])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vae-channels", default="128,256,512,512")
    parser.add_argument("--batch-frames", type=int, default=21)
    parser.add_argument("--overlap", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep-only", nargs="+", default=None, metavar="WxH")
    parser.add_argument("--keep-dir", default=None, help="where --keep-only writes (default: the system's temp folder)")
    args = parser.parse_args(argv)
    if args.keep_only:
        with tempfile.TemporaryDirectory(prefix="bench_resume_keep_", dir=args.keep_dir) as directory:
            kept = [keep_minute(size, args, directory) for size in args.keep_only]
        for r in kept:
            print(f"{r['size']:>10}: kept {r['frames_kept']} frames in {r['batches']} batches: "
                  f"{r['keep_s_per_minute']:.2f} s and {r['store_gib_per_minute']:.2f} GiB a minute of output")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(kept, f, indent=1)
        return 0
    if args.quick:
        args.clips, args.rounds, args.vae_channels = [parse_clip("96x64x9")], 1, ""
        args.batch_frames, args.overlap = 5, 1
    env = user_env({"SEEDVR2_DEMO_VAE_CHANNELS": args.vae_channels} if args.vae_channels else None)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_resume_store_") as directory:
        for clip in args.clips:
            results.append(bench_clip(clip, args, env, directory))
    print(f"{'clip':>16} {'wall kept':>10} {'wall none':>10} {'overhead':>9} {'restore kept':>13} "
          f"{'restore none':>13} {'overhead':>9} {'store peak':>11} {'GiB/min':>8} {'planned GiB/min':>16}")
    for r in results:
        ro = "-" if r["restore_overhead"] is None else f"{100 * r['restore_overhead']:+.1f}%"
        rk = r["with_store"]["restore_s"]
        rn = r["without_store"]["restore_s"]
        print(f"{r['clip']:>16} {r['with_store']['wall_s']:>9.2f}s {r['without_store']['wall_s']:>9.2f}s "
              f"{100 * r['wall_overhead']:>+8.1f}% {'-' if rk is None else f'{rk:.2f}s':>13} "
              f"{'-' if rn is None else f'{rn:.2f}s':>13} {ro:>9} {r['peak_store_bytes'] / 2**20:>9.1f}MB "
              f"{r['peak_store_gib_per_minute']:>8.2f} {r['planned_store_gib_per_minute']:>16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
