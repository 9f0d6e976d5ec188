"""A shifted-window model with a Swin-style relative position bias, written twice: plainly, and on winsp.

``PlainBiasedWindows`` is the original: a loop over each sample's windows (cut by hand, with no winsp code), a learned
bias table per block indexed by the (dt, dh, dw) offset of every query/key pair, text keys and queries beside the
video, the text output averaged over all windows of its sample. ``BiasedWindows`` holds the same parameters (same
state_dict) and runs through a winsp request: a layout hook turns each local row's global coordinates into a bias
key once per layout, and the bias enters attention as a ``score_mod``. Tests compare the two at several ranks
(``tests/test_score_mod_model.py``); ``python -m examples.toy_biased_windows`` prints the difference at 2 ranks.
"""

from __future__ import annotations

import torch
from torch import nn

import winsp


def _cuts(size: int, window: int, shift: int) -> list[tuple[int, int]]:
    """Window boundaries along one axis: the first cut at ``shift`` (or ``window``), then every ``window``."""
    starts = [0] + list(range(shift or window, size, window))
    return [(a, min(b, size)) for a, b in zip(starts, starts[1:] + [size], strict=True) if b > a]


class BiasedBlock(nn.Module):
    """Attention (qkv shared by video and text, a relative position bias on video pairs) and an MLP."""

    def __init__(self, dim: int, heads: int, window: tuple[int, int, int], layer: int) -> None:
        super().__init__()
        self.heads, self.window, self.layer = heads, window, layer
        self.norm, self.qkv, self.out = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        span = [2 * k - 1 for k in window]
        self.bias = nn.Parameter(torch.randn(span[0] * span[1] * span[2], heads) * 0.5)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def strides(self) -> tuple[int, int, int]:
        """Bias index of an offset ``d``: ``(d + window - 1) . strides``; the table is
        [(2wt-1)(2wh-1)(2ww-1), heads]."""
        _, sh, sw = (2 * k - 1 for k in self.window)
        return sh * sw, sw, 1

    def center(self) -> int:
        return sum((k - 1) * s for k, s in zip(self.window, self.strides(), strict=True))

    def split(self, x: torch.Tensor):
        return x.unflatten(-1, (3, self.heads, -1)).unbind(-3)


class PlainBiasedWindows(nn.Module):
    """The original model: no winsp, windows cut per sample by hand, layers alternate regular / shifted windows."""

    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 2, window=(2, 3, 4)) -> None:
        super().__init__()
        self.window = tuple(window)
        self.blocks = nn.ModuleList(BiasedBlock(dim, heads, self.window, i) for i in range(layers))

    def shift(self, layer: int) -> tuple[int, int, int]:
        return tuple(k // 2 for k in self.window) if layer % 2 else (0, 0, 0)

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, grids, text_lengths) -> torch.Tensor:
        """vid [N, dim] canonical rows of all samples, txt [sum(text_lengths), dim]; returns canonical [N, dim]."""
        for block in self.blocks:
            vid, txt = self._block(block, vid, txt, grids, text_lengths)
        return vid

    def _block(self, block: BiasedBlock, vid, txt, grids, text_lengths):
        out_vid, out_txt = torch.zeros_like(vid), torch.zeros_like(txt)
        x_vid, x_txt = block.norm(vid), block.norm(txt)
        row, trow = 0, 0
        for (t, h, w), n_txt in zip(grids, text_lengths, strict=True):
            ids = torch.arange(t * h * w).view(t, h, w)
            coords = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
            cuts = [_cuts(n, k, s) for n, k, s in zip((t, h, w), self.window, self.shift(block.layer), strict=True)]
            windows = [(a, b, c) for c in cuts[2] for b in cuts[1] for a in cuts[0]]
            for (t0, t1), (h0, h1), (w0, w1) in windows:
                mine = row + ids[t0:t1, h0:h1, w0:w1].reshape(-1)
                pos = coords[t0:t1, h0:h1, w0:w1].reshape(-1, 3)
                x = torch.cat([x_vid[mine], x_txt[trow:trow + n_txt]])
                q, k, v = block.split(block.qkv(x))
                scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
                n = len(mine)
                offset = pos[:, None, :] - pos[None, :, :] + torch.tensor(self.window) - 1
                index = (offset * torch.tensor(block.strides())).sum(-1)
                scores = torch.cat([torch.cat([scores[:, :n, :n] + block.bias[index].permute(2, 0, 1),
                                               scores[:, :n, n:]], 2), scores[:, n:]], 1)
                o = block.out(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1))
                out_vid = out_vid.index_add(0, mine, o[:n])
                out_txt = out_txt.index_add(0, torch.arange(trow, trow + n_txt), o[n:] / len(windows))
            row, trow = row + t * h * w, trow + n_txt
        vid, txt = vid + out_vid, txt + out_txt
        return vid + block.mlp(block.norm(vid)), txt + block.mlp(block.norm(txt))


class BiasedWindows(winsp.WindowParallel, PlainBiasedWindows):
    """The same model on winsp: same parameters, the bias as a ``score_mod``, its index from a layout hook."""

    def window_schedule(self):
        return [winsp.FixedWindows(self.window, shift=self.shift(i)) for i in range(len(self.blocks))]

    def build_runtime(self, parallel_config=None, *, group=None):
        runtime = super().build_runtime(parallel_config, group=group)
        strides = torch.tensor(self.blocks[0].strides())
        # one bias key per local row and layout: coordinates . strides (built once, read by every block)
        runtime.register_layout_hook(
            "bias_key", lambda local, device: torch.from_numpy(local.grid_coords).to(device) @ strides.to(device))
        return runtime

    def forward(self, vid, txt, grids, text_lengths):
        # score_mods=True: the bias indexes per-local-row tensors, so the planner keeps windows whole on one rank
        request = self.require_runtime().request(grids, text_lengths, device=vid.device, dtype=vid.dtype,
                                                 score_mods=True)
        x = request.scatter(vid)
        for block in self.blocks:
            x = request.to_layer(x, block.layer)
            key = request.layout_data("bias_key")
            center = block.center()

            def score_mod(score, head, q_row, k_row, bias=block.bias, key=key, center=center):
                return score + bias[key[q_row] - key[k_row] + center, head]

            xn, tn = block.norm(x), block.norm(txt)
            a_vid, a_txt = request.attention(*block.split(block.qkv(xn)), *block.split(block.qkv(tn)),
                                             layer=block.layer, score_mod=score_mod)
            x, txt = x + block.out(a_vid.flatten(1)), txt + block.out(a_txt.flatten(1))
            x, txt = x + block.mlp(block.norm(x)), txt + block.mlp(block.norm(txt))
        return request.gather(x)


def _demo(rank: int, world_size: int):
    torch.manual_seed(0)
    model = BiasedWindows().double()
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=world_size))
    torch.manual_seed(1)
    grids, lengths = [(3, 6, 8), (2, 5, 4)], [3, 2]
    vid, txt = torch.randn(3 * 6 * 8 + 2 * 5 * 4, 16, dtype=torch.double), torch.randn(5, 16, dtype=torch.double)
    return model(vid, txt, grids, lengths), (vid, txt, grids, lengths)


if __name__ == "__main__":
    from winsp.testing import run_ranks

    outs = run_ranks(_demo, 2)
    torch.manual_seed(0)
    plain = PlainBiasedWindows().double()
    print("max |2 ranks - original| =", (outs[0][0] - plain(*outs[0][1])).abs().max().item())
