"""Tokenwise building blocks of the NaDiT: norms, the two-stream weight container, ADA modulation, MLPs, time embedding.

Everything here acts row by row, so under window-parallel execution it runs on whichever rows a rank holds. The
parameter names follow the reference checkpoint layout (``weight``/``bias``, ``attn_shift`` ..., ``proj_in_gate`` ...).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "compute_dtype",
    "Norm",
    "make_norm",
    "StreamPair",
    "Modulation",
    "SwiGLUMLP",
    "GeluMLP",
    "make_mlp",
    "TimeEmbedding",
    "sinusoidal_embedding",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype precision-sensitive math runs in: float32, or float64 for float64 inputs (gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Norm(nn.Module):
    """RMS or layer normalisation over the last dim, computed in float32 and returned in the input dtype.

    ``kind`` is ``"rms"`` (weight only when affine) or ``"layer"`` (weight and bias when affine).
    """

    def __init__(self, dim: int, eps: float, affine: bool, kind: str) -> None:
        super().__init__()
        if kind not in ("rms", "layer"):
            raise ValueError(f"Norm kind must be 'rms' or 'layer', got {kind!r}")
        self.dim, self.eps, self.kind = dim, eps, kind
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine and kind == "layer" else None

    def forward(self, x: Tensor) -> Tensor:
        wide = compute_dtype(x.dtype)
        x32 = x.to(wide)
        if self.kind == "rms":
            y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            if self.weight is not None:
                y = y * self.weight.to(wide)
        else:
            y = F.layer_norm(
                x32, (self.dim,),
                None if self.weight is None else self.weight.to(wide),
                None if self.bias is None else self.bias.to(wide),
                self.eps,
            )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, kind={self.kind}, eps={self.eps}, affine={self.weight is not None}"


def make_norm(norm_type: Optional[str], dim: int, eps: float, affine: bool) -> nn.Module:
    """The module for a reference norm name: None -> identity; "rms"/"fusedrms" -> RMS; "layer"/"fusedln" -> layer."""
    if norm_type is None:
        return nn.Identity()
    if norm_type in ("rms", "fusedrms"):
        return Norm(dim, eps, affine, "rms")
    if norm_type in ("layer", "fusedln"):
        return Norm(dim, eps, affine, "layer")
    raise ValueError(f"unsupported norm type {norm_type!r}")


class StreamPair(nn.Module):
    """One sub-layer for the video and the text stream: separate modules (``vid``/``txt``) or one shared (``all``).

    ``video_only`` drops the text module when the streams are separate (the last block's text MLP path); with shared
    weights the single module stays, since the video uses it. :meth:`for_txt` is None when text has no module.
    """

    def __init__(self, make: Callable[[], nn.Module], *, shared: bool, video_only: bool = False) -> None:
        super().__init__()
        self.shared = shared
        if shared:
            self.all = make()
        else:
            self.vid = make()
            self.txt = None if video_only else make()

    def for_vid(self) -> nn.Module:
        return self.all if self.shared else self.vid

    def for_txt(self) -> Optional[nn.Module]:
        return self.all if self.shared else self.txt


class Modulation(nn.Module):
    """Adaptive shift/scale/gate ("ada single"): learned per-channel offsets added to slices of the time embedding.

    For each sub-layer name ``s`` in ``names`` it holds ``s_shift``/``s_scale`` (when ``with_in``) and ``s_gate``
    (when ``with_out``). The time embedding ``emb [b, 6 * dim]`` is laid out channel-major as ``(dim, 2, 3)``: for
    channel d, sub-layer slot j (0 = attention, 1 = MLP) and kind g (0 shift, 1 scale, 2 gate) the value is at
    ``emb[:, (d * 2 + j) * 3 + g]``.
    """

    def __init__(self, dim: int, names: Sequence[str], *, with_in: bool = True, with_out: bool = True) -> None:
        super().__init__()
        self.dim = dim
        self.names = tuple(names)
        std = 1.0 / math.sqrt(dim)
        for name in self.names:
            if with_in:
                self.register_parameter(f"{name}_shift", nn.Parameter(torch.randn(dim) * std))
                self.register_parameter(f"{name}_scale", nn.Parameter(torch.randn(dim) * std + 1))
            if with_out:
                self.register_parameter(f"{name}_gate", nn.Parameter(torch.randn(dim) * std))

    @staticmethod
    def split_embedding(emb: Tensor, dim: int) -> Tensor:
        """``emb [b, 6 * dim]`` -> ``[b, 2 (slot), 3 (shift, scale, gate), dim]``, contiguous.

        Contiguous rather than a permuted view (channel stride 6): a norm fused with per-channel values read at a
        stride makes torch 2.13's CPU inductor tile the row loop of the norm's outer-loop-fused kernel, whose local
        buffer then holds one row for 16 (pytorch/pytorch#185702, silently wrong output; see docs/torch_compile.md).
        """
        return emb.view(emb.shape[0], dim, 2, 3).permute(0, 2, 3, 1).contiguous()

    def scale_shift(self, name: str, slot_emb: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample ``(scale, shift)``, each ``[b, dim]``, for sub-layer ``name`` from its slot ``[b, 3, dim]``."""
        return slot_emb[:, 1] + getattr(self, f"{name}_scale"), slot_emb[:, 0] + getattr(self, f"{name}_shift")

    def gate(self, name: str, slot_emb: Tensor) -> Tensor:
        """Per-sample gate ``[b, dim]`` for sub-layer ``name``."""
        return slot_emb[:, 2] + getattr(self, f"{name}_gate")

    def extra_repr(self) -> str:
        return f"dim={self.dim}, names={list(self.names)}"


class SwiGLUMLP(nn.Module):
    """``proj_out(silu(proj_in_gate(x)) * proj_in(x))``, bias-free."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj_in_gate = nn.Linear(dim, hidden, bias=False)
        self.proj_out = nn.Linear(hidden, dim, bias=False)
        self.proj_in = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj_out(F.silu(self.proj_in_gate(x)) * self.proj_in(x))


class GeluMLP(nn.Module):
    """``proj_out(gelu_tanh(proj_in(x)))`` (the reference's "normal" MLP)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, hidden)
        self.proj_out = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


def make_mlp(mlp_type: str, dim: int, hidden: int) -> nn.Module:
    if mlp_type == "swiglu":
        return SwiGLUMLP(dim, hidden)
    if mlp_type == "normal":
        return GeluMLP(dim, hidden)
    raise ValueError(f"unsupported mlp_type {mlp_type!r}")


def sinusoidal_embedding(timestep: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """``[sin(t * f_k), cos(t * f_k)]`` with ``f_k = max_period ** (-k / (dim // 2))``, in float32; ``[b, dim]``."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = timestep.float()[:, None] * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class TimeEmbedding(nn.Module):
    """Diffusion timestep -> conditioning vector: sinusoid (256) -> Linear -> SiLU -> Linear -> SiLU -> Linear."""

    def __init__(self, sinusoidal_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.sinusoidal_dim = sinusoidal_dim
        self.proj_in = nn.Linear(sinusoidal_dim, hidden_dim)
        self.proj_hid = nn.Linear(hidden_dim, hidden_dim)
        self.proj_out = nn.Linear(hidden_dim, output_dim)

    def forward(self, timestep: Tensor, dtype: torch.dtype) -> Tensor:
        emb = sinusoidal_embedding(timestep, self.sinusoidal_dim).to(dtype)
        emb = F.silu(self.proj_in(emb))
        emb = F.silu(self.proj_hid(emb))
        return self.proj_out(emb)
