"""VAE memory and accuracy of its execution modes, CPU-sized.

    python benchmarks/bench_vae.py [--frames 17] [--height 64] [--width 96] [--json out.json]

Memory is the peak of live activation bytes (``examples.seedvr2.vae.memory.peak_tensor_bytes``: every tensor an
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from examples.seedvr2.vae import CausalVideoVAE  # noqa: E402
from examples.seedvr2.vae.memory import peak_tensor_bytes  # noqa: E402
from examples.seedvr2.vae.sharding import decode_sharded, encode_sharded  # noqa: E402
from examples.seedvr2.vae.tiling import decode_tiled, encode_tiled  # noqa: E402
from tests.helpers import random_video, tiny_vae  # noqa: E402
from winsp.group import SPGroup  # noqa: E402
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
        latent, enc_peak, enc_s = measured(lambda: vae.encode(video))
        decoded, dec_peak, dec_s = measured(lambda: vae.decode(latent))
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
        lat_t, e_peak, e_s = measured(lambda: encode_tiled(vae, video, tile_size=tile, overlap=overlap))
        dec_t, d_peak, d_s = measured(lambda: decode_tiled(vae, latent, tile_size=tile, overlap=overlap))
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
    args = parser.parse_args()
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
