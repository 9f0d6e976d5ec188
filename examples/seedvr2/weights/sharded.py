"""The DiT's block weights sharded over the SP group (``--shard-weights``): each rank holds 1/P of them.

The blocks hold 99% of the DiT's weights (the 7B: 8.16 of 8.24 billion values). Each block's parameters are one flat
byte buffer split P ways over the SP group and gathered just before the block runs, the next block's gather started
meanwhile (:class:`winsp.runtime.weight_shards.GatheredModules`, which owns the collectives; this module only reads
files and builds layouts). The rest of the DiT (patch and text input projections, time embedding, output) and every
buffer (RoPE frequencies) stay whole on every rank.

Two ways in:

* :func:`load_sharded_dit`: from a checkpoint file into a model built on the meta device. Each rank reads only its
  byte ranges of the block tensors, one block at a time (safetensors: plain reads at the header's offsets straight
  into the rank's buffer, no memory map; ``.pth``: ``torch.load(mmap=True, weights_only=True)`` and slices of the
  mapped tensors, the file mapped anew for each block so that the pages a rank touched are unmapped before the
  next: peak RSS counts them). No rank ever holds the whole state dict, and the key and shape checks run on the
  file's header first.
* :func:`shard_loaded_dit`: a DiT already loaded in memory (the demo weights, tests) keeps its rank's chunk of each
  block and drops the rest.

Packed weights (fp8 checkpoints, GGUF files, ``--weights fp8``) are refused with ``--shard-weights``: their bytes
could be split the same way, but an fp8 conversion needs each whole tensor's maximum and the GGUF reader has no byte
ranges yet, and a packed 7B is already 1/2 (fp8) to 1/4 (Q4) of its bf16 size.
"""

from __future__ import annotations

import math
import os
import re
import weakref
from typing import Callable, Mapping, Optional

import torch
from torch import nn

from winsp.comm.group import SPGroup
from winsp.runtime.weight_shards import FlatShardLayout, GatheredModules, module_layout, shard_of_module

from ..checkpoints.dtypes import match_model_dtypes
from ..checkpoints.quantized_linear import FP8_KINDS

__all__ = ["load_sharded_dit", "shard_loaded_dit", "sharded_weights_of", "check_shardable_checkpoint",
           "block_layouts"]

_REGISTRY: "weakref.WeakKeyDictionary[nn.Module, GatheredModules]" = weakref.WeakKeyDictionary()
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


def sharded_weights_of(dit: nn.Module) -> Optional[GatheredModules]:
    """The gatherer of ``dit``'s sharded blocks, or None when its weights are whole."""
    return _REGISTRY.get(dit)


def block_layouts(dit: nn.Module, parts: int) -> list[FlatShardLayout]:
    """The flat layout of each block's parameters over ``parts`` ranks (works on the meta device too)."""
    return [module_layout(block, parts) for block in dit.blocks]


def _attach(dit: nn.Module, layouts, shards, group: SPGroup) -> GatheredModules:
    gathered = GatheredModules(list(dit.blocks), layouts, shards, group, root=dit)
    _REGISTRY[dit] = gathered
    return gathered


def shard_loaded_dit(dit: nn.Module, group=None) -> GatheredModules:
    """Shard the blocks of a loaded ``dit`` over ``group`` (an :class:`SPGroup`, a process group or None): this rank
    keeps its chunk of each block, the whole parameters are dropped. Returns the gatherer (idempotent)."""
    existing = sharded_weights_of(dit)
    if existing is not None:
        return existing
    group = group if isinstance(group, SPGroup) else SPGroup(group)
    layouts = block_layouts(dit, group.size)
    shards = [shard_of_module(block, layout, group.rank) for block, layout in zip(dit.blocks, layouts, strict=True)]
    return _attach(dit, layouts, shards, group)


# ---- reading byte ranges of a checkpoint -----------------------------------------------------------------------


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class _RangeReader:
    """Element ranges of a checkpoint's tensors, read into a given buffer.

    safetensors: plain reads at the offsets of the file's header (:func:`..checkpoint_file.safetensors_header`), into
    the destination itself when the dtypes agree: no memory map (whose touched pages would count in this process's
    RSS, and whose size would count against an address-space limit), no intermediate copy. ``.pth``: the tensors of
    ``torch.load(mmap=True)`` sliced and copied, with the file mapped only inside ``with`` (leaving it unmaps the
    pages read).
    """

    def __init__(self, path: str) -> None:
        from ..checkpoints.file import safetensors_header

        self.path = path
        self.suffix = os.path.splitext(path)[1].lower()
        self.header = safetensors_header(path) if self.suffix == ".safetensors" else None
        self._file = None

    def __enter__(self) -> "_RangeReader":
        if self.header is not None:
            self._file = open(self.path, "rb", buffering=0)
        else:
            self._file = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        return self

    def __exit__(self, *exc) -> None:
        file, self._file = self._file, None
        if hasattr(file, "close"):
            file.close()
        del file

    def read_into(self, out: torch.Tensor, key: str, start: int, stop: int) -> Optional[torch.dtype]:
        """Copy elements ``[start, stop)`` of the flattened tensor ``key`` into the 1-D ``out`` (cast to its dtype);
        returns the file's dtype."""
        if self.header is None:
            values = self._file[key].reshape(-1)[start:stop]
            out.copy_(values)
            return values.dtype
        entry = self.header[key]
        dtype = _SAFETENSORS_DTYPES.get(entry.dtype)
        if dtype is None:
            raise ValueError(f"checkpoint {self.path!r}: tensor {key!r} has dtype {entry.dtype}, which a sharded "
                             f"load does not read")
        size = torch.empty((), dtype=dtype).element_size()
        if entry.start + stop * size > entry.stop:
            raise ValueError(f"checkpoint {self.path!r}: tensor {key!r} is shorter than its shape says")
        target = out if dtype == out.dtype else torch.empty(stop - start, dtype=dtype)
        view = memoryview(target.view(torch.uint8).numpy())
        self._file.seek(entry.start + start * size)
        done = 0
        while done < len(view):
            got = self._file.readinto(view[done:])
            if not got:
                raise ValueError(f"checkpoint {self.path!r} ends inside tensor {key!r} (truncated file)")
            done += got
        if target is not out:
            out.copy_(target)
        return dtype

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (its shape, the file's dtype)."""
        if self.header is None:
            return self._file[key].clone()
        entry = self.header[key]
        out = torch.empty(math.prod(entry.shape), dtype=_SAFETENSORS_DTYPES.get(entry.dtype, torch.uint8))
        self.read_into(out, key, 0, out.numel())
        return out.reshape(entry.shape)


def check_shardable_checkpoint(path: str, layout: Mapping[str, tuple], weights: str) -> None:
    """``ValueError`` (one line) when the checkpoint or ``weights`` asks for packed weights, which are not sharded
    (see the module docstring), or when a ``.pth`` cannot be memory-mapped."""
    suffix = os.path.splitext(path)[1].lower()
    why = ("sharding splits plain fp32/fp16/bf16 tensors; a packed 7B is already 1/2 (fp8) to 1/4 (Q4) of bf16: "
           "run it without --shard-weights, or shard a bf16/fp16/fp32 checkpoint")
    if suffix == ".gguf":
        raise ValueError(f"--shard-weights does not take GGUF checkpoints ({path}): {why}")
    if weights == "fp8":
        raise ValueError("--shard-weights cannot go with --weights fp8 (the fp8 conversion scales each weight by its "
                         "whole tensor's maximum, which a rank holding a shard never reads); use --weights stored")
    packed = sorted(k for k, (kind, _, _) in layout.items() if kind in FP8_KINDS)
    if packed:
        raise ValueError(f"--shard-weights does not take fp8 checkpoints ({path}, e.g. {packed[0]!r} is "
                         f"{layout[packed[0]][0]}): {why}")
    if suffix in (".pth", ".pt"):
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" in str(err):
                raise ValueError(f"--shard-weights reads .pth files memory-mapped, and {path} is in torch's legacy "
                                 f"(non-zip) format: re-save it with torch.save, or use a .safetensors file") from None
            raise


def load_sharded_dit(model: nn.Module, path: str, group=None, *, weights: str = "stored",
                     allow_truncated: bool = False, report: Optional[Callable[[str], None]] = None,
                     device: torch.device | str = "cpu") -> GatheredModules:
    """Load ``path`` into ``model`` (a DiT built on the meta device in its compute dtype) with its blocks sharded over
    ``group``: this rank reads only its chunk of each block (see the module docstring) and the rest whole.

    The checks of :func:`~examples.seedvr2.models.dit.load_dit_checkpoint` (missing, unexpected, mismatched keys, and
    dtypes: the same function, the same message) run on the file's header before anything is read. The shards go to
    ``device`` (the rest of the model stays on the CPU for the caller's ``.to(device)``). Returns the gatherer.
    ``report`` gets one line on what was cast.
    """
    from ..models.dit.loader import _drop_extra_blocks, _restore_exact_rope, check_dit_keys, normalize_checkpoint_keys
    from ..models.dit.rope import RotaryEmbedding3d
    from .footprint import checkpoint_layout

    group = group if isinstance(group, SPGroup) else SPGroup(group)
    path = os.fspath(path)
    try:
        layout = checkpoint_layout(path)
    except Exception as err:  # noqa: BLE001 - a damaged header fails in any way; the file is at fault
        raise ValueError(f"checkpoint {path!r} could not be read ({type(err).__name__}: {err})") from None
    check_shardable_checkpoint(path, layout, weights)
    placeholders = {k: torch.empty(shape, device="meta") for k, (_, shape, _) in layout.items()}
    file_key = dict(zip(normalize_checkpoint_keys(placeholders), placeholders, strict=True))
    config = getattr(model, "config", None)
    shapes = _drop_extra_blocks(normalize_checkpoint_keys(placeholders), len(model.blocks), allow_truncated,
                                getattr(config, "last_layer_video_only", True))
    expected = model.state_dict()
    check_dit_keys({k: (tuple(v.shape), v.dtype) for k, v in expected.items()},
                   {k: (tuple(v.shape), layout[file_key[k]][0]) for k, v in shapes.items()})

    layouts = block_layouts(model, group.size)
    reader = _RangeReader(path)
    shards, cast = [], set()
    for i, block_layout in enumerate(layouts):
        chunk = torch.zeros(block_layout.chunk_bytes, dtype=torch.uint8)
        dtypes = {e.name: e.dtype for e in block_layout.entries}
        with reader:  # one block at a time: a mapped .pth is unmapped before the next
            for piece in block_layout.pieces(group.rank):
                target = dtypes[piece.name]
                size = torch.empty((), dtype=target).element_size()
                out = chunk[piece.chunk_offset:piece.chunk_offset + (piece.stop - piece.start) * size].view(target)
                stored = reader.read_into(out, file_key[f"blocks.{i}.{piece.name}"], piece.start, piece.stop)
                if stored != target:
                    cast.add((str(stored).replace("torch.", ""), str(target).replace("torch.", "")))
        shards.append(chunk.to(device))
    gathered = _attach(model, layouts, shards, group)

    sharded = {f"blocks.{i}.{e.name}" for i, block_layout in enumerate(layouts) for e in block_layout.entries}
    with reader:
        rest = {k: reader.read(file_key[k]).reshape(shapes[k].shape) for k in expected if k not in sharded}
    exact = _restore_exact_rope(model, rest)
    rest, note = match_model_dtypes(rest, model, what="DiT checkpoint", weights="compute")
    notes = [n for n in (note, f"{len(cast)} block dtype cast(s) {sorted(cast)}" if cast else None,
                         f"{exact} RoPE frequency buffers set to their exact float32 values" if exact else None) if n]
    if notes:
        (report or (lambda _: None))("; ".join(notes))
    model.load_state_dict(rest, strict=False, assign=True)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding3d) and module.freqs.dtype != torch.float32:
            module.freqs = module.freqs.float()
    left = sorted(k for k, v in model.state_dict().items() if v.is_meta)
    if left:  # the checks above make this unreachable; never run half-loaded
        raise RuntimeError(f"sharded DiT load left {len(left)} tensors unloaded, e.g. {left[0]!r}")
    return gathered
