"""Import torchvision, whatever wheel sits beside torch: first as it is, and shimmed only if that import fails.

A torchvision that matches its torch (any CUDA install from the package index, or the CPU wheels of both) imports as
is, and its C extension registers ``torchvision::nms`` / ``qnms`` itself; declaring them before it would make that
registration a duplicate and abort the process. Only beside a *CPU* torch does the index's CUDA torchvision wheel fail:
its C extension does not load and the import stops at ``register_fake("torchvision::nms")``, because that operator was
never declared. Then, and only then, the two schemas are declared with a ``torch.library`` FRAGMENT and the import is
retried; the video models are plain PyTorch and never call those ops.
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
    """``torchvision``, imported as is; the two op schemas are declared and the import retried only if it failed on
    them.

    Call it before anything that imports torchvision (transformers does); afterwards ``import torchvision`` works.
    """
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as error:
        missing = [name for name in _SCHEMAS if f"torchvision::{name} does not exist" in str(error)]
        if not missing:
            raise
    _declare_missing_schemas()
    # The failed import left the submodules that completed (``extension`` and the autograd registrations, which did
    # nothing without the C ops) in sys.modules; the retry runs the rest of the package on top of them.
    return importlib.import_module("torchvision")


def _declare_missing_schemas() -> None:
    global _LIBRARY
    missing = [name for name in _SCHEMAS if not _declared(name)]
    if not missing:
        return
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        _LIBRARY.define(_SCHEMAS[name])


def _declared(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False
