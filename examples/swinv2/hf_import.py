"""Import transformers' Swin V2 whatever torchvision sits beside torch.

transformers imports torchvision when it is installed. A matching torchvision imports as is; the CUDA torchvision wheel
beside a CPU torch fails (its C extension did not load; see ``examples/swin3d/load_torchvision.py``). So torchvision is
imported first through the swin3d example's loader, which imports it untouched and shims only when that import fails.
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
