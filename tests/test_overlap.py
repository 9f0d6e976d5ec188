"""The restore's background reader / writer (:mod:`examples.seedvr2.restore.overlap`) and stage clock
(:mod:`examples.seedvr2.restore.stage_clock`): same items in the same order, failures raised in the caller, threads that
stop; and the command's output bytes with the background threads equal to those of the serial path."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from fractions import Fraction

import pytest

from examples.seedvr2.restore import stage_clock
from examples.seedvr2.restore.overlap import (
    SERIAL_IO_ENV,
    BackgroundWorker,
    InlineWorker,
    Prefetcher,
    background_worker,
    prefetch,
)


def test_prefetcher_yields_every_item_in_order_and_stops():
    fetcher = Prefetcher(iter(range(50)), depth=2)
    assert list(fetcher) == list(range(50))
    fetcher._thread.join(timeout=5)
    assert not fetcher._thread.is_alive()


def test_prefetcher_raises_the_sources_error_at_its_item():
    def source():
        yield 1
        yield 2
        raise ValueError("frame 3 is broken")

    seen = []
    with pytest.raises(ValueError, match="frame 3 is broken"):
        for item in Prefetcher(source()):
            seen.append(item)
    assert seen == [1, 2]


def test_prefetcher_dropped_half_way_stops_its_thread():
    produced = []

    def source():
        for i in range(10_000):
            produced.append(i)
            yield i

    fetcher = Prefetcher(source(), depth=1)
    iterator = iter(fetcher)
    assert next(iterator) == 0
    iterator.close()  # what garbage collection does to a dropped iterator
    fetcher._thread.join(timeout=5)
    assert not fetcher._thread.is_alive() and len(produced) < 10
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(iter(()), depth=0)


def test_background_worker_runs_items_in_order_off_the_caller_thread():
    seen, threads = [], set()

    def work(item):
        time.sleep(0.001 * (item % 3))
        seen.append(item)
        threads.add(threading.current_thread().name)

    worker = BackgroundWorker(work, depth=2)
    for i in range(20):
        worker.submit(i)
    worker.close()
    assert seen == list(range(20)) and threads == {"seedvr2-writer"}


def test_background_worker_failure_is_raised_in_the_caller():
    def work(item):
        if item == 2:
            raise OSError("disk full")

    worker = BackgroundWorker(work)
    with pytest.raises(OSError, match="disk full"):
        for i in range(100):
            worker.submit(i)
            time.sleep(0.01)
    with pytest.raises(OSError, match="disk full"):
        worker.close()


def test_background_worker_abandon_skips_what_is_queued():
    started = threading.Event()
    release = threading.Event()
    seen = []

    def work(item):
        started.set()
        release.wait(5)
        seen.append(item)

    worker = BackgroundWorker(work, depth=2)
    worker.submit(0)
    started.wait(5)
    worker.submit(1)
    release.set()
    worker.abandon()
    assert seen == [0] and not worker._thread.is_alive()


def test_serial_io_runs_in_line(monkeypatch):
    monkeypatch.setenv(SERIAL_IO_ENV, "1")
    source = iter([1, 2])
    assert prefetch(source) is source
    assert isinstance(background_worker(print), InlineWorker)
    monkeypatch.setenv(SERIAL_IO_ENV, "0")
    assert isinstance(background_worker(print), BackgroundWorker)


def test_stage_clock_records_only_when_enabled_and_unwraps():
    from winsp.comm.group import SPGroup

    original = SPGroup.all_reduce_sum
    with stage_clock.stage("nothing"):
        pass
    assert stage_clock.active() is None
    clock = stage_clock.enable(comm=True)
    try:
        assert SPGroup.all_reduce_sum is not original
        with stage_clock.stage("outer"):
            time.sleep(0.01)
            clock.count_comm(0.5)  # as the wrapped collectives do
        assert list(stage_clock.timed_iter(iter([1, 2, 3]), "read")) == [1, 2, 3]
        thread = threading.Thread(target=lambda: stage_clock.add_wait("x", 0.0) or list(
            stage_clock.timed_iter(iter([1]), "read")))
        thread.start()
        thread.join()
    finally:
        stage_clock.disable()
    assert SPGroup.all_reduce_sum is original and stage_clock.active() is None
    assert clock.wall["outer"] >= 0.01 and clock.comm["outer"] == 0.5 and clock.calls["outer"] == 1
    assert clock.calls["read"] == 4 and clock.calls["bg read"] == 2  # every next(), the last one included


# ---- the command: background threads change no byte ----------------------------------------------------------------


def _restore(tmp_path, monkeypatch, serial: bool, name: str, profile=None) -> bytes:
    from examples.seedvr2 import cli
    from tests.test_cli import make_mp4

    src = tmp_path / "in.mp4"
    if not src.exists():
        make_mp4(src, t=13, h=48, w=64, fps=Fraction(24))
    monkeypatch.setenv(SERIAL_IO_ENV, "1" if serial else "0")
    if profile is not None:
        monkeypatch.setenv(stage_clock.PROFILE_ENV, str(profile))
    out = tmp_path / name
    args = ["restore", str(src), "-o", str(out), "--crf", "0", "--batch-frames", "5", "--overlap", "2",
            "--color-fix", "wavelet", "--quiet"]
    assert cli.main(args) == 0
    monkeypatch.delenv(stage_clock.PROFILE_ENV, raising=False)
    return out.read_bytes()


def test_background_io_writes_the_same_bytes_as_the_serial_path(tmp_path, monkeypatch):
    """Lossless output (--crf 0), 4 temporal batches with cross-fades and the wavelet colour fix, one process."""
    pytest.importorskip("av")
    profile = tmp_path / "profile"
    profile.mkdir()
    serial = _restore(tmp_path, monkeypatch, True, "serial.mp4")
    threaded = _restore(tmp_path, monkeypatch, False, "threaded.mp4", profile=profile)
    assert hashlib.sha256(serial).hexdigest() == hashlib.sha256(threaded).hexdigest()
    data = json.loads((profile / "rank0.json").read_text())
    assert data["calls"]["VAE encode"] == 4 and data["calls"]["bg write"] == 4 and data["calls"]["bg read"] >= 13
    assert set(data["instants"]) == {"main entered", "restore started", "restore finished", "main left"}


@pytest.mark.slow
@pytest.mark.multirank
def test_background_io_writes_the_same_bytes_on_two_ranks(tmp_path):
    """As above under ``torchrun --nproc-per-node 2`` (one SP group of 2: the VAE and DiT split, rank 0 writes)."""
    pytest.importorskip("av")
    from tests.test_cli import make_mp4, run_cli

    src = make_mp4(tmp_path / "in.mp4", t=13, h=48, w=64, fps=Fraction(24))
    digests = []
    for serial in ("1", "0"):
        out = tmp_path / f"out{serial}.mp4"
        os.environ[SERIAL_IO_ENV] = serial
        try:
            result = run_cli("restore", src, "-o", out, "--crf", "0", "--batch-frames", "5", "--overlap", "2",
                             "--color-fix", "wavelet", nproc=2)
        finally:
            del os.environ[SERIAL_IO_ENV]
        assert result.returncode == 0, result.stderr
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def _spread_rank(rank: int, world: int, color_fix: str) -> bool:
    import torch

    from examples.seedvr2.models.demo import demo_models, demo_text_embeds
    from examples.seedvr2.media import model_to_frames, plan_geometry
    from examples.seedvr2.pipeline import SeedVR2Pipeline
    from winsp.comm.group import SPGroup

    dit, vae = demo_models()
    pipe = SeedVR2Pipeline(dit, vae, "height", group=SPGroup.world())
    video = torch.rand(3, 5, 32, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    geometry = plan_geometry((32, 48), scale=1.5)
    finish = lambda v: torch.from_numpy(model_to_frames(v.cpu(), geometry))  # noqa: E731
    spread = pipe.restore_batch_frames(video, demo_text_embeds(), 4, 7, color_fix, finish)
    os.environ[SERIAL_IO_ENV] = "1"
    whole = pipe.restore_batch_frames(video, demo_text_embeds(), 4, 7, color_fix, finish)
    direct = finish(pipe.restore_batch(video, demo_text_embeds(), 4, 7, color_fix))
    return spread.shape == (5, 48, 72, 3) and torch.equal(spread, whole) and torch.equal(whole, direct)


@pytest.mark.multirank
@pytest.mark.parametrize("color_fix", ["wavelet"])
def test_colour_fix_and_conversion_shared_by_the_ranks_change_no_byte(color_fix):
    """3 ranks share 5 frames (2, 2, 1): the gathered 8-bit frames equal every rank fixing and converting them all."""
    from winsp.testing import run_ranks

    assert all(run_ranks(_spread_rank, 3, color_fix, timeout=600))
