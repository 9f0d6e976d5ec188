"""``nn.Module`` pieces for composing window parallelism into a DiT.

:class:`WindowParallel` is the one way a model holds its runtime (SeedVR2, the toy model and the guide all use it).
The step modules take the current :class:`~winsp.runtime.runtime.WindowRequest` as an argument, so one instance serves
every request and holds no per-request state.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from winsp.comm.group import world_rank_and_size
from winsp.geometry.windows import WindowGeometry
from winsp.runtime.config import DiffusionParallelConfig
from winsp.runtime.runtime import WindowRequest, WindowRuntime

__all__ = ["WindowParallel", "ScatterWindows", "EnsureLayout", "ReplicatedTextWindowAttention", "GatherWindows"]


class WindowParallel:
    """Mixin for a model run through a winsp runtime: implement :meth:`window_schedule`, call :meth:`build_runtime`.

    In a forward, :meth:`require_runtime` returns the runtime. A model whose runtime was never built runs on one
    rank, but only where that cannot be a mistake: inside an initialised ``torch.distributed`` world of more than
    one rank it raises instead of silently running the whole model unsharded on every rank.
    """

    _winsp_runtime: Optional[WindowRuntime] = None

    def window_schedule(self) -> Sequence[WindowGeometry]:
        """One window geometry per attention layer, in forward order."""
        raise NotImplementedError(f"{type(self).__name__} must implement window_schedule()")

    def build_runtime(
        self, parallel_config: Optional[DiffusionParallelConfig] = None, *, group=None
    ) -> WindowRuntime:
        """Build (and keep) the runtime for ``parallel_config`` (None: one rank) over this model's schedule."""
        runtime = WindowRuntime.from_config(parallel_config, self.window_schedule(), group=group)
        object.__setattr__(self, "_winsp_runtime", runtime)  # not an nn.Module attribute: no state_dict entry
        return runtime

    @property
    def runtime(self) -> Optional[WindowRuntime]:
        """The runtime :meth:`build_runtime` made, or None."""
        return self._winsp_runtime

    def require_runtime(self) -> WindowRuntime:
        """The runtime to run a forward with: the built one, or a one-rank runtime outside a multi-rank world."""
        if self._winsp_runtime is not None:
            return self._winsp_runtime
        _, world = world_rank_and_size()
        if world > 1:
            raise RuntimeError(
                f"{type(self).__name__}: torch.distributed runs {world} ranks but build_runtime() was never called, "
                f"so every rank would run the whole model unsharded; call "
                f"model.build_runtime(DiffusionParallelConfig(sp_degree={world})) for window parallelism, or "
                f"model.build_runtime(DiffusionParallelConfig(sp_degree=1), group=None) to run each rank alone"
            )
        return self.build_runtime(None)


class ScatterWindows(nn.Module):
    """Canonical rows -> this rank's rows of the first layer's layout."""

    def forward(self, x: torch.Tensor, request: WindowRequest) -> torch.Tensor:
        return request.scatter(x)


class EnsureLayout(nn.Module):
    """Bring local rows into layer ``layer``'s layout (a no-op when it is already current)."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, request: WindowRequest) -> torch.Tensor:
        return request.to_layer(x, self.layer)

    def extra_repr(self) -> str:
        return f"layer={self.layer}"


class ReplicatedTextWindowAttention(nn.Module):
    """Layer ``layer``'s window attention over [window video, replicated text] followed by the global text mean.

    It knows its layer, so rows left in another layer's layout are refused. ``score_mod`` / ``mask_mod`` given to the
    forward modify the video x video scores (:mod:`winsp.attention.score_mods`).
    """

    def __init__(self, layer: int, *, softmax_scale: float | None = None) -> None:
        super().__init__()
        self.layer, self.softmax_scale = layer, softmax_scale

    def forward(self, request: WindowRequest, q_vid, k_vid, v_vid, q_txt=None, k_txt=None, v_txt=None, *,
                score_mod=None, mask_mod=None):
        return request.attention(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, layer=self.layer, score_mod=score_mod,
                                 mask_mod=mask_mod, softmax_scale=self.softmax_scale)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, softmax_scale={self.softmax_scale}"


class GatherWindows(nn.Module):
    """This rank's rows -> the canonical tensor, complete on every rank."""

    def forward(self, x: torch.Tensor, request: WindowRequest) -> torch.Tensor:
        return request.gather(x)
