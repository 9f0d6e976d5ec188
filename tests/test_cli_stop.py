"""The CLI keeps its promise when a run is stopped: a signal to a real process (SIGTERM, SIGINT), a failure on one
rank of two, an output directory that takes no files. One line, the documented exit code, no partial file, and no
rank left waiting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from fractions import Fraction

import pytest

av = pytest.importorskip("av")

from examples.seedvr2 import cli  # noqa: E402
from examples.seedvr2.cli import stages  # noqa: E402 - where the stages look up what the tests replace
from tests.test_cli import PREFIX, REPO, _expect_error, leftovers, make_mp4, make_png  # noqa: E402

TIMEOUT = 240


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


# ---- signals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_a_restore_removes_the_partial_output(tmp_path, signum, code):
    """The signal arrives while the output is being written (its temporary file exists): the process ends at once
    with 128 + signal, one line on stderr, no traceback, and neither the output nor its temporary file remains."""
    src = make_mp4(tmp_path / "in.mp4", t=25, h=32, w=48)
    out = tmp_path / "out.mp4"
    proc = subprocess.Popen([sys.executable, "-m", "examples.seedvr2", "restore", src, "-o", str(out), "--quiet",
                             "--batch-frames", "5", "--overlap", "0"],
                            cwd=REPO, env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: any(".partial" in n for n in os.listdir(tmp_path)) or proc.poll() is not None, TIMEOUT,
                  "the temporary output file")
        assert proc.poll() is None, "the restore finished before it could be interrupted"
        sent = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert took < 10, f"{took:.1f}s to stop"
    lines = [line for line in err.splitlines() if "WARNING" not in line]  # the demo's warning came before
    assert len(lines) == 1 and lines[0].startswith(f"python -m examples.seedvr2: stopped by {signum.name}"), err
    assert "removed the partial output .out." in lines[0] and "Traceback" not in err
    # the batches finished before the signal are kept for the same command to resume after them (see test_resume)
    kept = leftovers(tmp_path, {"in.mp4"})
    assert kept in ([], ["out.mp4.seedvr2-batches"]), kept
    assert ("kept the finished batches in out.mp4.seedvr2-batches" in lines[0]) == bool(kept), lines[0]


def test_signal_handlers_are_restored_after_main(tmp_path, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    src = make_png(tmp_path / "in.png")
    assert cli.main(["restore", src, "-o", str(tmp_path / "o.png"), "--quiet"]) == 0
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(-1) == -1  # and no wakeup fd was left behind


# ---- a failure on one rank of two ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multirank
@pytest.mark.parametrize("fault, rank", [pytest.param("disk_full", 0, marks=pytest.mark.slow),
                                         pytest.param("oom", 1, marks=pytest.mark.slow), ("bug", 1)])
def test_every_rank_exits_soon_after_one_fails(tmp_path, fault, rank):
    """Two ranks (one process each, as torchrun starts them, but without torchrun's agent, which would stop the
    survivor itself): one fails mid-run (the writer's disk fills, the other rank runs out of memory, or hits a bug)
    while its peer is computing or waiting on it. Every rank exits within 10 s of the failure, no partial file
    remains, and the failure is reported in one line (a bug with its traceback)."""
    src = make_mp4(tmp_path / "in.mp4", t=9, h=32, w=48, fps=Fraction(12))
    out = tmp_path / "out.mp4"
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.cli_with_fault", fault, str(rank), "restore", src, "-o",
                          str(out), "--quiet", "--batch-frames", "5", "--overlap", "0"], cwd=REPO,
                         env=_env(WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                         stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    ended: dict[int, float] = {}
    try:
        deadline = time.time() + TIMEOUT
        while len(ended) < 2 and time.time() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    errs = [p.communicate()[1] for p in procs]
    assert len(ended) == 2, f"a rank never exited: {errs}"
    failed_at = float(errs[rank].split(f"injected {fault} at ")[1].split()[0])
    for r in range(2):
        assert ended[r] - failed_at < 10, f"rank {r} exited {ended[r] - failed_at:.1f}s after the failure: {errs[r]}"
    # no partial output; the batches finished before the failure may be kept to resume after them (see test_resume)
    assert leftovers(tmp_path, {"in.mp4"}) in ([], ["out.mp4.seedvr2-batches"])
    other = 1 - rank
    assert procs[other].returncode == 2, errs[other]
    assert f"rank {other}: stopped: another rank failed" in errs[other] and "Traceback" not in errs[other]
    if fault == "bug":
        assert procs[rank].returncode == 1 and "RuntimeError: injected bug" in errs[rank], (procs[rank].returncode,
                                                                                          errs[rank])
    else:
        assert procs[rank].returncode == 2, errs[rank]
        lines = [line for line in errs[rank].splitlines() if line.startswith(PREFIX)]
        assert len(lines) == 1 and f"rank {rank}: " in lines[0], errs[rank]
        assert ("No space left on device" if fault == "disk_full" else "out of memory") in lines[0]
        assert "Traceback" not in errs[rank]


def _rank_0_names_rank_1_stuck(lines: list[str], shown: str) -> None:
    """The one line said when rank 1 stops answering mid-run: rank 0's roll call after the collective timeout names
    it (under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` the checker's barrier fails first and names it instead)."""
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL":
        assert len(lines) == 1 and "rank 0: stopped: another rank failed" in lines[0], shown
        assert "Ranks 1 failed to pass monitoredBarrier" in lines[0], shown
    else:
        assert lines == ["python -m examples.seedvr2: rank 0: stopped: rank 1 stopped answering (stuck, stopped or "
                         "gone): a collective timed out (WINSP_COLLECTIVE_TIMEOUT sets how long to wait)"], shown


@pytest.mark.multirank
@pytest.mark.slow  # the default run has the same stopped rank named: tests/test_faults.py test_3
def test_a_stuck_rank_is_named_after_the_collective_timeout(tmp_path):
    """Rank 1 stops (SIGSTOP) mid-run: with WINSP_COLLECTIVE_TIMEOUT=3 rank 0's collective fails after 3 s (instead
    of gloo's 30 minutes), a roll call through the group's store finds rank 1 silent, and rank 0 says so in one line,
    exit 2, its partial output removed."""
    src = make_mp4(tmp_path / "in.mp4", t=9, h=32, w=48, fps=Fraction(12))
    out = tmp_path / "out.mp4"
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.cli_with_fault", "hang", "1", "restore", src, "-o", str(out),
                          "--quiet", "--batch-frames", "5", "--overlap", "0"], cwd=REPO,
                         env=_env(WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WINSP_COLLECTIVE_TIMEOUT="3"),
                         stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        _, err = procs[0].communicate(timeout=TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        procs[1].communicate()
    lines = [line for line in err.splitlines() if line.startswith("python -m examples.seedvr2:")
             and "WARNING" not in line]
    assert procs[0].returncode == 2, err
    _rank_0_names_rank_1_stuck(lines, err)
    assert "Traceback" not in err
    assert leftovers(tmp_path, {"in.mp4"}) == []


def test_a_malformed_collective_timeout_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("WINSP_COLLECTIVE_TIMEOUT", "soon")
    _expect_error(capsys, ["restore", make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png"],
                  "WINSP_COLLECTIVE_TIMEOUT='soon' must be a positive number of seconds", tmp_path, keep={"in.png"})


# ---- an output directory that takes no files ----------------------------------------------------------------------


@contextlib.contextmanager
def _unwritable_directory(tmp_path, how: str):
    """A directory that refuses new files even to root: a read-only bind mount or ``chattr +i`` (skipped where the
    machine does not allow them), or /proc and /sys."""
    if how in ("proc", "sys"):
        yield f"/{how}"
        return
    target = tmp_path / "locked"
    target.mkdir()
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes into a mode 0555 directory anyway (see the bind-mount and chattr cases)")
        target.chmod(0o555)
        try:
            yield str(target)
        finally:
            target.chmod(0o755)
        return
    setup, teardown = {
        "read_only_mount": ([["mount", "--bind", str(target), str(target)],
                             ["mount", "-o", "remount,bind,ro", str(target)]], [["umount", str(target)]]),
        "chattr": ([["chattr", "+i", str(target)]], [["chattr", "-i", str(target)]]),
    }[how]
    done = []
    try:
        for cmd in setup:
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                pytest.skip(f"{' '.join(cmd[:2])} is not available here: {result.stderr.strip()}")
            done.append(cmd)
        yield str(target)
    finally:
        if done:
            for cmd in teardown:
                subprocess.run(cmd, capture_output=True)


def _entries(directory: str) -> list[str]:
    """A directory's names, less the process directories of ``/proc`` (they come and go with other processes)."""
    return sorted(n for n in os.listdir(directory) if not (directory == "/proc" and n.isdigit()))


@pytest.mark.parametrize("how", ["read_only_mount", "chattr", "chmod", "proc", "sys"])
def test_unwritable_output_directory_is_refused_before_reading(tmp_path, capsys, monkeypatch, how):
    """One line, exit 2, naming the directory, before the input is read or any model loaded (the input here does
    not even exist, and reading or loading would fail the test)."""
    from examples.seedvr2.media import reading as media

    def must_not_run(*args, **kwargs):
        raise AssertionError("read or loaded before the output directory was checked")

    monkeypatch.setattr(media, "probe_media", must_not_run)
    monkeypatch.setattr(stages, "load_models", must_not_run)
    with _unwritable_directory(tmp_path, how) as directory:
        before = _entries(directory)
        line = _expect_error(capsys, ["restore", tmp_path / "missing.mp4", "-o", os.path.join(directory, "o.mp4")],
                             f"cannot write to the output directory {directory}", tmp_path,
                             keep={"locked"} if how not in ("proc", "sys") else ())
        assert "choose another -o" in line
        assert _entries(directory) == before


@pytest.mark.multirank
def test_unwritable_output_directory_two_ranks(tmp_path):
    """Under torchrun the writer's check fails, both ranks stop at once (no 60 s barrier), one error line."""
    from tests.test_cli import run_cli

    src = make_png(tmp_path / "in.png")
    started = time.monotonic()
    result = run_cli("restore", src, "-o", "/sys/o.png", "--quiet", nproc=2)
    took = time.monotonic() - started
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1 and "cannot write to the output directory /sys" in errors[0], result.stderr
    assert "examples/seedvr2/" not in result.stderr  # no traceback from the ranks (torchrun prints its own report)
    assert took < 60, f"{took:.0f}s"
