"""Layer 4, attention: the kernels that attend on one rank's rows.

Whole windows (:mod:`~winsp.attention.windows`, with the backends of :mod:`~winsp.attention.backends`), split
windows head-parallel among their holders (:mod:`~winsp.attention.split`), neighborhood layers with their halos
(:mod:`~winsp.attention.halo`), and score modifications (:mod:`~winsp.attention.score_mods`).
"""

from winsp.attention.halo.layer import halo_tensors, neighborhood_attention, neighborhood_rpb_score_mod
from winsp.attention.segments import WindowSegments
from winsp.attention.windows import WindowAttention, available_backends, reference_window_attention, window_attention

__all__ = ["window_attention", "WindowAttention", "reference_window_attention", "available_backends",
           "WindowSegments", "neighborhood_attention", "halo_tensors", "neighborhood_rpb_score_mod"]
