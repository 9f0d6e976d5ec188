"""Calibrate the restore memory estimate: peak resident memory of real CLI runs against what the CLI estimated.

    OMP_NUM_THREADS=1 python benchmarks/calibrate_memory.py [--sizes 192x112 256x144 384x208] [--batches 5 9]
        [--modes replicated height tiled] [--sp 1 2] [--tile 96] [--json out.json]
    python benchmarks/calibrate_memory.py --from-json out.json    # the table again, estimates from the current code

Each grid point is one ``python -m examples.seedvr2 restore`` of a synthetic clip of ``batch`` frames (one temporal
batch, demo weights, fp32 on the CPU), as a user runs it: in a subprocess, under ``torchrun --nproc-per-node 2`` for SP
2. Inside the process the CLI's own :func:`~examples.seedvr2.cli.plan_memory` is wrapped to record its estimate and the
process's resident set (VmRSS) and mapped size (VmSize) at that moment, just before anything big is allocated; at exit
the peak resident set (VmHWM) and peak mapped size (VmPeak) are read. ``measured = VmHWM - VmRSS at the estimate`` is
what the run added on top of what the process already held, which is what the estimate predicts (the usable memory is
likewise what the limits leave beyond what is already held). The table prints the estimate, the measured peak, their
ratio (estimate / measured: below 1 is an under-estimate) and the growth of the mapped size (what an address-space
limit sees). The worst rank of an SP 2 run is shown. Not part of the test suite (minutes on 2 cores).

``--from-json`` reprints a recorded grid with the estimates of the current code (the measurements do not depend on
the estimate: every setting is pinned), which is how the estimate's constants were refitted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _status(*names: str) -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in names:
                values[key] = int(rest.split()[0]) * 1024
    return values


def child(out_dir: str, argv: list[str]) -> int:
    """Run the CLI in this process with :func:`plan_memory` instrumented; write this rank's figures to ``out_dir``."""
    from examples.seedvr2 import cli

    record: dict = {}
    plan_memory = cli.plan_memory

    def recording_plan_memory(*args, **kwargs):
        if os.environ.get("CALIBRATE_NO_LIMIT"):  # measure points beyond this machine's free memory estimate too
            from examples.seedvr2.memory.limits import MemoryLimit

            args = args[:8]
            kwargs["limit"] = MemoryLimit(None, "calibration: no limit")
        record.update({f"{k}_at_plan": v for k, v in _status("VmRSS", "VmSize").items()})
        plan = plan_memory(*args, **kwargs)
        record.update(need=plan.need, settings=plan.settings.describe())
        return plan

    cli.plan_memory = recording_plan_memory
    code = cli.main(argv)
    record.update(_status("VmHWM", "VmPeak"), code=code)
    with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(record, f)
    return code


def make_clip(path: str, frames: int, width: int, height: int) -> str:
    import av
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = np.stack([(x * 3 + i * 9) % 256, (y * 5) % 256, ((x + y) * 2) % 256], -1).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def measure(src: str, out_dir: str, batch: int, mode: str, sp: int, tile: int, no_limit: bool = False,
            timeout: float = 900) -> dict:
    """One grid point: the worst rank's figures."""
    for name in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, name))
    argv = ["restore", src, "-o", os.path.join(out_dir, "out.mp4"), "--overwrite", "--quiet",
            "--batch-frames", str(batch), "--vae-parallel", mode]
    if mode == "tiled":
        argv += ["--vae-tile", str(tile)]
    code = f"import sys; sys.path.insert(0, {REPO!r}); from benchmarks.calibrate_memory import child; " \
           f"sys.exit(child({out_dir!r}, {argv!r}))"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    if no_limit:
        env["CALIBRATE_NO_LIMIT"] = "1"
    if sp == 1:
        cmd = [sys.executable, "-c", code]
    else:
        script = os.path.join(out_dir, "child.py")
        with open(script, "w") as f:
            f.write(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={sp}", script]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd[-3:])}): {done.stderr[-2000:]}")
    worst = None
    for rank in range(sp):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            r = json.load(f)
        r["measured"] = r["VmHWM"] - r["VmRSS_at_plan"]
        r["mapped"] = r["VmPeak"] - r["VmSize_at_plan"]
        r["ratio"] = r["need"] / r["measured"]
        if worst is None or r["ratio"] < worst["ratio"]:
            worst = r
    return worst


def current_estimate(row: dict) -> int:
    """What the current code estimates for a recorded grid point (demo models, fp32, pinned settings)."""
    from examples.seedvr2.models.demo import DEMO_DIT_CONFIG, DEMO_VAE_CONFIG
    from examples.seedvr2.memory.fit import tile_overlap
    from examples.seedvr2.pipeline import estimate_restore_bytes

    width, height = (int(v) for v in row["size"].split("x"))
    tile = row.get("tile") if row["mode"] == "tiled" else None
    return estimate_restore_bytes(
        frames=row["frames"], height=height, width=width, vae_channels=DEMO_VAE_CONFIG["block_out_channels"][0],
        dit_width=DEMO_DIT_CONFIG.vid_dim, vae_parallel=row["mode"], sp_size=row["sp"],
        tile=None if tile is None else (tile, tile), tile_overlap=None if tile is None else tile_overlap(tile)).total


def print_row(r: dict) -> None:
    mode_name = f"tiled {r['tile']}" if r["mode"] == "tiled" else r["mode"]
    print(f"| {r['size']} | {r['frames']} | {mode_name} | {r['sp']} | {r['need'] / 2**20:.0f} | "
          f"{r['measured'] / 2**20:.0f} | {r['need'] / r['measured']:.2f} | {r['mapped'] / 2**20:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["192x112", "256x144", "384x208"])
    parser.add_argument("--batches", nargs="+", type=int, default=[5, 9])
    parser.add_argument("--modes", nargs="+", default=["replicated", "height", "tiled"])
    parser.add_argument("--sp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--tile", type=int, default=96)
    parser.add_argument("--json")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a grid point may take (default 900)")
    parser.add_argument("--no-limit", action="store_true",
                        help="let the CLI run points whose estimate exceeds this machine's usable memory (the estimate "
                             "being calibrated may be too high)")
    parser.add_argument("--from-json")
    args = parser.parse_args()
    rows = []
    print("| size | frames | VAE | SP | estimate MiB | measured MiB | ratio | mapped growth MiB |")
    print("|---|---|---|---|---|---|---|---|")
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)
        for r in rows:
            r.setdefault("tile", args.tile)
            r["need"] = current_estimate(r)
            print_row(r)
        ratios = [r["need"] / r["measured"] for r in rows]
        print(f"\nratio estimate/measured: min {min(ratios):.2f}, max {max(ratios):.2f} over {len(rows)} runs")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            width, height = (int(v) for v in size.split("x"))
            for batch in args.batches:
                src = make_clip(os.path.join(tmp, f"in_{size}_{batch}.mp4"), batch, width, height)
                for mode in args.modes:
                    for sp in args.sp:
                        out_dir = os.path.join(tmp, "run")
                        os.makedirs(out_dir, exist_ok=True)
                        r = measure(src, out_dir, batch, mode, sp, args.tile, args.no_limit, args.timeout)
                        r.update(size=size, frames=batch, mode=mode, sp=sp, tile=args.tile)
                        rows.append(r)
                        print_row(r)
                        if args.json:  # after every point: a long grid that fails late keeps what it measured
                            with open(args.json, "w") as f:
                                json.dump(rows, f, indent=1)
    ratios = [r["ratio"] for r in rows]
    print(f"\nratio estimate/measured: min {min(ratios):.2f}, max {max(ratios):.2f} over {len(rows)} runs")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3:]))
    main()
