"""Padded replicated text (a model that masks its text's padding, valid rows first): ``Replicated(valid=)`` counts each
sample's valid rows from the region's arguments, ``request.attention(text_padded=True)`` takes the padded text and
gives the padding zeros; ``Patches.whole_grid`` swaps a module that computes per-position tables from the video's
shape (diffusers' RoPE). End to end on diffusers' HunyuanVideo 1.5: ``tests/test_hunyuanvideo15.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import winsp
from winsp.adoption import Patches, Replicated


class _Region(nn.Module):
    def forward(self, x, text=None, mask=None, extra=3):
        return x


def test_valid_counts_come_from_the_region_arguments_by_name():
    region, x, text = _Region(), torch.zeros(2, 7, 4), torch.zeros(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    valid = Replicated(at="text", valid=lambda a: [int(m.sum()) + a["extra"] for m in a["mask"]])
    counts = valid.take(region, (x, text), {"mask": mask})[3]  # mask by keyword, extra from its default
    assert counts == (2, (6, 4)) and valid.lengths(counts, 2) == (6, 4)
    assert Replicated(at="text", valid=lambda a: a["mask"].sum(1)).take(region, (x, text, mask), {})[3] == (2, (3, 1))
    with pytest.raises(ValueError, match="valid must return one non-negative integer count per sample, for the 2"):
        Replicated(at="text", valid=lambda a: [3]).take(region, (x, text), {})
    with pytest.raises(ValueError, match="valid must return one non-negative integer count per sample"):
        Replicated(at="text", valid=lambda a: [0.5, 1]).take(region, (x, text), {})
    with pytest.raises(ValueError, match="for a separate argument"):
        Replicated(at="first", valid=lambda a: [1])
    with pytest.raises(ValueError, match="must be a function"):
        Replicated(at="text", valid=3)


def _request(text_lengths):
    runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2)), winsp.Neighborhood((1, 3, 3))])
    return runtime.request([(2, 4, 4), (2, 4, 4)], text_lengths)


@pytest.mark.parametrize("layer", [0, 1])  # windows, a neighbourhood
def test_padded_text_takes_the_valid_rows_and_gives_the_padding_zeros(layer):
    torch.manual_seed(0)
    request, per = _request((3, 1)), 4  # text lengths 3 and 1, padded to 4 rows each
    q, k, v = (request.to_layer(request.scatter(torch.randn(64, 2, 8, dtype=torch.float64)), layer) for _ in range(3))
    padded = [torch.randn(2 * per, 2, 8, dtype=torch.float64) for _ in range(3)]
    valid = [torch.cat([t[:3], t[per:per + 1]]) for t in padded]
    want_vid, want_txt = request.attention(q, k, v, *valid, layer=layer)
    vid, txt = request.attention(q, k, v, *padded, layer=layer, text_padded=True)
    assert torch.equal(vid, want_vid)
    assert torch.equal(txt[:3], want_txt[:3]) and torch.equal(txt[per:per + 1], want_txt[3:])
    assert not txt[3:per].any() and not txt[per + 1:].any() and txt.shape == padded[0].shape
    with pytest.raises(ValueError, match=r"text tensors have \[5\] rows; they must hold the 2 sample"):
        request.attention(q, k, v, *(t[:5] for t in padded), layer=layer, text_padded=True)
    with pytest.raises(ValueError, match=r"at least their text lengths \(3, 1\)"):
        request.attention(q, k, v, *(t[:4] for t in padded), layer=layer, text_padded=True)


class _Positions(nn.Module):
    """A table per grid position computed from the video's shape only, as diffusers' RoPE modules do."""

    def forward(self, video):
        t, h, w = video.shape[2:]
        return torch.stack(torch.meshgrid(*(torch.arange(n, dtype=video.dtype) for n in (t, h, w)), indexing="ij"),
                           -1).flatten(0, 2), video.new_ones(t * h * w, 1)


class _Video(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.positions, self.proj, self.attn = _Positions(), nn.Conv3d(3, 4, 1), nn.Identity()

    def forward(self, video):  # [1, C, T, H, W] -> the same, plus each position's (t, h, w) in channels 0..2
        pos, ones = self.positions(video)
        x = self.proj(video).flatten(2).transpose(1, 2)  # [1, N, 4]
        x = self.attn(x + torch.cat([pos, ones], -1))
        return x.transpose(1, 2).unflatten(2, video.shape[2:])


def test_whole_grid_computes_the_table_on_the_whole_grid_and_reads_this_ranks_rows():
    torch.manual_seed(0)
    original, model = _Video().double(), _Video().double()
    model.load_state_dict(original.state_dict())
    io = Patches((1, 1, 1), channels=1)
    winsp.parallelize(model, winsp.ParallelPlan(
        region=winsp.Region("", "", io), stages=[winsp.Stage([winsp.FixedWindows((1, 2, 2))])], attention="attn",
        layer_entry="attn", make_attention=winsp.swapped(lambda m, x: x), swaps=[("positions", io.whole_grid)]))
    video = torch.randn(1, 3, 2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(model(video), original(video), rtol=0, atol=0)
    model.positions.fn = lambda m, video: io._on_whole_grid(m, video[0])
    with pytest.raises(ValueError, match=r"Patches.whole_grid \(_Positions\): takes this rank's patches of one video"):
        model(video)
