"""``serve``'s jobs survive faults (issue 48): a job whose rank dies, whose server is killed or restarted on the same
``--state-dir``, or that a drain stops, goes on after its last finished temporal batch, kept in its own folder.

Real servers on loopback (the tiny demo weights, ``tests/test_serve.py``'s :class:`Served`). Every job restores the
41-frame clip in 5-frame batches, lossless (``--crf 0``); its result is compared byte for byte with an uninterrupted
job's on the same server and with ``restore``'s. The ranks tell the server each temporal batch they compute (the
status's ``batches_computed``, every run of the job counted, the record keeps it across a killed server): a job that
survived a fault computed at most one batch more than the uninterrupted one. The test-only gate
(``SEEDVR2_SERVE_TEST_GATE``) holds a job between two batches, so no test depends on the machine's speed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time

import numpy as np
import pytest

from tests.cli_with_kill import KILL_HOOK
from tests.test_cli import make_mp4
from tests.test_resume import SEED  # one draw for both modules' kills: WINSP_TEST_SEED=S replays it
from tests.test_serve import JOB_S, REPO, Served, _restore, httpx, media  # noqa: F401  (media: a fixture)

OPTIONS = {"crf": 0, "batch_frames": 5}
STORE = "result.mp4.seedvr2-batches"


def _until(what, check, served, timeout: float = JOB_S):
    """Wait until ``check()`` is true (``what`` in the failure)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}:\n{served.text()}"
        time.sleep(0.05)


def _running_past_batch(served, n: int, clip=None) -> str:
    """Submit ``clip`` (the server's own by default) with the ranks held, release them once the job runs, and return
    its id once batch ``n`` has started (more than ``n`` batches computed), the gate closed again: the job stops
    before one of its next batches, however fast its batches run, until :func:`_resumed` releases it."""
    served.hold()
    job_id = served.submit(served.clip if clip is None else clip, **OPTIONS).json()["id"]
    served.wait(job_id, states=("running",))
    served.release()
    _until(f"batch {n} started", lambda: served.status(job_id)["progress"]["batches_computed"] > n, served)
    served.hold()
    return job_id


def _run_to_batch(served, job_id: str, batches: int) -> dict:
    """Let ``job_id`` run until its ranks start batch ``batches`` (0-based: ``batches`` batches finished and kept
    before it), then close the gate: it stops before one of its next batches."""
    served.release()
    _until(f"job {job_id} reaching batch {batches}",
           lambda: served.status(job_id)["progress"]["batches_computed"] > batches, served)
    served.hold()
    return served.status(job_id)


def _reference(served) -> tuple[bytes, int]:
    """An uninterrupted job of the clip on ``served``: its result and the batches it computed."""
    served.release()
    job_id = served.submit(served.clip, **OPTIONS).json()["id"]
    done = served.wait(job_id)
    assert done["state"] == "done" and done["progress"]["frames_reused"] == 0, (done, served.text())
    return served.client.get(done["result"]).content, done["progress"]["batches_computed"]


def _resumed(served, job_id: str, uninterrupted: tuple[bytes, int], *, redone: int = 1,
             all_kept: bool = False) -> dict:
    """``job_id`` ran on to the end after a fault: the uninterrupted job's bytes, at most ``redone`` batches
    computed again, frames reused (all of them only where ``all_kept``: the fault came after its last batch was
    kept), and its kept batches gone."""
    served.release()
    done = served.wait(job_id)
    assert done["state"] == "done", (done, served.text())
    result, batches = uninterrupted
    assert served.client.get(done["result"]).content == result
    progress = done["progress"]
    assert batches <= progress["batches_computed"] <= batches + redone, (progress, batches, served.text())
    assert progress["frames"] == 41 and 0 < progress["frames_reused"] <= (41 if all_kept else 40), progress
    assert f"job {job_id} resumed: {progress['frames_reused']} of 41 frames reused" in served.text()
    assert not os.path.lexists(os.path.join(served.state_dir(), "jobs", job_id, STORE))
    return done


def _ranks(served) -> list[int]:
    """The rank processes (children of any of the server's threads: the ranks restarted by its dispatcher thread are
    that thread's children)."""
    pids = []
    for task in os.listdir(f"/proc/{served.proc.pid}/task"):
        try:
            with open(f"/proc/{served.proc.pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return sorted(pids)


def _metric(served, name: str) -> int:
    return int(re.search(rf"^{name} (\d+)$", served.client.get("/metrics").text, re.M).group(1))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the cases that share it; its clip is the long one's 41 frames at 48x32 (the gate holds a job
    wherever a test needs it, so a short job does; the 96x64 one costs four times the time)."""
    tmp = tmp_path_factory.mktemp("resume")
    server = Served(str(tmp), "--state-dir", tmp / "state", token=False)
    server.clip = make_mp4(tmp / "long_small.mp4", t=41, h=32, w=48)
    server.uninterrupted = _reference(server)
    yield server
    server.stop()


@pytest.mark.slow  # tests/test_serve.py compares jobs with restore byte for byte in the default run
def test_the_uninterrupted_job_is_restore_byte_for_byte(served, tmp_path):
    result, batches = served.uninterrupted
    assert batches == 10  # 41 frames in batches of 5 with the default overlap: as the CLI plans them
    assert result == _restore(served.clip, tmp_path / "ref.mp4", "--crf", 0, "--batch-frames", 5)


def test_a_killed_rank_costs_its_job_one_batch_at_most(served):
    """The rank is SIGKILLed mid-job (mid-batch or between two: wherever it is once batch 3 started): the ranks are
    restarted and the job goes on after its kept batches, to the uninterrupted job's bytes."""
    reused_before = _metric(served, "seedvr2_frames_reused_total")
    job_id = _running_past_batch(served, 3)
    (rank,) = _ranks(served)
    os.kill(rank, signal.SIGKILL)
    done = _resumed(served, job_id, served.uninterrupted)
    assert "rank 0 was killed by SIGKILL" in served.text() and "it goes on after its kept batches" in served.text()
    assert _ranks(served) != [rank]
    assert _metric(served, "seedvr2_frames_reused_total") == reused_before + done["progress"]["frames_reused"]


@pytest.mark.slow
def test_a_job_whose_rank_dies_twice_without_finishing_a_batch_fails(served):
    """The job itself is then the likely cause (say, it makes the kernel's OOM killer end its rank): it fails with
    one line instead of running forever, its kept batches go, and the ranks serve the next job."""
    served.hold()  # before its first batch: no batch can finish
    job_id = served.submit(served.clip, **OPTIONS).json()["id"]
    served.wait(job_id, states=("running",))
    (first,) = _ranks(served)
    os.kill(first, signal.SIGKILL)
    _until("the job running again", lambda: f"job {job_id}: rank 0 was killed" in served.text(), served)
    (second,) = _ranks(served)
    assert second != first
    os.kill(second, signal.SIGKILL)
    failed = served.wait(job_id)
    served.release()
    assert failed["state"] == "failed", failed
    assert failed["error"].startswith("rank 0 was killed by SIGKILL") and failed["error"].endswith(
        "(its ranks died 2 times in a row without finishing a batch of it)"), failed
    assert sorted(os.listdir(os.path.join(served.state_dir(), "jobs", job_id))) == ["input.mp4", "job.json"]
    assert _next_job_runs_whole(served)


def _next_job_runs_whole(served) -> bool:
    """The next job runs from its first frame on the restarted ranks, to the uninterrupted job's bytes."""
    job_id = served.submit(served.clip, **OPTIONS).json()["id"]
    done = served.wait(job_id)
    assert done["state"] == "done" and done["progress"]["frames_reused"] == 0, done
    assert served.client.get(done["result"]).content == served.uninterrupted[0]
    return done["progress"]["batches_computed"] == served.uninterrupted[1]


def test_a_cancelled_job_keeps_nothing(served):
    served.hold()
    job_id = served.submit(served.clip, **OPTIONS).json()["id"]
    served.wait(job_id, states=("running",))
    _run_to_batch(served, job_id, 2)
    assert os.path.isdir(os.path.join(served.state_dir(), "jobs", job_id, STORE))  # kept while it runs
    served.client.delete(f"/v1/restorations/{job_id}")
    assert served.wait(job_id)["state"] == "cancelled"
    served.release()
    assert sorted(os.listdir(os.path.join(served.state_dir(), "jobs", job_id))) == ["input.mp4", "job.json"]


@pytest.mark.slow
def test_a_killed_server_restarted_on_its_state_dir_goes_on_after_the_kept_batches(media, tmp_path):  # noqa: F811
    """SIGKILL to the server mid-job (its rank goes with it): a server started again on the same ``--state-dir``
    queues the job again and it goes on after its kept batches, to an uninterrupted job's bytes."""
    state = tmp_path / "state"
    first = Served(str(tmp_path), "--state-dir", state, token=False)
    try:
        first.clip = media["long"]
        uninterrupted = _reference(first)
        job_id = _running_past_batch(first, 4)
        (rank,) = _ranks(first)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
        _until("the rank gone with its server", lambda: not os.path.exists(f"/proc/{rank}"), first, timeout=30)
    finally:
        first.stop()
    kept = os.listdir(state / "jobs" / job_id / STORE)
    assert "manifest.json" in kept and "frames-000003.bin" in kept, kept
    second = Served(str(tmp_path), "--state-dir", state, token=False)
    try:
        assert "1 unfinished job(s)" in second.text()
        done = _resumed(second, job_id, uninterrupted)
        assert done["progress"]["frames_reused"] >= 16  # batches 0-3 at least were kept
        assert _metric(second, "seedvr2_frames_reused_total") == done["progress"]["frames_reused"]
    finally:
        second.stop()


@pytest.mark.slow
def test_a_drain_that_times_out_queues_the_job_at_its_batch_boundary_and_a_corrupt_batch_is_redone(media,  # noqa: F811
                                                                                                  tmp_path):
    """The drain stops the job before its next batch (its finished batches kept, queued again); one kept batch is
    then damaged on disk: the next server on the state folder restores that batch again (its checksum fails), takes
    the ones before it, and the result is an uninterrupted job's."""
    state = tmp_path / "state"
    first = Served(str(tmp_path), "--state-dir", state, "--drain-timeout", "1", token=False)
    try:
        first.clip = media["long"]
        uninterrupted = _reference(first)
        first.hold()
        job_id = first.submit(first.clip, **OPTIONS).json()["id"]
        first.wait(job_id, states=("running",))
        _run_to_batch(first, job_id, 4)
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=120) == 0, first.text()
        text = first.text()
        assert "drain timeout: stopping job" in text and f"job {job_id} queued again at its batch boundary" in text
    finally:
        first.stop()
    with open(state / "jobs" / job_id / "job.json") as f:
        record = json.load(f)
    assert record["state"] == "queued" and record["batches_computed"] >= 5, record
    folder = state / "jobs" / job_id / STORE
    last = max(int(name[7:13]) for name in os.listdir(folder) if name.startswith("frames-"))
    assert last >= 4, os.listdir(folder)
    damaged = folder / f"frames-{last:06d}.bin"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    second = Served(str(tmp_path), "--state-dir", state, token=False)
    try:
        _resumed(second, job_id, uninterrupted)  # the damaged batch alone is computed again (the drain cost none)
        assert re.search(rf"frame \d+ of frames-{last:06d}\.bin fails its checksum: that batch is restored again",
                         second.text()), second.text()
    finally:
        second.stop()


@pytest.mark.slow
@pytest.mark.multirank
def test_one_of_two_ranks_killed_costs_its_job_one_batch_at_most(media, tmp_path):  # noqa: F811
    served = Served(str(tmp_path), "--state-dir", tmp_path / "state", ranks=2, token=False)
    try:
        served.clip = media["long"]
        uninterrupted = _reference(served)
        assert uninterrupted[0] == _restore(served.clip, tmp_path / "ranks2.mp4", "--crf", 0, "--batch-frames", 5,
                                            ranks=2)
        job_id = _running_past_batch(served, 3)
        environ = {pid: open(f"/proc/{pid}/environ", "rb").read().split(b"\0") for pid in _ranks(served)}
        (rank1,) = [pid for pid, names in environ.items() if b"RANK=1" in names]
        os.kill(rank1, signal.SIGKILL)
        _resumed(served, job_id, uninterrupted)
        assert "rank 1 was killed by SIGKILL" in served.text()
    finally:
        served.stop()


# ---- killed at a drawn point of a batch ------------------------------------------------------------------------

def _draw(point: str, target: str) -> int:
    """N for ``point`` (tests/cli_with_kill.py) on the 10-batch job: a batch or frame with a kept batch before it."""
    rng = random.Random(f"{SEED}-serve-{point}-{target}")
    if point == "mid_encode":
        return rng.randrange(41)  # a frame is handed to the encoder once its batch is kept
    if point == "between":
        return rng.randrange(10)  # batch N kept (the last one too: then every batch is kept)
    return rng.randrange(1, 10)  # inside batch N or its write, batches 0..N-1 kept


@pytest.fixture(scope="module")
def uninterrupted(media, tmp_path_factory):  # noqa: F811
    """The long clip as ``restore`` writes it (a job's bytes: ``test_the_uninterrupted_job_is_restore_byte_for_byte``
    checks that on the shared server's clip) and the batches an uninterrupted job computes."""
    return _restore(media["long"], tmp_path_factory.mktemp("whole") / "ref.mp4", "--crf", 0, "--batch-frames", 5), 10


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rank", "server"])
@pytest.mark.parametrize("point", ["between", "mid_batch", "mid_write", "mid_encode"])
def test_a_rank_or_its_server_killed_at_a_drawn_point_goes_on_to_the_uninterrupted_bytes(media, uninterrupted,  # noqa: F811
                                                                                        tmp_path, point, target):
    """SIGKILL to the job's rank (the server restarts it) or to the server and its rank (a server started again on
    its ``--state-dir`` goes on) between two batches, inside one, half-way through keeping one, or inside the
    encode: the job ends with the uninterrupted job's bytes, and at most one batch computed again."""
    n = _draw(point, target)
    what = f"SIGKILL to the {target} {point} {n} (seed {SEED})"
    marker = tmp_path / "killed"
    env = {"WINSP_TEST_KILL": f"{point}:{n}:0:{target}:{marker}",
           "PYTHONPATH": KILL_HOOK + os.pathsep + REPO}
    state = tmp_path / "state"
    first = Served(str(tmp_path), "--state-dir", state, token=False, env=env)
    try:
        job_id = first.submit(media["long"], **OPTIONS).json()["id"]
        if target == "server":
            assert first.proc.wait(timeout=JOB_S) == -signal.SIGKILL, (what, first.text())
        else:
            done = _resumed_or_say(first, job_id, uninterrupted, point, what)
            assert "rank 0 was killed by SIGKILL" in first.text(), what
        assert marker.exists(), what
    finally:
        first.stop()
    if target == "server":
        second = Served(str(tmp_path), "--state-dir", state, token=False)
        try:
            assert "1 unfinished job(s)" in second.text(), what
            done = _resumed_or_say(second, job_id, uninterrupted, point, what)
        finally:
            second.stop()
    kept = n + 1 if point == "between" else n if point in ("mid_batch", "mid_write") else 1
    assert done["progress"]["frames_reused"] >= 4 * kept, (what, done["progress"])


def _resumed_or_say(served, job_id: str, uninterrupted: tuple[bytes, int], point: str, what: str) -> dict:
    """:func:`_resumed`, its failure saying which kill it followed (with the seed of the draw)."""
    try:
        return _resumed(served, job_id, uninterrupted, all_kept=point in ("between", "mid_encode"))
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from exc


# ---- the kept batches are untrusted input ---------------------------------------------------------------------


def test_a_store_that_is_a_link_or_holds_links_is_never_followed(tmp_path):
    from examples.seedvr2.restore.batch_store import BatchRecord, BatchStore, StoreError, read_frames_file

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_text("{}")
    store = BatchStore(str(tmp_path / "result.mp4.seedvr2-batches"), (4, 6, 3), 5)
    os.symlink(outside, store.directory)
    assert not store.exists()  # a link to a folder is no store
    store.remove()
    assert not os.path.lexists(store.directory)
    assert (outside / "manifest.json").exists()  # the link went, not its target

    frames = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)
    store.create({"format": 1})
    store.write_batch(BatchRecord(0, 4, 2, frames, frames[:1]))
    store.write_batch(BatchRecord(1, 8, 4, frames, frames[:1]))
    assert store.finished(3) == (2, [])
    target = tmp_path / "secret.bin"
    os.replace(store._path("frames", 1), target)
    os.symlink(target, store._path("frames", 1))
    done, notes = store.finished(3)
    assert done == 1 and notes == ["frames-000001.bin is a link (never followed)"], notes
    store.drop_from(1)
    assert target.exists()  # the link was removed, not what it names

    # a header that claims frames of another size, or more frames than a batch holds, is refused before its frames
    # are read (a file someone made cannot make a rank read gigabytes)
    big = BatchStore(store.directory, (400, 600, 3), 5)
    with pytest.raises(StoreError, match=r"frames of shape \[4, 6, 3\], this run's are \[400, 600, 3\]"):
        big.read_batch(0)
    with pytest.raises(StoreError, match="holds 2 frames, a batch has at most 1"):
        read_frames_file(store._path("frames", 0), (4, 6, 3), 1)
    # a batch whose count of final frames disagrees with the batches before it is not trusted
    store.write_batch(BatchRecord(1, 8, 7, frames, frames[:1]))
    assert store.finished(3) == (1, ["frames-000001.bin says 7 frames are final after it, its batches hold 4"])


def test_the_records_new_fields_are_checked(tmp_path):
    from examples.seedvr2.serve.job_records import BadRecord, validate

    folder = tmp_path / ("a" * 32)
    good = {"id": "a" * 32, "state": "queued", "created": 1.0, "input": "input.mp4", "output": "result.mp4",
            "options": {}, "name": "clip.mp4", "frames": 41, "frames_done": 0, "frames_reused": 16,
            "batches_computed": 5}
    assert validate(good, str(folder), "a" * 32)["frames_reused"] == 16
    for key, value, said in (("frames_reused", "16", "not a count"), ("batches_computed", -1, "not a count"),
                             ("frames_reused", True, "not a count"), ("frames_reused", 42, "more than its 41 frames")):
        with pytest.raises(BadRecord, match=said):
            validate({**good, key: value}, str(folder), "a" * 32)


@pytest.mark.slow
@pytest.mark.multirank
def test_under_torchrun_a_killed_rank_takes_the_world_down_and_the_next_world_goes_on(media, tmp_path):  # noqa: F811
    """Rank 1 is SIGKILLed once batches were kept, under ``torchrun --max-restarts 1``: rank 0 queues the job again
    and exits, torchrun starts the world again on the same state folder, and the job goes on after its kept batches,
    to what ``restore`` writes on 2 ranks."""
    import socket

    with socket.socket() as free:  # a fixed port: the world started again listens on it again
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    served = Served(str(tmp_path), "--state-dir", tmp_path / "state", "--port", port, torchrun=2, restarts=1,
                    token=False)
    try:
        job_id = _running_past_batch(served, 3, media["long"])
        os.kill(served.torchrun_rank(1), signal.SIGKILL)
        served.listen(2)
        assert re.search(rf"job {job_id}: .*the world went down.*; queued again: it goes on after its kept batches",
                         served.text()), served.text()
        reference = _restore(media["long"], tmp_path / "ranks2.mp4", "--crf", 0, "--batch-frames", 5, ranks=2)
        _resumed(served, job_id, (reference, 10))
    finally:
        served.stop()


def test_a_jobs_store_of_other_settings_or_version_is_removed_and_the_job_starts_over(tmp_path):
    """``serve``'s jobs (``start_over``): nobody is there to pass ``--restart``, so kept batches that cannot be
    resumed are removed in one line and the run starts at its first batch; ``restore`` itself still refuses them."""
    from examples.seedvr2.restore.batch_store import BatchRecord, BatchStore, store_path
    from examples.seedvr2.restore.kept_batches import open_kept_batches
    from examples.seedvr2.restore.resume import ResumeRefused, manifest_for
    from examples.seedvr2.restore.temporal import plan_temporal_batches

    output = str(tmp_path / "result.mp4")
    plan = plan_temporal_batches(9, 5, 1)
    frames = np.zeros((4, 4, 6, 3), dtype=np.uint8)
    for kept, said in (({"seed": 7}, "--seed changed (kept batches: 7; this run: 1)"),
                       ({"seed": 1, "version": "0.0.1"}, "written by seedvr2 of winsp 0.0.1")):
        store = BatchStore(store_path(output))
        manifest = manifest_for({"seed": kept["seed"]})
        manifest["version"] = kept.get("version", manifest["version"])
        store.create(manifest)
        store.write_batch(BatchRecord(0, 4, 4, frames, frames[:1]))
        lines: list[str] = []

        def opened(start_over: bool, said_to: list = lines):
            return open_kept_batches(output=output, settings={"seed": 1}, plan=plan, frame_hw=(4, 6), overlap=1,
                                     writer=True, enabled=True, restart=False, gather_rows=None, say=said_to.append,
                                     start_over=start_over)

        with pytest.raises(ResumeRefused, match=re.escape(said)):
            opened(False)
        assert store.exists()  # restore: refused, nothing lost
        resumed = opened(True)
        assert resumed.first == 0 and not os.path.lexists(store.directory), lines
        assert len(lines) == 1 and said in lines[0] and lines[0].endswith(
            ": the kept batches were removed and the job starts over"), lines
        assert "--restart" not in lines[0]
