"""Peak bytes of live tensors during a block of code, measured on any device (CPU included).

CPU PyTorch has no ``max_memory_allocated``, and process RSS is blurred by the allocator and by everything
else in the process. Instead, a dispatch mode sees every tensor an operator creates, counts each new storage
once, and subtracts it when the last tensor using it is garbage-collected. The peak is therefore the largest
total of activation storages alive at one time inside the block; inputs and parameters, which existed before,
are not counted (views of them are not new storages). Deterministic for a given program, so suitable for tests.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakBytes", "peak_tensor_bytes"]


@dataclass
class PeakBytes:
    peak: int = 0
    current: int = 0


class _LiveStorageCounter(TorchDispatchMode):
    def __init__(self, record: PeakBytes) -> None:
        super().__init__()
        self.record = record
        self.live: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, live tensors]

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]
            self.record.current -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in self.live:
                self.live[ptr][1] += 1
            elif ptr in inputs or nbytes == 0:
                continue  # a view of something that existed before the block: not a new allocation
            else:
                self.live[ptr] = [nbytes, 1]
                self.record.current += nbytes
                self.record.peak = max(self.record.peak, self.record.current)
            weakref.finalize(t, self._release, ptr)
        return out


@contextlib.contextmanager
def peak_tensor_bytes() -> Iterator[PeakBytes]:
    """``with peak_tensor_bytes() as m: ...`` then ``m.peak`` is the peak of live new tensor bytes in the block."""
    record = PeakBytes()
    with _LiveStorageCounter(record):
        yield record
