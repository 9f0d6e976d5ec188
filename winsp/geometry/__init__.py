"""Layer 1, geometry: which windows tile a token grid, and the canonical order of the rows inside them.

Pure functions of shapes, with no tensors of activations and no communication: the SeedVR2 windowing
(:mod:`~winsp.geometry.windows`), Swin's clamped windows (:mod:`~winsp.geometry.swin`), rolled
shifted windows and the global window (:mod:`~winsp.geometry.rolled`), neighborhood layers
(:mod:`~winsp.geometry.neighborhood`) and the packed-batch layout of a geometry (:mod:`~winsp.geometry.layout`).
"""

from winsp.geometry.layout import Grids, Layout, build_layout, check_grids, inverse_permutation
from winsp.geometry.neighborhood import Neighborhood, is_neighborhood
from winsp.geometry.rolled import GlobalWindow, RolledWindows, rolled_cuts
from winsp.geometry.swin import SwinWindows
from winsp.geometry.windows import (
    REGULAR_METHOD,
    SHIFTED_METHOD,
    FixedWindows,
    Grid,
    SeedVR2Windows,
    WindowGeometry,
    check_grid,
    make_geometry,
    window_slices,
)

__all__ = [
    "Grid", "Grids", "WindowGeometry", "SeedVR2Windows", "FixedWindows", "SwinWindows", "RolledWindows",
    "GlobalWindow", "rolled_cuts", "Neighborhood", "make_geometry",
    "window_slices", "check_grid", "check_grids", "is_neighborhood", "Layout", "build_layout", "inverse_permutation",
    "REGULAR_METHOD", "SHIFTED_METHOD",
]
