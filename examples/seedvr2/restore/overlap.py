"""Running the restore's serial input and output work beside the ranks' compute, on background threads.

Decoding the input's frames (and converting them to the model's size) and encoding the output's frames are serial:
one stream each, in order. Left in line, every rank waits while they run (and the ranks of a group wait for the
writer, rank 0, at their next collective). Here they run on one thread each:

* :class:`Prefetcher` pulls an iterator ``depth`` items ahead (the next temporal batch's frames are decoded while
  the current one is restored);
* :class:`BackgroundWorker` applies a function to the items it is handed, in order (the finished batches are
  cross-faded and encoded while the next one is restored).

Both do exactly the work the serial loop did, in the same order, so the output bytes are the same. A failure on the
thread is raised in the caller at its next call (or at :meth:`close`), never lost. Memory: ``depth`` more items alive
(one temporal batch of input frames; one finished batch of 8-bit output frames).

``SEEDVR2_SERIAL_IO=1`` in the environment runs both in line instead (the behaviour before this module; for
comparisons and tests).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable, Generic, Iterable, Iterator, Optional, TypeVar

__all__ = ["SERIAL_IO_ENV", "serial_io", "Prefetcher", "BackgroundWorker", "InlineWorker", "prefetch",
           "background_worker"]

SERIAL_IO_ENV = "SEEDVR2_SERIAL_IO"
T = TypeVar("T")
_DONE = object()
_POLL_S = 0.1


def serial_io() -> bool:
    """Whether ``SEEDVR2_SERIAL_IO`` asks for the input and output work in line (no background threads)."""
    return os.environ.get(SERIAL_IO_ENV, "").strip() not in ("", "0")


class Prefetcher(Generic[T]):
    """Iterates ``source`` on a daemon thread, up to ``depth`` items ahead of the consumer.

    Iterate it like ``source``; an exception raised by ``source`` is raised where the consumer would have received
    that item. :meth:`close` (also on leaving a ``with`` block) stops the thread at its next item.
    """

    def __init__(self, source: Iterable[T], depth: int = 1, name: str = "seedvr2-prefetch") -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(source),), name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put((item, None)):
                    return
            self._put((_DONE, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put((None, exc))

    def __iter__(self) -> Iterator[T]:
        try:
            while True:
                item, error = self._queue.get()
                if error is not None:
                    raise error
                if item is _DONE:
                    return
                yield item
        finally:  # also when the consumer drops the iterator half-way (it is closed when collected)
            self.close()

    def close(self) -> None:
        self._stop.set()

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BackgroundWorker(Generic[T]):
    """Calls ``fn(item)`` on a thread for every item :meth:`submit` hands it, in order, ``depth`` items queued at
    most (``submit`` blocks beyond that). :meth:`close` waits for every item and raises the first failure; after a
    failure ``submit`` raises it at once."""

    def __init__(self, fn: Callable[[T], None], depth: int = 1, name: str = "seedvr2-writer") -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._fn = fn
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if self._error is None:
                try:
                    self._fn(item)
                except BaseException as exc:  # noqa: BLE001 - raised in the caller
                    self._error = exc

    @property
    def failed(self) -> bool:
        """Whether an item failed (or the worker was abandoned): the items after it are skipped."""
        return self._error is not None

    def submit(self, item: T) -> None:
        if self._error is not None:
            raise self._error
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                if self._error is not None or not self._thread.is_alive():
                    raise self._error or RuntimeError("the background worker stopped") from None

    def close(self) -> None:
        """Wait for every submitted item; raise the first failure."""
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Skip the items not yet started, wait for the one running (its failure is dropped): for a caller that is
        failing itself and must not leave the thread working on what it is about to clean up."""
        if self._error is None:
            self._error = RuntimeError("abandoned")
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()


class InlineWorker(Generic[T]):
    """:class:`BackgroundWorker`'s interface, calling ``fn`` at once in the caller's thread."""

    failed = False

    def __init__(self, fn: Callable[[T], None]) -> None:
        self._fn = fn

    def submit(self, item: T) -> None:
        self._fn(item)

    def close(self) -> None:
        pass

    def abandon(self) -> None:
        pass


def prefetch(source: Iterable[T], depth: int = 1) -> Iterable[T]:
    """``source`` read ahead on a thread (:class:`Prefetcher`), or ``source`` itself under ``SEEDVR2_SERIAL_IO``."""
    return source if serial_io() else Prefetcher(source, depth)


def background_worker(fn: Callable[[T], None], depth: int = 1):
    """A :class:`BackgroundWorker` of ``fn``, or an :class:`InlineWorker` under ``SEEDVR2_SERIAL_IO``."""
    return InlineWorker(fn) if serial_io() else BackgroundWorker(fn, depth)
