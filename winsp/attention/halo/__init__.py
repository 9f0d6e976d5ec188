"""Neighborhood attention on local rows: the halo exchange and its kernels (tiled SDPA, FlexAttention, NATTEN)."""
