"""Patchify / un-patchify of packed video latents as one precomputed row gather each.

Pre-patch rows are the packed samples, each row-major in (t, h, w). With patch size (pt, ph, pw), post-patch token
(T, H, W) of a sample collects the pre-patch rows of its (pt, ph, pw) block, in row-major (i, j, k) order with the
channels innermost, i.e. a patch vector is laid out ``(pt, ph, pw, C)``. When a sample's frame count is not a
multiple of pt, its first frame is repeated in front until it is (and those leading frames are dropped again on the
way out), as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["PatchPlan", "plan_patches", "PatchIn", "PatchOut"]

Triple = tuple[int, int, int]


@dataclass(frozen=True)
class PatchPlan:
    """Index tensors for one packed batch of pre-patch shapes (CPU, int64).

    Attributes:
        shapes: pre-patch (T, H, W) of each sample.
        grids: post-patch (T', H', W') of each sample.
        gather: ``[N_post, pt*ph*pw]`` pre-patch row of each element of each post-patch token (canonical order).
        scatter: ``[N_pre]`` row of the ``[N_post * pt*ph*pw, C]`` view of the un-patchified output that feeds each
            pre-patch row.
    """

    shapes: tuple[Triple, ...]
    grids: tuple[Triple, ...]
    gather: Tensor
    scatter: Tensor


def plan_patches(shapes: tuple[Triple, ...], patch_size: Triple) -> PatchPlan:
    """Build the patchify/un-patchify indices for pre-patch ``shapes``; H and W must divide by the patch size.

    Planning code: the indices are computed with numpy on the host (no torch op whose values a fake or device mode
    would hide) and handed over as CPU tensors for one move to the device.
    """
    pt, ph, pw = patch_size
    volume = pt * ph * pw
    gathers, scatters, grids = [], [], []
    pre_offset = post_offset = 0
    for s, (t, h, w) in enumerate(shapes):
        if h % ph or w % pw:
            raise ValueError(
                f"vid_shape[{s}] = {(t, h, w)}: height and width must be divisible by the patch size {(ph, pw)}"
            )
        pad = (-t) % pt  # leading copies of frame 0
        gt, gh, gw = (t + pad) // pt, h // ph, w // pw
        grids.append((gt, gh, gw))
        # padded frame index of each (T', i) -> source frame (frames before `pad` repeat frame 0)
        frame = np.maximum(np.arange(gt)[:, None] * pt + np.arange(pt)[None, :] - pad, 0)  # [T', pt]
        row = np.arange(gh)[:, None] * ph + np.arange(ph)[None, :]                          # [H', ph]
        col = np.arange(gw)[:, None] * pw + np.arange(pw)[None, :]                          # [W', pw]
        # pre-patch row id, shaped [T', H', W', pt, ph, pw]
        pre = (
            frame[:, None, None, :, None, None] * (h * w)
            + row[None, :, None, None, :, None] * w
            + col[None, None, :, None, None, :]
        )
        gathers.append(pre.reshape(-1, volume) + pre_offset)
        # inverse: element (token, p) of the output view feeds pre-patch row `pre` unless it is a padding frame
        element = np.arange(gt * gh * gw * volume, dtype=np.int64).reshape(gt, gh, gw, pt, ph, pw)
        padded_frame = np.arange(gt)[:, None] * pt + np.arange(pt)[None, :]               # [T', pt]
        keep = np.broadcast_to((padded_frame >= pad)[:, None, None, :, None, None], element.shape)
        order = np.argsort(pre[keep], kind="stable")  # kept rows are distinct: any sort gives the same order
        scatters.append(element[keep][order] + post_offset * volume)
        pre_offset += t * h * w
        post_offset += gt * gh * gw
    return PatchPlan(
        shapes=tuple(shapes), grids=tuple(grids),
        gather=torch.from_numpy(np.concatenate(gathers).astype(np.int64)),
        scatter=torch.from_numpy(np.concatenate(scatters).astype(np.int64)),
    )


class PatchIn(nn.Module):
    """Patch projection ``proj: Linear(C * pt * ph * pw, dim)`` applied to already gathered patch vectors."""

    def __init__(self, in_channels: int, patch_size: Triple, dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Linear(in_channels * patch_size[0] * patch_size[1] * patch_size[2], dim)

    @staticmethod
    def patchify(vid: Tensor, plan: PatchPlan) -> Tensor:
        """Pre-patch rows ``[N_pre, C]`` -> canonical post-patch patch vectors ``[N_post, pt*ph*pw*C]``."""
        gather = plan.gather.to(vid.device)  # a no-op when the plan already lives there
        return vid.index_select(0, gather.reshape(-1)).reshape(gather.shape[0], -1)

    def forward(self, patches: Tensor) -> Tensor:
        return self.proj(patches)


class PatchOut(nn.Module):
    """Output projection ``proj: Linear(dim, C * pt * ph * pw)``; :meth:`unpatchify` restores pre-patch rows."""

    def __init__(self, out_channels: int, patch_size: Triple, dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.out_channels = out_channels
        self.proj = nn.Linear(dim, out_channels * patch_size[0] * patch_size[1] * patch_size[2])

    def unpatchify(self, out: Tensor, plan: PatchPlan) -> Tensor:
        """Canonical post-patch rows ``[N_post, pt*ph*pw*C]`` -> pre-patch rows ``[N_pre, C]``."""
        elements = out.reshape(-1, self.out_channels)
        return elements.index_select(0, plan.scatter.to(out.device))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)
