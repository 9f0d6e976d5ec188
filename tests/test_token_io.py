"""winsp.FlatTokens and winsp.adoption.Patches: a region's tokens as [B, L, C] with the grid as another argument (HF
vision encoders), or as a latent video cut into patches (a whole video DiT)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import winsp


def test_reads_rows_and_grids_and_puts_local_rows_back():
    io = winsp.FlatTokens()
    x = torch.arange(2 * 6 * 3.0).view(2, 6, 3)
    rows, grids = io.read((x, (2, 3), "flag"), {})
    assert torch.equal(rows, x.reshape(12, 3)) and grids == [(1, 2, 3), (1, 2, 3)]
    args, kwargs = io.with_rows((x, (2, 3), "flag"), {"k": 1}, rows[:5])
    assert args[0].shape == (5, 3) and args[1:] == ((2, 3), "flag") and kwargs == {"k": 1}
    _, grids3 = winsp.FlatTokens().read((torch.zeros(1, 24, 2), (2, 3, 4)), {})
    assert grids3 == [(2, 3, 4)]


def test_rebuilds_tensor_tuple_and_mapping_outputs():
    io, rows = winsp.FlatTokens(), torch.arange(8.0).view(4, 2)
    grids = [(1, 1, 2), (1, 1, 2)]
    assert io.with_output(torch.zeros(4, 2), rows, grids).shape == (2, 2, 2)
    out = io.with_output((torch.zeros(4, 2), "extra"), rows, grids)
    assert torch.equal(out[0], rows.view(2, 2, 2)) and out[1] == "extra"
    mapping = OrderedDict(last_hidden_state=torch.zeros(4, 2), other=1)
    assert torch.equal(io.with_output(mapping, rows, grids)["last_hidden_state"], rows.view(2, 2, 2))
    assert torch.equal(io.output_rows((rows, None)), rows) and io.output_rows(rows) is rows


def test_refuses_bad_input_clearly():
    with pytest.raises(ValueError, match="does not describe the 6 tokens"):
        winsp.FlatTokens().read((torch.zeros(1, 6, 2), (2, 2)), {})
    with pytest.raises(ValueError, match="tokens \\[B, L, C\\] first"):
        winsp.FlatTokens().read((torch.zeros(6, 2),), {})
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        winsp.FlatTokens(refuse=("output_hidden_states",)).read((torch.zeros(1, 4, 2), (2, 2)),
                                                                {"output_hidden_states": True})
    with pytest.raises(ValueError, match="different grids"):
        winsp.FlatTokens().with_output(torch.zeros(3, 2), torch.zeros(3, 2), [(1, 1, 1), (1, 1, 2)])


def test_patches_present_each_patch_as_a_frame_that_a_strided_conv_embeds_as_the_whole_video_does():
    from winsp.adoption import Patches

    io = Patches((2, 2, 3), channels=1)  # [B, C, T, H, W] latents, temporal patches of 2
    x = torch.randn(1, 3, 4, 4, 6, dtype=torch.float64)
    rows, grids = io.read((x,), {})
    assert grids == [(2, 2, 2)] and tuple(rows.shape) == (8, 3 * 2 * 2 * 3)
    frames = io.with_rows((x, "cond"), {}, rows)[0][0]
    assert tuple(frames.shape) == (1, 3, 8 * 2, 2, 3)  # one sample: the 8 patches one after the other in time
    conv = torch.nn.Conv3d(3, 5, (2, 2, 3), stride=(2, 2, 3)).double()
    whole = conv(x).flatten(2).transpose(1, 2)[0]  # the tokens of the whole video, row-major in (t, h, w)
    torch.testing.assert_close(conv(frames).flatten(2).transpose(1, 2)[0], whole, rtol=1e-14, atol=1e-14)
    back = io.with_output((frames, "aux"), io.output_rows((frames, "aux")), grids)  # a tuple output: first item
    assert torch.equal(back[0], x) and back[1] == "aux"
    with pytest.raises(ValueError, match="batch of 2 samples"):
        io.read((torch.zeros(2, 3, 4, 4, 6),), {})
    with pytest.raises(ValueError, match=r"not a multiple of the patch \(2, 2, 3\)"):
        io.read((torch.zeros(1, 3, 4, 4, 5),), {})


def test_flat_tokens_in_any_axis_order_with_the_grid_as_frames_a_keyword_or_fixed():
    video = torch.arange(2 * 3 * 2 * 4 * 5.0).view(2, 3, 2, 4, 5)  # [B, T, H, W, C], canonical rows row-major
    frames_fastest = video.permute(0, 2, 3, 1, 4).reshape(2, 24, 5)  # (h w t): token (h*4 + w)*3 + t
    io = winsp.FlatTokens(order="hwt", grid_arg="thw")
    rows, grids = io.read((frames_fastest,), {"thw": (3, 2, 4)})
    assert torch.equal(rows, video.reshape(-1, 5)) and grids == [(3, 2, 4)] * 2
    back = io.with_output((torch.zeros(2, 24, 5), "aux"), rows, grids)
    assert torch.equal(back[0], frames_fastest) and back[1] == "aux"
    per_frame = video.reshape(2, 3, 8, 5).transpose(1, 2).reshape(2, 24, 5)  # S positions x T frames, frames fastest
    rows, grids = winsp.FlatTokens(order="hwt").read((per_frame, 3), {})  # a number of frames: the grid (T, 1, S)
    assert torch.equal(rows, video.reshape(-1, 5)) and grids == [(3, 1, 8)] * 2
    fixed = winsp.FlatTokens(grid=(3, 2, 4), order="twh")
    twh = video.permute(0, 1, 3, 2, 4).reshape(2, 24, 5)
    rows, _ = fixed.read((twh,), {})
    assert torch.equal(rows, video.reshape(-1, 5)) and torch.equal(fixed.with_output(twh, rows, grids=[(3, 2, 4)] * 2),
                                                                     twh)


def test_flat_tokens_refuse_a_bad_order_grid_or_frame_count_by_name():
    with pytest.raises(ValueError, match="FlatTokens.order must be a permutation of 'thw'"):
        winsp.FlatTokens(order="tw")
    with pytest.raises(ValueError, match=r"FlatTokens.grid must be \(H, W\) or \(T, H, W\)"):
        winsp.FlatTokens(grid=(2, 0))
    with pytest.raises(ValueError, match="4 frames do not divide the 6 tokens"):
        winsp.FlatTokens().read((torch.zeros(1, 6, 2), 4), {})
    with pytest.raises(ValueError, match="the grid as keyword argument 'thw'"):
        winsp.FlatTokens(grid_arg="thw").read((torch.zeros(1, 6, 2),), {})
