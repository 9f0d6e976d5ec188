"""Import transformers' Swin V2 next to a CPU torch and a torchvision wheel built for CUDA.

transformers imports torchvision when it is installed; a CUDA torchvision wheel beside the CPU torch fails there, on
``register_fake("torchvision::nms")``, because its C extension (which defines the op) did not load. Declaring the two
op schemas first lets the pure-Python parts load; nothing here calls them.
"""

from __future__ import annotations

import torch

_FRAGMENT = None


def _declare_torchvision_ops() -> None:
    global _FRAGMENT
    try:
        torch.ops.torchvision.nms  # the C extension loaded (or this ran already): nothing to declare
        return
    except (AttributeError, RuntimeError):
        pass
    _FRAGMENT = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        _FRAGMENT.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def import_swinv2():
    """``(Swinv2Config, Swinv2Model)`` from transformers (ImportError if transformers is not installed)."""
    _declare_torchvision_ops()
    from transformers import Swinv2Config, Swinv2Model

    return Swinv2Config, Swinv2Model
