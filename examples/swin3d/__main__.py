"""Demo: torchvision's swin3d_t on 2 gloo ranks (all four stages window-parallel) against the untouched model.

    python -m examples.swin3d            # float64, a 4 x 32 x 32 clip (padded grid) in training mode, batch 2
"""

from __future__ import annotations

import argparse
import time

from winsp.planning.hierarchy import grid_change_rows
from winsp.testing import run_ranks

from .adapter import swin3d_plan
from .compare import compare_with_torchvision
from .load_torchvision import import_torchvision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--size", type=int, default=32, help="height = width of the clip in pixels")
    parser.add_argument("--eval", action="store_true", help="eval mode (default: training, stochastic depth on)")
    args = parser.parse_args()
    shape = (2, 3, args.frames, args.size, args.size)
    start = time.perf_counter()
    report = run_ranks(compare_with_torchvision, args.ranks, shape, not args.eval, timeout=900)[0]
    print(f"swin3d_t, input {shape}, {'eval' if args.eval else 'train'} mode, {args.ranks} gloo ranks vs the "
          f"untouched torchvision model (float64, relative max differences):")
    for name, value in report.items():
        print(f"  {name:12s} {value:.3e}" if isinstance(value, float) else f"  {name:12s} {value}")
    print(f"({time.perf_counter() - start:.1f} s)")
    import_torchvision()
    from torchvision.models.video import swin3d_t

    grids = [(-(-args.frames // 2), -(-args.size // 4), -(-args.size // 4))] * shape[0]
    print("rows each sharded patch merging moves between ranks (an all-gather of the same activations would move):")
    for stage, moved, all_gather in grid_change_rows(swin3d_plan(swin3d_t(weights=None)).stages, grids, args.ranks):
        print(f"  into stage {stage}: {moved} rows ({all_gather})")


if __name__ == "__main__":
    main()
