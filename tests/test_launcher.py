"""The CLI's own launcher (``restore ... --ranks N``, examples/seedvr2/cli/launcher.py): the same output as torchrun, a
mistake or a mid-run failure as one line with exit code 2 and every rank gone, no torch in the launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from examples.seedvr2.cli.launcher import (
    FAILED_ENV,
    LAUNCHED_ENV,
    LaunchError,
    check_ranks,
    gpu_count,
    rank_environment,
    requested_ranks,
    wants_launcher,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300


def test_requested_ranks_and_who_launches():
    assert requested_ranks(["restore", "a.mp4", "--ranks", "3"]) == "3"
    assert requested_ranks(["restore", "a.mp4", "--ranks=2"]) == "2"
    assert requested_ranks(["restore", "a.mp4"]) is None
    assert requested_ranks(["restore", "--ranks"]) == ""
    assert wants_launcher(["restore", "a", "--ranks", "2"], env={})
    assert not wants_launcher(["restore", "a", "--ranks", "2"], env={LAUNCHED_ENV: str(os.getppid())})  # a rank
    assert wants_launcher(["restore", "a", "--ranks", "2"], env={LAUNCHED_ENV: "1"})  # inherited from a shell
    assert not wants_launcher(["restore", "--help", "--ranks", "2"], env={})
    assert not wants_launcher(["restore", "a"], env={})


def test_check_ranks():
    assert check_ranks("2", gpus=0, cpus=2) == 2
    assert check_ranks("4", gpus=8, cpus=2) == 4
    for text, gpus, match in (("x", 0, "whole number"), ("0", 0, "at least 1"), ("3", 2, "2 GPUs"),
                              ("9", 0, "4 ranks per CPU core")):
        with pytest.raises(LaunchError, match=match):
            check_ranks(text, gpus=gpus, cpus=2)


def test_gpu_count(tmp_path):
    proc = tmp_path / "gpus"
    assert gpu_count({}, proc=str(proc)) == 0  # no driver
    proc.mkdir()
    for i in range(4):
        (proc / f"0000:0{i}:00.0").mkdir()
    assert gpu_count({}, proc=str(proc)) == 4
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "1,3"}, proc=str(proc)) == 2
    assert gpu_count({"CUDA_VISIBLE_DEVICES": ""}, proc=str(proc)) == 0


def test_rank_environment():
    env = rank_environment({"PYTHONPATH": "/x"}, 1, 2, 12345, "/tmp/m", cpus=8)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "1", "2", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == ("127.0.0.1", "12345", "4")
    assert env[LAUNCHED_ENV] == str(os.getpid()) and env[FAILED_ENV] == "/tmp/m"
    assert env["PYTHONPATH"] == REPO + os.pathsep + "/x"
    assert rank_environment({"OMP_NUM_THREADS": "3"}, 0, 2, 1, "m", cpus=8)["OMP_NUM_THREADS"] == "3"


def test_the_launcher_does_not_import_torch():
    code = ("import sys; import examples.seedvr2.__main__, examples.seedvr2.cli.launcher; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", LAUNCHED_ENV)}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra)


def _cli(*args, torchrun: int = 0):
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
              if torchrun else [sys.executable])
    return subprocess.run([*prefix, "-m", "examples.seedvr2", *map(str, args)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    pytest.importorskip("av")
    from tests.test_cli import make_mp4

    return make_mp4(tmp_path_factory.mktemp("clip") / "in.mp4", t=9, h=32, w=48)


@pytest.mark.multirank
@pytest.mark.slow  # the default run: torchrun against one process in tests/test_cli.py, --ranks 2 in test_faults.py
def test_ranks_2_output_equals_torchrun(clip, tmp_path):
    ours, theirs = tmp_path / "ranks.mp4", tmp_path / "torchrun.mp4"
    flags = ["--crf", "0", "--quiet", "--batch-frames", "5", "--overlap", "1"]  # 3 batches: the ranks talk
    done = _cli("restore", clip, "-o", ours, "--ranks", "2", *flags)
    assert done.returncode == 0, done.stderr
    assert "SP 2" in done.stderr
    reference = _cli("restore", clip, "-o", theirs, *flags, torchrun=2)
    assert reference.returncode == 0, reference.stderr
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.multirank
@pytest.mark.parametrize("mistake", ["missing input", pytest.param("usage", marks=pytest.mark.slow),
                                     pytest.param("sp size", marks=pytest.mark.slow)])
def test_a_mistake_under_ranks_2_is_one_line(clip, tmp_path, mistake):
    out = tmp_path / "o.mp4"
    args = {"missing input": [tmp_path / "nope.mp4", "-o", out],
            "usage": [clip, "-o", out, "--crf", "abc"],
            "sp size": [clip, "-o", out, "--sp-size", "3"]}[mistake]
    done = _cli("restore", *args, "--ranks", "2", "--quiet")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m examples.seedvr2: error:"), done.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


def _torch_debug_log(line: str) -> bool:
    """Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``.ci/run detail``) torch's own C++ log adds lines such as
    ``[rank0]:[E... ProcessGroupGloo.cpp:...] ... failed to pass monitoredBarrier``: diagnostics the user asked for,
    not the CLI's. Without it nothing is set aside."""
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL" and re.match(r"\[rank\d+\]:\[[EWI]", line) is not None


@pytest.mark.multirank
def test_a_rank_failing_mid_run_is_one_line_and_every_rank_goes(clip, tmp_path):
    """Rank 1 runs out of memory in its first batch: its line is the only one, exit code 2, every rank gone within
    seconds, no output."""
    out = tmp_path / "o.mp4"
    argv = ["oom", "1", "restore", clip, "-o", str(out), "--ranks", "2", "--quiet"]
    code = ("import sys; from examples.seedvr2.cli.launcher import launch; "
            f"sys.exit(launch({argv!r}, module='tests.cli_with_fault'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    ended = time.time()
    assert done.returncode == 2, done.stderr
    injected = [line for line in done.stderr.splitlines() if line.startswith("injected")]
    errors = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("injected")
              and "DEMO" not in line and not _torch_debug_log(line)]
    assert len(injected) == 1 and len(errors) == 1 and "rank 1: out of memory" in errors[0], done.stderr
    assert ended - float(injected[0].split()[-1]) < 15  # the launcher waits for every rank before it exits
    assert not out.exists() and os.listdir(tmp_path) == []
