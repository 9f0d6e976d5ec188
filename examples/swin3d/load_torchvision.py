"""Import torchvision's pure-Python video models beside a CPU-only torch.

The torchvision wheel on the package index is a CUDA build: beside the CPU torch its C extension does not load, and
``import torchvision`` then fails on ``register_fake("torchvision::nms")`` because that operator was never declared.
Declaring the two schemas its import registers fakes for (``torchvision::nms`` and ``torchvision::qnms``) with a
``torch.library`` FRAGMENT lets the import finish; the video models are plain PyTorch and never call those ops.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch

__all__ = ["import_torchvision"]

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY = None  # kept alive: a dropped Library object would remove its definitions


def import_torchvision() -> ModuleType:
    """``torchvision``, imported (declaring the two op schemas first when its C extension did not define them)."""
    global _LIBRARY
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    missing = [name for name in _SCHEMAS if not _declared(name)]
    if missing:
        _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            _LIBRARY.define(_SCHEMAS[name])
    return importlib.import_module("torchvision")


def _declared(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False
