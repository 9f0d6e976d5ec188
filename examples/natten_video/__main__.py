"""``python -m examples.natten_video``: the NATTEN model against its winsp version, in one process or under torchrun.

Prints the largest output difference (float32; natten's own forward is the reference). Under
``torchrun --nproc-per-node N -m examples.natten_video`` every rank runs the parallel model on gloo and rank 0 prints.
"""

from __future__ import annotations

import copy
import os

import torch

import winsp
from examples.natten_video.adapter import parallelize
from examples.natten_video.model import NATVideoConfig, random_model


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    config = NATVideoConfig(dim=32, heads=4)
    model = random_model(config).eval()
    video = torch.randn(1, 4, 12, 16, config.in_channels, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(video)
        parallel = parallelize(copy.deepcopy(model), winsp.DiffusionParallelConfig(ulysses_degree=world))
        out = parallel(video)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"NATTEN video model on {world} rank(s): max |winsp - natten| = {(out - expected).abs().max():.2e}")
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
