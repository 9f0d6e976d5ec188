"""Where a restore's time goes, stage by stage and rank by rank, at P = 1 and P = 2 (the whole command, as run).

    python benchmarks/bench_restore_profile.py [--clips 320x240x33 1280x720x9] [--ranks 1 2] [--rounds 1]
        [--launcher auto|torchrun|ranks] [--json out.json] [--quick] [--predict 2 4 8] [-- more restore options]

Runs ``python -m examples.seedvr2 restore CLIP`` (one process) and the same on N ranks (torchrun, or the CLI's own
``--ranks N`` where it exists) with ``SEEDVR2_PROFILE`` set, so that every rank writes its stage figures
(:mod:`examples.seedvr2.restore.stage_clock`), and prints for every clip one table: a row per stage, a column per rank of
each run, each cell the stage's wall seconds on that rank and, in brackets, the part of it spent waiting for other
ranks (inside collectives, receives, or for the background reader / writer). The stages:

* start-up: from the command's start to the rank entering ``main`` (interpreter, imports, the launcher's agent);
* read (probe), load: the CLI's stages before the restore (probe the input; build or load the models);
* in the restore stage, on the rank's main thread: input wait (for the next batch's frames), VAE encode, DiT,
  VAE decode, colour fix, to frames (back to 8-bit frames), frames gather (the 8-bit frames the ranks converted,
  gathered), writer wait (handing a batch to the writer), batch
  transfer (finished batches sent to the writer by other temporal groups); other = the rest of the stage;
* bg read, bg write: frame decoding and output encoding on the background threads (they overlap the above);
* finish: the summary's gather and leaving the process group; exit: from leaving ``main`` to the command's end.

Under each table: the whole command's wall time, and the critical path: the rank that finished last, and its stages
with the most time not spent waiting. CPU seconds per stage (the rank's busy time, which holds on a loaded machine)
(process CPU: every thread of the rank) are in the JSON, and the restore stage's speed-up predicted from them is
printed. With ``--rounds`` > 1 the round with the shortest whole command is shown. ``--predict 2 4 8``
extrapolates the restore stage to more ranks from the measured stage mix (see :func:`predict`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_whole_command import (  # noqa: E402
    command,
    has_ranks_flag,
    make_clip,
    parse_clip,
    run_once,
    user_env,
)

MAIN_STAGES = ("input wait", "VAE encode", "DiT", "VAE decode", "colour fix", "to frames", "frames gather",
               "writer wait", "batch transfer")
BACKGROUND = ("bg read", "bg write", "read", "write")  # read / write: the same, in line (SEEDVR2_SERIAL_IO=1)
#: the stages whose work is shared by the ranks of a group (the rest is serial, or repeated on every rank)
PARALLEL = ("VAE encode", "DiT", "VAE decode")


def profile_run(cmd: list[str], directory: str, threads: int = 0) -> dict:
    """Run ``cmd`` with ``SEEDVR2_PROFILE`` (and ``OMP_NUM_THREADS=threads`` unless 0); per-rank stage rows plus the
    whole command's wall time."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    extra = {"SEEDVR2_PROFILE": directory, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.time()
    result = run_once(cmd, env=user_env(extra))
    end = start + result["wall_s"]
    ranks = []
    for name in sorted(os.listdir(directory), key=lambda n: int(n[4:-5])):
        with open(os.path.join(directory, name)) as f:
            ranks.append(rank_rows(json.load(f), start, end))
    return {"whole_s": result["wall_s"], "summary": result["summary"], "ranks": ranks}


def rank_rows(data: dict, start: float, end: float) -> dict:
    """One rank's stages: ``{stage: (wall, wait, cpu)}`` in the order of the table."""
    t = data["instants"]
    wall, comm, cpu = data["wall"], data["comm"], data.get("process_cpu", data["cpu"])
    rows = {"start-up": (t["main entered"] - start, 0.0, 0.0),
            "read (probe)": (data["cli"].get("read", 0.0), 0.0, 0.0),
            "load": (data["cli"].get("load", 0.0), 0.0, 0.0)}
    restore = t["restore finished"] - t["restore started"]
    inside = 0.0
    for stage in MAIN_STAGES:
        if stage in wall:
            waits = comm.get(stage, 0.0) + (wall[stage] if stage in ("input wait", "writer wait") else 0.0)
            rows[stage] = (wall[stage], min(waits, wall[stage]), cpu.get(stage, 0.0))
            inside += wall[stage]
    rows["other (restore)"] = (max(0.0, restore - inside), 0.0, 0.0)
    rows["restore stage"] = (restore, sum(rows[s][1] for s in MAIN_STAGES if s in rows), 0.0)
    for stage in BACKGROUND:
        if stage in wall:
            rows[stage] = (wall[stage], 0.0, cpu.get(stage, 0.0))
    rows["finish"] = (t["main left"] - t["restore finished"], 0.0, 0.0)
    rows["exit"] = (end - t["main left"], 0.0, 0.0)
    return {"rank": data["rank"], "rows": rows, "restore_finished": t["restore finished"]}


def critical_path(run: dict, top: int = 3) -> str:
    """The rank that finished the restore last, and its stages with the most time not spent waiting."""
    last = max(run["ranks"], key=lambda r: r["restore_finished"])
    busy = sorted(((w - wait, s) for s, (w, wait, _) in last["rows"].items()
                   if s in MAIN_STAGES or s in ("start-up", "read (probe)", "load", "finish", "exit")),
                  reverse=True)
    parts = ", ".join(f"{s} {b:.2f} s" for b, s in busy[:top])
    return f"rank {last['rank']} finishes the restore last; its largest non-waiting stages: {parts}"


def table(runs: dict[int, dict]) -> str:
    columns = [(p, r) for p, run in runs.items() for r in run["ranks"]]
    order = ["start-up", "read (probe)", "load", *MAIN_STAGES, "other (restore)", "restore stage", *BACKGROUND,
             "finish", "exit"]
    present = {s for _, r in columns for s in r["rows"]}
    stages = [s for s in order if s in present] + sorted(present - set(order))
    header = "| stage | " + " | ".join(f"P{p} rank {r['rank']}" for p, r in columns) + " |"
    lines = [header, "|---|" + "---:|" * len(columns)]
    for stage in stages:
        cells = []
        for _, r in columns:
            if stage not in r["rows"]:
                cells.append("-")
                continue
            wall, wait, _ = r["rows"][stage]
            cells.append(f"{wall:.2f}" + (f" ({wait:.2f})" if wait >= 0.005 else ""))
        name = f"**{stage}**" if stage == "restore stage" else stage
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **whole command** | " + " | ".join(f"{runs[p]['whole_s']:.2f}" for p, _ in columns) + " |")
    return "\n".join(lines)


def cpu_speedups(runs: dict[int, dict]) -> dict[int, float]:
    """Restore-stage speed-up predicted from CPU time (what holds on a loaded machine): the P = 1 process's CPU
    seconds in the main-thread stages over the busiest rank's at P = N (a machine with a core per rank, no waits)."""
    if 1 not in runs:
        return {}

    def busy(rank: dict) -> float:
        return sum(rank["rows"][s][2] for s in MAIN_STAGES if s in rank["rows"])

    one = busy(runs[1]["ranks"][0])
    return {p: one / max(busy(r) for r in run["ranks"]) for p, run in runs.items() if p > 1}


def predict(runs: dict[int, dict], degrees: list[int]) -> dict[int, float]:
    """The restore stage's speed-up at each degree in ``degrees``, extrapolated from the measured stage mix.

    The busiest rank's VAE and DiT time at P = 1 is taken to shrink as 1 / (P x e(P)), with e(P) = e2 ** log2(P),
    e2 being the parallel efficiency those stages measured at P = 2 (``2 x P1 / P2``); the rest of the restore stage
    (reading, colour fix, conversion, the waits for the writer) stays as measured at P = 1. A rough model of this
    machine's stage mix, not of a GPU's."""
    import math

    if 1 not in runs or 2 not in runs:
        return {}

    def stage(p: int, name: str) -> float:
        return max((r["rows"].get(name, (0.0, 0.0, 0.0))[0] for r in runs[p]["ranks"]), default=0.0)

    one = runs[1]["ranks"][0]["rows"]
    parallel1 = sum(one.get(s, (0.0,))[0] for s in PARALLEL)
    parallel2 = sum(stage(2, s) for s in PARALLEL)
    serial1 = one["restore stage"][0] - parallel1
    e2 = min(1.0, parallel1 / (2 * parallel2)) if parallel2 else 1.0
    out = {}
    for p in degrees:
        eff = e2 ** math.log2(p) if p > 1 else 1.0
        out[p] = one["restore stage"][0] / (serial1 + parallel1 / (p * eff))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", nargs="+", type=parse_clip, default=[(320, 240, 33), (1280, 720, 9)])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--launcher", choices=("auto", "torchrun", "ranks"), default="auto")
    parser.add_argument("--predict", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--json", help="also write every figure (CPU seconds included) to this file")
    parser.add_argument("--quick", action="store_true", help="one 96x64x9 clip (checks the script)")
    parser.add_argument("--p1-threads", type=int, default=0,
                        help="OMP_NUM_THREADS of the one-process run (default 0: unset, torch's default of one thread "
                             "per core, what a user gets; 1 makes its CPU seconds comparable with one rank's on a "
                             "loaded machine, where idle OpenMP threads spin)")
    parser.add_argument("cli_args", nargs=argparse.REMAINDER, help="after --: more restore options")
    args = parser.parse_args(argv)
    extra = [a for a in args.cli_args if a != "--"]
    if args.quick:
        args.clips = [(96, 64, 9)]
    launcher = "ranks" if args.launcher == "auto" and has_ranks_flag() else (
        "torchrun" if args.launcher == "auto" else args.launcher)
    print(f"restore profile: ranks {args.ranks} ({launcher}), {args.rounds} round(s), {os.cpu_count()} CPUs, load "
          f"average {os.getloadavg()[0]:.2f}; cells: wall seconds (waiting for other ranks or threads)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for clip in args.clips:
            name = "x".join(map(str, clip))
            path = make_clip(tmp, clip)
            out = os.path.join(tmp, "out" + os.path.splitext(path)[1])
            runs: dict[int, dict] = {}
            for _ in range(args.rounds):
                for p in args.ranks:
                    run = profile_run(command(p, launcher, path, out, extra), os.path.join(tmp, "profile"),
                                      threads=args.p1_threads if p == 1 else 0)
                    if p not in runs or run["whole_s"] < runs[p]["whole_s"]:
                        runs[p] = run
            print(f"\n{name} (demo weights; load average {os.getloadavg()[0]:.2f})")
            print(table(runs))
            for p, run in runs.items():
                print(f"P{p}: whole {run['whole_s']:.2f} s; critical path: {critical_path(run)}")
            if 1 in runs:
                restore1 = runs[1]["ranks"][0]["rows"]["restore stage"][0]
                for p in (p for p in runs if p > 1):
                    restore = max(r["rows"]["restore stage"][0] for r in runs[p]["ranks"])
                    print(f"P1 / P{p}: whole command {runs[1]['whole_s'] / runs[p]['whole_s']:.2f}x, restore stage "
                          f"{restore1 / restore:.2f}x")
            by_cpu = cpu_speedups(runs)
            if by_cpu:
                print("restore stage predicted from process CPU seconds (busiest rank): " +
                      ", ".join(f"P{p} {s:.2f}x" for p, s in by_cpu.items()))
            prediction = predict(runs, args.predict)
            if prediction:
                print("restore stage extrapolated from this stage mix: " +
                      ", ".join(f"P{p} {s:.2f}x" for p, s in prediction.items()))
            results[name] = {"runs": {str(p): r for p, r in runs.items()},
                             "prediction": {str(p): s for p, s in prediction.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launcher": launcher, "clips": list(results), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
