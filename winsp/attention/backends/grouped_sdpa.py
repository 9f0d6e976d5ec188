"""``grouped_sdpa``: one batched SDPA call per set of windows of equal segment length. Runs everywhere.

With a ``score_mod`` the scores of each group are materialised and modified (exact, every device, forward and
backward); with only a ``mask_mod`` SDPA takes it as a boolean mask.
"""

from __future__ import annotations

import torch

from winsp.attention.backends.base import Backend, attend_groups, pack, unpack


def _run(qkv_vid, qkv_txt, segments, idx, scale, mods=None):
    q, k, v = (pack(vid, txt, idx.pack_index, segments) for vid, txt in zip(qkv_vid, qkv_txt, strict=True))
    heads_dim = q.shape[1:]
    outs = []
    for start, count, length in segments.group_slices:
        rows = slice(start, start + count * length)
        shape = (count, length, *heads_dim)
        group_rows = (idx.pack_index[rows].view(count, length), idx.pack_vid_row[rows].view(count, length)) \
            if mods else None
        out = attend_groups(q[rows].reshape(shape), k[rows].reshape(shape), v[rows].reshape(shape), group_rows,
                            segments, scale, mods)
        outs.append(out.reshape(count * length, *heads_dim))
    packed_out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return unpack(packed_out, idx.unpack_index, segments)


BACKEND = Backend(name="grouped_sdpa", unavailable_reason=lambda device, segments, dtype: None, load=lambda: _run)
