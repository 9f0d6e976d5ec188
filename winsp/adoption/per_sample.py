"""Modules that broadcast a per-sample tensor over a channels-last grid, run unchanged on local rows.

AdaRMSNorm, adaLN feed-forwards and the like take the tokens ``[N, H, W, C]`` and a conditioning vector ``[N, D]``
and broadcast it with ``cond[:, None, None, :]``. On this rank's rows ``[L, C]`` that broadcast lines the samples up
against the rows. :class:`PerSampleOnRows` runs the *original* forward on the rows viewed as ``L`` one-token grids
``[L, 1, 1, C]`` (as many ones as the region's grid has dimensions), with every per-sample tensor argument (first
dimension the request's number of samples) taken per row (``request.sample_rows``), so row ``i`` meets its own
sample's vector, then views the result back as rows. Outside a region (or on a tensor that is not local rows) the
module runs exactly as the original. ``ParallelPlan(per_sample=glob)`` swaps every matching module for one.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from winsp.adoption.parallelize import adopt
from winsp.runtime.context import current_request_or_none

__all__ = ["PerSampleOnRows"]


class PerSampleOnRows(nn.Module):
    """``original`` (its tensors adopted, state_dict keys unchanged) run per row on local rows (module docstring)."""

    def __init__(self, original: nn.Module, spatial_dims: int, path: str = "") -> None:
        super().__init__()
        if spatial_dims not in (1, 2, 3):
            raise ValueError(f"PerSampleOnRows: spatial_dims must be 1, 2 or 3, got {spatial_dims!r}")
        adopt(self, original)
        object.__setattr__(self, "_original", original)  # not a child: its tensors are this module's
        self.spatial_dims, self.path, self.swapped_from = spatial_dims, path, type(original).__name__

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        original: nn.Module = self.__dict__["_original"]
        original._parameters.update(self._parameters)  # a .to() / .double() after the swap reached these dicts
        original._buffers.update(self._buffers)
        original.training = self.training
        request = current_request_or_none()
        now = request._now if request is not None else None
        if request is None or now is None or not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != now.num_rows:
            return original(x, *args, **kwargs)
        samples = len(request.stage_model_grids[request.stage])

        def per_row(a: Any) -> Any:
            return request.sample_rows(a) if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == samples else a

        lead = (x.shape[0],) + (1,) * self.spatial_dims
        out = original(x.reshape(lead + tuple(x.shape[1:])), *map(per_row, args),
                       **{k: per_row(v) for k, v in kwargs.items()})
        if not isinstance(out, Tensor) or tuple(out.shape[:len(lead)]) != lead:
            got = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"ParallelPlan.per_sample: {self.path!r} ({self.swapped_from}) ran on local rows viewed "
                             f"as {list(lead) + list(x.shape[1:])} and returned {got}: it must return a tensor of the "
                             f"grid shape it was given (a module that mixes tokens cannot run per row)")
        return out.reshape((x.shape[0],) + tuple(out.shape[len(lead):]))

    def extra_repr(self) -> str:
        return f"{self.swapped_from} per row, spatial_dims={self.spatial_dims}"
