"""Usable-memory detection (``examples.seedvr2.memory.limits``): fake /proc and cgroup files, and a real
``setrlimit`` in a subprocess."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from examples.seedvr2.memory.limits import (
    ADDRESS_SPACE_RESERVE,
    SystemFiles,
    host_memory_limits,
    ranks_on_this_host,
    usable_memory,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


def _unlimited(which):
    return resource.RLIM_INFINITY, resource.RLIM_INFINITY


def fake_system(tmp_path, *, available_kib=8 * 2**20, vm_size_kib=600 * 2**10, vm_data_kib=200 * 2**10,
                cgroup_lines=("0::/",), rlimits=None) -> SystemFiles:
    (tmp_path / "meminfo").write_text(f"MemTotal: 16000000 kB\nMemFree: 1000 kB\nMemAvailable: {available_kib} kB\n")
    (tmp_path / "status").write_text(f"Name: python\nVmPeak: 999999 kB\nVmSize: {vm_size_kib} kB\n"
                                     f"VmData: {vm_data_kib} kB\n")
    (tmp_path / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    (tmp_path / "cg").mkdir(exist_ok=True)
    getrlimit = _unlimited if rlimits is None else (lambda which: rlimits.get(which, _unlimited(which)))
    return SystemFiles(meminfo=str(tmp_path / "meminfo"), status=str(tmp_path / "status"),
                       cgroup=str(tmp_path / "cgroup"), cgroup_root=str(tmp_path / "cg"), getrlimit=getrlimit)


def test_free_ram_alone(tmp_path):
    limit = usable_memory("cpu", files=fake_system(tmp_path), ranks_on_host=1)
    assert limit.usable == 8 * GiB and limit.source == "free RAM"


def test_address_space_limit_minus_what_is_mapped_binds(tmp_path):
    files = fake_system(tmp_path, rlimits={resource.RLIMIT_AS: (3 * GiB, 3 * GiB)})
    limit = usable_memory("cpu", files=files, ranks_on_host=1)
    assert limit.usable == 3 * GiB - 600 * 2**20 - ADDRESS_SPACE_RESERVE
    assert "address-space limit (ulimit -v) 3.00 GiB" in limit.source and "0.59 GiB already mapped" in limit.source
    assert "2.2 GiB (address-space limit" in limit.describe()


def test_data_limit_counts_the_data_segment(tmp_path):
    files = fake_system(tmp_path, rlimits={resource.RLIMIT_DATA: (GiB, GiB)})
    limit = usable_memory("cpu", files=files, ranks_on_host=1)
    assert limit.usable == GiB - 200 * 2**20 and limit.source.startswith("data-size limit")


def test_cgroup_v2_limit_and_its_ancestors(tmp_path):
    files = fake_system(tmp_path, cgroup_lines=("0::/outer/inner",))
    inner = tmp_path / "cg" / "outer" / "inner"
    inner.mkdir(parents=True)
    (inner / "memory.max").write_text("max\n")  # no limit of its own
    (inner / "memory.current").write_text(f"{GiB}\n")
    (tmp_path / "cg" / "outer" / "memory.max").write_text(f"{4 * GiB}\n")
    (tmp_path / "cg" / "outer" / "memory.current").write_text(f"{GiB}\n")
    limit = usable_memory("cpu", files=files, ranks_on_host=1)
    assert limit.usable == 3 * GiB and limit.source.startswith("cgroup memory.max 4.00 GiB, 1.00 GiB used")


def test_cgroup_v1_inside_a_namespace_reads_the_mount_root(tmp_path):
    """In a container the path /proc/self/cgroup names does not exist under the mount; the mount is the cgroup."""
    files = fake_system(tmp_path, cgroup_lines=("4:memory:/docker/abc", "1:cpu:/docker/abc", "0::/"))
    (tmp_path / "cg" / "memory").mkdir()
    (tmp_path / "cg" / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (tmp_path / "cg" / "memory" / "memory.usage_in_bytes").write_text(f"{GiB // 2}\n")
    limit = usable_memory("cpu", files=files, ranks_on_host=1)
    assert limit.usable == 3 * GiB // 2 and limit.source.startswith("cgroup v1 memory limit")


def test_cgroup_v1_without_a_limit_is_ignored(tmp_path):
    files = fake_system(tmp_path, cgroup_lines=("4:memory:/",))
    (tmp_path / "cg" / "memory").mkdir()
    (tmp_path / "cg" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "cg" / "memory" / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    assert usable_memory("cpu", files=files, ranks_on_host=1).source == "free RAM"


def test_ranks_on_a_host_share_ram_and_cgroup_but_not_process_limits(tmp_path):
    files = fake_system(tmp_path, cgroup_lines=("0::/",), rlimits={resource.RLIMIT_AS: (5 * GiB, 5 * GiB)})
    (tmp_path / "cg" / "memory.max").write_text(f"{6 * GiB}\n")
    (tmp_path / "cg" / "memory.current").write_text("0\n")
    limits = dict(host_memory_limits(files, ranks_on_host=4))
    by_kind = {phrase.split(" ")[0]: value for phrase, value in limits.items()}
    assert by_kind["free"] == 2 * GiB and by_kind["cgroup"] == 6 * GiB // 4
    assert by_kind["address-space"] == 5 * GiB - 600 * 2**20 - ADDRESS_SPACE_RESERVE  # per process: not divided
    limit = usable_memory("cpu", files=files, ranks_on_host=4)
    assert limit.usable == 6 * GiB // 4 and "/ 4 ranks on this host" in limit.source


def test_local_world_size_is_read_from_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert ranks_on_this_host() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_on_this_host() == 1


def test_nothing_readable_is_unknown(tmp_path):
    files = SystemFiles(meminfo=str(tmp_path / "none"), status=str(tmp_path / "none"), cgroup=str(tmp_path / "none"),
                        cgroup_root=str(tmp_path), getrlimit=_unlimited)
    limit = usable_memory("cpu", files=files, ranks_on_host=1)
    assert limit.usable is None and limit.describe() == "unknown"


def test_a_real_address_space_limit_in_a_subprocess():
    """``setrlimit(RLIMIT_AS)`` in a child: the limit binds, and it is the limit minus what the process maps."""
    code = (
        "import resource, sys\n"
        "from examples.seedvr2.memory.limits import ADDRESS_SPACE_RESERVE, usable_memory\n"
        "size = [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:')][0]\n"
        "limit = size + 700 * 2**20\n"
        "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
        "got = usable_memory('cpu', ranks_on_host=1)\n"
        "print(got.usable, limit - size - ADDRESS_SPACE_RESERVE, got.source)\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    usable, expected, source = done.stdout.split(maxsplit=2)
    assert source.startswith("address-space limit (ulimit -v)")
    assert abs(int(usable) - int(expected)) < 32 * 2**20  # the child maps a little more while it reads the files


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_gpu_free_memory():
    import torch

    limit = usable_memory("cuda", ranks_on_host=1)
    assert 0 < limit.usable <= torch.cuda.mem_get_info()[1] and "free memory of cuda" in limit.source
