"""``python -m examples.swinv2``: a tiny random HF Swinv2Model on 2 gloo ranks against the untouched model.

Prints, per image size (32x32: grids are window multiples; 36x36: padding at every stage) and mode (eval; train with
per-sample drop path), the largest differences of the outputs and of the gradients after ``winsp.sync_gradients``,
then how many rows each stage boundary (the sharded patch merging) moves, against an all-gather of the same rows.
"""

from __future__ import annotations

from winsp.testing import run_ranks

from .parity import boundary_rows, compare_with_original


def main() -> None:
    results = run_ranks(compare_with_original, 2, timeout=300)[0]
    print("HF Swinv2Model (float64, batch 2) on 2 ranks vs the untouched model: largest differences")
    for (size, train), r in results.items():
        print(f"  {size}x{size} {'train' if train else 'eval '}: last_hidden_state {r['last_hidden_state']:.1e}, "
              f"pooler_output {r['pooler_output']:.1e}, stage hidden states {r['hidden_states']:.1e}, "
              f"parameter grads {r['parameter_grad']:.1e} (relative), pixel grads {r['pixel_grad']:.1e} (relative)")
    per_rank = run_ranks(boundary_rows, 2, timeout=300)
    for stage, (moved, _) in enumerate(per_rank[0], start=1):
        rows = sum(r[stage - 1][1] for r in per_rank)
        print(f"  36x36, patch merging into stage {stage}: {moved} rows change rank; an all-gather of the stage's "
              f"{rows} rows would send {rows * (len(per_rank) - 1)}")


if __name__ == "__main__":
    main()
