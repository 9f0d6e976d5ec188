"""The cost constants the default planner weighs whole windows against split windows with.

They describe one SeedVR2 3B layer on one H100/H200-class GPU with NVLink between the ranks, from published figures
(dense bf16 989 TFLOP/s at 60 % for GEMMs and 40 % for attention, 53 % elementwise on top of 45 % GEMMs in eager
profiles, NVLink 450 GB/s per direction, tens of microseconds per collective). ``benchmarks/cost_model.py`` builds its
predictions from the same numbers. Only their *ratios* steer the planner: a row of tokenwise work against a
query x key pair of attention against a row moved between ranks against one collective's latency; the absolute
values only scale the predicted times.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostConstants", "DEFAULT_COSTS", "PCIE_COSTS", "GLOO_CPU_COSTS", "PEAK_BF16_FLOPS", "GEMM_EFFICIENCY",
           "ATTENTION_EFFICIENCY", "ELEMENTWISE_PER_GEMM", "NVLINK_BYTES_PER_S", "NVLINK_LATENCY_S", "PCIE_BYTES_PER_S"]

#: Published dense bf16 peak of an H100/H200 SXM (FLOP/s).
PEAK_BF16_FLOPS = 989e12
#: Assumed share of peak reached by large bf16 GEMMs.
GEMM_EFFICIENCY = 0.6
#: Assumed share of peak reached by FlashAttention-class kernels on 1-4K-token windows.
ATTENTION_EFFICIENCY = 0.4
#: Published eager SeedVR2 profile: 53 % elementwise time against 45 % GEMM time.
ELEMENTWISE_PER_GEMM = 53 / 45
#: NVLink 4, per GPU and direction (bytes/s), published.
NVLINK_BYTES_PER_S = 450e9
#: PCIe 4.0 x16 per direction: 32 GB/s published, 25 GB/s assumed reached by collectives.
PCIE_BYTES_PER_S = 25e9
#: One NCCL collective inside a node (seconds), order of magnitude of published figures.
NVLINK_LATENCY_S = 20e-6

_3B_DIM, _3B_MLP_HIDDEN = 2560, 6912  # SeedVR2 3B: 20 heads x 128, SwiGLU MLP
_3B_LINEAR_FLOPS_PER_ROW = 2.0 * (4 * _3B_DIM * _3B_DIM + 3 * _3B_DIM * _3B_MLP_HIDDEN)


@dataclass(frozen=True)
class CostConstants:
    """Seconds per unit of work: a row's tokenwise work, a query x key pair (all heads), a byte moved, a collective.

    Args:
        row_s: tokenwise work of one video row in one layer (projections, MLP, norms).
        pair_s: one video query x video key pair of attention, all heads (QK^T and AV).
        byte_s: one byte sent or received by a rank in an all-to-all.
        latency_s: the fixed cost of one collective.
        row_bytes: bytes of one row of the hidden state (what a transition moves per row; an in-window exchange moves
            q, k, v in and the output back, four such rows' worth split over the heads).
    """

    row_s: float
    pair_s: float
    byte_s: float
    latency_s: float
    row_bytes: int

    def __post_init__(self) -> None:
        for name in ("row_s", "pair_s", "byte_s", "latency_s", "row_bytes"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"CostConstants.{name} must be >= 0, got {value!r}")


#: SeedVR2 3B on one NVLink node (bf16): what ``DiffusionParallelConfig``'s default planner uses.
DEFAULT_COSTS = CostConstants(
    row_s=_3B_LINEAR_FLOPS_PER_ROW / (PEAK_BF16_FLOPS * GEMM_EFFICIENCY) * (1 + ELEMENTWISE_PER_GEMM),
    pair_s=4.0 * _3B_DIM / (PEAK_BF16_FLOPS * ATTENTION_EFFICIENCY),
    byte_s=1.0 / NVLINK_BYTES_PER_S,
    latency_s=NVLINK_LATENCY_S,
    row_bytes=2 * _3B_DIM,
)


#: :data:`DEFAULT_COSTS`' GPU with its ranks on PCIe 4.0 x16 instead of NVLink (cards without NVLink: a move costs
#: 18x more against the same work), for ``WindowRuntime(costs=...)`` / ``DiffusionParallelConfig(costs=...)``.
PCIE_COSTS = CostConstants(row_s=DEFAULT_COSTS.row_s, pair_s=DEFAULT_COSTS.pair_s, byte_s=1.0 / PCIE_BYTES_PER_S,
                           latency_s=NVLINK_LATENCY_S, row_bytes=DEFAULT_COSTS.row_bytes)


#: SeedVR2 3B width (float32) on gloo CPU ranks, one thread each, *measured*: ``benchmarks/cost_model.py --fit-wall``
#: on ``benchmarks/bench_split.py`` runs of 9x256x384 and a 720p image (2 layers, every planner, 2026-12-01; fitted
#: on the slower rank's CPU time, the machine being loaded; model / measured 0.99-1.02 on all 12 points). Attention
#: weighs about 10x more against tokenwise work than on a GPU. ``DiffusionParallelConfig(costs=GLOO_CPU_COSTS)``.
GLOO_CPU_COSTS = CostConstants(row_s=1.683e-3, pair_s=7.056e-7, byte_s=3.973e-9, latency_s=1.479e-2, row_bytes=10240)
