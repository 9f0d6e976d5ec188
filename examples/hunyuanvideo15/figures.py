"""HunyuanVideo 1.5's STA layer at 720p x 121 frames on P ranks, from winsp's real halo plans: bytes per layer against
Ulysses' four all-to-alls, and each rank's attention work against the mean.

    python -m examples.hunyuanvideo15.figures            # P = 2, 4, 8 bytes; P = 2 .. 8 balance

The setting (:func:`examples.hunyuanvideo15.sta.hunyuanvideo15_sta_setting`): latent grid (31, 45, 80) (diffusers'
VAE: 4x time, 16x space; patch 1), STA tile (6, 8, 8) and 3 x 3 x 3 tiles (HunyuanVideo 1.5's own attn_param), so
``Neighborhood.sliding_tile`` = kernel (18, 24, 24), stride (6, 8, 8); 16 heads x 128, bf16 activations.

- **Video bytes.** A layer receives the k and v rows of each rank's halo (``block_halo_rows`` of the plan's blocks);
  Ulysses sends (P - 1) / P of q, k, v and the output, ``[N, C]`` each. Totals over all ranks.
- **Text bytes.** winsp: the text queries' partial sums over each rank's video, one all-reduce of ``[n, heads,
  head_dim + 1]`` (plus the ``[n, heads]`` maxima, all-gathered), counted as a ring all-reduce (each rank sends
  2 (P - 1) / P of it). Ulysses: the text is on every rank, each computes its heads, and the text output is
  all-gathered ((P - 1) / P of ``[n, C]`` to each rank). ``n`` is every text row valid: 1000 (Qwen) + 256 (ByT5) + 729
  (image) = 1985, the pipeline's padded maximum; a prompt's valid rows are fewer.
- **Balance.** ``block_work`` (query x key pairs of the neighbourhoods) of each rank's block, against the mean.
"""

from __future__ import annotations

import math

import winsp
from examples.hunyuanvideo15.sta import hunyuanvideo15_sta_setting
from winsp.planning.costs import DEFAULT_COSTS, PCIE_COSTS, CostConstants
from winsp.planning.halo import NeighborhoodBlocks, block_halo_rows, block_work, choose_blocks

__all__ = ["sta_layer_figures", "cut_label"]

TEXT_ROWS = 1000 + 256 + 729  # diffusers' pipeline: tokenizer_max_length, tokenizer_2_max_length, image tokens
BYTES = 2  # bf16


def sta_layer_figures(p: int, setting: dict | None = None, text_rows: int = TEXT_ROWS,
                      costs: CostConstants = DEFAULT_COSTS) -> dict:
    """One STA layer of HunyuanVideo 1.5 on ``p`` ranks, from the plan winsp makes for it with ``costs``."""
    s = setting or hunyuanvideo15_sta_setting()
    grid, geometry = s["grid"], winsp.Neighborhood.sliding_tile(s["tile"], s["tiles"])
    c, n = s["heads"] * s["head_dim"], math.prod(grid)
    blocks = choose_blocks([grid], [geometry], p, costs)
    rows = block_halo_rows(grid, blocks, geometry)
    work = block_work(grid, blocks, geometry)
    halo_bytes = 2 * sum(h for _, h in rows) * c * BYTES
    ulysses_bytes = 4 * n * c * BYTES * (p - 1) / p
    text_winsp = p * 2 * (p - 1) / p * text_rows * s["heads"] * (s["head_dim"] + 1) * BYTES \
        + p * (p - 1) / p * text_rows * s["heads"] * BYTES * 2  # all-reduce of partial sums, all-gather of maxima
    text_ulysses = p * (p - 1) / p * text_rows * c * BYTES
    return dict(p=p, cut=cut_label(grid, blocks), halo_rows=[h for _, h in rows],
                own_rows=[o for o, _ in rows], halo_bytes=halo_bytes, ulysses_bytes=ulysses_bytes,
                ratio=halo_bytes / ulysses_bytes, text_bytes=text_winsp, ulysses_text_bytes=text_ulysses,
                ratio_with_text=(halo_bytes + text_winsp) / (ulysses_bytes + text_ulysses),
                heaviest_over_mean=max(work) / (sum(work) / p))


def cut_label(grid, blocks) -> str:
    """A product cut's ``(pt, ph, pw)``, or ``nested`` (boxes cut two ways in a tree)."""
    if isinstance(blocks, NeighborhoodBlocks):
        return str(blocks.splits)
    return f"nested ({len(blocks.slices(grid))} boxes)"


def main() -> None:
    s = hunyuanvideo15_sta_setting()
    print(f"HunyuanVideo 1.5 STA at 720p x 121 frames: grid {s['grid']}, tile {s['tile']} x {s['tiles']} tiles = "
          f"kernel {s['kernel']}, stride {s['stride']}; {s['heads']} heads x {s['head_dim']}, bf16, "
          f"text {TEXT_ROWS} rows")
    print("| P | links (planner costs) | cut | halo rows (all ranks) | halo MB | Ulysses MB | halo / Ulysses "
          "| with text | heaviest / mean work |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in range(2, 9):
        for name, costs in (("NVLink", DEFAULT_COSTS), ("PCIe", PCIE_COSTS)):
            f = sta_layer_figures(p, s, costs=costs)
            print(f"| {p} | {name} | {f['cut']} | {sum(f['halo_rows'])} | {f['halo_bytes'] / 1e6:.1f} | "
                  f"{f['ulysses_bytes'] / 1e6:.1f} | {f['ratio']:.3f} | {f['ratio_with_text']:.3f} | "
                  f"{f['heaviest_over_mean']:.4f} |")


if __name__ == "__main__":
    main()
