"""The SeedVR2 CLI as users run it: live progress under a terminal (a pseudo-terminal here) and none when piped,
the short summary line with the true written size, and folders (several files, one broken, models loaded once)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time

import pytest

av = pytest.importorskip("av")

from examples.seedvr2.cli.progress import expected_calls, format_seconds, summary_line  # noqa: E402
from tests.test_cli import make_mp4, make_png, probe  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "python -m examples.seedvr2"
TIMEOUT = 300


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SEEDVR2_LAUNCHED")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra)


def _run(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", *map(str, args)], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


def _run_in_pty(*args) -> tuple[int, str]:
    """Run the CLI with stderr (and stdout) on a pseudo-terminal; returns (exit code, everything it drew)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "examples.seedvr2", "restore", *map(str, args)], cwd=REPO,
                            env=_env(TQDM_MININTERVAL="0", COLUMNS="120"), stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=TIMEOUT), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_mp4(tmp_path_factory.mktemp("clip") / "in.mp4", t=9, h=32, w=48)


BATCHES = ["--batch-frames", "5", "--overlap", "1"]  # 9 frames: 2 batches of 5 (one shared frame)


def test_progress_moves_within_batches_on_a_terminal(clip, tmp_path):
    code, drawn = _run_in_pty(clip, "-o", tmp_path / "o.mp4", *BATCHES)
    assert code == 0, drawn
    states = re.findall(r"restore (\d+)/(\d+) frames +(\d+)%\|[^|]*\| \[([\d:]+)<([\d:?]+)", drawn)
    assert states, drawn
    assert {total for _, total, _, _, _ in states} == {"9"}  # the clip's 9 frames, the shared one counted once
    done = [int(n) for n, _, _, _, _ in states]
    assert done == sorted(done)  # whole frames' worth of work: no fractions like 1.1/9
    percent = [int(p) for _, _, p, _, _ in states]
    assert set(percent) - {0, 56, 100}, percent  # it moved inside a batch (per VAE chunk / DiT step)
    assert percent == sorted(percent)
    for n, p in zip(done, percent, strict=True):  # the count and the percentage agree (never 0/9 frames 50%)
        assert abs(n - p * 9 / 100) < 1.05, (n, p, states)
    for line in drawn.split("\n"):  # the stage bar and the restore bar never draw over each other on one line
        kinds = ["bar" if "%|" in part else "stage" if re.search(r"\] \d/3 ", part) else "blank"
                 for part in line.split("\r") if part]
        for drawn_first, drawn_over in zip(kinds, kinds[1:], strict=False):
            assert {drawn_first, drawn_over} != {"bar", "stage"}, repr(line)  # only a cleared line between them
    assert "restore: batch" not in drawn  # no log lines on a terminal
    assert f"{PROG}: wrote " in drawn


def test_no_progress_when_piped_one_line_per_batch(clip, tmp_path):
    done = _run(clip, "-o", tmp_path / "o.mp4", *BATCHES)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "%|" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("restore: batch") and "% done" not in line]
    assert [line.split(",")[0] for line in lines] == ["restore: batch 1/2", "restore: batch 2/2"]
    assert [line.split(",")[1] for line in lines] == [" 5/9 frames", " 9/9 frames"]  # the shared frame once
    assert all("elapsed, ETA" in line for line in lines)
    quiet = _run(clip, "-o", tmp_path / "q.mp4", "--quiet", *BATCHES)
    assert quiet.returncode == 0 and "restore: batch" not in quiet.stderr and "%|" not in quiet.stderr


def test_a_single_long_batch_prints_progress_lines_when_piped(clip, tmp_path):
    """Within a batch, a line every SEEDVR2_PROGRESS_SECONDS (30 s unless set; 0 here: at every VAE chunk and DiT
    step), so a pipe or a log never waits a whole batch in silence."""
    done = subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", str(clip), "-o",
                           str(tmp_path / "o.mp4"), "--batch-frames", "9"], cwd=REPO,
                          env=_env(SEEDVR2_PROGRESS_SECONDS="0"), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("restore: batch 1/1")]
    within = [line for line in lines if "% done" in line]
    assert len(within) >= 3 and lines[-1].startswith("restore: batch 1/1, 9/9 frames"), done.stderr
    shares = [int(re.search(r"(\d+)% done", line).group(1)) for line in within]
    counts = [int(re.search(r", (\d+)/9 frames,", line).group(1)) for line in within]
    for count, share in zip(counts, shares, strict=True):  # one batch: its share is the clip's; they agree
        assert abs(count - share * 9 / 100) < 1.05, (count, share, within)
    assert shares == sorted(shares) and 0 < shares[0] and shares[-1] < 100


def test_the_closing_line_gives_the_whole_commands_time_with_its_stages(clip, tmp_path):
    started = time.time()
    done = _run(clip, "-o", tmp_path / "o.mp4", "--quiet", *BATCHES)
    wall = time.time() - started
    assert done.returncode == 0, done.stderr
    found = re.search(r"\| ([\d.]+)s \(start-up ([\d.]+), read ([\d.]+), load ([\d.]+), restore ([\d.]+)\), ",
                      done.stderr.strip().splitlines()[-1])
    assert found, done.stderr
    total, *stages = map(float, found.groups())
    assert abs(total - sum(stages)) <= 0.25  # the stages add up to the total (each rounded to 0.1 s)
    assert 0.5 * wall <= total <= wall + 0.1  # the command's own time, start-up included (not the 3 stages alone)


def test_the_wavefront_is_said_in_a_users_words():
    from examples.seedvr2.models.vae.wavefront import VAESplit, splits_in_words

    assert splits_in_words(VAESplit(2, 1), VAESplit(2, 1)) == "2 ranks pass chunks of frames along in time"
    assert splits_in_words(VAESplit(1, 2), VAESplit(1, 2)) == "each frame's rows split over 2 ranks"
    assert splits_in_words(VAESplit(1, 2), VAESplit(2, 1)) == (
        "encode: each frame's rows split over 2 ranks; decode: 2 ranks pass chunks of frames along in time")


def test_summary_line_is_short_and_states_the_written_size(tmp_path):
    src = make_png(tmp_path / "odd.png", h=33, w=49)  # an odd-sized image written as a (one-frame) H.264 video
    out = tmp_path / "o.mp4"
    done = _run(src, "-o", out, "--quiet")
    assert done.returncode == 0, done.stderr
    summary = done.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"{PROG}: wrote {out}: 50x34 (model at 48x32) |"), summary  # the size as encoded
    assert probe(out)[1:3] == (34, 50)
    assert len(summary) - len(str(out)) < 260  # with the whole command's time and its stages
    assert summary.count("SP") <= 1


def test_summary_line_formats():
    line = summary_line(PROG, "o.mp4", (242, 322), 45, "24 fps", weights="SeedVR2 3B", dtype="bf16", device="cuda",
                        world=4, sp=2, vae="height", batches=3, batch_frames=21, overlap=5, seconds=90.0,
                        peak_gib=20.5, stages={"start-up": 11.7, "read": 0.3, "load": 1.1, "restore": 76.9})
    assert "322x242, 45 frames, 24 fps" in line and "4 ranks, SP 2" in line
    # the whole command's wall time, then the stages in it
    assert "| 90.0s (start-up 11.7, read 0.3, load 1.1, restore 76.9), 0.50 frames/s" in line, line
    assert "batches 3x21, overlap 5" in line and "0.50 frames/s" in line and len(line) - len("o.mp4") < 260
    assert "(model at" not in line  # said only when the model ran at another size
    assert "(model at 320x240)" in summary_line(PROG, "o.png", (242, 322), 1, None, weights="DEMO 3B", dtype="fp32",
                                                device="cpu", world=1, sp=1, vae="replicated", batches=1,
                                                batch_frames=1, overlap=0, seconds=1.0, peak_gib=0.3,
                                                work=(240, 320))
    assert format_seconds(42) == "42s" and format_seconds(185) == "3m05s" and format_seconds(7620) == "2h07m"
    assert expected_calls(21, steps=1) == {"encode": 5, "dit": 1, "decode": 5}
    assert expected_calls(1, steps=1, tiles=4) == {"encode": 4, "dit": 1, "decode": 4}


def test_a_folder_of_three_mixed_files_one_broken(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    make_mp4(folder / "a.mp4", t=5, h=32, w=48)
    make_png(folder / "b.png", h=32, w=48)
    (folder / "c.mp4").write_bytes(b"not a video" * 50)
    (folder / "notes.txt").write_text("skipped: not media")
    out = tmp_path / "restored"
    done = _run(folder, "-o", out, "--quiet")
    assert done.returncode == 2, done.stderr
    assert sorted(os.listdir(out)) == ["a.mp4", "b.png"]
    assert probe(out / "a.mp4")[:3] == (5, 32, 48)
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "c.mp4" in errors[0]
    assert done.stderr.count("DEMO weights") == 1  # the models were loaded once
    assert done.stderr.count(f"{PROG}: wrote ") == 2
    summary = done.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"{PROG}: restored 2 of 3 files into {out}") and "FAILED 1: c.mp4" in summary

    again = _run(folder, "-o", out, "--quiet")  # the outputs exist: refused per file without --overwrite
    assert again.returncode == 2 and "restored 0 of 3 files" in again.stderr
    assert again.stderr.count("pass --overwrite") == 2
    (folder / "c.mp4").unlink()
    replaced = _run(folder, "-o", out, "--quiet", "--overwrite")
    assert replaced.returncode == 0 and "restored 2 of 2 files" in replaced.stderr


@pytest.mark.slow  # several CLI processes; the folder itself is test_a_folder_of_three_mixed_files_one_broken
def test_folder_default_output_and_refusals(tmp_path):
    folder = tmp_path / "pics"
    folder.mkdir()
    make_png(folder / "x.png", h=16, w=16)
    done = _run(folder, "--quiet")
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "pics_restored") == ["x.png"]
    same = _run(folder, "-o", folder, "--quiet")
    assert same.returncode == 2 and "would replace the inputs" in same.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = _run(empty, "--quiet")
    assert nothing.returncode == 2 and "has no videos or images" in nothing.stderr
