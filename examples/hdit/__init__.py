"""The ``hdit`` package's HDiT (k-diffusion's hourglass diffusion transformer) run window-parallel by one plan.

``hdit`` imports torchvision; beside a CPU torch the package index's CUDA torchvision wheel does not import as is, so
torchvision is imported first through the swin3d example's loader (untouched where it imports; README).
"""

from examples.swin3d.load_torchvision import import_torchvision

import_torchvision()

from .adapter import PLAN, attend, resize  # noqa: E402

__all__ = ["PLAN", "attend", "resize"]
