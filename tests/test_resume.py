"""A restore killed at any point resumes after its last finished temporal batch, and its output equals an
uninterrupted run's (issue 48): the store of finished batches (``examples.seedvr2.restore.batch_store``), the
resume decision (``examples.seedvr2.restore.resume``), and real runs SIGKILLed between batches, mid-batch, mid-write
of a batch and mid encode, on one rank and on one of two ranks.

The kill points are drawn at random (the seed is in every assertion's message); each run's pipeline says which
batches it computed (``tests/cli_with_kill.py``), so the tests count what was computed twice: at most one batch.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from examples.seedvr2.restore.batch_store import (  # noqa: E402
    STORE_SUFFIX,
    BatchRecord,
    BatchStore,
    StoreError,
    read_frames_file,
    store_path,
    write_frames_file,
)
from examples.seedvr2.restore.kept_batches import KeptBatches, ResumableBlender  # noqa: E402
from examples.seedvr2.restore.resume import Resume, ResumeRefused, check_disk, manifest_for, resume_point, run_settings  # noqa: E402
from examples.seedvr2.restore.temporal import plan_temporal_batches  # noqa: E402
from tests.cli_with_kill import KILL_HOOK  # noqa: E402
from tests.test_cli import PREFIX, REPO, make_mp4  # noqa: E402

PROG = "python -m examples.seedvr2:"

TIMEOUT = 240
FRAMES, BATCH, OVERLAP = 17, 5, 1  # 4 batches: frames 0-4, 4-8, 8-12, 12-16
PLAN = plan_temporal_batches(FRAMES, BATCH, OVERLAP)
#: the kill points' draw, printed with every failure; WINSP_TEST_SEED=S draws them as a failed run drew them
SEED = int(os.environ.get("WINSP_TEST_SEED") or random.SystemRandom().randrange(2**32))


# ---- the store ----------------------------------------------------------------------------------------------------


def _frames(n: int, value: int = 0) -> np.ndarray:
    rng = np.random.default_rng(value)
    return rng.integers(0, 256, size=(n, 4, 6, 3), dtype=np.uint8)


def test_a_frames_file_round_trips_and_a_flipped_byte_or_a_cut_is_caught(tmp_path):
    path = str(tmp_path / "f.bin")
    frames = _frames(3)
    write_frames_file(path, frames, {"index": 2})
    header, back = read_frames_file(path)
    assert header["index"] == 2 and header["frames"] == 3 and np.array_equal(back, frames)
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(StoreError, match="frame 2 of f.bin fails its checksum"):
        read_frames_file(path)
    open(path, "wb").write(bytes(data[:-7]))
    with pytest.raises(StoreError, match="holds .* bytes of frames"):
        read_frames_file(path)
    assert os.listdir(tmp_path) == ["f.bin"]  # no temporary file left by the writes


def test_a_write_that_fails_half_way_leaves_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "f.bin")

    class Boom(Exception):
        pass

    def parts():
        yield b"SVR2BAT1"
        raise Boom

    with pytest.raises(Boom):
        from examples.seedvr2.restore.batch_store import write_atomic

        write_atomic(path, parts())  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def _store_with(tmp_path, batches: int) -> BatchStore:
    store = BatchStore(str(tmp_path / ("o.mp4" + STORE_SUFFIX)))
    store.remove()  # a store made afresh (as --restart does): create() never replaces one
    store.create({"format": 1})
    out = 0
    for k in range(batches):
        out += 4
        store.write_batch(BatchRecord(k, 4 * (k + 1), out, _frames(4, k), _frames(1, 100 + k)))
    return store


def test_the_store_keeps_a_tail_per_batch_and_finds_the_resume_point(tmp_path):
    store = _store_with(tmp_path, 3)
    names = sorted(os.listdir(store.directory))
    assert names == ["frames-000000.bin", "frames-000001.bin", "frames-000002.bin", "manifest.json",
                     "tail-000000.bin", "tail-000001.bin", "tail-000002.bin"]
    assert store.finished(4) == (3, [])
    record = store.read_batch(2, tail=True)
    assert record.frames_out == 12 and np.array_equal(record.tail, _frames(1, 102))
    os.unlink(os.path.join(store.directory, "tail-000002.bin"))  # killed between a batch's frames and its tail
    assert store.finished(4)[0] == 2
    store = _store_with(tmp_path, 3)
    path = os.path.join(store.directory, "frames-000001.bin")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    done, notes = store.finished(4)
    assert done == 1 and len(notes) == 1 and "frames-000001.bin fails its checksum" in notes[0]


def _settings(tmp_path, **change) -> dict:
    src = tmp_path / "in.bin"
    if not src.exists():
        src.write_bytes(os.urandom(3 * 2**20))
    values = dict(input_path=str(src), model="3b", weights="demo", text_embeds=None, output_size=(32, 48),
                  work_size=(32, 48), frames=17, seed=42, batch_frames=5, overlap=1, dtype="float32",
                  vae_parallel="replicated", vae_tile=None, color_fix="none", sp_size=1)
    values.update(change)
    return run_settings(**values)


def test_a_changed_setting_or_version_is_refused_by_name_and_the_store_kept(tmp_path):
    store = BatchStore(str(tmp_path / ("o.mp4" + STORE_SUFFIX)))
    assert resume_point(store, manifest_for(_settings(tmp_path)), 4, restart=False, output_name="o.mp4").batches == 0
    store.write_batch(BatchRecord(0, 4, 4, _frames(4), _frames(1)))
    with pytest.raises(ResumeRefused, match=r"--seed changed \(kept batches: 42; this run: 7\)"):
        resume_point(store, manifest_for(_settings(tmp_path, seed=7)), 4, restart=False, output_name="o.mp4")
    with pytest.raises(ResumeRefused, match=r"--batch-frames changed \(kept batches: 5; this run: 9\)"):
        resume_point(store, manifest_for(_settings(tmp_path, batch_frames=9)), 4, restart=False, output_name="o.mp4")
    other = dict(manifest_for(_settings(tmp_path)), version="0.0.1")
    with pytest.raises(ResumeRefused, match=r"written by seedvr2 of winsp 0.1.0 \(store format 1\); this is winsp "
                                            r"0.0.1 \(store format 1\)"):
        resume_point(store, other, 4, restart=False, output_name="o.mp4")
    assert store.finished(4)[0] == 1  # nothing lost by the refusals
    with open(tmp_path / "in.bin", "r+b") as f:  # the input's last MiB changed, its size and time kept
        st = os.stat(tmp_path / "in.bin")
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    os.utime(tmp_path / "in.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ResumeRefused, match="the input file changed"):
        resume_point(store, manifest_for(_settings(tmp_path)), 4, restart=False, output_name="o.mp4")
    resume = resume_point(store, manifest_for(_settings(tmp_path)), 4, restart=True, output_name="o.mp4")
    assert resume.batches == 0 and store.finished(4)[0] == 0


def test_too_little_disk_is_refused_before_the_start(tmp_path, monkeypatch):
    store = BatchStore(str(tmp_path / ("o.mp4" + STORE_SUFFIX)))
    monkeypatch.setattr(BatchStore, "free_bytes", lambda self: 10 * 2**20)
    with pytest.raises(ResumeRefused, match=r"need up to .* GiB beside the output .* --no-resume-store"):
        check_disk(store, 1000, 720, 1280, 5, 63)
    check_disk(store, 1, 32, 48, 0, 1)


def test_a_full_disk_is_one_line_and_the_restore_goes_on(tmp_path, monkeypatch):
    store = BatchStore(str(tmp_path / ("o.mp4" + STORE_SUFFIX)))
    store.create({})
    lines = []
    kept = KeptBatches(store, Resume(), PLAN, say=lines.append)

    def full(self, record):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(BatchStore, "write_batch", full)
    blender = ResumableBlender()
    for batch in PLAN[:3]:
        final = list(blender.push(batch, torch.zeros(batch.num_frames, 4, 6, 3, dtype=torch.uint8), OVERLAP))
        kept.keep(batch, final, blender)
    assert len(lines) == 1 and "the disk filled while keeping batch 1 of 4" in lines[0], lines


def test_two_runs_on_one_output_never_share_or_remove_each_others_store(tmp_path):
    """Two runs writing the same -o both start with no store: the first to keep a batch claims the folder; the other
    says so in one line, keeps nothing, and leaves the folder alone (whether its output wins or loses the race); a run
    whose output lost the race removes only a store it made itself."""
    directory = str(tmp_path / ("o.mp4" + STORE_SUFFIX))
    runs = []
    for _ in range(2):
        store = BatchStore(directory)
        store.pending = {"format": 1}  # as resume_point leaves a fresh store: made with the first kept batch
        lines: list[str] = []
        runs.append((KeptBatches(store, Resume(), PLAN, say=lines.append), lines, ResumableBlender()))
    clip = torch.zeros(FRAMES, 4, 6, 3, dtype=torch.uint8)
    for batch in PLAN[:2]:
        for kept, _, blender in runs:
            kept.keep(batch, list(blender.push(batch, clip[batch.start:batch.stop], OVERLAP)), blender)
    (first, first_lines, _), (second, second_lines, _) = runs
    assert first.created and not first_lines
    assert not second.created and len(second_lines) == 1, second_lines
    assert "appeared while this run worked" in second_lines[0] and "keeps no batches" in second_lines[0]
    assert first.store.finished(len(PLAN))[0] == 2  # the first run's batches, untouched by the second
    with pytest.raises(FileExistsError):
        BatchStore(directory).create({"format": 1})
    second.discard_own()  # the second run lost the output: the folder is not its own
    assert first.store.finished(len(PLAN))[0] == 2
    second.complete()  # or won it: the first run's folder is still not its to remove
    assert first.store.finished(len(PLAN))[0] == 2
    first.discard_own()
    assert not os.path.lexists(directory)


def test_a_resumed_blender_continues_exactly(tmp_path):
    clip = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (FRAMES, 4, 6, 3), dtype=np.uint8))
    whole = ResumableBlender()
    expected = [f for b in PLAN for f in whole.push(b, clip[b.start:b.stop], OVERLAP)] + list(whole.finish())
    store = BatchStore(str(tmp_path / "s"))
    store.create({})
    first = ResumableBlender()
    kept = KeptBatches(store, Resume(), PLAN)
    for batch in PLAN[:2]:
        kept.keep(batch, list(first.push(batch, clip[batch.start:batch.stop], OVERLAP)), first)
    again = KeptBatches(store, Resume(batches=2), PLAN)
    blender = again.blender()
    frames = [torch.from_numpy(f.copy()) for f in again.replay()]
    frames += [f for b in PLAN[2:] for f in blender.push(b, clip[b.start:b.stop], OVERLAP)] + list(blender.finish())
    assert len(frames) == FRAMES and all(torch.equal(a, b) for a, b in zip(frames, expected, strict=True))


# ---- real runs, killed --------------------------------------------------------------------------------------------


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra)


def _args(src, out, crf) -> list[str]:
    return ["restore", str(src), "-o", str(out), "--demo", "--quiet", "--batch-frames", str(BATCH), "--overlap",
            str(OVERLAP), "--crf", str(crf)]


def _run(src, out, crf, point="none", n=0, rank=0, extra=()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.cli_with_kill", point, str(n), str(rank), *_args(src, out, crf), *extra]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


def _computed(stderr: str, rank=None) -> list[int]:
    """The batches (indices) a run's pipeline started, in order (on world rank ``rank`` alone, when given: torchrun
    gathers its ranks' stderr in one)."""
    starts = {b.start: b.index for b in PLAN}
    found = re.findall(r"computing batch at frame (\d+) on rank (\d+)\n", stderr)
    return [starts[int(start)] for start, on in found if rank is None or int(on) == rank]


def _decoded(path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_mp4(tmp_path_factory.mktemp("resume") / "in.mp4", t=FRAMES, h=32, w=48)


@pytest.fixture(scope="module")
def reference(clip, tmp_path_factory):
    """Uninterrupted runs' outputs, by crf: (bytes, decoded frames), each run the first time a test asks for it."""

    class Runs(dict):
        def __missing__(self, crf):
            out = tmp_path_factory.mktemp(f"ref{crf}") / "out.mp4"
            done = _run(clip, out, crf)
            assert done.returncode == 0, done.stderr
            assert _computed(done.stderr) == [0, 1, 2, 3]
            assert not os.path.exists(store_path(str(out)))  # removed once the output is complete
            self[crf] = (out.read_bytes(), _decoded(out))
            return self[crf]

    return Runs()


def _kill_and_resume(tmp_path, clip, reference, crf, point, n, what):
    out = tmp_path / "out.mp4"
    killed = _run(clip, out, crf, point, n)
    assert killed.returncode == -9, f"{what}: {killed.returncode} {killed.stderr[-2000:]}"
    assert not out.exists()
    resumed = _run(clip, out, crf)
    assert resumed.returncode == 0, f"{what}: {resumed.stderr[-2000:]}"
    first, second = _computed(killed.stderr), _computed(resumed.stderr)
    again = sorted(set(first) & set(second))
    assert sorted(set(first) | set(second)) == [0, 1, 2, 3], (what, first, second)
    assert len(again) <= 1, f"{what}: batches computed twice: {again} (killed run {first}, resumed {second})"
    data, frames = reference[crf]
    assert np.array_equal(_decoded(out), frames), what
    assert out.read_bytes() == data, f"{what}: the file differs from an uninterrupted run's"
    assert not os.path.exists(store_path(str(out))), what
    if 0 not in second:  # resumed from kept batches: the killed run's temporary output was removed with them
        assert os.listdir(tmp_path) == ["out.mp4"], (what, os.listdir(tmp_path))
    lines = [line for line in resumed.stderr.splitlines() if line.startswith(PROG)]
    reused = [line for line in lines if "resuming:" in line]
    if 0 not in second:
        assert len(reused) == 1 and "frames reused" in reused[0], (what, lines)
    return first, second, reused


# the default run: a kill after a kept batch (lossless) and one inside the encode (the default crf); the rest slow
_CASES = [(0, "between"), (23, "mid_encode")]
_SLOW_CASES = [(0, "mid_write"), (23, "mid_batch"), (23, "between"), (23, "mid_write"), (0, "mid_batch"),
               (0, "mid_encode")]


def _draw(point: str, tag, *, last_batch: bool = True) -> int:
    """N for ``point``, drawn from the seed and ``tag``: a frame of the encode (the last batch's flush included), or a
    batch (the last one only where ``last_batch``: a world of two then has only its encode left to lose)."""
    rng = random.Random(f"{SEED}-{tag}-{point}")
    if point == "mid_encode":
        return rng.randrange(FRAMES)
    return rng.randrange(len(PLAN) if last_batch else len(PLAN) - 1)


@pytest.mark.parametrize("crf,point", _CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in _SLOW_CASES])
def test_a_killed_restore_resumes_and_equals_an_uninterrupted_run(tmp_path, clip, reference, crf, point):
    n = _draw(point, crf)
    first, second, reused = _kill_and_resume(tmp_path, clip, reference, crf, point, n,
                                             f"SIGKILL {point} {n}, --crf {crf} (seed {SEED})")
    if point == "between":  # batches 0..n were kept: the resumed run starts after them
        assert second == list(range(n + 1, len(PLAN))), (n, second)
    if point == "mid_encode":  # every batch may be kept already: nothing computed twice but the last batch at most
        assert len(set(first) & set(second)) <= 1


def test_a_changed_setting_is_refused_a_corrupt_batch_redone_and_restart_starts_over(tmp_path, clip, reference):
    out = tmp_path / "out.mp4"
    assert _run(clip, out, 0, "between", 2).returncode == -9
    changed = _run(clip, out, 0, extra=["--seed", "7"])
    lines = [line for line in changed.stderr.splitlines() if line.startswith(PREFIX)]
    assert changed.returncode == 2 and len(lines) == 1, changed.stderr
    assert "--seed changed (kept batches: 666; this run: 7)" in lines[0] and "--restart" in lines[0], lines
    assert sorted(os.listdir(store_path(str(out))))[:3] == ["frames-000000.bin", "frames-000001.bin",
                                                           "frames-000002.bin"]  # nothing lost
    path = os.path.join(store_path(str(out)), "frames-000001.bin")
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x10
    open(path, "wb").write(bytes(data))
    redone = _run(clip, out, 0)
    assert redone.returncode == 0, redone.stderr
    notes = [line for line in redone.stderr.splitlines() if "checksum" in line]
    assert len(notes) == 1 and "frames-000001.bin fails its checksum" in notes[0], redone.stderr
    assert _computed(redone.stderr) == [1, 2, 3]
    assert out.read_bytes() == reference[0][0]
    out.unlink()
    assert _run(clip, out, 0, "between", 1).returncode == -9
    again = _run(clip, out, 0, extra=["--restart"])
    assert again.returncode == 0 and _computed(again.stderr) == [0, 1, 2, 3], again.stderr
    assert out.read_bytes() == reference[0][0]


def test_a_store_from_another_version_is_refused_by_name(tmp_path, clip):
    out = tmp_path / "out.mp4"
    assert _run(clip, out, 0, "between", 0).returncode == -9
    manifest = os.path.join(store_path(str(out)), "manifest.json")
    content = json.load(open(manifest))
    content["version"] = "0.0.1"
    json.dump(content, open(manifest, "w"))
    refused = _run(clip, out, 0)
    lines = [line for line in refused.stderr.splitlines() if line.startswith(PREFIX)]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "written by seedvr2 of winsp 0.0.1 (store format 1)" in lines[0], lines
    assert os.path.exists(os.path.join(store_path(str(out)), "frames-000000.bin"))


@pytest.mark.slow  # the default run passes --no-resume-store in tests/test_cli_untrusted.py
def test_no_resume_store_keeps_nothing(tmp_path, clip):
    out = tmp_path / "out.mp4"
    assert _run(clip, out, 0, "between", 0, extra=["--no-resume-store"]).returncode == 0  # never keeps: never killed
    assert sorted(os.listdir(tmp_path)) == ["out.mp4"]
    out.unlink()
    assert _run(clip, out, 0, "between", 0).returncode == -9
    done = _run(clip, out, 0, extra=["--no-resume-store"])  # ignores the kept batches, and removes them when done
    assert done.returncode == 0 and _computed(done.stderr) == [0, 1, 2, 3], done.stderr
    # (the killed process's temporary output, .out.<random>.partial.mp4, is left: no resume ran to remove it)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["out.mp4"]


# ---- two ranks ----------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(src, out, crf, point="none", n=0, rank=1, extra=()) -> list[subprocess.CompletedProcess]:
    """Both ranks of a world of 2 started as torchrun starts them (its environment), rank ``rank`` killed at
    ``point``; when one dies the other's next collective fails and it exits."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.cli_with_kill", point, str(n), str(rank),
                               *_args(src, out, crf), *extra], cwd=REPO,
                              env=_env(WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WINSP_COLLECTIVE_TIMEOUT="30"),
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) for r in range(2)]
    done = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=TIMEOUT)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, "", err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


#: the points of a world of 2 (rank 0 alone keeps the batches and encodes: its store and encode points are rank 0's)
_TWO_RANK_CASES = [("mid_batch", 1), ("mid_batch", 0), ("between", 0), ("mid_write", 0), ("mid_encode", 0)]


@pytest.mark.slow
@pytest.mark.parametrize("point,rank", _TWO_RANK_CASES)
def test_one_rank_of_two_killed_resumes_and_equals_an_uninterrupted_run(tmp_path, clip, point, rank):
    ref = tmp_path / "ref.mp4"
    whole = _two_ranks(clip, ref, 0)
    assert [p.returncode for p in whole] == [0, 0], whole[0].stderr + whole[1].stderr
    n = _draw(point, f"2-{rank}", last_batch=False)
    what = f"SIGKILL {point} {n} to rank {rank} of 2 (seed {SEED})"
    out = tmp_path / "out.mp4"
    killed = _two_ranks(clip, out, 0, point, n, rank)
    assert killed[rank].returncode == -9, what
    if point != "mid_encode":  # in the encode the other rank may have finished its part (and exited cleanly)
        assert killed[1 - rank].returncode != 0, what
    resumed = _two_ranks(clip, out, 0)
    assert [p.returncode for p in resumed] == [0, 0], what + resumed[0].stderr + resumed[1].stderr
    for r in range(2):  # both ranks agreed on the resume point: they computed the same batches
        assert _computed(resumed[r].stderr) == _computed(resumed[0].stderr), what
    first, second = _computed(killed[0].stderr), _computed(resumed[0].stderr)
    assert len(set(first) & set(second)) <= 1 and sorted(set(first) | set(second)) == [0, 1, 2, 3], (
        what, first, second)
    assert out.read_bytes() == ref.read_bytes(), what
    assert not os.path.exists(store_path(str(out)))


@pytest.mark.slow
@pytest.mark.parametrize("point,rank", [("mid_batch", 1), ("mid_batch", 0), ("between", 0)])
def test_two_temporal_groups_resume_after_a_killed_rank(tmp_path, clip, point, rank):
    """``--sp-size 1`` on 2 ranks: two temporal groups, each computing every other batch. A rank killed inside its
    batch or after a batch is kept: the resumed world goes on from the first batch not kept, and writes what an
    uninterrupted world of two groups writes. A kill costs one batch, or the two of its round where rank 0 (the one
    that keeps them) dies inside its own."""
    extra = ["--sp-size", "1"]
    ref = tmp_path / "ref.mp4"
    whole = _two_ranks(clip, ref, 0, extra=extra)
    assert [p.returncode for p in whole] == [0, 0], whole[0].stderr + whole[1].stderr
    assert sorted(_computed(whole[0].stderr) + _computed(whole[1].stderr)) == [0, 1, 2, 3]  # each batch once
    n = _draw(point, f"groups-{rank}", last_batch=False) % 2  # a group computes 2 of the 4 batches
    what = f"SIGKILL {point} {n} to rank {rank} of 2 temporal groups (seed {SEED})"
    out = tmp_path / "out.mp4"
    killed = _two_ranks(clip, out, 0, point, n, rank, extra=extra)
    assert killed[rank].returncode == -9, what
    resumed = _two_ranks(clip, out, 0, extra=extra)
    assert [p.returncode for p in resumed] == [0, 0], what + resumed[0].stderr + resumed[1].stderr
    first = _computed(killed[0].stderr) + _computed(killed[1].stderr)
    second = _computed(resumed[0].stderr) + _computed(resumed[1].stderr)
    assert sorted(set(first) | set(second)) == [0, 1, 2, 3] and len(second) == len(set(second)), (what, first, second)
    # rank 0 keeps the batches, in order: killed inside its own batch, the other group's batch of that round (computed,
    # not yet kept: it blends after rank 0's) is lost with it; any other kill costs one batch
    assert len(set(first) & set(second)) <= (2 if (point, rank) == ("mid_batch", 0) else 1), (what, first, second)
    assert out.read_bytes() == ref.read_bytes(), what
    assert not os.path.exists(store_path(str(out)))


def _launched(src, out, crf, spec: str) -> subprocess.CompletedProcess:
    """``restore --ranks 2`` with the kill hook's ``spec`` (``POINT:N:RANK:rank:MARKER``) in its ranks."""
    cmd = [sys.executable, "-m", "examples.seedvr2", *_args(src, out, crf), "--ranks", "2"]
    env = dict(_env(WINSP_TEST_KILL=spec), PYTHONPATH=KILL_HOOK + os.pathsep + REPO)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("point,rank", _TWO_RANK_CASES)
def test_one_rank_of_restores_two_killed_at_a_drawn_point_resumes(tmp_path, clip, point, rank):
    """``restore --ranks 2`` (the CLI's own launcher): a rank SIGKILLed at a drawn point; the launcher stops the other
    and says which rank died; the same command resumes and writes what an uninterrupted ``--ranks 2`` run writes."""
    marker = tmp_path / "killed"
    count = f"none:0:0:rank:{marker}"  # no kill: the ranks say which batches they compute
    ref = tmp_path / "ref.mp4"
    whole = _launched(clip, ref, 0, count)
    assert whole.returncode == 0 and _computed(whole.stderr, rank=0) == [0, 1, 2, 3], whole.stderr
    n = _draw(point, f"launcher-{rank}", last_batch=False)
    what = f"SIGKILL {point} {n} to rank {rank} of restore --ranks 2 (seed {SEED})"
    out = tmp_path / "out.mp4"
    killed = _launched(clip, out, 0, f"{point}:{n}:{rank}:rank:{marker}")
    assert killed.returncode == 2 and f"rank {rank} was killed by SIGKILL" in killed.stderr, (what, killed.stderr)
    assert marker.exists() and not out.exists(), what
    resumed = _launched(clip, out, 0, count)
    assert resumed.returncode == 0, (what, resumed.stderr)
    first, second = _computed(killed.stderr, rank=0), _computed(resumed.stderr, rank=0)
    assert len(set(first) & set(second)) <= 1 and set(first) | set(second) == {0, 1, 2, 3}, (what, first, second)
    assert out.read_bytes() == ref.read_bytes(), what
    assert not os.path.exists(store_path(str(out))), what


def test_ordered_results_skips_the_kept_batches_on_every_rank():
    from winsp.comm.temporal import build_temporal_mesh, ordered_results

    mesh = build_temporal_mesh()
    computed = []
    seen = list(ordered_results(mesh, 4, lambda i: computed.append(i) or torch.full((1,), i), first=2))
    assert computed == [2, 3] and [i for i, _ in seen] == [2, 3]
    assert list(ordered_results(mesh, 4, lambda i: torch.zeros(1), first=4)) == []
    with pytest.raises(ValueError, match=r"first must be in \[0, num_batches\] = \[0, 4\], got 5"):
        list(ordered_results(mesh, 4, lambda i: torch.zeros(1), first=5))


@pytest.mark.slow
def test_a_rank_of_the_launcher_killed_at_a_random_moment_resumes(tmp_path, clip):
    """``--ranks 2``: rank 1 SIGKILLed from outside at a random moment after a batch is kept; the launcher stops
    rank 0, and the same command resumes with every batch kept by then and writes what an uninterrupted run writes."""
    import signal
    import time

    from tests.test_faults import _rank_pids

    args = [sys.executable, "-m", "examples.seedvr2", *_args(clip, tmp_path / "ref.mp4", 0), "--ranks", "2"]
    whole = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "out.mp4"
    args = [sys.executable, "-m", "examples.seedvr2", *_args(clip, out, 0), "--ranks", "2"]
    proc = subprocess.Popen(args, cwd=REPO, env=_env(), stderr=subprocess.PIPE, text=True)
    store = store_path(str(out))
    delay = random.Random(f"{SEED}-launcher").uniform(0.0, 0.5)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(os.path.join(store, "tail-000000.bin")):
            assert proc.poll() is None and time.monotonic() < deadline, "no batch was kept before the end"
            time.sleep(0.02)
        time.sleep(delay)
        kept = len([n for n in os.listdir(store) if n.startswith("tail-")])
        os.kill(_rank_pids(proc.pid)[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode == 0:
        pytest.skip(f"the run finished before the kill ({delay:.2f}s after the first batch, seed {SEED})")
    assert proc.returncode == 2 and "rank 1 was killed by SIGKILL" in err, err
    resumed = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr
    reused = [line for line in resumed.stderr.splitlines() if "resuming:" in line]
    assert len(reused) == 1, resumed.stderr
    batches = int(reused[0].split("(")[1].split(" of ")[0])
    assert batches >= kept, (reused, kept, SEED)  # nothing kept before the kill was lost
    assert out.read_bytes() == (tmp_path / "ref.mp4").read_bytes(), SEED
    assert not os.path.exists(store)


@pytest.mark.slow
@pytest.mark.parametrize("point,rank", _TWO_RANK_CASES)
def test_under_torchrun_a_killed_rank_costs_one_batch_at_most(tmp_path, clip, point, rank):
    """torchrun's own ranks (``--standalone --nproc-per-node 2``): a rank SIGKILLed at a drawn point (inside a batch,
    after one is kept, half-way through keeping one, in the encode); torchrun stops the other; the same torchrun
    command resumes and writes what an uninterrupted torchrun run writes."""

    def torchrun(out, point="none", n=0) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "tests.cli_with_kill", point, str(n), str(rank), *_args(clip, out, 0)]
        return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)

    ref = tmp_path / "ref.mp4"
    whole = torchrun(ref)
    assert whole.returncode == 0, whole.stderr[-3000:]
    n = _draw(point, f"torchrun-{rank}", last_batch=False)
    out = tmp_path / "out.mp4"
    killed = torchrun(out, point, n)
    assert killed.returncode != 0, killed.stderr[-3000:]
    resumed = torchrun(out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # rank 0's batches (both ranks compute each batch; the other rank may have started the next one alone, waiting
    # in its first collective for a rank that is gone: started, never computed)
    first, second = _computed(killed.stderr, rank=0), _computed(resumed.stderr, rank=0)
    again = set(first) & set(second)
    assert len(again) <= 1 and set(first) | set(second) == {0, 1, 2, 3}, (point, n, first, second, SEED)
    assert not second or set(second) == set(range(min(second), len(PLAN)))  # from the resume point on
    assert out.read_bytes() == ref.read_bytes(), (point, n, SEED)
    assert not os.path.exists(store_path(str(out)))


def test_a_disk_too_small_is_refused_before_the_start_and_a_full_disk_is_one_line(tmp_path, clip, reference,
                                                                                  capsys, monkeypatch):
    from examples.seedvr2 import cli

    out = tmp_path / "out.mp4"
    argv = _args(clip, out, 0)
    monkeypatch.setattr(BatchStore, "free_bytes", lambda self: 1000)
    assert cli.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PROG)]
    assert len(lines) == 1 and "need up to" in lines[0] and "0.00 GiB free" in lines[0], lines
    assert os.listdir(tmp_path) == []  # refused before anything was written
    monkeypatch.undo()
    written = []

    def fills(self, record):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(record.index)
        original(self, record)

    original = BatchStore.write_batch
    monkeypatch.setattr(BatchStore, "write_batch", fills)
    assert cli.main(argv) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "disk filled" in line]
    assert len(notes) == 1 and "keeping batch 2 of 4" in notes[0] and "the restore goes on" in notes[0], notes
    assert out.read_bytes() == reference[0][0] and os.listdir(tmp_path) == ["out.mp4"]
