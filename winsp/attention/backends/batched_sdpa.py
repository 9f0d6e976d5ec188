"""``batched_sdpa``: one SDPA call over all windows, when every non-empty window has the same segment length.

With equal video counts and text lengths the video part is a plain view of the local rows (no packing gather);
otherwise it falls back to the grouped packing, which is then a single group.
"""

from __future__ import annotations

import torch

import winsp.attention.backends.grouped_sdpa as grouped_sdpa
from winsp.attention.backends.base import Backend, sdpa_segments


def _unavailable(device, segments, dtype):
    if segments is not None and len(segments.groups) > 1:
        lengths = sorted(length for length, _ in segments.groups)
        return f"it needs all windows to share one segment length, got lengths {lengths}"
    return None


def _run(qkv_vid, qkv_txt, segments, idx, scale, mods=None):
    if mods or not segments.is_uniform:  # mixed video/text splits, or modified scores: the grouped path, one group
        return grouped_sdpa._run(qkv_vid, qkv_txt, segments, idx, scale, mods)
    count, vid_len, txt_len = segments.num_windows, segments.vid_counts[0], segments.txt_lengths[0]
    heads_dim = qkv_vid[0].shape[1:]

    def window_batch(vid, txt):
        vid = vid.reshape(count, vid_len, *heads_dim)
        if txt_len == 0:
            return vid
        txt = txt.index_select(0, idx.uniform_txt_index).view(count, txt_len, *heads_dim)
        return torch.cat([vid, txt], dim=1)

    q, k, v = (window_batch(vid, txt) for vid, txt in zip(qkv_vid, qkv_txt, strict=True))
    out = sdpa_segments(q, k, v, scale)
    vid_out = out[:, :vid_len].reshape(count * vid_len, *heads_dim)
    txt_out = out[:, vid_len:].reshape(count * txt_len, *heads_dim)
    return vid_out, txt_out


BACKEND = Backend(name="batched_sdpa", unavailable_reason=_unavailable, load=lambda: _run)
