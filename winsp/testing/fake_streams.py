"""CUDA streams and events for the fake GPU (:mod:`winsp.testing.fake_gpu`), which has no driver to make real ones.

FSDP2 makes its own streams at its first forward (all-gather copy-in, all-gather, reduce-scatter) and orders them with
events; ``torch.cuda.Stream()`` and ``torch.cuda.Event()`` need a driver. On the fake GPU nothing executes, so the
order between streams has nothing to act on: these stand-ins accept every call that only orders device work
(``wait_stream``, ``wait_event``, ``record``, ``record_event``, entering ``torch.cuda.stream(s)``) and record none of
it. A call that makes the host wait for the device (``Stream.synchronize``, ``Event.synchronize``) is a host sync and
is reported as one, like ``torch.cuda.synchronize``.

What they cannot show: a missing wait between two streams (a race on a real GPU). A fake tensor has no values, so no
run here could show that, with or without streams. The collectives issued on a side stream are the same calls, in
the same order on the host, and are checked across ranks as any other.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["fake_stream_api"]


class FakeEvent:
    """A CUDA event that orders nothing (nothing runs on the fake GPU); ``synchronize`` reports a host sync."""

    on_sync: Callable[[str], None] = staticmethod(lambda what: None)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> "FakeEvent":
        self.recorded = True
        return self

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.on_sync("torch.cuda.Event.synchronize")


class FakeStream:
    """A CUDA stream on the fake GPU's one device; ``synchronize`` reports a host sync."""

    on_sync: Callable[[str], None] = staticmethod(lambda what: None)
    event_class: type = FakeEvent

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.priority = priority
        self.device_index = 0
        self.device_type = 1  # torch's DeviceType enum value of CUDA, as torch.Stream reports it

    @property
    def device(self):
        import torch

        return torch.device("cuda", 0)

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> FakeEvent:
        event = event if event is not None else self.event_class()
        return event.record(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.on_sync("torch.cuda.Stream.synchronize")


def fake_stream_api(on_sync: Callable[[str], None]) -> dict[str, Any]:
    """The ``torch.cuda`` names to replace while the fake GPU is open: ``Stream``, ``Event``, ``current_stream``,
    ``default_stream`` and ``stream`` (the context manager that makes a stream current). ``on_sync(what)`` is called
    for each host sync."""
    event = type("Event", (FakeEvent,), {"on_sync": staticmethod(on_sync)})
    stream_class = type("Stream", (FakeStream,), {"on_sync": staticmethod(on_sync), "event_class": event})
    default = stream_class()
    current = [default]

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        previous = current[0]
        if s is not None:
            current[0] = s
        try:
            yield
        finally:
            current[0] = previous

    return {"Stream": stream_class, "Event": event,
            "current_stream": lambda device=None: current[0],
            "default_stream": lambda device=None: default,
            "stream": stream}
