"""``flex``: PyTorch FlexAttention over all windows packed into one sequence, for calls with a score or mask mod.

The windows' block mask (a query attends only inside its own window segment) is built once per request shape, when
the runtime prepares the layout; the call's ``score_mod`` / ``mask_mod`` become FlexAttention's ``score_mod``. On CUDA
the kernel is compiled (``torch.compile(flex_attention)``, once per shape); inside a model compiled as a whole, dynamo
compiles it with the rest. On CPU it runs FlexAttention's eager implementation (every score materialised) unless the
caller's model is compiled, and it is inference-only there: torch has no CPU backward for FlexAttention, so a call
that needs gradients on CPU is refused (``grouped_sdpa`` applies the same mods with a backward). ``"auto"`` picks it
only on CUDA and only for calls with mods; name it explicitly elsewhere.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from winsp.attention.backends.base import Backend, Runner, pack, unpack
from winsp.attention.score_mods import ScoreMods

_compiled = None


def _import():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:
        return None
    return flex_attention, create_block_mask


def _kernel(device: torch.device):
    """FlexAttention: compiled on CUDA outside a compiled region, as it is otherwise."""
    global _compiled
    flex_attention = _import()[0]
    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _unavailable(device, segments, dtype) -> Optional[str]:
    if _import() is None:
        return "torch.nn.attention.flex_attention is not importable (torch >= 2.5 is needed)"
    if device.type not in ("cuda", "cpu"):
        return f"FlexAttention runs on CUDA and CPU, got {device.type!r}"
    return None


def _auto_rule(device, modded: bool) -> Optional[str]:
    if not modded:
        return "it is used for calls with a score_mod or mask_mod only"
    if device.type != "cuda":
        return "on CPU it runs eagerly and without a backward; grouped SDPA applies the mods there"
    return None


def _flex_score_mod(rows: torch.Tensor, vid_rows: torch.Tensor, segment_of_row: torch.Tensor, num_vid: int,
                    mods: Optional[ScoreMods]):
    """The user's mods in FlexAttention's ``(score, b, h, q_idx, kv_idx)`` form, on packed rows.

    FlexAttention may evaluate pairs its block mask drops (eagerly it evaluates all of them): a pair that is not two
    video rows of one window is evaluated at the query's video row paired with itself, then left unmodified.
    """
    if not mods or num_vid == 0:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        same_window = segment_of_row[q_idx] == segment_of_row[kv_idx]
        video_pair = (rows[q_idx] < num_vid) & (rows[kv_idx] < num_vid) & same_window
        q_vid = vid_rows[q_idx]
        k_vid = torch.where(same_window, vid_rows[kv_idx], q_vid)
        return apply_mods(score, h, q_vid, k_vid, video_pair, mods)

    return score_mod


def apply_mods(score, h, q_row, k_row, where, mods: ScoreMods):
    """``mods`` on one FlexAttention score at the pairs ``where`` holds (the others keep their score)."""
    if mods.score_mod is not None:
        score = torch.where(where, mods.score_mod(score, h, q_row, k_row), score)
    if mods.mask_mod is not None:
        score = torch.where(where & ~mods.mask_mod(h, q_row, k_row), float("-inf"), score)
    return score


def _prepare(segments, idx) -> Runner:
    device = idx.pack_index.device
    lengths = [segments.seq_lens[w] for w in segments.pack_order]
    total = int(sum(lengths))
    segment_of_row = torch.from_numpy(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)).to(device)

    def same_window(b, h, q_idx, kv_idx):
        return segment_of_row[q_idx] == segment_of_row[kv_idx]

    block_mask = _import()[1](same_window, None, None, total, total, device=device) if total else None

    def run(qkv_vid, qkv_txt, segments, idx, scale, mods=None):
        if (device.type == "cpu" and torch.is_grad_enabled()
                and any(t.requires_grad for t in (*qkv_vid, *qkv_txt))):
            raise ValueError("the flex backend on CPU is inference-only (torch has no CPU backward for "
                             "FlexAttention); use attention_backend='grouped_sdpa' to train on CPU")
        q, k, v = (pack(vid, txt, idx.pack_index, segments).transpose(0, 1).unsqueeze(0).contiguous()
                   for vid, txt in zip(qkv_vid, qkv_txt, strict=True))
        score_mod = _flex_score_mod(idx.pack_index, idx.pack_vid_row, segment_of_row, segments.total_vid, mods)
        out = _kernel(device)(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
        return unpack(out.squeeze(0).transpose(0, 1), idx.unpack_index, segments)

    return run


def _load() -> Runner:
    def run(qkv_vid, qkv_txt, segments, idx, scale, mods=None):
        return _prepare(segments, idx)(qkv_vid, qkv_txt, segments, idx, scale, mods)

    return run


BACKEND = Backend(name="flex", unavailable_reason=_unavailable, load=_load, auto_rule=_auto_rule, prepare=_prepare)
