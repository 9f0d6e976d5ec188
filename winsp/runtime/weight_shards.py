"""Inference weights sharded over the SP group, gathered one module (a transformer block) at a time.

With P ranks running one request window-parallel, the activations are split P ways but every rank still holds every
weight. Here each of a sequence of modules (the blocks, in forward order) keeps its tensors as one flat byte buffer
split P ways: rank r holds bytes ``[r * S, (r + 1) * S)``. Just before a block runs, the P chunks are all-gathered
into the whole buffer and the block's parameters become views into it; just after, they become empty again and the
buffer is freed. While block ``i`` computes, the gather of block ``i + 1`` is already under way (prefetch), so at most
two blocks are whole at once, and the first block's gather starts when the model's forward begins.

The gathered bytes are the loaded bytes, so a forward is bitwise the forward of the replicated model. Why not FSDP2's
``fully_shard``: it shards parameters only (the packed fp8 / GGUF weights of a model are buffers), it pads each
parameter's dim 0 separately (a per-rank file read then needs the same padding rules), and its prefetch overlap is
built around CUDA streams; one flat chunk a block is all an inference run needs, loads as plain byte ranges of the
checkpoint's tensors (:meth:`FlatShardLayout.pieces`) and is one collective a block on any backend.

Only inference: gradients of gathered parameters are not reduced back into the shards. The layout is a pure function of
the tensors' names, shapes and dtypes and the group size, so every rank computes the same one without talking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from winsp.comm.group import PendingRows, SPGroup

__all__ = ["ShardEntry", "ShardPiece", "FlatShardLayout", "module_layout", "shard_of_module", "GatheredModules"]

#: every tensor starts at a multiple of this many bytes in the flat buffer (any dtype's view is aligned)
ALIGN = 64


@dataclass(frozen=True)
class ShardEntry:
    """One tensor of a module's flat buffer: its name in the module, shape, dtype and byte offset."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class ShardPiece:
    """The part of tensor ``name`` a rank holds: elements ``[start, stop)`` of its flattened values, at byte
    ``chunk_offset`` of the rank's chunk."""

    name: str
    start: int
    stop: int
    chunk_offset: int


@dataclass(frozen=True)
class FlatShardLayout:
    """Where each tensor of a module lies in its flat buffer of ``parts * chunk_bytes`` bytes (see the module
    docstring); ``chunk_bytes`` is what each of the ``parts`` ranks holds."""

    entries: tuple[ShardEntry, ...]
    parts: int
    chunk_bytes: int

    @classmethod
    def of(cls, tensors: Sequence[tuple[str, Sequence[int], torch.dtype]], parts: int) -> "FlatShardLayout":
        """The layout of ``(name, shape, dtype)`` tensors, in this order, split over ``parts`` ranks."""
        if parts < 1:
            raise ValueError(f"a flat shard layout needs at least one part, got {parts}")
        entries, offset = [], 0
        for name, shape, dtype in tensors:
            entry = ShardEntry(name, tuple(int(d) for d in shape), dtype, offset)
            entries.append(entry)
            offset += -(-entry.nbytes // ALIGN) * ALIGN
        chunk = -(-offset // (parts * ALIGN)) * ALIGN
        return cls(tuple(entries), parts, chunk)

    @property
    def total_bytes(self) -> int:
        """Bytes of the gathered buffer (the tensors, alignment and the padding of the last chunk)."""
        return self.parts * self.chunk_bytes

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def pieces(self, rank: int) -> list[ShardPiece]:
        """What ``rank`` holds, tensor by tensor: the element ranges to read from a checkpoint to fill its chunk."""
        if not 0 <= rank < self.parts:
            raise ValueError(f"rank {rank} is not one of the layout's {self.parts} parts")
        lo, hi = rank * self.chunk_bytes, (rank + 1) * self.chunk_bytes
        found = []
        for e in self.entries:
            first, last = max(lo, e.offset), min(hi, e.offset + e.nbytes)
            if first < last:  # offsets and chunk bounds are multiples of ALIGN: the cut falls between elements
                size = e.element_size
                found.append(ShardPiece(e.name, (first - e.offset) // size, (last - e.offset) // size, first - lo))
        return found

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view into the gathered ``flat`` uint8 buffer."""
        if flat.dtype != torch.uint8 or flat.numel() != self.total_bytes:
            raise ValueError(f"the gathered buffer must be {self.total_bytes} uint8 bytes, got {flat.numel()} "
                             f"{flat.dtype}")
        return {e.name: flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries}


def module_layout(module: nn.Module, parts: int) -> FlatShardLayout:
    """The layout of ``module``'s parameters (each shared parameter once), in registration order."""
    return FlatShardLayout.of([(name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()], parts)


def shard_of_module(module: nn.Module, layout: FlatShardLayout, rank: int) -> torch.Tensor:
    """``rank``'s chunk of ``module``'s loaded parameters (uint8, on their device): a copy of its byte range."""
    params = dict(module.named_parameters())
    device = next(iter(params.values())).device if params else torch.device("cpu")
    chunk = torch.zeros(layout.chunk_bytes, dtype=torch.uint8, device=device)
    for piece in layout.pieces(rank):
        values = params[piece.name].detach().reshape(-1)[piece.start:piece.stop]
        chunk[piece.chunk_offset:piece.chunk_offset + values.numel() * values.element_size()] = values.view(
            torch.uint8)
    return chunk


class GatheredModules:
    """Gather each of ``modules`` (run once a forward, in this order) from the ranks' chunks just before it runs.

    Args:
        modules: the sharded modules (e.g. a DiT's blocks), in forward order.
        layouts: each module's :class:`FlatShardLayout` (``parts`` = the group's size).
        shards: this rank's chunk of each module (``layout.chunk_bytes`` uint8 bytes), e.g. read from a checkpoint
            or made by :func:`shard_of_module`.
        group: the SP group the chunks are spread over (an :class:`SPGroup` or a process group or None).
        root: the module whose forward runs the others; its forward starts the first gather (optional).
        prefetch: start module ``i + 1``'s gather when module ``i`` starts (False: gather each when it starts).

    The modules' parameters are replaced by empty ones (``requires_grad=False``) that point into the gathered buffer
    while their module runs. :meth:`remove` takes the hooks off (the parameters stay empty).
    """

    def __init__(self, modules: Sequence[nn.Module], layouts: Sequence[FlatShardLayout],
                 shards: Sequence[torch.Tensor], group=None, *, root: Optional[nn.Module] = None,
                 prefetch: bool = True) -> None:
        self.group = group if isinstance(group, SPGroup) else SPGroup(group)
        if not (len(modules) == len(layouts) == len(shards)):
            raise ValueError(f"{len(modules)} modules, {len(layouts)} layouts and {len(shards)} shards: give one "
                             f"of each per module")
        for i, (layout, shard) in enumerate(zip(layouts, shards, strict=True)):
            if layout.parts != self.group.size:
                raise ValueError(f"module {i}: its layout is split {layout.parts} ways but the group has "
                                 f"{self.group.size} ranks")
            if shard.dtype != torch.uint8 or tuple(shard.shape) != (layout.chunk_bytes,):
                raise ValueError(f"module {i}: its shard must be {layout.chunk_bytes} uint8 bytes, got "
                                 f"{shard.dtype} {list(shard.shape)}")
        self.modules, self.layouts, self.shards = list(modules), list(layouts), list(shards)
        self.prefetch = prefetch
        self._pending: dict[int, PendingRows] = {}
        self._params = [self._empty_parameters(m, layout, shard) for m, layout, shard in
                        zip(modules, layouts, shards, strict=True)]
        self._handles = []
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i)))
            self._handles.append(module.register_forward_hook(lambda _m, _a, _o, i=i: self._leave(i)))
        if root is not None:
            self._handles.append(root.register_forward_pre_hook(lambda _m, _a: self._start_forward()))

    @staticmethod
    def _empty_parameters(module: nn.Module, layout: FlatShardLayout, shard: torch.Tensor) -> dict[str, nn.Parameter]:
        """Replace every parameter of ``module`` named in ``layout`` (under all its names) by an empty one on the
        shard's device; returns ``{layout name: [parameter]}``."""
        names = {e.name: e for e in layout.entries}
        replaced: dict[int, nn.Parameter] = {}
        by_name: dict[str, nn.Parameter] = {}
        for full, param in module.named_parameters(remove_duplicate=False):
            owner_name, _, leaf = full.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            new = replaced.get(id(param))
            if new is None:
                dtype = names[full].dtype if full in names else param.dtype
                new = replaced[id(param)] = nn.Parameter(torch.empty(0, dtype=dtype, device=shard.device),
                                                         requires_grad=False)
            owner._parameters[leaf] = new
            if full in names:
                by_name[full] = new
        missing = set(names) - set(by_name)
        if missing:
            raise ValueError(f"the layout names tensors the module does not have: {sorted(missing)[:4]}")
        return by_name

    # ---- per-rank figures ----------------------------------------------------------------------------------
    @property
    def shard_bytes(self) -> int:
        """Bytes of sharded weights this rank holds."""
        return sum(s.numel() for s in self.shards)

    @property
    def largest_gathered_bytes(self) -> int:
        """Bytes of the largest gathered module (two of them are whole at once with prefetch)."""
        return max((layout.total_bytes for layout in self.layouts), default=0)

    # ---- hooks ---------------------------------------------------------------------------------------------
    def _start(self, i: int) -> None:
        if i < len(self.modules) and i not in self._pending:
            self._pending[i] = self.group.start_all_gather(self.shards[i])

    def _start_forward(self) -> None:
        for pending in self._pending.values():  # a forward that failed midway left gathers in flight
            pending.wait()
        self._pending.clear()
        if self.prefetch:
            self._start(0)

    def _enter(self, i: int) -> None:
        self._start(i)
        flat = self._pending.pop(i).wait()
        for name, view in self.layouts[i].views(flat).items():
            self._params[i][name].data = view
        if self.prefetch:
            self._start(i + 1)

    def _leave(self, i: int) -> None:
        for param in self._params[i].values():
            param.data = param.data.new_empty(0)

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
