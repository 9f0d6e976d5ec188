"""A tiny windowed DiT made window-parallel with winsp, and run over 2 gloo ranks.

    python -m examples.toy_windowed_block

The model is ordinary PyTorch: tokenwise projections, window attention over [window video, replicated text], an MLP.
The only winsp-specific lines are the ones that use ``request``: scatter the canonical rows, switch layout before each
layer, attend, gather. The same model object runs at any degree; its output equals the single-rank output.
"""

from __future__ import annotations

import torch
from torch import nn

import winsp


class ToyWindowedBlock(nn.Module):
    """Pre-norm attention + MLP over video rows and replicated text rows, modulated by a per-sample embedding.

    ``shared=True`` uses the video stream's weights for the text stream too (as MM-DiTs with shared projections do).
    """

    def __init__(self, dim: int, heads: int, layer: int, shared: bool = False) -> None:
        super().__init__()
        self.heads, self.layer = heads, layer
        self.norm_vid, self.norm_txt = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv_vid, self.out_vid = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        if shared:
            self.qkv_txt, self.out_txt = self.qkv_vid, self.out_vid
        else:
            self.qkv_txt, self.out_txt = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, vid, txt, request: winsp.runtime.WindowRequest, scale=None):
        def heads(x):
            return x.unflatten(-1, (3, self.heads, -1)).unbind(-3)  # q, k, v as [L, heads, head_dim]

        v, t = self.norm_vid(vid), self.norm_txt(txt)
        if scale is not None:  # per-sample modulation: video rows pick their sample's row, text rows theirs
            v = v * (1 + scale[0].index_select(0, request.row_sample))
            t = t * (1 + scale[1])
        qv, kv, vv = heads(self.qkv_vid(v))
        qt, kt, vt = heads(self.qkv_txt(t))
        # no communication but the text mean
        attn_vid, attn_txt = request.attention(qv, kv, vv, qt, kt, vt, layer=self.layer)
        vid = vid + self.out_vid(attn_vid.flatten(1))
        txt = txt + self.out_txt(attn_txt.flatten(1))
        return vid + self.mlp(vid), txt


class ToyWindowedDiT(winsp.WindowParallel, nn.Module):
    """Layers alternate Swin-style regular and shifted windows of a fixed size (clipped at the borders).

    The last ``shared_layers`` blocks share their weights between the streams. With a timestep, a small embedding
    modulates both streams of every block (one value per sample).
    """

    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 4, window=(2, 4, 4),
                 shared_layers: int = 0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyWindowedBlock(dim, heads, i, shared=i >= layers - shared_layers)
                                    for i in range(layers))
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.window = tuple(window)

    def window_schedule(self):
        shift = tuple(k // 2 for k in self.window)
        return [winsp.FixedWindows(self.window, shift=shift if i % 2 else (0, 0, 0)) for i in range(len(self.blocks))]

    def forward(self, vid, txt, grids, text_lengths, timestep=None):
        """vid [N, dim] canonical rows of all samples; txt [L_txt, dim] replicated; returns canonical [N, dim].

        ``timestep`` (optional) is one value per sample, [b].
        """
        request = self.require_runtime().request(grids, text_lengths, device=vid.device, dtype=vid.dtype)
        scale = None
        if timestep is not None:
            per_sample = self.time_embed(timestep.to(vid.dtype).unsqueeze(-1))  # [b, dim]
            sample_of_text = torch.tensor([s for s, n in enumerate(text_lengths) for _ in range(n)], device=vid.device)
            scale = (per_sample, per_sample.index_select(0, sample_of_text))
        vid = request.scatter(vid)
        for i, block in enumerate(self.blocks):
            vid = request.to_layer(vid, i)
            vid, txt = block(vid, txt, request, scale)
        return request.gather(vid)


def _demo_inputs(dim: int = 16):
    torch.manual_seed(0)
    grids, text_lengths = [(3, 12, 20), (2, 8, 8)], [5, 3]
    n = sum(t * h * w for t, h, w in grids)
    vid, txt = torch.randn(n, dim, dtype=torch.float64), torch.randn(sum(text_lengths), dim, dtype=torch.float64)
    return vid, txt, grids, text_lengths


def _rank_main(rank: int, world_size: int):
    torch.manual_seed(1)
    model = ToyWindowedDiT().double()  # same seed -> same weights on every rank
    path = model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size)).execution_path
    vid, txt, grids, text_lengths = _demo_inputs()
    return path, model(vid, txt, grids, text_lengths)


def main() -> None:
    from winsp.testing import run_ranks

    torch.manual_seed(1)
    reference = ToyWindowedDiT().double()(*_demo_inputs())
    for (path, out) in run_ranks(_rank_main, 2, timeout=120):
        print(f"{path}: max |parallel - single| = {(out - reference).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
