"""torchvision's Video Swin Transformer on winsp: ``examples.swin3d.parallelize(model, config) -> model``."""

from .adapter import SwinAttention3d, SwinPatchMerging, parallelize, swin3d_plan
from .load_torchvision import import_torchvision

__all__ = ["parallelize", "swin3d_plan", "SwinAttention3d", "SwinPatchMerging", "import_torchvision"]
