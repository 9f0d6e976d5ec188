"""Reading a ``.gguf`` checkpoint (the llama.cpp container that ComfyUI-GGUF repacks use) into ``{name: tensor}``.

Tensor names are the released state-dict keys (the repack tools keep them as they are, after removing a
``model.diffusion_model.`` / ``model.`` prefix, which is removed here too). GGUF lists a tensor's dimensions innermost
first (``ne[0]`` is the contiguous one), so the torch shape is the reverse of the stored list: the released 3B's
``txt_in.weight`` ``[2560, 5120]`` is stored as ``{5120, 2560}``, with its 256-value K-quant blocks running along the
5120 inputs of each row. A tensor the tool reshaped (GGUF holds at most 4 dimensions, and K-quant rows must be a
multiple of 256 values) carries its torch shape in the metadata array ``comfy.gguf.orig_shape.<name>``; it is
reshaped back to it.

F32 / F16 / BF16 tensors come back as torch tensors; the quantised types of :mod:`.gguf_dequant` come back as
:class:`~.quantized_linear.PackedWeight` (their bytes, still packed), which the loaders keep packed or expand. Any
other type is refused by its name. The ``gguf`` package is an optional dependency (``pip install -e '.[gguf]'`` in
the winsp checkout).
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np
import torch

from .gguf_dequant import QUANTISED_TYPES
from .quantized_linear import PackedWeight

__all__ = ["read_gguf_file", "GGUF_TYPES", "ORIG_SHAPE_KEY"]

_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}
#: every GGML type this loader reads
GGUF_TYPES = ("F32", "F16", "BF16") + QUANTISED_TYPES
ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
_PREFIXES = ("model.diffusion_model.", "model.")


def _import_gguf(path: str):
    try:
        import gguf
    except ImportError:
        raise ValueError(
            f"checkpoint {path!r} is a GGUF file, which needs the optional 'gguf' package: pip install gguf "
            f"(or pip install -e '.[gguf]' in the winsp checkout)"
        ) from None
    return gguf


def _orig_shape(reader, name: str) -> tuple[int, ...] | None:
    field = reader.get_field(ORIG_SHAPE_KEY + name)
    if field is None:
        return None
    try:
        return tuple(int(v) for v in field.contents())
    except Exception as err:  # noqa: BLE001 - a malformed metadata field is the file's fault
        raise ValueError(f"metadata {ORIG_SHAPE_KEY + name!r} is not a list of dimensions ({err})") from None


def strip_prefix(names: list[str]) -> str:
    """The ``model.diffusion_model.`` / ``model.`` prefix every name carries ("" when none does)."""
    for prefix in _PREFIXES:
        if names and all(n.startswith(prefix) for n in names):
            return prefix
    return ""


def read_gguf_file(path: str) -> dict[str, Union[torch.Tensor, PackedWeight]]:
    """The tensors of a ``.gguf`` file (see the module docstring), on the CPU."""
    gguf = _import_gguf(path)
    try:
        reader = gguf.GGUFReader(path)
    except ValueError as err:
        text = str(err)
        if "GGMLQuantizationType" in text:  # a type id this gguf version does not know at all
            raise ValueError(f"checkpoint {path!r} holds a tensor type unknown to the gguf package ({text}); "
                             f"supported: {', '.join(GGUF_TYPES)}") from None
        raise ValueError(f"checkpoint {path!r} is not a readable GGUF file ({text})") from None
    except Exception as err:  # noqa: BLE001 - truncated or random bytes fail in any way
        raise ValueError(f"checkpoint {path!r} is not a readable GGUF file ({type(err).__name__}: {err})") from None
    try:
        return _tensors(reader, path)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged header can point anywhere; the file is at fault
        raise ValueError(f"checkpoint {path!r} is not a readable GGUF file ({type(err).__name__}: {err})") from None


def _tensors(reader, path: str) -> dict[str, Union[torch.Tensor, PackedWeight]]:
    prefix = strip_prefix([t.name for t in reader.tensors])
    state: dict[str, Union[torch.Tensor, PackedWeight]] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        name = tensor.name[len(prefix):]
        if kind not in GGUF_TYPES:
            raise ValueError(
                f"checkpoint {path!r}: tensor {tensor.name!r} is stored as {kind}, which this loader does not read "
                f"(supported: {', '.join(GGUF_TYPES)}); requantise it to one of those"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        wanted = _orig_shape(reader, tensor.name)
        if wanted is not None:
            if math.prod(wanted) != math.prod(shape):
                raise ValueError(f"checkpoint {path!r}: tensor {tensor.name!r} has {math.prod(shape)} values but its "
                                 f"{ORIG_SHAPE_KEY}{tensor.name} says {list(wanted)}")
            shape = wanted
        raw = np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8)
        expected_bytes = tensor.n_bytes
        if raw.size != expected_bytes:
            raise ValueError(f"checkpoint {path!r}: tensor {tensor.name!r} is truncated ({raw.size} of "
                             f"{expected_bytes} bytes)")
        data = torch.from_numpy(raw.copy())
        if kind in _FLOAT_TYPES:
            state[name] = data.view(torch.float32 if kind == "F32" else torch.float16).reshape(shape)
        elif kind == "BF16":
            state[name] = data.view(torch.bfloat16).reshape(shape)
        else:
            state[name] = PackedWeight(data, kind, shape)
    return state
