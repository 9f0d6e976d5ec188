"""VAE memory and accuracy of its execution modes, CPU-sized; and (``--scaling``) how its parallel modes scale.

    python benchmarks/bench_vae.py [--frames 17] [--height 64] [--width 96] [--json out.json]
    python benchmarks/bench_vae.py --scaling [--clips 9x128x192 5x720x64 33x64x96] [--worlds 2 4]
        [--modes height wavefront time] [--channels 128,256,512,512] [--json out.json]

``--scaling`` (modes ``height``; ``wavefront``, the split :func:`choose_split` picks; ``time``, the wavefront alone)
runs the released VAE architecture (``--channels`` scales its widths; random weights, float32, one
thread a rank, gloo, temporal chunks of 4) on each clip: one rank (``vae.encode`` / ``vae.decode``), then every mode at
every world size, one process a rank, in ``--rounds`` interleaved rounds (the best of them kept). One rank is run
twice: as a user runs it (a plain single process with torch's default intra-op threads: one per core,
``--p1-threads`` to change) and on one thread like each parallel rank. **Wall speed-ups are against the first** (what
a user runs at P = 1); ``*_speedup_1thread`` against the second. (Before, the only baseline was one rank on one
thread, so on a 2-core machine a P = 2 run with one thread a rank was compared with half of what one process
uses.) Per rank it records wall time (after a barrier), process CPU time, and the time
spent inside collectives and point-to-point waits; *busy* = wall - that, and *busy CPU* = the rank's main-thread CPU
time outside them (what a rank computes, which predicts a machine with a core per rank and, unlike wall time, holds
on a loaded machine). Reported: wall speed-up over one rank (the slowest rank's wall), total CPU over the ranks / one
rank's CPU, each rank's busy and busy-CPU time and the busiest rank's speed-up (one rank's wall or main-thread CPU over
it), collective counts, and the max error against the single-rank result (0 means bit for bit). A tiny untimed run
first warms every rank (kernels, connections).

Memory is the peak of live activation bytes (``examples.seedvr2.models.vae.memory.peak_tensor_bytes``: every tensor an
operator creates, counted while alive; parameters and the input are excluded), which is deterministic on CPU.
Figures reported:

* whole clip vs causal temporal chunks (split 4): encode and decode peaks, and their max difference;
* height-sharded at SP=2 (and 3): per-rank peak vs the replicated whole-frame peak, and the max difference;
* tiled: max/mean deviation from whole frame and peak, for a few tile sizes.

The model is the golden file's tiny architecture (channels [16, 16, 32, 32]) with seeded random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from examples.seedvr2.models.vae import CausalVideoVAE  # noqa: E402
from examples.seedvr2.models.vae.memory import peak_tensor_bytes  # noqa: E402
from examples.seedvr2.models.vae.sharding import decode_sharded, encode_sharded  # noqa: E402
from examples.seedvr2.models.vae.tiling import decode_tiled, encode_tiled  # noqa: E402
from examples.seedvr2.models.vae.wavefront import (  # noqa: E402
    RelayCache,
    VAESplit,
    clip_splits,
    decode_wavefront,
    encode_wavefront,
)
from tests.helpers import random_video, tiny_vae  # noqa: E402
from winsp.comm.group import SPGroup  # noqa: E402
from winsp.testing import run_ranks  # noqa: E402

MIB = 1024 * 1024


def build_vae(split: int | None = None) -> CausalVideoVAE:
    """The shared tiny VAE (seed 0) with causal temporal chunks of ``split`` frames."""
    vae = tiny_vae(seed=0)
    vae.set_temporal_chunking(split)
    return vae


def measured(fn):
    start = time.perf_counter()
    with peak_tensor_bytes() as mem:
        out = fn()
    return out, mem.peak, time.perf_counter() - start


def bench_chunking(video: torch.Tensor) -> dict:
    rows = {}
    reference = {}
    for split in (None, 4):
        vae = build_vae(split)
        latent, enc_peak, enc_s = measured(partial(vae.encode, video))
        decoded, dec_peak, dec_s = measured(partial(vae.decode, latent))
        name = "whole" if split is None else f"chunked(split={split})"
        if split is None:
            reference = {"latent": latent, "decoded": decoded}
        rows[name] = {
            "encode_peak_mib": enc_peak / MIB, "decode_peak_mib": dec_peak / MIB,
            "encode_s": enc_s, "decode_s": dec_s,
            "latent_max_diff": (latent - reference["latent"]).abs().max().item(),
            "decoded_max_diff": (decoded - reference["decoded"]).abs().max().item(),
        }
    return rows


def _sharded_rank(rank: int, world: int, frames: int, height: int, width: int) -> dict:
    torch.set_num_threads(1)
    vae = build_vae(4)
    video = random_video(frames, height, width)
    group = SPGroup.world()
    latent, enc_peak, enc_s = measured(lambda: encode_sharded(vae, video, group))
    decoded, dec_peak, dec_s = measured(lambda: decode_sharded(vae, latent, group))
    whole_latent = vae.encode(video)
    whole_decoded = vae.decode(whole_latent)
    return {
        "encode_peak_mib": enc_peak / MIB, "decode_peak_mib": dec_peak / MIB, "encode_s": enc_s, "decode_s": dec_s,
        "latent_max_diff": (latent - whole_latent).abs().max().item(),
        "decoded_max_diff": (decoded - whole_decoded).abs().max().item(),
    }


def bench_sharded(frames: int, height: int, width: int, worlds=(2, 3)) -> dict:
    rows = {}
    for world in worlds:
        per_rank = run_ranks(_sharded_rank, world, frames, height, width, timeout=600)
        rows[f"height_sp{world}"] = {
            "encode_peak_mib_per_rank": [r["encode_peak_mib"] for r in per_rank],
            "decode_peak_mib_per_rank": [r["decode_peak_mib"] for r in per_rank],
            "latent_max_diff": max(r["latent_max_diff"] for r in per_rank),
            "decoded_max_diff": max(r["decoded_max_diff"] for r in per_rank),
            "encode_s": max(r["encode_s"] for r in per_rank), "decode_s": max(r["decode_s"] for r in per_rank),
        }
    return rows


def bench_tiled(video: torch.Tensor, tiles=((32, 16), (48, 16), (64, 32))) -> dict:
    vae = build_vae(4)
    latent, enc_peak, _ = measured(lambda: vae.encode(video))
    decoded, dec_peak, _ = measured(lambda: vae.decode(latent))
    rows = {"whole(split=4)": {"encode_peak_mib": enc_peak / MIB, "decode_peak_mib": dec_peak / MIB}}
    for tile, overlap in tiles:
        lat_t, e_peak, e_s = measured(partial(encode_tiled, vae, video, tile_size=tile, overlap=overlap))
        dec_t, d_peak, d_s = measured(partial(decode_tiled, vae, latent, tile_size=tile, overlap=overlap))
        rows[f"tiled(tile={tile},overlap={overlap})"] = {
            "encode_peak_mib": e_peak / MIB, "decode_peak_mib": d_peak / MIB,
            "latent_max_dev": (lat_t - latent).abs().max().item(),
            "latent_mean_dev": (lat_t - latent).abs().mean().item(),
            "latent_mean_abs": latent.abs().mean().item(),
            "decoded_max_dev": (dec_t - decoded).abs().max().item(),
            "decoded_mean_dev": (dec_t - decoded).abs().mean().item(),
            "decoded_mean_abs": decoded.abs().mean().item(),
            "encode_s": e_s, "decode_s": d_s,
        }
    return rows


# ---- scaling (--scaling) ------------------------------------------------------------------------------------


class _CommClock:
    """Seconds and calls inside every SPGroup collective / receive and every wait for a send, in this process."""

    METHODS = ("all_to_all_single", "all_reduce_sum", "all_gather_rows", "recv_")

    def __init__(self) -> None:
        self.seconds, self.cpu, self.calls = 0.0, 0.0, {}
        for name in self.METHODS:
            self._wrap(SPGroup, name)
        self._wrap(RelayCache, "finish")

    def _wrap(self, cls, name: str) -> None:
        original = getattr(cls, name)
        clock = self

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
                clock.cpu += time.thread_time() - cpu
                clock.calls[name] = clock.calls.get(name, 0) + 1

        setattr(cls, name, timed)

    def reset(self) -> None:
        self.seconds, self.cpu, self.calls = 0.0, 0.0, {}


def scaled_vae(channels: list[int]) -> CausalVideoVAE:
    from examples.seedvr2.models.vae import VideoVAEConfig

    torch.manual_seed(0)
    groups = 32 if min(channels) >= 32 and all(c % 32 == 0 for c in channels) else 4
    vae = CausalVideoVAE(VideoVAEConfig(block_out_channels=channels, norm_num_groups=groups)).eval()
    vae.set_temporal_chunking(4)
    return vae


def _run_mode(mode: str, vae, x, group, what: str):
    if mode == "single":
        return vae.encode(x) if what == "encode" else vae.decode(x)
    if mode == "height":
        return encode_sharded(vae, x, group) if what == "encode" else decode_sharded(vae, x, group)
    split = VAESplit(group.size, 1) if mode == "time" else None  # "wavefront": the split choose_split picks
    if what == "encode":
        return encode_wavefront(vae, x, group, split=split)
    return decode_wavefront(vae, x, group, split=split)


def _scaling_rank(rank: int, world: int, mode: str, clip: tuple[int, int, int], channels: list[int],
                  threads: int = 1) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    clock = _CommClock()
    vae = scaled_vae(channels)
    group = SPGroup.world()
    warm = random_video(5, 16 * max(1, world), 16)
    for what, x in (("encode", warm), ("decode", vae.encode(warm))):
        _run_mode(mode, vae, x, group, what)
    video = random_video(*clip)
    reference = torch.load(os.environ["BENCH_VAE_REFERENCE"]) if mode != "single" else None
    out = {}
    for what in ("encode", "decode"):
        x = video if what == "encode" else (reference["latent"] if reference is not None else out["latent"])
        if world > 1:
            dist.barrier()
        clock.reset()
        wall0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
        result = _run_mode(mode, vae, x, group, what)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        thread = time.thread_time() - thread0
        out[what] = {"wall_s": wall, "cpu_s": cpu, "comm_s": clock.seconds, "busy_s": wall - clock.seconds,
                     "busy_cpu_s": thread - clock.cpu, "calls": dict(clock.calls)}
        if reference is None:
            out["latent" if what == "encode" else "decoded"] = result
        else:
            ref = reference["latent" if what == "encode" else "decoded"]
            out[what]["max_err"] = (result - ref).abs().max().item()
    return out


def user_threads() -> int:
    """The intra-op threads torch gives a process started without ``OMP_NUM_THREADS`` (what a user's single process
    gets: one per core)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                          capture_output=True, text=True, timeout=300)
    return int(done.stdout.strip() or 1)


def _best(runs: list[dict]) -> dict:
    """Of several runs of one configuration (lists of per-rank results), the one with the smallest slowest-rank wall
    time, for encode and decode separately."""
    best = {}
    for what in ("encode", "decode"):
        best[what] = min((r for r in runs), key=lambda per_rank: max(x[what]["wall_s"] for x in per_rank))
    return best


def bench_scaling(clips, worlds, modes, channels, rounds: int = 2, threads: int | None = None) -> dict:
    """Every mode at every world size against one rank, interleaved over ``rounds`` rounds (the best kept).

    One rank is measured twice: as a user runs it (a plain ``vae.encode`` / ``vae.decode`` in one process with
    torch's default intra-op threads, ``threads``: one per core) and on one thread (as each rank of the parallel runs
    is). Speed-ups are against the first (``*_speedup``) and, for reference, the second (``*_speedup_1thread``).
    """
    import tempfile

    threads = threads or user_threads()
    rows = {}
    for clip in clips:
        name = "x".join(map(str, clip))
        runs: dict = {"user": [], "one": []}
        reference_path = None
        for r in range(rounds):
            for key, n in (("one", 1), ("user", threads)):  # the one-thread run first: the reference outputs
                result = run_ranks(_scaling_rank, 1, "single", clip, channels, n, timeout=3600)
                if reference_path is None:
                    with tempfile.NamedTemporaryFile(suffix=".pt", delete=False) as f:
                        torch.save({"latent": result[0]["latent"], "decoded": result[0]["decoded"]}, f.name)
                    reference_path = os.environ["BENCH_VAE_REFERENCE"] = f.name
                for x in result:
                    x.pop("latent", None)
                    x.pop("decoded", None)
                runs[key].append(result)
                print(f"  round {r + 1} {name} P=1 ({n} thread{'s' if n > 1 else ''}): encode "
                      f"{result[0]['encode']['wall_s']:.2f} s, decode {result[0]['decode']['wall_s']:.2f} s",
                      flush=True)
            for world in worlds:
                for mode in modes:
                    result = run_ranks(_scaling_rank, world, mode, clip, channels, timeout=3600)
                    runs.setdefault((world, mode), []).append(result)
                    print(f"  round {r + 1} {name} {mode} P={world}: encode "
                          f"{max(x['encode']['wall_s'] for x in result):.2f} s, decode "
                          f"{max(x['decode']['wall_s'] for x in result):.2f} s", flush=True)
        user, one = _best(runs["user"]), _best(runs["one"])
        singles = {"user": {w: user[w][0][w] for w in ("encode", "decode")},
                   "one": {w: one[w][0][w] for w in ("encode", "decode")}}
        rows[f"{name} P=1"] = {"clip": list(clip), "world": 1, "mode": "single", "user_threads": threads,
                               **{f"{w}_{k}": round(singles['user'][w][k], 3) for w in ("encode", "decode")
                                  for k in ("wall_s", "cpu_s", "busy_cpu_s")},
                               **{f"{w}_{k}_1thread": round(singles['one'][w][k], 3) for w in ("encode", "decode")
                                  for k in ("wall_s", "cpu_s", "busy_cpu_s")}}
        for world in worlds:
            for mode in modes:
                best = _best(runs[(world, mode)])
                row = {"clip": list(clip), "world": world, "mode": mode}
                for what in ("encode", "decode"):
                    per_rank = [x[what] for x in best[what]]
                    wall = max(x["wall_s"] for x in per_rank)
                    busy = [x["busy_s"] for x in per_rank]
                    user1, one1 = singles["user"][what], singles["one"][what]
                    row[f"{what}_wall_s"] = round(wall, 3)
                    row[f"{what}_speedup"] = round(user1["wall_s"] / wall, 3)
                    row[f"{what}_speedup_1thread"] = round(one1["wall_s"] / wall, 3)
                    row[f"{what}_cpu_ratio"] = round(sum(x["cpu_s"] for x in per_rank) / one1["cpu_s"], 3)
                    row[f"{what}_busy_s"] = [round(b, 3) for b in busy]
                    row[f"{what}_busy_speedup"] = round(one1["wall_s"] / max(busy), 3)
                    busy_cpu = [x["busy_cpu_s"] for x in per_rank]
                    row[f"{what}_busy_cpu_s"] = [round(b, 3) for b in busy_cpu]
                    row[f"{what}_busy_cpu_speedup"] = round(one1["busy_cpu_s"] / max(busy_cpu), 3)
                    row[f"{what}_calls"] = per_rank[0]["calls"]
                    row[f"{what}_max_err"] = max(x["max_err"] for x in per_rank)
                if mode == "height":
                    splits = (VAESplit(1, world),) * 2
                elif mode == "time":
                    splits = (VAESplit(world, 1),) * 2
                else:
                    splits = clip_splits(world, clip[0], clip[1] // 8)
                row["splits"] = {"encode": [splits[0].time, splits[0].height],
                                 "decode": [splits[1].time, splits[1].height]}
                rows[f"{name} {mode} P={world}"] = row
                print(f"  {name} {mode} P={world}: {row}", flush=True)
        if reference_path is not None:
            os.unlink(reference_path)
    return rows


def _print(title: str, rows: dict) -> None:
    print(f"\n== {title}")
    for name, row in rows.items():
        cells = ", ".join(
            f"{k}={[round(x, 3) for x in v] if isinstance(v, list) else (f'{v:.3g}' if isinstance(v, float) else v)}"
            for k, v in row.items()
        )
        print(f"  {name}: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-sharded", action="store_true")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--scaling", action="store_true", help="time the parallel modes instead (see above)")
    parser.add_argument("--clips", nargs="+", default=["9x128x192", "5x720x64", "33x64x96"],
                        help="FRAMESxHEIGHTxWIDTH clips of --scaling")
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--modes", nargs="+", default=["height", "wavefront", "time"],
                        choices=["height", "wavefront", "time"],
                        help="height: height bands; wavefront: the split choose_split picks; time: wavefront only")
    parser.add_argument("--channels", default="128,256,512,512", help="VAE widths of --scaling (released: default)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="--scaling: interleaved rounds (one rank, then every mode and world), the best kept")
    parser.add_argument("--p1-threads", type=int, default=0,
                        help="--scaling: intra-op threads of the one-rank baseline (default 0: torch's default in a "
                             "fresh process, one per core, what a user's single process gets)")
    args = parser.parse_args()
    if args.scaling:
        clips = [tuple(int(v) for v in c.split("x")) for c in args.clips]
        channels = [int(c) for c in args.channels.split(",")]
        print(f"scaling: channels {channels}, clips {args.clips}, worlds {args.worlds}, modes {args.modes}; "
              f"load {os.getloadavg()}")
        results = {"scaling": bench_scaling(clips, args.worlds, args.modes, channels, rounds=args.rounds,
                                            threads=args.p1_threads or None)}
        _print("scaling (wall = slowest rank; busy = wall minus collectives; cpu_ratio = total CPU / one rank's)",
               results["scaling"])
        print(f"load after: {os.getloadavg()}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    torch.set_num_threads(args.threads)
    video = random_video(args.frames, args.height, args.width)
    print(f"video {tuple(video.shape)}, tiny VAE, peaks = live activation bytes")
    results = {"chunking": bench_chunking(video)}
    _print("temporal chunking (single device)", results["chunking"])
    if not args.skip_sharded:
        results["sharded"] = bench_sharded(args.frames, args.height, args.width)
        _print("height-sharded (split=4 inside each rank; gathered result)", results["sharded"])
    results["tiled"] = bench_tiled(video)
    _print("tiled (split=4 inside each tile)", results["tiled"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
