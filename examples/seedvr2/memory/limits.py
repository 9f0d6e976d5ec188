"""How much memory this process may really use: the smallest of every limit that applies, and which one binds.

Free RAM is rarely the binding limit in a container or under a batch scheduler. The process may also be held by

* its address-space limit (``ulimit -v``, ``RLIMIT_AS``) and its data limit (``RLIMIT_DATA``): per process, minus what
  the process already maps (``VmSize`` / ``VmData`` in ``/proc/self/status``; torch alone maps several hundred MB),
  and for the address space minus :data:`ADDRESS_SPACE_RESERVE` (mapped but never resident);
* its cgroup (container) limit: v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes -
  memory.usage_in_bytes``, the tightest over the cgroup and its ancestors;
* on a GPU, the device's free memory (``torch.cuda.mem_get_info``).

RAM and the cgroup are shared by the ranks on one host: under torchrun their share is divided by ``LOCAL_WORLD_SIZE``
(the process limits are per process and are not divided). Every path is a parameter so that tests can point the
functions at fake ``/proc`` and cgroup files.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

__all__ = ["MemoryLimit", "SystemFiles", "usable_memory", "host_memory_limits", "ranks_on_this_host",
           "ADDRESS_SPACE_RESERVE"]

#: values at or above this are "no limit" (cgroup v1 reports 2^63 rounded down to a page)
_UNLIMITED = 2**62
#: address space a run maps beyond what it makes resident (thread stacks, allocator arenas, the process group's
#: threads): an address-space limit sees it, the memory estimate (of resident bytes) does not. Measured as the growth
#: of VmPeak over VmHWM in benchmarks/calibrate_memory.py (up to ~50 MiB on one process, ~180 MiB on a gloo rank).
ADDRESS_SPACE_RESERVE = 192 * 2**20


@dataclass(frozen=True)
class SystemFiles:
    """Where the limits are read from (the real files by default; tests pass fakes)."""

    meminfo: str = "/proc/meminfo"
    status: str = "/proc/self/status"
    cgroup: str = "/proc/self/cgroup"
    cgroup_root: str = "/sys/fs/cgroup"
    getrlimit: Callable[[int], tuple[int, int]] = field(default=resource.getrlimit, compare=False)


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes this rank may still allocate (``None``: nothing known) and a phrase naming the limit that binds."""

    usable: Optional[int]
    source: str
    candidates: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        """``"2.7 GiB (address-space limit ...)"`` for messages."""
        if self.usable is None:
            return "unknown"
        size = self.usable / 2**30
        return f"{size:.1f} GiB ({self.source})" if size >= 1 else f"{self.usable / 2**20:.0f} MiB ({self.source})"


def _kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """``name: N kB`` lines of a /proc file, in bytes (missing file or fields: left out)."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in names and rest.split():
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return found


def _read_number(path: str) -> Optional[int]:
    """An integer file (``max`` or a huge value: None); None when missing or unreadable."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _cgroup_dirs(files: SystemFiles) -> list[tuple[str, str, str, str]]:
    """(directory, limit file, usage file, label) of this process's memory cgroup and its ancestors, innermost first.

    The path from ``/proc/self/cgroup`` is looked up under the mount; inside a container with its own cgroup namespace
    that path does not exist under the mount, whose root is then the process's own cgroup.
    """
    try:
        with open(files.cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            found.append((os.path.join(files.cgroup_root), path, "memory.max", "memory.current", "cgroup memory.max"))
        elif "memory" in controllers.split(","):
            found.append((os.path.join(files.cgroup_root, "memory"), path, "memory.limit_in_bytes",
                          "memory.usage_in_bytes", "cgroup v1 memory limit"))
    dirs = []
    for mount, path, limit_file, usage_file, label in found:
        relative = path.strip("/")
        start = os.path.join(mount, relative) if relative and os.path.isdir(os.path.join(mount, relative)) else mount
        directory = start
        while True:
            dirs.append((directory, limit_file, usage_file, label))
            if os.path.normpath(directory) == os.path.normpath(mount):
                break
            directory = os.path.dirname(directory)
    return dirs


def ranks_on_this_host() -> int:
    """Ranks sharing this host's RAM: torchrun's ``LOCAL_WORLD_SIZE`` (1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def host_memory_limits(files: SystemFiles = SystemFiles(), ranks_on_host: int = 1) -> list[tuple[str, int]]:
    """Every host-memory limit that applies to this process, as ``(phrase, bytes still usable)``.

    Shared limits (free RAM, the cgroup) are divided by ``ranks_on_host``; per-process limits are not.
    """
    shared = f" / {ranks_on_host} ranks on this host" if ranks_on_host > 1 else ""
    limits: list[tuple[str, int]] = []
    meminfo = _kib_fields(files.meminfo, ("MemAvailable",))
    if "MemAvailable" in meminfo:
        limits.append((f"free RAM{shared}", meminfo["MemAvailable"] // ranks_on_host))
    status = _kib_fields(files.status, ("VmSize", "VmData"))
    for which, mapped_field, phrase in ((resource.RLIMIT_AS, "VmSize", "address-space limit (ulimit -v)"),
                                        (resource.RLIMIT_DATA, "VmData", "data-size limit (ulimit -d)")):
        try:
            soft = files.getrlimit(which)[0]
        except (OSError, ValueError):
            continue
        if soft == resource.RLIM_INFINITY or soft < 0 or soft >= _UNLIMITED:
            continue
        mapped = status.get(mapped_field, 0)
        reserve = ADDRESS_SPACE_RESERVE if which == resource.RLIMIT_AS else 0
        limits.append((f"{phrase} {soft / 2**30:.2f} GiB, {mapped / 2**30:.2f} GiB already mapped",
                       max(0, soft - mapped - reserve)))
    for directory, limit_file, usage_file, label in _cgroup_dirs(files):
        limit = _read_number(os.path.join(directory, limit_file))
        if limit is None:
            continue
        usage = _read_number(os.path.join(directory, usage_file)) or 0
        limits.append((f"{label} {limit / 2**30:.2f} GiB, {usage / 2**30:.2f} GiB used{shared}",
                       max(0, limit - usage) // ranks_on_host))
    return limits


def usable_memory(device: torch.device | str = "cpu", *, files: SystemFiles = SystemFiles(),
                  ranks_on_host: Optional[int] = None) -> MemoryLimit:
    """The bytes this rank may still allocate on ``device`` and which limit binds (see the module docstring).

    ``ranks_on_host`` defaults to :func:`ranks_on_this_host`. On CUDA the limit is the device's free memory, shared
    by the ranks that use the same device.
    """
    device = torch.device(device)
    ranks = ranks_on_this_host() if ranks_on_host is None else max(1, int(ranks_on_host))
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
        sharing = max(1, -(-ranks // max(1, torch.cuda.device_count())))
        phrase = f"free memory of {device}" + (f" / {sharing} ranks on it" if sharing > 1 else "")
        return MemoryLimit(free // sharing, phrase, ((phrase, free // sharing),))
    limits = host_memory_limits(files, ranks)
    if not limits:
        return MemoryLimit(None, "no memory limit could be read")
    phrase, usable = min(limits, key=lambda item: item[1])
    return MemoryLimit(usable, phrase, tuple(limits))
