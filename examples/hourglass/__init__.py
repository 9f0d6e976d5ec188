"""A small hourglass (U-net) video transformer in plain PyTorch, and its winsp plan (one region for all levels)."""

from .adapter import hourglass_plan, parallelize
from .model import HourglassNet

__all__ = ["HourglassNet", "hourglass_plan", "parallelize"]
