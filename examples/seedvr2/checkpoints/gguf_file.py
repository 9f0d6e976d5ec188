"""Reading a ``.gguf`` checkpoint (the llama.cpp container that ComfyUI-GGUF repacks use) into ``{name: tensor}``.

The header is parsed here, not by the ``gguf`` package: a checkpoint is untrusted input, and that package trusts the
counts a file declares (an array of 2^62 items is walked item by item past the end of the file, without bound). The
format is small: the magic ``GGUF``, a version (2 or 3), the tensor and metadata counts, the metadata entries (a
string key, a value type, a value; arrays hold a type, a count and the items), the tensor table (name, dimensions,
GGML type, offset into the data section) and, aligned to ``general.alignment`` (32), the tensor data. Every count is
bounded by the bytes left in the file before anything is allocated or walked, and every tensor's bytes must lie in
the file. :func:`gguf_header` parses a file once per change of the file (the memory plan and the loader share it).

Byte order: a file written big-endian (``GGUFWriter(endianess=BIG)``: its header numbers and its F32 / F16 / BF16
values byte-swapped) is read correctly, values swapped back. Its quantised tensors are refused: the tools disagree on
whether the half-precision scales inside the blocks are swapped (the ``gguf`` writer leaves them, llama.cpp's
converter swaps them), so their values cannot be known.

Tensor names are the released state-dict keys (the repack tools keep them as they are, after removing a
``model.diffusion_model.`` / ``model.`` prefix, which is removed here too). GGUF lists a tensor's dimensions innermost
first (``ne[0]`` is the contiguous one), so the torch shape is the reverse of the stored list: the released 3B's
``txt_in.weight`` ``[2560, 5120]`` is stored as ``{5120, 2560}``, with its 256-value K-quant blocks running along the
5120 inputs of each row. A tensor the tool reshaped (GGUF holds at most 4 dimensions, and K-quant rows must be a
multiple of 256 values) carries its torch shape in the metadata array ``comfy.gguf.orig_shape.<name>``; it is
reshaped back to it (and refused, by name, when the counts differ).

F32 / F16 / BF16 tensors come back as torch tensors; the quantised types of :mod:`.gguf_dequant` come back as
:class:`~.quantized_linear.PackedWeight` (their bytes, still packed), which the loaders keep packed or expand. Any
other type is refused by its name. No package beyond torch is needed to read.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .gguf_dequant import QUANTISED_TYPES
from .quantized_linear import PackedWeight

__all__ = ["read_gguf_file", "gguf_header", "GGUFHeader", "GGUFTensor", "GGUF_TYPES", "ORIG_SHAPE_KEY"]

#: every GGML type this loader reads
GGUF_TYPES = ("F32", "F16", "BF16") + QUANTISED_TYPES
ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
_PREFIXES = ("model.diffusion_model.", "model.")

#: GGML type id -> (name, values per block, bytes per block), as ggml numbers them (ids 4 and 5 were retired)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: metadata value type id -> (struct code, size); 8 is a string, 9 an array
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4), 7: ("?", 1),
            10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8  # ggml itself holds 4; the gguf package writes more (a 5-D conv), read too
_MAX_ORIG_DIMS = 16  # a torch shape longer than this is no model weight
_MAX_NESTING = 8


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table: its name as stored, torch shape (``orig_shape`` applied), GGML type name, and
    where its bytes are (absolute file offset, count)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file holds, from its header alone: byte order, the tensors, and the prefix their names share."""

    path: str
    big_endian: bool
    tensors: tuple[GGUFTensor, ...]
    prefix: str

    def layout(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """``{key: (kind, torch shape, stored bytes)}``, keys without the prefix (what the memory plan needs)."""
        return {t.name[len(self.prefix):]: (t.kind, t.shape, t.nbytes) for t in self.tensors}


class _Bytes:
    """A cursor over the file's bytes that refuses to read past the end, in the file's byte order."""

    def __init__(self, data, order: str) -> None:
        self.data, self.order, self.pos, self.size = data, order, 0, len(data)

    def left(self) -> int:
        return self.size - self.pos

    def take(self, code: str, size: int, what: str):
        if self.pos + size > self.size:
            raise ValueError(f"the file ends inside {what} (at byte {self.pos})")
        value = struct.unpack_from(self.order + code, self.data, self.pos)[0]
        self.pos += size
        return value

    def count(self, what: str, least_bytes_each: int) -> int:
        """A u64 count of items each at least ``least_bytes_each`` bytes long, checked against the bytes left."""
        n = self.take("Q", 8, what)
        if n * least_bytes_each > self.left():
            raise ValueError(f"{what} is {n}, more than the {self.left()} bytes left in the file can hold")
        return n

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise ValueError(f"{what} needs {n} bytes but the file has {self.left()} left")
        self.pos += n

    def string(self, what: str) -> bytes:
        n = self.take("Q", 8, f"the length of {what}")
        start = self.pos
        self.skip(n, what)
        return bytes(self.data[start:self.pos])


def _least_size(value_type: int) -> int:
    """The fewest bytes a value of ``value_type`` takes (bounds array counts before walking them)."""
    if value_type in _SCALARS:
        return _SCALARS[value_type][1]
    return 8 if value_type == _STRING else 12  # a string: its length; an array: its type and count


def _skip_value(cur: _Bytes, value_type: int, what: str, depth: int = 0) -> None:
    """Step over one metadata value, walking only what has to be walked (strings, nested arrays), each bounded."""
    if value_type in _SCALARS:
        cur.skip(_SCALARS[value_type][1], what)
    elif value_type == _STRING:
        cur.skip(cur.take("Q", 8, f"the length of {what}"), what)
    elif value_type == _ARRAY:
        if depth >= _MAX_NESTING:
            raise ValueError(f"{what} nests arrays more than {_MAX_NESTING} deep")
        item_type = cur.take("I", 4, f"the item type of {what}")
        if item_type not in _SCALARS and item_type not in (_STRING, _ARRAY):
            raise ValueError(f"{what} has items of unknown value type {item_type}")
        n = cur.count(f"the item count of {what}", _least_size(item_type))
        if item_type in _SCALARS:
            cur.skip(n * _SCALARS[item_type][1], what)
        elif item_type == _STRING:
            for _ in range(n):
                cur.skip(cur.take("Q", 8, f"the length of an item of {what}"), what)
        else:
            for _ in range(n):
                _skip_value(cur, item_type, what, depth + 1)
    else:
        raise ValueError(f"{what} has unknown value type {value_type}")


def _int_array(cur: _Bytes, what: str) -> tuple[int, ...]:
    """An array of integers (the ``orig_shape`` entries), at most ``_MAX_ORIG_DIMS`` long."""
    item_type = cur.take("I", 4, f"the item type of {what}")
    if item_type not in _INTEGER_TYPES:
        raise ValueError(f"{what} is not a list of dimensions (its items are of value type {item_type})")
    code, size = _SCALARS[item_type]
    n = cur.count(f"the item count of {what}", size)
    if n > _MAX_ORIG_DIMS:
        raise ValueError(f"{what} lists {n} dimensions (at most {_MAX_ORIG_DIMS})")
    return tuple(cur.take(code, size, what) for _ in range(n))


def _name(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8 text ({raw[:40]!r})") from None


def strip_prefix(names: list[str]) -> str:
    """The ``model.diffusion_model.`` / ``model.`` prefix every name carries ("" when none does)."""
    for prefix in _PREFIXES:
        if names and all(n.startswith(prefix) for n in names):
            return prefix
    return ""


def _parse(path: str, data) -> GGUFHeader:
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"it does not start with the GGUF magic (first bytes {bytes(data[:4])!r})")
    if len(data) < 24:
        raise ValueError(f"it ends after {len(data)} bytes, inside the 24-byte header")
    version = struct.unpack_from("<I", data, 4)[0]
    big = version & 0xFFFF == 0 and version != 0  # a big-endian file's small version number, read little-endian
    cur = _Bytes(data, ">" if big else "<")
    cur.pos = 4
    version = cur.take("I", 4, "the version")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not read here (versions 2 and 3 are)")
    n_tensors = cur.take("Q", 8, "the tensor count")
    n_kv = cur.count("the metadata entry count", 8 + 4 + 1)
    alignment = 32
    orig_shapes: dict[str, tuple[int, ...]] = {}
    for index in range(n_kv):
        key = cur.string(f"the key of metadata entry {index}").decode("utf-8", "backslashreplace")
        value_type = cur.take("I", 4, f"the value type of metadata {key!r}")
        what = f"metadata {key!r}"
        if key.startswith(ORIG_SHAPE_KEY) and value_type == _ARRAY:
            orig_shapes[key[len(ORIG_SHAPE_KEY):]] = _int_array(cur, what)
        elif key == "general.alignment" and value_type == 4:
            alignment = cur.take("I", 4, what)
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment} is not a power of two")
        elif key.startswith(ORIG_SHAPE_KEY):
            raise ValueError(f"{what} is not a list of dimensions (value type {value_type})")
        else:
            _skip_value(cur, value_type, what)
    if n_tensors * (8 + 4 + 8 + 4 + 8) > cur.left():
        raise ValueError(f"the tensor count is {n_tensors}, more than the {cur.left()} bytes left in the file can hold")
    entries = []
    for index in range(n_tensors):
        name = _name(cur.string(f"the name of tensor {index}"), f"the name of tensor {index}")
        n_dims = cur.take("I", 4, f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (read here: 1 to {_MAX_DIMS})")
        dims = [cur.take("Q", 8, f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
        type_id = cur.take("I", 4, f"the type of tensor {name!r}")
        offset = cur.take("Q", 8, f"the data offset of tensor {name!r}")
        entries.append((name, dims, type_id, offset))
    data_start = -(-cur.pos // alignment) * alignment
    data_size = len(data) - data_start
    tensors, seen = [], set()
    for name, dims, type_id, offset in entries:
        if name in seen:
            raise ValueError(f"tensor {name!r} is listed twice")
        seen.add(name)
        tensors.append(_tensor(name, dims, type_id, offset, data_start, data_size, orig_shapes.get(name), big))
    return GGUFHeader(path, big, tuple(tensors), strip_prefix([t.name for t in tensors]))


def _tensor(name: str, dims: list[int], type_id: int, offset: int, data_start: int, data_size: int,
            orig: Optional[tuple[int, ...]], big: bool) -> GGUFTensor:
    if type_id not in GGML_TYPES:
        raise ValueError(f"tensor {name!r} has GGML type id {type_id}, which is unknown here (supported: "
                         f"{', '.join(GGUF_TYPES)})")
    kind, block, size = GGML_TYPES[type_id]
    if kind not in GGUF_TYPES:
        raise ValueError(f"tensor {name!r} is stored as {kind}, which this loader does not read (supported: "
                         f"{', '.join(GGUF_TYPES)}); requantise it to one of those")
    if big and kind not in _FLOAT_DTYPES:
        raise ValueError(f"tensor {name!r} is {kind} in a big-endian file; the byte order inside big-endian "
                         f"quantised blocks is not defined the same way by the tools that write them, so it is not "
                         f"read (convert the file to little-endian)")
    numel = math.prod(dims)
    if dims[0] % block:
        raise ValueError(f"tensor {name!r}: its rows of {dims[0]} values are not a multiple of the {block}-value "
                         f"{kind} block")
    nbytes = numel // block * size
    if offset + nbytes > data_size:
        raise ValueError(f"tensor {name!r} is truncated: its {nbytes} bytes at offset {offset} of the data section "
                         f"lie past the end of the file ({data_size} bytes of data)")
    shape = tuple(reversed(dims))  # GGUF lists dims innermost first
    if orig is not None:
        if any(d < 0 for d in orig) or math.prod(orig) != numel:
            raise ValueError(f"tensor {name!r} has {numel} values but its {ORIG_SHAPE_KEY}{name} says "
                             f"{list(orig)} ({math.prod(orig)} values)")
        shape = orig
    return GGUFTensor(name, shape, kind, data_start + offset, nbytes)


_CACHE: dict[tuple, GGUFHeader] = {}
_CACHE_SIZE = 4


def gguf_header(path: str) -> GGUFHeader:
    """The parsed header of the GGUF file at ``path`` (see the module docstring); a ``ValueError`` naming the file
    and the problem when it is not a readable GGUF file. Parsed once per version of the file (the memory plan and the
    loader both ask)."""
    try:
        st = os.stat(path)
        identity = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if identity in _CACHE:
            return _CACHE[identity]
        with open(path, "rb") as f:
            if st.st_size == 0:
                raise ValueError("it is empty (0 bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                header = _parse(path, data)
    except ValueError as err:
        raise ValueError(f"checkpoint {path!r} is not a readable GGUF file: {err}") from None
    except (OSError, struct.error, OverflowError, MemoryError) as err:
        raise ValueError(f"checkpoint {path!r} is not a readable GGUF file ({type(err).__name__}: {err})") from None
    while len(_CACHE) >= _CACHE_SIZE:  # a run asks for the DiT's and the VAE's, each twice (plan, then load)
        del _CACHE[next(iter(_CACHE))]
    _CACHE[identity] = header
    return header


def read_gguf_file(path: str) -> dict[str, Union[torch.Tensor, PackedWeight]]:
    """The tensors of a ``.gguf`` file (see the module docstring), on the CPU."""
    header = gguf_header(path)
    state: dict[str, Union[torch.Tensor, PackedWeight]] = {}
    with open(path, "rb") as f:
        for tensor in header.tensors:
            raw = torch.empty(tensor.nbytes, dtype=torch.uint8)
            f.seek(tensor.offset)
            if f.readinto(raw.numpy()) != tensor.nbytes:  # the file shrank since its header was read
                raise ValueError(f"checkpoint {path!r}: tensor {tensor.name!r} is truncated")
            name = tensor.name[len(header.prefix):]
            dtype = _FLOAT_DTYPES.get(tensor.kind)
            if dtype is None:
                state[name] = PackedWeight(raw, tensor.kind, tensor.shape)
                continue
            if header.big_endian:
                width = torch.finfo(dtype).bits // 8
                raw = raw.reshape(-1, width).flip(1).reshape(-1)
            state[name] = raw.view(dtype).reshape(tensor.shape)
    return state
