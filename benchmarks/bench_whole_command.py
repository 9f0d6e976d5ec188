"""The whole command as a user times it: ``python -m examples.seedvr2 restore CLIP`` against the same on N ranks.

    python benchmarks/bench_whole_command.py [--clips 320x240x33 1280x720x9] [--ranks 2] [--rounds 3]
        [--launcher auto|torchrun|ranks] [--vae-channels 128,256,512,512] [--one-thread-baseline]
        [--json out.json] [--quick]

Makes the clips itself (the synthetic demo clip, H.264), then for ``--rounds`` rounds runs, interleaved (one process,
then N ranks, then the next round), each command from start to exit as a subprocess, and takes the best (minimum)
of the rounds for each. Printed per clip: the whole command's wall time, the CLI's own ``restore`` stage (from its
summary line), and the ratios one process / N ranks. Demo weights (no checkpoints), float32 on the CPU.

The single process gets what a user's process gets: the environment as it is, minus ``OMP_NUM_THREADS`` (torch
then uses one intra-op thread per core). The N ranks start with ``torchrun --standalone --nproc-per-node N``
(torchrun gives each rank ``OMP_NUM_THREADS=1``) or, where the command has it, the CLI's own launcher
``restore ... --ranks N`` (``--launcher auto``: the launcher when ``restore --help`` lists ``--ranks``, else
torchrun). ``--quick``: one small clip, one round (a smoke test of the script, not a measurement).

``--vae-channels``: the demo VAE at these widths (``128,256,512,512``: the released architecture, random weights;
through ``SEEDVR2_DEMO_VAE_CHANNELS``), so that the VAE costs what it costs a user. ``--one-thread-baseline``: also
time the single process with ``OMP_NUM_THREADS=1`` (one core's worth, the per-rank budget of the parallel command),
interleaved with the others, and print the ratios against it too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PREFIX = "python -m examples.seedvr2: "


def parse_clip(text: str) -> tuple[int, int, int]:
    """``WIDTHxHEIGHTxFRAMES`` -> (width, height, frames)."""
    try:
        width, height, frames = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a clip is WIDTHxHEIGHTxFRAMES (e.g. 320x240x33), got {text!r}") from None
    if min(width, height, frames) < 1:
        raise argparse.ArgumentTypeError(f"a clip needs positive sides and frames, got {text!r}")
    return width, height, frames


def make_clip(directory: str, clip: tuple[int, int, int]) -> str:
    """Write the synthetic demo clip of this size as H.264 (or a PNG for one frame); returns its path."""
    from examples.seedvr2.models.demo import sample_frames
    from examples.seedvr2.media import write_media

    width, height, frames = clip
    path = os.path.join(directory, f"clip_{width}x{height}x{frames}{'.png' if frames == 1 else '.mp4'}")
    if not os.path.exists(path):
        write_media(path, sample_frames(frames, height, width).numpy(), Fraction(24))
    return path


def user_env(extra: dict | None = None) -> dict:
    """The environment a user's command gets: ours without ``OMP_NUM_THREADS``, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def has_ranks_flag() -> bool:
    """Whether the CLI has its own launcher (``restore --ranks N``)."""
    done = subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", "--help"], cwd=ROOT,
                          env=user_env(), capture_output=True, text=True, timeout=120)
    return "--ranks" in done.stdout


def command(ranks: int, launcher: str, clip: str, output: str, extra: list[str]) -> list[str]:
    """The command line of a restore of ``clip`` on ``ranks`` ranks (``launcher``: ``torchrun`` or ``ranks``)."""
    cli = ["-m", "examples.seedvr2", "restore", clip, "-o", output, "--overwrite", "--quiet", *extra]
    if ranks == 1:
        return [sys.executable, *cli]
    if launcher == "ranks":
        return [sys.executable, *cli, "--ranks", str(ranks)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *cli]


def summary_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(PREFIX) and " | " in line]
    if not lines:
        raise RuntimeError(f"no summary line in the command's output:\n{stderr[-3000:]}")
    return lines[-1]


def run_once(cmd: list[str], env: dict | None = None, timeout: float = 3600.0) -> dict:
    """Run ``cmd``; its wall time from start to exit, its summary line and the CLI's stage times (read, load,
    restore; written by rank 0 to ``SEEDVR2_STAGE_TIMES``, which times nothing more)."""
    with tempfile.TemporaryDirectory() as scratch:
        times = os.path.join(scratch, "stages.json")
        env = dict(env or user_env(), SEEDVR2_STAGE_TIMES=times)
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - start
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        summary = summary_line(done.stderr)
        if not os.path.exists(times):
            raise RuntimeError(f"the command wrote no stage times to SEEDVR2_STAGE_TIMES: {summary}")
        with open(times) as f:
            stages = json.load(f)
    return {"wall_s": wall, "stages": stages, "summary": summary}


def measure(clips: list[tuple[int, int, int]], ranks: int, rounds: int, launcher: str, extra: list[str],
            directory: str, log=print, env: dict | None = None, one_thread: bool = False) -> list[dict]:
    """Interleaved rounds of one process and ``ranks`` ranks on every clip (and, with ``one_thread``, one process on
    one thread, key 0); the best of the rounds of each."""
    rows = []
    env = env or user_env()
    for clip in clips:
        path = make_clip(directory, clip)
        out = os.path.join(directory, "out" + os.path.splitext(path)[1])
        kinds = ((0, 1),) * one_thread + ((1, 1), (ranks, ranks))  # (key, ranks); key 0: one process, one thread
        runs: dict[int, list[dict]] = {key: [] for key, _ in kinds}
        for r in range(rounds):
            for key, p in kinds:
                result = run_once(command(p, launcher, path, out, extra),
                                  dict(env, OMP_NUM_THREADS="1") if key == 0 else env)
                runs[key].append(result)
                log(f"  round {r + 1} {'x'.join(map(str, clip))} P={p}{' (1 thread)' if key == 0 else ''}: whole "
                    f"{result['wall_s']:.2f} s, restore {result['stages'].get('restore', float('nan')):.2f} s "
                    f"(load {os.getloadavg()[0]:.1f})")
        best = {p: {"wall_s": min(x["wall_s"] for x in runs[p]),
                    "restore_s": min(x["stages"].get("restore", float("inf")) for x in runs[p])} for p in runs}
        one = {} if not one_thread else {
            "p1_1thread_wall_s": best[0]["wall_s"], "p1_1thread_restore_s": best[0]["restore_s"],
            "whole_speedup_1thread": best[0]["wall_s"] / best[ranks]["wall_s"],
            "restore_speedup_1thread": best[0]["restore_s"] / best[ranks]["restore_s"]}
        rows.append({**one,
            "clip": "x".join(map(str, clip)), "ranks": ranks, "launcher": launcher if ranks > 1 else "-",
            "p1_wall_s": best[1]["wall_s"], "pn_wall_s": best[ranks]["wall_s"],
            "p1_restore_s": best[1]["restore_s"], "pn_restore_s": best[ranks]["restore_s"],
            "whole_speedup": best[1]["wall_s"] / best[ranks]["wall_s"],
            "restore_speedup": best[1]["restore_s"] / best[ranks]["restore_s"],
            "summary_pn": runs[ranks][-1]["summary"], "rounds": {str(p): runs[p] for p in runs},
        })
    return rows


def table(rows: list[dict]) -> str:
    n = rows[0]["ranks"] if rows else 2
    lines = [f"| clip (WxHxframes) | whole command P1 / P{n} (s) | whole P1/P{n} | CLI restore stage P1 / P{n} (s) "
             f"| restore P1/P{n} |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['clip']} | {r['p1_wall_s']:.2f} / {r['pn_wall_s']:.2f} | **{r['whole_speedup']:.2f}x** | "
                     f"{r['p1_restore_s']:.2f} / {r['pn_restore_s']:.2f} | **{r['restore_speedup']:.2f}x** |")
    if rows and "p1_1thread_wall_s" in rows[0]:
        lines += ["", f"| clip | whole P1 on 1 thread / P{n} (s) | ratio | restore P1 on 1 thread / P{n} (s) | ratio |",
                  "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['clip']} | {r['p1_1thread_wall_s']:.2f} / {r['pn_wall_s']:.2f} | "
                         f"{r['whole_speedup_1thread']:.2f}x | {r['p1_1thread_restore_s']:.2f} / "
                         f"{r['pn_restore_s']:.2f} | {r['restore_speedup_1thread']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", nargs="+", type=parse_clip, default=[(320, 240, 33), (1280, 720, 9)],
                        help="WIDTHxHEIGHTxFRAMES (default: 320x240x33 1280x720x9)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the parallel command (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of them is kept")
    parser.add_argument("--launcher", choices=("auto", "torchrun", "ranks"), default="auto")
    parser.add_argument("--json", help="also write the figures (every round) to this file")
    parser.add_argument("--quick", action="store_true", help="one 96x64x9 clip, one round (checks the script)")
    parser.add_argument("--vae-channels", metavar="WIDTHS",
                        help="the demo VAE's widths (128,256,512,512: the released architecture, random weights)")
    parser.add_argument("--one-thread-baseline", action="store_true",
                        help="also time one process on one thread (OMP_NUM_THREADS=1), interleaved")
    parser.add_argument("--keep", metavar="DIR", help="make the clips and outputs in DIR (kept) instead of a temp dir")
    parser.add_argument("cli_args", nargs=argparse.REMAINDER,
                        help="after --: more restore options for both commands (e.g. -- --color-fix wavelet)")
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    extra = [a for a in args.cli_args if a != "--"]
    if args.quick:
        args.clips, args.rounds = [(96, 64, 9)], 1
    launcher = args.launcher
    if launcher == "auto":
        launcher = "ranks" if has_ranks_flag() else "torchrun"
    env = user_env({"SEEDVR2_DEMO_VAE_CHANNELS": args.vae_channels} if args.vae_channels else None)
    print(f"whole command, P1 vs P{args.ranks} ({launcher}); {args.rounds} interleaved rounds, best kept; "
          f"{os.cpu_count()} CPUs; load average at start {os.getloadavg()[0]:.2f}; demo weights"
          + (f", VAE widths {args.vae_channels}" if args.vae_channels else ""))
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.keep or tmp
        os.makedirs(directory, exist_ok=True)
        rows = measure(args.clips, args.ranks, args.rounds, launcher, extra, directory, env=env,
                       one_thread=args.one_thread_baseline)
    print(table(rows))
    print(f"load average at end {os.getloadavg()[0]:.2f}; P{args.ranks} summary of the last round of each clip:")
    for r in rows:
        print(f"  {r['summary_pn']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "clips"},
                       "clips": ["x".join(map(str, c)) for c in args.clips], "launcher": launcher, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
