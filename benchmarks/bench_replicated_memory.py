"""What SP divides when a replicated part holds most of the activations: the 3D segmentation network
(``examples/swin_seg3d``: a Swin encoder made parallel, its CNN decoder replicated) in a training forward at
P = 1, 2, 4 (gloo ranks on the CPU, winsp at every P).

It counts the bytes each rank keeps for backward (``torch.autograd.graph.saved_tensors_hooks``, each storage once),
split into what is saved while the encoder's region runs (sharded) and outside it (the patch embedding and the
decoder, replicated, which also hold the gathered skips whole). Deterministic, so the figures may be recorded; they
are what a training step's activation memory is made of, not a device's peak (which adds weights, gradients,
optimizer state and the allocator's own).

    python benchmarks/bench_replicated_memory.py             # a 32 x 64 x 64 volume, feature size 16, float32
    python benchmarks/bench_replicated_memory.py --tiny      # a smoke run
"""

from __future__ import annotations

import argparse

import torch

import winsp
from winsp.runtime.context import current_request_or_none
from winsp.testing import run_ranks


def _rank(rank: int, world: int, size: tuple, dim: int) -> dict:
    from examples.swin_seg3d.adapter import seg_plan
    from examples.swin_seg3d.model import SegNet3d

    torch.manual_seed(0)
    model = SegNet3d(dim=dim)
    model = winsp.parallelize(model, seg_plan(model), winsp.DiffusionParallelConfig(ulysses_degree=world))
    x = torch.randn((1, 1) + size)
    seen: set = set()
    saved = {"region": 0, "replicated": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            saved["region" if current_request_or_none() is not None else "replicated"] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="an 8 x 16 x 16 volume, feature size 8")
    args = parser.parse_args()
    size, dim = ((8, 16, 16), 8) if args.tiny else ((32, 64, 64), 16)
    print(f"SegNet3d, volume {size}, feature size {dim}, float32, training forward: bytes saved for backward per rank")
    base = None
    for world in (1, 2, 4):
        saved = run_ranks(_rank, world, size, dim, timeout=1200)[0]
        total = saved["region"] + saved["replicated"]
        base = base or total
        print(f"  P = {world}: {total / 2**20:8.2f} MiB ({100 * (1 - total / base):5.1f} % below P = 1): encoder "
              f"region {saved['region'] / 2**20:7.2f} MiB, replicated {saved['replicated'] / 2**20:7.2f} MiB")


if __name__ == "__main__":
    main()
