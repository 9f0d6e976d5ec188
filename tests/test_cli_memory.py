"""The command line and memory: automatic fitting, refusals that name what would fit, and out-of-memory at run time
(real ``setrlimit(RLIMIT_AS)`` in subprocesses, single process and ``torchrun --nproc-per-node 2``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

av = pytest.importorskip("av")

from examples.seedvr2 import cli  # noqa: E402
from examples.seedvr2.memory import limits as memory_limits  # noqa: E402
from examples.seedvr2.memory.limits import MemoryLimit  # noqa: E402
from tests.test_cli import PREFIX, REPO, _expect_error, leftovers, make_mp4, make_png, probe  # noqa: E402

RUN_TIMEOUT = 300


def _limit_to(monkeypatch, usable: int) -> None:
    monkeypatch.setattr(memory_limits, "usable_memory", lambda device: MemoryLimit(usable, "test limit"))


def _needs(src, **flags) -> dict:
    """The CLI's own estimate of each setting for ``src`` (replicated at the default batch, and tiled 64/128px)."""
    from examples.seedvr2.media import plan_geometry, probe_media
    from examples.seedvr2.memory.fit import PinnedSettings

    info = probe_media(src)
    args = cli.build_parser().parse_args(["restore", src])
    geometry = plan_geometry((info.height, info.width))
    found = {}
    original = memory_limits.usable_memory
    try:
        for name, pinned in {"replicated": PinnedSettings(vae_parallel="replicated"),
                             "tiled128": PinnedSettings(vae_parallel="tiled", vae_tile=128),
                             "tiled64": PinnedSettings(vae_parallel="tiled", vae_tile=64)}.items():
            memory_limits.usable_memory = lambda device: MemoryLimit(None, "none")
            plan = cli.plan_memory(args, pinned, geometry, info.num_frames, cli.torch.float32, 1, cli.torch.device("cpu"),
                                   True)
            found[name] = plan.need
    finally:
        memory_limits.usable_memory = original
    return found


def test_automatic_fit_picks_the_largest_tile_that_fits(tmp_path, capsys, monkeypatch):
    src = make_png(tmp_path / "in.png", h=160, w=160)
    needs = _needs(src)
    assert needs["tiled64"] < needs["tiled128"] < needs["replicated"]
    _limit_to(monkeypatch, (needs["tiled128"] + needs["replicated"]) // 2)
    assert cli.main(["restore", src, "-o", str(tmp_path / "o.png")]) == 0
    err = capsys.readouterr().err
    summary = err.strip().splitlines()[-1]
    assert "VAE tiled 128px" in summary
    warning = [line for line in err.splitlines() if "CHANGES THE OUTPUT" in line]  # tiles are approximate: loudly
    assert len(warning) == 1 and "the VAE in 128px tiles" in warning[0] and "(test limit) usable per rank" in warning[0]


def test_pinned_settings_that_do_not_fit_are_refused_with_settings_that_would(tmp_path, capsys, monkeypatch):
    src = make_png(tmp_path / "in.png", h=192, w=192)
    needs = _needs(src)
    _limit_to(monkeypatch, (needs["tiled128"] + needs["replicated"]) // 2)
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--vae-parallel", "replicated"],
                         "VAE replicated needs about", tmp_path, keep={"in.png"})
    assert "--vae-parallel tiled --vae-tile 128 would fit" in line and "(test limit) is usable" in line
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--vae-tile", "512"],
                         "VAE tiled 512px needs", tmp_path, keep={"in.png"})


def test_nothing_fits_is_one_error_line_and_no_file(tmp_path, capsys, monkeypatch):
    src = make_png(tmp_path / "in.png", h=64, w=64)
    _limit_to(monkeypatch, 1024)
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png"], "nothing fits", tmp_path,
                         keep={"in.png"})
    assert "0 MiB (test limit) usable per rank" in line and "the most frugal about" in line
    assert "more ranks" in line and "--resolution" in line


def test_vae_tile_goes_with_tiled_only(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--vae-parallel", "height", "--vae-tile", "64"],
                  "--vae-tile", tmp_path, keep={"in.png"})
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--vae-tile", "60"], "multiple of 8",
                  tmp_path, keep={"in.png"})


# ---- real limits, real allocator failures ------------------------------------------------------------------------

#: a child that limits its own address space (on the ranks in ``RANKS``) to what it maps plus ``EXTRA`` MiB, at start
#: or (``at-plan``) just before the CLI reads its limits, plus the reserve the CLI keeps for mapped-only memory (so the
#: CLI sees ``EXTRA`` MiB usable); it can make the CLI's estimate blind (``blind``: every setting "needs" nothing, so
#: an allocation must fail at run time); then it runs the CLI with the remaining arguments
_CHILD = textwrap.dedent("""
    import faulthandler, os, resource, signal, sys
    faulthandler.register(signal.SIGUSR1)
    from examples.seedvr2 import cli
    from examples.seedvr2.memory import estimate as pipeline
    from examples.seedvr2.memory import limits as memory_limits
    extra_mib, ranks, mode = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    def limit_now():
        if os.environ.get("RANK", "0") in ranks:
            mapped = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:")][0]
            limit = mapped + memory_limits.ADDRESS_SPACE_RESERVE + extra_mib * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if mode == "blind":
        pipeline.estimate_restore_bytes = lambda **kw: pipeline.MemoryEstimate(0, 0, 0)
    if mode == "at-plan":
        usable_memory = memory_limits.usable_memory
        def limited_usable_memory(device):
            limit_now()
            return usable_memory(device)
        memory_limits.usable_memory = limited_usable_memory
    else:
        limit_now()
    sys.exit(cli.main(sys.argv[4:]))
""")


def run_limited(tmp_path, extra_mib: int, *args, ranks="0", blind=False, at_plan=False,
                nproc=1) -> subprocess.CompletedProcess:
    script = tmp_path / "limited_child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    head = [str(extra_mib), ranks, "blind" if blind else "at-plan" if at_plan else "honest"]
    if nproc == 1:
        cmd = [sys.executable, str(script), *head, *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(script), *head, *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)


def test_allocation_failure_is_one_error_line_exit_2_and_no_file(tmp_path):
    """An estimate that lets through what cannot run (blinded here) meets the real allocator under ``RLIMIT_AS``.

    The limit leaves room for the run's set-up (loading, the decoder's and the encoder's threads and buffers: about
    250 MiB of address space, more when threads get their own malloc arenas) but not for its first batch (about
    960 MiB at 512x512): so the allocation that fails is the batch's, by hundreds of MiB either way. (At 256x256 with
    150 MiB the margins were about 100 MiB on both sides: under load, libx264's start-up failed first now and then.)"""
    src = make_mp4(tmp_path / "in.mp4", t=5, h=512, w=512)
    result = run_limited(tmp_path, 400, "restore", src, "-o", tmp_path / "o.mp4", blind=True)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), result.stderr
    assert "out of memory on cpu" in lines[0] and "the estimate was" in lines[0] and "address-space limit" in lines[0]
    assert "you tried to allocate" in lines[0]  # torch's allocator, in the batch
    assert "--vae-parallel tiled" in lines[0] and "--batch-frames" in lines[0]
    assert "Traceback" not in result.stderr
    assert leftovers(tmp_path, {"in.mp4", "limited_child.py"}) == []


def test_an_honest_estimate_fits_the_limit_without_any_flag(tmp_path):
    """The scaled-down "done when": under an address-space limit that the replicated VAE does not fit, ``restore``
    with no flags beyond input and output picks settings that fit and writes every frame."""
    src = make_mp4(tmp_path / "in.mp4", t=5, h=128, w=160)
    out = tmp_path / "o.mp4"
    needs = _needs(src)
    extra = (needs["replicated"] + needs["tiled128"]) // 2 // 2**20
    result = run_limited(tmp_path, extra, "restore", src, "-o", out, at_plan=True)
    assert result.returncode == 0, result.stderr
    assert probe(out)[:3] == (5, 128, 160)
    summary = result.stderr.strip().splitlines()[-1]
    assert "VAE tiled" in summary
    warning = [line for line in result.stderr.splitlines() if "CHANGES THE OUTPUT" in line]
    assert len(warning) == 1 and "tiles" in warning[0] and "address-space limit" in warning[0], result.stderr


@pytest.mark.multirank
def test_allocation_failure_on_one_rank_ends_every_rank(tmp_path):
    """Under torchrun with SP 2 only rank 1 is limited: it reports the failure and leaves; rank 0, blocked in a
    collective with it, fails over and exits too (no hang, no partial file)."""
    src = make_mp4(tmp_path / "in.mp4", t=5, h=512, w=512)
    result = run_limited(tmp_path, 400, "restore", src, "-o", tmp_path / "o.mp4", "--vae-parallel", "height",
                         ranks="1", blind=True, nproc=2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1 and "rank 1: out of memory on cpu" in errors[0], result.stderr
    assert "examples/seedvr2/cli/" not in result.stderr  # no traceback from our processes (torchrun adds its report)
    assert leftovers(tmp_path, {"in.mp4", "limited_child.py"}) == []
