"""Demo: torchvision's swin3d_t on 2 gloo ranks (all four stages window-parallel) against the untouched model.

    python -m examples.swin3d            # float64, a 4 x 32 x 32 clip (padded grid) in training mode, batch 2
"""

from __future__ import annotations

import argparse
import time

from winsp.testing import run_ranks

from .compare import compare_with_torchvision


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


if __name__ == "__main__":
    main()
