"""Reading a checkpoint file into ``{name: tensor}`` without ever running code from it.

Shared by the DiT and VAE loaders. ``.gguf`` files are read by :mod:`.gguf_file` (their quantised tensors come back as
:class:`~.quantized_linear.PackedWeight`, still packed). ``.safetensors`` files hold only tensors; ``.pth``/``.pt``
files are pickles and go through ``torch.load(weights_only=True)``, which rebuilds tensors and plain containers and
refuses anything else. A zip-format file is memory-mapped when its records are stored as they are (what
``torch.save`` writes); a re-zipped file whose records are compressed (DEFLATE) is read without ``mmap``, which
decompresses them: memory-mapped, the compressed bytes would be taken for the values. Every failure is a
``ValueError`` naming the file: a damaged file (random bytes, a truncated zip, a wrong magic number, a pickle that
breaks anywhere) makes ``torch.load`` raise almost any exception type (``IndexError``, ``KeyError``,
``struct.error``, ``AssertionError``, ...), so every ``Exception`` from the readers is translated; only interrupts
(``KeyboardInterrupt``, ``SystemExit``) pass through.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zipfile
from dataclasses import dataclass
from typing import Mapping, Union

import torch

from .quantized_linear import PackedWeight

__all__ = ["CHECKPOINT_SUFFIXES", "read_checkpoint_file", "tensor_state", "SafetensorsEntry", "safetensors_header",
           "compressed_zip_records", "read_error_reason"]

CHECKPOINT_SUFFIXES = (".safetensors", ".pth", ".pt", ".gguf")
StateValue = Union[torch.Tensor, PackedWeight]


def read_checkpoint_file(path: str | os.PathLike) -> dict[str, StateValue]:
    """The tensors of a ``.safetensors`` / ``.pth`` / ``.pt`` / ``.gguf`` checkpoint, on the CPU."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"checkpoint {path!r} is a directory, not a file")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} does not exist or is not a file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in CHECKPOINT_SUFFIXES and os.path.getsize(path) == 0:
        raise ValueError(f"checkpoint {path!r} is empty (0 bytes)")
    if suffix == ".safetensors":
        state = _read_safetensors(path)
    elif suffix in (".pth", ".pt"):
        state = _torch_load_weights_only(path)
    elif suffix == ".gguf":
        from .gguf_file import read_gguf_file

        state = read_gguf_file(path)
    else:
        raise ValueError(
            f"checkpoint {path!r}: unsupported file type {suffix!r} (use {', '.join(CHECKPOINT_SUFFIXES)})"
        )
    return tensor_state(state)


def tensor_state(state: Mapping) -> dict[str, StateValue]:
    """``state`` as a dict, after checking that every key is a string and every value a tensor (or a packed one)."""
    for key, value in state.items():
        if not isinstance(key, str):
            raise ValueError(f"checkpoint key {key!r} is not a string")
        if not isinstance(value, (torch.Tensor, PackedWeight)):
            raise ValueError(f"checkpoint entry {key!r} is a {type(value).__name__}, not a tensor")
    return dict(state)


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except SafetensorError as err:
        raise ValueError(f"checkpoint {path!r} is not a readable safetensors file ({read_error_reason(err)})") from None
    except Exception as err:  # noqa: BLE001 - a damaged file can fail in any way; the file is at fault
        raise ValueError(f"checkpoint {path!r} is not a readable safetensors file ({_reason(err)})") from None


def _reason(err: BaseException) -> str:
    """``Type: first line`` of an exception, for a one-line message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


#: the advice torch wraps around a weights-only refusal (re-run with ``weights_only=False``, allow-list the global,
#: file an issue, read the docs): following it would run the file's code, so it is never passed on
_TORCH_ADVICE = (r"Weights only load failed\..*?trusted source\.",
                 r"Please file an issue with the following.*?use case:", r"WeightsUnpickler error:",
                 r"Check the documentation of torch\.load.*$", r"Please use `torch\.serialization\..*$")


def read_error_reason(err: BaseException) -> str:
    """Why a file could not be read, in one short line for a message: what torch's weights-only unpickler refused
    (without its unsafe advice), safetensors' complaint without its boilerplate, else ``Type: first line``."""
    if isinstance(err, pickle.UnpicklingError):
        return _unpickling_reason(err)
    if type(err).__name__ == "SafetensorError":
        text = " ".join(str(err).split()).replace("Error while deserializing header: ", "")
        return f"damaged header: {text}"[:200]
    return _reason(err)


def _unpickling_reason(err: BaseException) -> str:
    """What torch's weights-only unpickler found (``Trying to load unsupported GLOBAL posix.system ...``), without
    torch's advice around it (see :data:`_TORCH_ADVICE`)."""
    import re

    text = " ".join(str(err).split())
    for advice in _TORCH_ADVICE:
        text = re.sub(advice, " ", text)
    text = " ".join(text.split()).removesuffix(".")
    if not text or "weights_only" in text or "safe_globals" in text:
        return "its pickle holds more than tensors and plain containers"
    return text[:200]


def compressed_zip_records(path: str) -> list[str]:
    """The names of the compressed records of a zip-format checkpoint ([] when none is, or the file is no readable
    zip: ``torch.load`` then says what is wrong)."""
    try:
        if not zipfile.is_zipfile(path):
            return []
        with zipfile.ZipFile(path) as archive:
            return [r.filename for r in archive.infolist() if r.compress_type != zipfile.ZIP_STORED]
    except Exception:  # noqa: BLE001 - a damaged zip directory; torch.load reports the file
        return []


def _torch_load_weights_only(path: str) -> dict:
    mmap = not compressed_zip_records(path)  # memory-mapped compressed records would be read as raw values
    try:
        with warnings.catch_warnings():  # a damaged pickle also warns (odd protocol numbers); the error says it all
            warnings.simplefilter("ignore")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"refused to load checkpoint {path!r}: it is not a plain tensor checkpoint (loading it would need to run "
            f"pickled code, which weights_only loading does not do, or the file is damaged): {_unpickling_reason(err)}"
        ) from None
    except Exception as err:  # noqa: BLE001 - random bytes, truncated zips, broken pickles fail in any way
        raise ValueError(f"checkpoint {path!r} could not be read as a torch checkpoint ({_reason(err)})") from None
    if not isinstance(state, Mapping):
        raise ValueError(f"checkpoint {path!r} holds a {type(state).__name__}, not a state dict")
    return dict(state)


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: its dtype name (``BF16``, ``F8_E4M3``, ...), shape, and where its bytes lie
    in the file (``start`` to ``stop``, absolute offsets)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def safetensors_header(path: str) -> dict[str, SafetensorsEntry]:
    """The tensors of a safetensors file from its header alone: two small reads, no memory map (so it works under an
    address-space limit smaller than the file, and nothing of the data enters this process's memory)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= min(size - 8, 100 * 2**20):
                raise ValueError(f"header length {length} does not fit a file of {size} bytes")
            header = json.loads(f.read(length))
        base = 8 + length
        entries = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = (int(v) for v in info["data_offsets"])
            if not 0 <= begin <= end <= size - base:
                raise ValueError(f"tensor {key!r} lies at bytes {begin}..{end}, beyond the file's data")
            entries[key] = SafetensorsEntry(str(info["dtype"]), tuple(int(d) for d in info["shape"]), base + begin,
                                            base + end)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"checkpoint {path!r} is not a readable safetensors file ({_reason(err)})") from None
    return entries
