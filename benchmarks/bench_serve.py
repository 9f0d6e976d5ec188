"""Warm ranks against cold commands: N short clips through ``serve``, through N ``restore`` runs, and through one
folder run of ``restore``.

    python benchmarks/bench_serve.py [--clips 10] [--clip 64x48x5] [--ranks 1] [--vae-channels 128,256,512,512]
        [--quick]

Each way is timed as a user meets it, from the command's start: the time to the first restored file, and the whole
wall time until the last one is there (for ``serve``: its start-up with the weights loaded, the N jobs sent at once
over HTTP, each result downloaded). Throughput is clips a minute over that whole wall time; for ``serve`` also from
the moment it listens (the rate of a server already running). Demo weights, float32 on the CPU, the demo VAE at
``--vae-channels`` (``128,256,512,512``: the released widths, random weights, through
``SEEDVR2_DEMO_VAE_CHANNELS``). The N clips are copies of the synthetic demo clip; the outputs of the three ways are
compared byte for byte (lossless ``--crf 0``). ``--quick``: 3 clips of 48x32x5 with a narrow VAE (a smoke test).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_whole_command import make_clip, parse_clip, user_env  # noqa: E402


def restore_each(clips: list[str], out: str, flags: list[str], env: dict) -> tuple[float, float]:
    """N ``restore`` commands one after another: (seconds to the first output, seconds in all)."""
    start = time.perf_counter()
    first = None
    for clip in clips:
        target = os.path.join(out, os.path.basename(clip))
        subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", clip, "-o", target, *flags], cwd=ROOT,
                       env=env, check=True, capture_output=True, timeout=3600)
        first = first if first is not None else time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


def restore_folder(folder: str, out: str, flags: list[str], env: dict, count: int) -> tuple[float, float]:
    """One ``restore FOLDER -o OUT``: (seconds to the first output file, seconds in all)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "examples.seedvr2", "restore", folder, "-o", out, *flags],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    names = set(os.listdir(folder))
    first = None
    while proc.poll() is None:
        if first is None and os.path.isdir(out) and names & set(os.listdir(out)):
            first = time.perf_counter() - start  # published whole under its name (renamed from a partial file)
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"the folder run failed: {proc.stderr.read()[-2000:]}")
    total = time.perf_counter() - start
    written = len([n for n in os.listdir(out) if n.endswith(".mp4")])
    assert written == count, f"the folder run wrote {written} of {count} files"
    return first if first is not None else total, total


def serve(clips: list[str], out: str, flags: list[str], env: dict) -> tuple[float, float, float]:
    """``serve`` started, the clips sent at once, each result downloaded as it is done: (seconds to the first
    result, seconds in all, seconds from listening to the last result)."""
    import httpx

    start = time.perf_counter()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "examples.seedvr2", "serve", "--port", "0", *flags,
                             "--max-queue", str(len(clips) + 1)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        url = None
        while url is None:
            found = re.search(r"listening on (http://[0-9.]+:\d+)", Path(log.name).read_text())
            if found:
                url = found.group(1)
            elif proc.poll() is not None:
                raise SystemExit(f"serve did not start:\n{Path(log.name).read_text()[-2000:]}")
            else:
                time.sleep(0.05)
        listening = time.perf_counter()
        client = httpx.Client(base_url=url, timeout=600)
        ids = {}
        for clip in clips:
            with open(clip, "rb") as f:
                answer = client.post("/v1/restorations", files={"file": (os.path.basename(clip), f)},
                                     data={"crf": "0"})
            answer.raise_for_status()
            ids[answer.json()["id"]] = os.path.basename(clip)
        first = None
        for job_id, name in ids.items():  # they finish in order: one request every 0.1 s, for the oldest
            while True:
                status = client.get(f"/v1/restorations/{job_id}").json()
                if status["state"] == "done":
                    Path(out, name).write_bytes(client.get(status["result"]).content)
                    first = first if first is not None else time.perf_counter() - start
                    break
                if status["state"] not in ("queued", "running"):
                    raise SystemExit(f"job {name} {status['state']}: {status['error']}")
                time.sleep(0.1)
        end = time.perf_counter()
        return first or 0.0, end - start, end - listening
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        os.unlink(log.name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=10, help="how many clips (default 10)")
    parser.add_argument("--clip", type=parse_clip, default=(64, 48, 5), help="WIDTHxHEIGHTxFRAMES (default 64x48x5)")
    parser.add_argument("--ranks", type=int, default=1, help="ranks of every way (default 1)")
    parser.add_argument("--vae-channels", default="128,256,512,512",
                        help="the demo VAE's widths (default the released 128,256,512,512)")
    parser.add_argument("--quick", action="store_true", help="3 clips of 48x32x5, a narrow VAE: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.clips, args.clip, args.vae_channels = 3, (48, 32, 5), "32,32,64,64"
    env = user_env({"SEEDVR2_DEMO_VAE_CHANNELS": args.vae_channels})
    flags = ["--demo", "--quiet", "--crf", "0"] + (["--ranks", str(args.ranks)] if args.ranks > 1 else [])
    serve_flags = ["--demo", "--crf", "0", "--ranks", str(args.ranks)]
    work = tempfile.mkdtemp(prefix="bench-serve-")
    try:
        source = make_clip(work, args.clip)
        folder = os.path.join(work, "clips")
        os.makedirs(folder)
        clips = []
        for i in range(args.clips):
            clips.append(os.path.join(folder, f"clip{i:02d}.mp4"))
            shutil.copy(source, clips[-1])
        outs = {name: os.path.join(work, name) for name in ("each", "folder", "serve")}
        for path in (outs["each"], outs["serve"]):
            os.makedirs(path)
        figures = {"restore x N": restore_each(clips, outs["each"], flags, env),
                   "restore FOLDER": restore_folder(folder, outs["folder"], flags, env, args.clips)}
        first, total, warm = serve(clips, outs["serve"], serve_flags, env)
        figures["serve"] = (first, total)
        names = [os.path.basename(c) for c in clips]
        same = all(Path(outs[way], n).read_bytes() == Path(outs["each"], n).read_bytes()
                   for way in ("folder", "serve") for n in names)
        w, h, t = args.clip
        print(f"{args.clips} clips of {w}x{h}x{t}, {args.ranks} rank(s), demo VAE {args.vae_channels}, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")
        print(f"{'way':<16} {'first output s':>15} {'all s':>8} {'clips/min':>10}")
        for name, (first_s, total_s) in figures.items():
            print(f"{name:<16} {first_s:>15.1f} {total_s:>8.1f} {args.clips * 60 / total_s:>10.2f}")
        print(f"serve once listening: {warm:.1f} s for {args.clips} clips, {args.clips * 60 / warm:.2f} clips/min")
        print(f"outputs byte-identical across the three ways: {'yes' if same else 'NO'}")
        return 0 if same else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
