"""The CLI's last failure paths (issue 30): inputs checked for what they are (3), no lost files (4), one line for
every failure (5), names from files escaped (7), a checkpoint directory named (8). Demo weights, tiny inputs.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

av = pytest.importorskip("av")

from examples.seedvr2 import cli  # noqa: E402
from examples.seedvr2.media import writing as media  # noqa: E402
from tests.test_cli import PREFIX, REPO, _expect_error, leftovers, make_mp4, make_png  # noqa: E402


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra)


# ---- (3) inputs checked for what they are -------------------------------------------------------------------------


def _embeds(tmp_path, value, name="txt.pth"):
    path = tmp_path / name
    torch.save(value, path)
    return path


@pytest.mark.parametrize("case, match", [
    ("nan", "has 6 non-finite values (NaN or inf) of 64"),
    ("inf", "has 1 non-finite values (NaN or inf) of 64"),
    ("complex", "must be a real floating-point tensor, got torch.complex64"),
    ("integer", "must be a real floating-point tensor, got torch.int64"),
    ("mixed_keys", "has keys that are not strings (1)"),
])
def test_text_embeddings_are_checked_for_what_they_are(tmp_path, capsys, case, match):
    """NaN embeddings made an all-black video with exit 0; complex ones only a torch warning; keys of mixed types a
    TypeError traceback. Each is now one line naming the file."""
    from examples.seedvr2.models.demo import DEMO_DIT_CONFIGS

    dim = DEMO_DIT_CONFIGS["3b"].txt_in_dim
    good = torch.randn(64 // dim, dim)
    value = {
        "nan": {"pos": good.masked_fill(torch.arange(good.numel()).reshape(good.shape) % 11 == 0, float("nan"))},
        "inf": {"pos": good.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("inf")))},
        "complex": {"pos": good.to(torch.complex64)},
        "integer": {"pos": good.long()},
        "mixed_keys": {1: good, "neg": good},
    }[case]
    path = _embeds(tmp_path, value)
    src = make_png(tmp_path / "in.png")
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--text-embeds", path], match, tmp_path,
                         keep={"in.png", "txt.pth"})
    assert str(path) in line


def test_a_dit_that_produces_nan_ends_the_run_naming_the_stage(tmp_path, capsys, monkeypatch):
    """Damaged weights (one NaN in the DiT) made a black video with exit 0; now one line, no output file."""
    from examples.seedvr2.models import demo

    build = demo.demo_models

    def damaged(*args, **kwargs):
        dit, vae = build(*args, **kwargs)
        with torch.no_grad():
            next(dit.parameters()).view(-1)[0] = float("nan")
        return dit, vae

    monkeypatch.setattr(demo, "demo_models", damaged)
    src = make_png(tmp_path / "in.png")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png"], "the DiT produced", tmp_path, keep={"in.png"})


def test_demo_vae_widths_hook(monkeypatch):
    """``SEEDVR2_DEMO_VAE_CHANNELS`` (a benchmark hook) gives the demo VAE those widths; unset, the tiny one."""
    from examples.seedvr2.models import demo

    monkeypatch.delenv(demo.DEMO_VAE_CHANNELS_ENV, raising=False)
    assert demo.demo_vae_config() == demo.DEMO_VAE_CONFIG
    monkeypatch.setenv(demo.DEMO_VAE_CHANNELS_ENV, "32,64,64,96")
    config = demo.demo_vae_config()
    assert config["block_out_channels"] == [32, 64, 64, 96] and config["norm_num_groups"] == 32
    _, vae = demo.demo_models()
    assert vae.config.block_out_channels == [32, 64, 64, 96]
    assert demo.DEMO_VAE_CONFIG["block_out_channels"] == [16, 16, 32, 32]  # the default is not modified


@pytest.mark.parametrize("value", ["128,256", "a,b,c,d", "0,16,16,16", "16,16,16,18"])
def test_demo_vae_widths_hook_refuses_bad_values_in_one_line(tmp_path, capsys, monkeypatch, value):
    monkeypatch.setenv("SEEDVR2_DEMO_VAE_CHANNELS", value)
    src = make_png(tmp_path / "in.png")
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png"], "SEEDVR2_DEMO_VAE_CHANNELS", tmp_path,
                         keep={"in.png"})
    assert repr(value) in line


# ---- (4) no lost files --------------------------------------------------------------------------------------------


def test_a_file_created_at_the_output_during_the_run_survives(tmp_path, capsys, monkeypatch):
    """The existence check runs at the start; a file that appears later was replaced. Now it is kept and the run
    exits 2 naming the path, its own output removed."""
    out = tmp_path / "out.png"
    write = media.MediaWriter.write

    def write_and_race(self, frame, pts=None):
        out.write_text("the user's file")
        return write(self, frame, pts)

    monkeypatch.setattr(media.MediaWriter, "write", write_and_race)
    src = make_png(tmp_path / "in.png")
    line = _expect_error(capsys, ["restore", src, "-o", out], f"the output {out} appeared while this run", tmp_path,
                         keep={"in.png", "out.png"})
    assert "--overwrite" in line and out.read_text() == "the user's file"


def test_with_overwrite_a_file_created_during_the_run_is_replaced(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.png"
    write = media.MediaWriter.write
    monkeypatch.setattr(media.MediaWriter, "write",
                        lambda self, frame, pts=None: (out.write_text("old"), write(self, frame, pts))[1])
    assert cli.main(["restore", make_png(tmp_path / "in.png"), "-o", str(out), "--overwrite", "--quiet"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert leftovers(tmp_path, {"in.png", "out.png"}) == []


@pytest.mark.parametrize("fallback", ["link", "exclusive_create"])
def test_no_replace_publish_fallbacks_keep_an_existing_file(tmp_path, monkeypatch, fallback):
    """Where renameat2 is missing (the hard-link path), and where hard links are too (the O_EXCL claim)."""
    import errno

    monkeypatch.setattr(media, "_renameat2", [None])
    if fallback == "exclusive_create":
        def no_links(src, dst):
            raise OSError(errno.EPERM, "no hard links here")
        monkeypatch.setattr(os, "link", no_links)
    target = tmp_path / "out.png"
    with media.atomic_output(target) as tmp:
        open(tmp, "w").write("first")
    assert target.read_text() == "first"
    with pytest.raises(media.MediaError, match="appeared while this run"):
        with media.atomic_output(target) as tmp:
            open(tmp, "w").write("second")
    assert target.read_text() == "first" and os.listdir(tmp_path) == ["out.png"]


@pytest.mark.slow
def test_two_runs_on_one_output_one_wins_the_other_exits_2(tmp_path):
    """Both pass the start-up check (nothing is there yet); both used to exit 0 with one output lost. Slow (two
    real runs side by side); the race itself is in the default run above (a file appearing mid-run)."""
    src = make_mp4(tmp_path / "in.mp4", t=9, h=32, w=48)
    out = tmp_path / "out.mp4"
    runs = [subprocess.Popen([sys.executable, "-m", "examples.seedvr2", "restore", src, "-o", str(out), "--quiet",
                              "--seed", str(seed)], cwd=REPO, env=_env(), stderr=subprocess.PIPE, text=True)
            for seed in (1, 2)]
    errs = [p.communicate(timeout=240)[1] for p in runs]
    codes = sorted(p.returncode for p in runs)
    if codes == [0, 0]:
        pytest.fail(f"both runs exited 0 on one output: {errs}")
    assert codes == [0, 2], errs
    loser = errs[[p.returncode for p in runs].index(2)]
    lines = [line for line in loser.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1 and f"the output {out} appeared while this run" in lines[0], loser
    assert leftovers(tmp_path, {"in.mp4", "out.mp4"}) == []


# ---- (5) one line for every failure -------------------------------------------------------------------------------


@pytest.mark.parametrize("store", [False, True], ids=["no-store", "store"])
def test_a_write_error_from_the_encoder_is_one_line(tmp_path, store):
    """A real write failure inside PyAV (the file-size limit: EFBIG, as a full disk gives ENOSPC) was a 51-line
    traceback with exit 1; now exit 2, one line naming the output, no partial file. With the batch store on (the
    default), the same limit first fails the keeping of the batch: one note says so and the restore goes on, to the
    encoder's one-line error; nothing is left behind."""
    src = make_mp4(tmp_path / "in.mp4", t=5, h=64, w=96)
    out = tmp_path / "out.mp4"

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of a core dump
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    done = subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", src, "-o", str(out), "--quiet",
                           "--crf", "0", *([] if store else ["--no-resume-store"])], cwd=REPO,
                          env=_env(PYTHONDONTWRITEBYTECODE="1"), capture_output=True, text=True, timeout=240,
                          preexec_fn=small_files)
    lines = [line for line in done.stderr.splitlines() if "WARNING" not in line]
    assert done.returncode == 2, done.stderr[-3000:]
    if store:
        note = PREFIX.removesuffix("error:") + "note: could not keep batch 1 of 1 for resuming (File too large)"
        assert len(lines) == 2 and lines[0].startswith(note), done.stderr
        assert "(a fault now starts over)" in lines[0], lines  # no batch kept: nothing to resume from
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith(f"{PREFIX} cannot write {out}: File too large"), done.stderr
    # no partial output, and no store folder: its one batch could not be kept, so there is nothing to resume from
    assert leftovers(tmp_path, {"in.mp4"}) == []


def test_sigint_during_start_up_is_one_line(tmp_path):
    """Ctrl-C while torch is being imported (the first seconds) was a KeyboardInterrupt traceback."""
    src = make_png(tmp_path / "in.png")
    proc = subprocess.Popen([sys.executable, "-m", "examples.seedvr2", "restore", src, "-o", str(tmp_path / "o.png")],
                            cwd=REPO, env=_env(), stderr=subprocess.PIPE, text=True)
    time.sleep(0.4)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m examples.seedvr2: stopped by SIGINT"), err
    assert leftovers(tmp_path, {"in.png"}) == []


# ---- (7) names from files escaped, (8) a directory named ----------------------------------------------------------


def test_checkpoint_key_names_are_escaped_in_the_error(tmp_path, capsys):
    from safetensors.torch import save_file

    src = make_png(tmp_path / "in.png")
    dit, vae = tmp_path / "dit.safetensors", tmp_path / "vae.safetensors"
    save_file({"\x1b]0;pwned\x07\x1b[2J": torch.zeros(2)}, str(dit))
    save_file({"encoder.conv_in.weight": torch.zeros(2)}, str(vae))
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint", dit,
                                  "--vae-checkpoint", vae], "--dit-checkpoint", tmp_path,
                         keep={"in.png", "dit.safetensors", "vae.safetensors"})
    assert r"unexpected keys: \x1b]0;pwned\x07\x1b[2J" in line and "\x1b" not in line, line


def test_printable_escapes_control_and_bidi_characters():
    from examples.seedvr2.cli.terminal_text import printable

    assert printable("a\x1b[2Jb\x07\u202ec\\") == "a\\x1b[2Jb\\x07\\u202ec\\"
    assert printable("plain text / ünïcödé") == "plain text / ünïcödé"


def test_checkpoint_that_is_a_directory_says_so(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    (tmp_path / "dit.safetensors").mkdir()
    vae = tmp_path / "vae.safetensors"
    vae.write_bytes(b"x")
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint",
                                  tmp_path / "dit.safetensors", "--vae-checkpoint", vae], "is a directory", tmp_path,
                         keep={"in.png", "dit.safetensors", "vae.safetensors"})
    assert "not found" not in line
