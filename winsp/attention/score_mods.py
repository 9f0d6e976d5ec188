"""Score modification inside window attention: relative position bias, continuous position bias, decays, masks.

A model modifies attention scores with two FlexAttention-style functions of tensors:

- ``score_mod(score, head, q_row, k_row) -> score``: the new pre-softmax score (add a bias, scale, ...);
- ``mask_mod(head, q_row, k_row) -> bool``: True where the query may attend to the key.

``q_row`` and ``k_row`` are **local video row indices**: rows of this rank's local tensors in the current layout, so
they index ``request.window_coords``, ``request.grid_coords`` or any per-local-row tensor the model built (in a
layout hook, say). ``head`` is the head index. Both functions apply to video-query x video-key pairs only; pairs with
a text query or a text key keep their plain score. Scores arrive already multiplied by the softmax scale.

Write them with broadcasting tensor ops and ``[..., i]`` indexing: the SDPA backends call them once per window group
with broadcast index tensors (``head`` ``[1, H, 1, 1]``, ``q_row`` ``[G, 1, S, 1]``, ``k_row`` ``[G, 1, 1, S]``,
``score`` ``[G, H, S, S]``); the FlexAttention backend calls them on scalars under vmap. Tensors they capture (a bias
table, an MLP's output) receive gradients as usual. Every query must keep at least one key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["ScoreMod", "MaskMod", "ScoreMods", "check_score_mods", "modified_scores", "attention_with_mods"]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True, eq=False)
class ScoreMods:
    """A call's ``score_mod`` and ``mask_mod`` (either may be None)."""

    score_mod: Optional[ScoreMod] = None
    mask_mod: Optional[MaskMod] = None

    def __bool__(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None


def check_score_mods(score_mod: Optional[ScoreMod], mask_mod: Optional[MaskMod]) -> Optional[ScoreMods]:
    """A :class:`ScoreMods` for the two arguments (None when both are None); a ValueError if one is not callable
    (the types say what a caller should pass; the check is for callers without a type checker)."""
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a callable (score_mod(score, head, q_row, k_row) / "
                             f"mask_mod(head, q_row, k_row)), got {type(fn).__name__}")
    mods = ScoreMods(score_mod, mask_mod)
    return mods if mods else None


def modified_scores(scores: Tensor, rows: Tensor, vid_rows: Tensor, num_vid: int, mods: ScoreMods) -> Tensor:
    """Apply ``mods`` to ``scores`` ``[G, H, S, S]`` of windows whose packed rows are ``rows`` ``[G, S]``.

    ``rows`` are concat rows (``< num_vid``: a local video row; else a text row), as in
    :attr:`~winsp.attention.segments.WindowSegments.concat_index`; ``vid_rows`` the matching
    :attr:`~winsp.attention.segments.WindowSegments.pack_vid_row`, where the functions are evaluated (text pairs are
    evaluated at a video row of the same window, then left unmodified). Masked pairs become ``-inf``.
    """
    if num_vid == 0:
        return scores
    groups, length = rows.shape
    head = torch.arange(scores.shape[1], device=scores.device).view(1, -1, 1, 1)
    video_pair = (rows.view(groups, 1, length, 1) < num_vid) & (rows.view(groups, 1, 1, length) < num_vid)
    q_vid, k_vid = vid_rows.view(groups, 1, length, 1), vid_rows.view(groups, 1, 1, length)
    if mods.score_mod is not None:
        scores = torch.where(video_pair, mods.score_mod(scores, head, q_vid, k_vid), scores)
    if mods.mask_mod is not None:
        blocked = video_pair & ~mods.mask_mod(head, q_vid, k_vid)
        scores = scores.masked_fill(blocked, float("-inf"))
    return scores


def attention_with_mods(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, vid_rows: Tensor, num_vid: int,
                        scale: float, mods: ScoreMods) -> Tensor:
    """Explicit attention over ``[G, S, heads, head_dim]`` groups with ``mods`` applied; returns the same layout.

    Scores and softmax run in float32 for half-precision inputs.
    """
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.einsum("gqhd,gkhd->ghqk", q.to(compute), k.to(compute)) * scale
    probs = torch.softmax(modified_scores(scores, rows, vid_rows, num_vid, mods), dim=-1)
    return torch.einsum("ghqk,gkhd->gqhd", probs, v.to(compute)).to(q.dtype)
