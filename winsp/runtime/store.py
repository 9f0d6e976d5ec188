"""The runtime's one store: an LRU-bounded map from request shapes to everything prepared for them.

A :class:`~winsp.runtime.runtime.WindowRuntime` keeps plans, transitions, each rank's local windows and their device
index tensors here, under tagged keys, with a single bound and a single :meth:`RuntimeStore.cache_info`. Nothing in
winsp caches at module level or stashes state on other objects; dropping the runtime drops all of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable, NamedTuple, TypeVar

__all__ = ["RuntimeStore", "CacheInfo"]

T = TypeVar("T")


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int
    currsize: int


class RuntimeStore:
    """A thread-safe LRU map: :meth:`get` returns the entry for ``key``, building it with ``build()`` on a miss."""

    def __init__(self, maxsize: int = 64) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be a positive integer, got {maxsize!r}")
        self.maxsize = maxsize
        self._entries: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self._hits += 1
                return self._entries[key]  # type: ignore[return-value]
            self._misses += 1
        value = build()  # outside the lock: building may take a while, and may itself read the store
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return value

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, self.maxsize, len(self._entries))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._hits = self._misses = 0
