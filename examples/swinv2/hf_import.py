"""Import transformers' Swin V2 next to a CPU torch and a torchvision wheel built for CUDA.

transformers imports torchvision when it is installed; a CUDA torchvision wheel beside the CPU torch fails there (its
C extension did not load; see ``examples/swin3d/load_torchvision.py``), so torchvision is imported first the way the
swin3d example does it.
"""

from __future__ import annotations

import importlib.util


def import_swinv2():
    """``(Swinv2Config, Swinv2Model)`` from transformers (ImportError if transformers is not installed)."""
    if importlib.util.find_spec("torchvision") is not None:
        from examples.swin3d.load_torchvision import import_torchvision

        import_torchvision()
    from transformers import Swinv2Config, Swinv2Model

    return Swinv2Config, Swinv2Model
