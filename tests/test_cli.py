"""The command line ``python -m examples.seedvr2 restore`` on tiny generated inputs (embedded demo weights).

Real runs go through ``subprocess`` (single process, and 2 gloo ranks under ``torchrun``); the many bad-input cases
call ``cli.main`` in-process (same code path, same exit code and message, without paying a Python start each), and
two of them are repeated as real processes to prove the exit code and the absence of a traceback end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

av = pytest.importorskip("av")

from examples.seedvr2 import cli  # noqa: E402
from tests.media_files import write_clip_with_audio, write_truncated_faststart  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "python -m examples.seedvr2: error:"
RUN_TIMEOUT = 300


# ---- inputs, made with PyAV directly --------------------------------------------------------------------------------


def _frames(t: int, h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack(
        [np.stack([(x * 4 + i * 10) % 256, (y * 6) % 256, ((x + y) * 3) % 256], -1) for i in range(t)]
    ).astype(np.uint8)


def make_mp4(path, t=5, h=32, w=48, fps=Fraction(24)) -> str:
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for f in _frames(t, h, w):
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode(None))
    return str(path)


def make_png(path, h=32, w=48) -> str:
    with av.open(str(path), "w", format="image2", options={"update": "1"}) as c:
        s = c.add_stream("png")
        s.width, s.height, s.pix_fmt = w, h, "rgb24"
        c.mux(s.encode(av.VideoFrame.from_ndarray(_frames(1, h, w)[0], format="rgb24")))
        c.mux(s.encode(None))
    return str(path)


def probe(path) -> tuple[int, int, int, Fraction]:
    """(frames, height, width, fps) of a written file, decoded with PyAV."""
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
        return len(frames), frames[0].shape[0], frames[0].shape[1], Fraction(stream.average_rate or 0)


def run_cli(*args, nproc: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    if nproc == 1:
        cmd = [sys.executable, "-m", "examples.seedvr2", *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "examples.seedvr2", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)


def leftovers(directory, keep=()) -> list[str]:
    return sorted(set(os.listdir(directory)) - set(keep))


# ---- real runs ----------------------------------------------------------------------------------------------------


def test_restore_mp4_single_process(tmp_path):
    src = make_mp4(tmp_path / "in.mp4", fps=Fraction(24000, 1001))
    out = tmp_path / "out.mp4"
    result = run_cli("restore", src, "-o", out)
    assert result.returncode == 0, result.stderr
    assert probe(out) == (5, 32, 48, Fraction(24000, 1001))
    assert "DEMO" in result.stderr and "WARNING" in result.stderr  # says loudly that it is the demo
    summary = result.stderr.strip().splitlines()[-1]
    assert f"wrote {out}: 48x32, 5 frames, 23.976 fps |" in summary and "1 rank" in summary and "| 1 batch |" in summary
    assert "frames/s" in summary and "peak" in summary and len(summary) - len(str(out)) < 260
    assert leftovers(tmp_path, {"in.mp4", "out.mp4"}) == []


def test_restore_png_with_resolution_not_a_multiple_of_16(tmp_path):
    src = make_png(tmp_path / "in.png")
    out = tmp_path / "out.png"
    result = run_cli("restore", src, "-o", out, "--resolution", "70x40", "--color-fix", "wavelet", "--quiet")
    assert result.returncode == 0, result.stderr
    frames, h, w, _ = probe(out)
    assert (frames, h, w) == (1, 40, 70)
    assert f"wrote {out}: 70x40 (model at 64x32) |" in result.stderr and "colour wavelet |" in result.stderr


def test_restore_is_deterministic_for_a_seed(tmp_path):
    src = make_png(tmp_path / "in.png")
    a, b, c = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    for out, seed in ((a, 1), (b, 1), (c, 2)):
        assert cli.main(["restore", src, "-o", str(out), "--seed", str(seed), "--quiet"]) == 0
    read = lambda p: next(av.open(str(p)).decode(video=0)).to_ndarray(format="rgb24")  # noqa: E731
    assert np.array_equal(read(a), read(b))
    assert not np.array_equal(read(a), read(c))


@pytest.mark.multirank
@pytest.mark.parametrize("vae_parallel", ["replicated", pytest.param("height", marks=pytest.mark.slow),
                                          pytest.param("wavefront", marks=pytest.mark.slow)])
def test_restore_two_ranks_torchrun(tmp_path, vae_parallel):
    src = make_mp4(tmp_path / "in.mp4", t=5, h=32, w=48, fps=Fraction(12))
    single, double = tmp_path / "single.mp4", tmp_path / "double.mp4"
    result = run_cli("restore", src, "-o", double, "--vae-parallel", vae_parallel, "--scale", "1.5", "--crf", "0",
                     nproc=2)
    assert result.returncode == 0, result.stderr
    assert probe(double) == (5, 48, 72, Fraction(12))
    assert "2 ranks, SP 2" in result.stderr
    assert result.stderr.count("WARNING") == 1  # rank 0 speaks for both
    # same pixels as one process up to float rounding, compared in the samples lossless H.264 stored (--crf 0; a
    # lossy encoder would turn a one-level difference into larger ones through its rate-control decisions)
    assert cli.main(["restore", src, "-o", str(single), "--scale", "1.5", "--crf", "0", "--quiet"]) == 0
    assert_same_up_to_rounding(stored_samples(single), stored_samples(double))


@pytest.mark.slow  # the default run's budget; test_restore_two_ranks_torchrun covers torchrun
@pytest.mark.multirank
def test_image_two_ranks_torchrun(tmp_path):
    src = make_png(tmp_path / "in.png", h=48, w=32)
    out = tmp_path / "out.png"
    result = run_cli("restore", src, "-o", out, "--quiet", nproc=2)
    assert result.returncode == 0, result.stderr
    assert probe(out)[:3] == (1, 48, 32)


def decoded(path) -> tuple[np.ndarray, list[float], list[bytes]]:
    """(frames as int, frame times in seconds, coded audio packets) of a file."""
    with av.open(str(path)) as c:
        frames = [(f.to_ndarray(format="rgb24"), f.time) for f in c.decode(video=0)]
    with av.open(str(path)) as c:
        audio = [bytes(p) for p in c.demux(c.streams.audio[0]) if p.size] if c.streams.audio else []
    return np.stack([f for f, _ in frames]).astype(int), [t for _, t in frames], audio


def stored_samples(path) -> np.ndarray:
    """A yuv420p video's frames as the codec stored them (Y, then U and V, per frame), with no conversion to RGB."""
    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.pix_fmt == "yuv420p"
        return np.stack([f.to_ndarray(format="yuv420p") for f in c.decode(video=0)]).astype(int)


def assert_same_up_to_rounding(a: np.ndarray, b: np.ndarray) -> None:
    """Two restores of one clip agree up to float rounding: a few 8-bit values one step apart, in what lossless H.264
    stored. Why one step: a float-level difference moves a channel of the pipeline's uint8 frames by at most one; the
    BT.601 RGB->YUV weights of each plane sum to under 1 in absolute value (Y 0.86, U and V 0.88) and chroma averages
    2x2 pixels, so a stored sample moves by at most one too. (Decoding to RGB would multiply it by the YUV->RGB gains,
    1.16 for luma plus up to 2.02 for chroma, and a stored one-step difference could read as 4.)"""
    assert a.shape == b.shape
    diff = np.abs(a - b)
    assert diff.max() <= 1, f"{int((diff > 1).sum())} stored samples differ by more than one (max {diff.max()})"
    assert diff.mean() < 0.01


@pytest.mark.slow  # the default run's budget
@pytest.mark.multirank
def test_long_clip_streams_the_same_frames_single_process_and_4_ranks_sp_2(tmp_path):
    """A 160-frame clip with audio, in temporal batches (default 21 frames, overlap 5): one process, and
    ``torchrun --nproc-per-node 4 --sp-size 2`` (2 groups taking alternate batches, window SP 2 inside each), give the
    same frames up to float rounding (lossless H.264, --crf 0, so the codec adds nothing), keep the frame count, fps
    and timing, and copy the audio packets untouched."""
    src = write_clip_with_audio(tmp_path / "long.mp4", _frames(160, 32, 48), Fraction(24000, 1001))
    one, four = tmp_path / "one.mp4", tmp_path / "four.mp4"
    single = run_cli("restore", src, "-o", one, "--crf", "0")
    assert single.returncode == 0, single.stderr
    multi = run_cli("restore", src, "-o", four, "--crf", "0", "--sp-size", "2", nproc=4)
    assert multi.returncode == 0, multi.stderr
    summary = multi.stderr.strip().splitlines()[-1]
    assert "batches 10x21, overlap 5" in summary  # strides of 16 frames: 144 + 16 = 160
    assert "4 ranks, SP 2" in summary and "frames/s" in summary and "GiB/rank" in summary
    batch_lines = [line for line in multi.stderr.splitlines()
                   if line.startswith("restore: batch") and "% done" not in line]  # one line per finished batch
    assert [line.split(",")[0] for line in batch_lines] == [f"restore: batch {i}/5" for i in range(1, 6)]  # rank 0
    src_frames, src_times, src_audio = decoded(src)
    for out in (one, four):
        assert probe(out) == (160, 32, 48, Fraction(24000, 1001))
        _, times, audio = decoded(out)
        np.testing.assert_allclose(times, src_times, atol=1e-3)
        assert audio == src_audio and len(audio) > 10
    assert_same_up_to_rounding(stored_samples(one), stored_samples(four))


def test_stream_settings_are_checked_before_anything_runs(tmp_path, capsys):
    src = make_mp4(tmp_path / "in.mp4")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.mp4", "--batch-frames", "8"], "4n+1", tmp_path,
                  keep={"in.mp4"})
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.mp4", "--overlap", "21"], "--overlap", tmp_path,
                  keep={"in.mp4"})
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.mp4", "--sp-size", "2"],
                  "world size 1 must be a positive multiple", tmp_path, keep={"in.mp4"})
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.mp4", "--crf", "99"], "--crf", tmp_path,
                  keep={"in.mp4"})


def test_overlapping_batches_write_every_frame_once(tmp_path, capsys):
    """Two batches of 9 frames over 13 frames with --overlap 4: 13 frames written (the blend itself is checked
    against the batches in tests/test_temporal.py)."""
    src = make_mp4(tmp_path / "in.mp4", t=13)
    out = tmp_path / "o.mp4"
    assert cli.main(["restore", src, "-o", str(out), "--batch-frames", "9", "--overlap", "4", "--crf", "0",
                     "--quiet"]) == 0
    assert "batches 2x9, overlap 4" in capsys.readouterr().err
    assert probe(out)[0] == 13


# ---- bad input ----------------------------------------------------------------------------------------------------


def _expect_error(capsys, argv, match: str, directory, keep=()) -> str:
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:  # a usage error found by argparse (an option's type); same one-line contract
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert match in lines[0], lines[0]
    assert "Traceback" not in err
    assert leftovers(directory, keep) == [], "a (partial) output file was left behind"
    return lines[0]


def test_missing_input(tmp_path, capsys):
    _expect_error(capsys, ["restore", tmp_path / "nope.mp4", "-o", tmp_path / "o.mp4"], "not found", tmp_path)


def test_not_a_video(tmp_path, capsys):
    bad = tmp_path / "notes.mp4"
    bad.write_text("just some text\n" * 50)
    _expect_error(capsys, ["restore", bad, "-o", tmp_path / "o.mp4"], "not a readable video or image", tmp_path,
                  keep={"notes.mp4"})


def test_empty_file(tmp_path, capsys):
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    _expect_error(capsys, ["restore", empty, "-o", tmp_path / "o.mp4"], "input file is empty", tmp_path,
                  keep={"empty.mp4"})


def test_zero_frames(tmp_path, capsys):
    empty = tmp_path / "empty.mp4"
    with av.open(str(empty), "w") as c:  # a container whose video track never got a frame
        s = c.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
        c.start_encoding()
    _expect_error(capsys, ["restore", empty, "-o", tmp_path / "o.mp4"], "no video stream", tmp_path,
                  keep={"empty.mp4"})


def test_unreadable_stream(tmp_path, capsys):
    src = make_mp4(tmp_path / "in.mp4")
    data = bytearray(open(src, "rb").read())
    at = data.find(b"mdat")
    size = int.from_bytes(data[at - 4:at], "big")
    data[at + 4:at - 4 + size] = b"\x00" * (size - 8)  # keep the container, destroy the coded frames
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(bytes(data))
    _expect_error(capsys, ["restore", broken, "-o", tmp_path / "o.mp4"], "cannot decode", tmp_path,
                  keep={"in.mp4", "broken.mp4"})


def test_output_under_16_pixels(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--scale", "0.25"], "under the minimum of 16",
                  tmp_path, keep={"in.png"})
    small = make_png(tmp_path / "small.png", h=8, w=40)
    _expect_error(capsys, ["restore", small, "-o", tmp_path / "o.png"], "height 8 is under the minimum", tmp_path,
                  keep={"in.png", "small.png"})


@pytest.mark.parametrize("scale", ["0", "-1", "-2", "nan", "inf", "abc"])
def test_nonsensical_scale(tmp_path, capsys, scale):
    src = make_png(tmp_path / "in.png")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", f"--scale={scale}"], "--scale", tmp_path,
                  keep={"in.png"})


@pytest.mark.parametrize("text", ["big", "abc", "", "16x16x16", "1.5x20"])
def test_bad_resolution_string(tmp_path, capsys, text):
    src = make_png(tmp_path / "in.png")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--resolution", text], "WIDTHxHEIGHT",
                  tmp_path, keep={"in.png"})


def test_resolution_under_16_pixels(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--resolution", "10x10"],
                  "height 10 is under the minimum of 16", tmp_path, keep={"in.png"})


def test_scale_and_resolution_together_is_a_usage_error(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    with pytest.raises(SystemExit) as exc:
        cli.main(["restore", src, "-o", str(tmp_path / "o.png"), "--scale", "2", "--resolution", "64x64"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not allowed with argument" in err


def test_checkpoint_that_does_not_match(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    src = make_png(tmp_path / "in.png")
    dit_ckpt, vae_ckpt = tmp_path / "dit.safetensors", tmp_path / "vae.safetensors"
    save_file({"vid_in.proj.weight": torch.zeros(4, 4)}, str(dit_ckpt))
    save_file({"encoder.conv_in.weight": torch.zeros(2)}, str(vae_ckpt))
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint", dit_ckpt,
                                  "--vae-checkpoint", vae_ckpt], "--dit-checkpoint", tmp_path,
                         keep={"in.png", "dit.safetensors", "vae.safetensors"})
    assert "does not match" in line


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_garbage_checkpoint_file(tmp_path, capsys, suffix):
    src = make_png(tmp_path / "in.png")
    dit_ckpt, vae_ckpt = tmp_path / f"dit{suffix}", tmp_path / f"vae{suffix}"
    dit_ckpt.write_bytes(b"not a checkpoint")
    vae_ckpt.write_bytes(b"not a checkpoint")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint", dit_ckpt,
                           "--vae-checkpoint", vae_ckpt], "--dit-checkpoint", tmp_path,
                  keep={"in.png", dit_ckpt.name, vae_ckpt.name})


def golden_checkpoints(monkeypatch) -> tuple:
    """The golden tiny DiT and VAE state dicts (the reference layout, as released) and prompt embedding; the
    CLI's released configurations are patched to the tiny ones, so these stand in for the 3B checkpoints."""
    from safetensors import safe_open

    from examples.seedvr2.models.dit import NaDiTConfig
    from examples.seedvr2.models.vae import VideoVAEConfig
    from tests.test_pipeline import GOLDEN

    with safe_open(GOLDEN, "pt") as f:
        meta = f.metadata()
        dit_state = {k[4:]: f.get_tensor(k) for k in f.keys() if k.startswith("dit.")}
        vae_state = {k[4:]: f.get_tensor(k) for k in f.keys() if k.startswith("vae.")}
        txt = f.get_tensor("input.txt_pos").float()
    tiny_dit, tiny_vae = NaDiTConfig.from_metadata(meta["dit_config"]), VideoVAEConfig.from_metadata(meta["vae_config"])
    monkeypatch.setattr(NaDiTConfig, "seedvr2_3b", classmethod(lambda cls: tiny_dit))
    monkeypatch.setattr(VideoVAEConfig, "seedvr2", classmethod(lambda cls: tiny_vae))
    return dit_state, vae_state, txt


@pytest.mark.parametrize("model", ["dit", "vae"])
def test_checkpoint_with_one_wrong_key(tmp_path, capsys, monkeypatch, model):
    """A checkpoint that is right but for one renamed key is refused, naming both keys."""
    from safetensors.torch import save_file

    states = dict(zip(("dit", "vae"), golden_checkpoints(monkeypatch)[:2]))
    key = sorted(states[model])[0]
    states[model][key + "_renamed"] = states[model].pop(key)
    for name, state in states.items():
        save_file(state, str(tmp_path / f"{name}.safetensors"))
    src = make_png(tmp_path / "in.png")
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png",
                                  "--dit-checkpoint", tmp_path / "dit.safetensors",
                                  "--vae-checkpoint", tmp_path / "vae.safetensors"], f"--{model}-checkpoint",
                         tmp_path, keep={"in.png", "dit.safetensors", "vae.safetensors"})
    assert "missing keys: " + key in line and "unexpected keys: " + key + "_renamed" in line


def test_one_checkpoint_without_the_other(tmp_path, capsys, monkeypatch):
    """The other file is looked for (tests/test_weights_discovery.py); when it is not found, one line says which."""
    import torch

    src = make_png(tmp_path / "in.png")
    ckpt = tmp_path / "dit.pth"
    torch.save({"blocks.0.mlp.weight": torch.zeros(2), "encoder.conv_in.weight": torch.zeros(2)}, ckpt)
    for name in ("SEEDVR2_HOME", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-cache"))
    monkeypatch.chdir(tmp_path)
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint", ckpt],
                         "no SeedVR2 3B VAE found", tmp_path, keep={"in.png", "dit.pth"})
    assert "pass --vae-checkpoint" in line and str(ckpt) in line
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--vae-checkpoint", ckpt],
                         "no SeedVR2 3B DiT found", tmp_path, keep={"in.png", "dit.pth"})
    assert "pass --dit-checkpoint" in line


def test_text_embeddings_of_the_wrong_width(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    src = make_png(tmp_path / "in.png")
    embeds = tmp_path / "emb.safetensors"
    save_file({"pos": torch.zeros(5, 32)}, str(embeds))
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--text-embeds", embeds], "[tokens, 64]",
                  tmp_path, keep={"in.png", "emb.safetensors"})


def test_bad_output_paths(tmp_path, capsys):
    src = make_mp4(tmp_path / "in.mp4")
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.gif"], "unsupported output extension", tmp_path,
                  keep={"in.mp4"})
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png"], "5 frames", tmp_path, keep={"in.mp4"})
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "missing_dir" / "o.mp4"], "does not exist", tmp_path,
                  keep={"in.mp4"})


def test_failed_write_leaves_no_file(tmp_path, capsys, monkeypatch):
    from examples.seedvr2.media import writing as media

    def explode(self, frame, pts=None):
        raise media.MediaError("disk full (simulated)")

    monkeypatch.setattr(media.MediaWriter, "write", explode)
    src = make_mp4(tmp_path / "in.mp4")
    # no partial output; the finished batch is kept beside it (the same command resumes after it, see test_resume)
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.mp4", "--quiet"], "disk full", tmp_path,
                  keep={"in.mp4", "o.mp4.seedvr2-batches"})
    assert os.path.isfile(tmp_path / "o.mp4.seedvr2-batches" / "frames-000000.bin")


# ---- the CLI never loses data -------------------------------------------------------------------------------------


@pytest.mark.parametrize("link", ["same", "relative", "symlink", "hardlink"])
def test_output_that_is_the_input_is_refused(tmp_path, capsys, link, monkeypatch):
    src = make_mp4(tmp_path / "in.mp4")
    before = open(src, "rb").read()
    out = {"same": src, "relative": "in.mp4"}.get(link, tmp_path / "alias.mp4")
    monkeypatch.chdir(tmp_path)
    if link == "symlink":
        os.symlink(src, out)
    elif link == "hardlink":
        os.link(src, out)
    keep = {"in.mp4"} | ({"alias.mp4"} if link in ("symlink", "hardlink") else set())
    line = _expect_error(capsys, ["restore", src, "-o", out, "--overwrite"], "is the input", tmp_path, keep=keep)
    assert "same file, or a link" in line
    assert open(src, "rb").read() == before


def test_existing_output_needs_overwrite(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    out = tmp_path / "o.png"
    out.write_bytes(b"precious")
    _expect_error(capsys, ["restore", src, "-o", out], "--overwrite", tmp_path, keep={"in.png", "o.png"})
    assert out.read_bytes() == b"precious"
    assert cli.main(["restore", src, "-o", str(out), "--overwrite", "--quiet"]) == 0
    assert probe(out)[:3] == (1, 32, 48)


def test_default_output_goes_beside_the_input(tmp_path, capsys, monkeypatch):
    sub = tmp_path / "clips"
    sub.mkdir()
    src = make_mp4(sub / "walk.mp4")
    monkeypatch.chdir(tmp_path)  # not where the output goes
    assert cli.main(["restore", src, "--quiet"]) == 0
    assert "walk_restored.mp4" in capsys.readouterr().err
    assert sorted(os.listdir(sub)) == ["walk.mp4", "walk_restored.mp4"] and leftovers(tmp_path, {"clips"}) == []
    _expect_error(capsys, ["restore", src], "walk_restored.mp4 exists", sub, keep={"walk.mp4", "walk_restored.mp4"})


def test_short_decode_is_refused_unless_allowed(tmp_path, capsys):
    src = write_truncated_faststart(tmp_path / "half.mp4", _frames(40, 32, 48))
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.mp4"], "of the 40 frames", tmp_path,
                         keep={"half.mp4"})
    assert "--allow-partial-input" in line
    decodable = read_frames_count(src)
    assert 0 < decodable < 40
    assert cli.main(["restore", src, "-o", str(tmp_path / "o.mp4"), "--allow-partial-input", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and f"only {decodable} of the 40 frames" in err
    assert probe(tmp_path / "o.mp4")[0] == decodable


def read_frames_count(path) -> int:
    n = 0
    with av.open(str(path)) as c:
        try:
            for _ in c.decode(video=0):
                n += 1
        except av.FFmpegError:
            pass
    return n


def test_small_image_says_to_use_scale(tmp_path, capsys):
    small = make_png(tmp_path / "small.png", h=12, w=40)
    line = _expect_error(capsys, ["restore", small, "-o", tmp_path / "o.png"], "use --scale 1.34 or more", tmp_path,
                         keep={"small.png"})
    assert "the input is 40x12" in line
    assert cli.main(["restore", small, "-o", str(tmp_path / "o.png"), "--scale", "1.34", "--quiet"]) == 0


def test_alpha_input_says_what_was_dropped(tmp_path, capsys):
    src = tmp_path / "rgba.png"
    with av.open(str(src), "w", format="image2", options={"update": "1"}) as c:
        s = c.add_stream("png")
        s.width, s.height, s.pix_fmt = 48, 32, "rgba"
        c.mux(s.encode(av.VideoFrame.from_ndarray(_frames(1, 32, 48)[0], format="rgb24").reformat(format="rgba")))
        c.mux(s.encode(None))
    assert cli.main(["restore", str(src), "-o", str(tmp_path / "o.png"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "drops the alpha channel" in err


def test_odd_output_size_is_written_in_yuv420p_and_said(tmp_path, capsys):
    src = make_mp4(tmp_path / "in.mp4")
    out = tmp_path / "o.mp4"
    assert cli.main(["restore", src, "-o", str(out), "--resolution", "47x33", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "written as 48x34" in err
    with av.open(str(out)) as c:
        assert c.streams.video[0].codec_context.pix_fmt == "yuv420p"
    assert probe(out)[:3] == (5, 34, 48)


def test_oversized_request_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    from examples.seedvr2.memory import limits as memory_limits

    monkeypatch.setattr(memory_limits, "usable_memory",
                        lambda device: memory_limits.MemoryLimit(8 * 2**30, "free RAM"))
    src = make_png(tmp_path / "in.png")
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--resolution", "16000x16000",
                                  "--allow-large-output"], "nothing fits", tmp_path, keep={"in.png"})
    assert "8.0 GiB (free RAM) usable per rank" in line and "more ranks" in line and "--resolution" in line


def test_memory_check_uses_the_memory_it_is_told(tmp_path, capsys, monkeypatch):
    """With 4 MiB usable, a 128x128 png (well over 4 MiB of demo-VAE activations) is refused; with plenty it runs."""
    from examples.seedvr2.memory import limits as memory_limits

    monkeypatch.setattr(memory_limits, "usable_memory", lambda device: memory_limits.MemoryLimit(4 * 2**20, "told"))
    src = make_png(tmp_path / "in.png", h=128, w=128)
    _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png"], "4 MiB (told)", tmp_path, keep={"in.png"})
    monkeypatch.setattr(memory_limits, "usable_memory", lambda device: memory_limits.MemoryLimit(2**40, "told"))
    assert cli.main(["restore", src, "-o", str(tmp_path / "o.png"), "--quiet"]) == 0


@pytest.mark.parametrize("damage", ["random", "truncated_zip", "magic", "pickle"])
def test_every_unreadable_checkpoint_is_one_error_line(tmp_path, capsys, damage):
    import io
    import pickle

    import torch

    src = make_png(tmp_path / "in.png")
    good = io.BytesIO()
    torch.save({"w": torch.zeros(64, 64)}, good)
    data = {
        "random": bytes(np.random.default_rng(1).integers(0, 256, 999, dtype=np.uint8)),
        "truncated_zip": good.getvalue()[: len(good.getvalue()) // 2],
        "magic": b"XXXX" + good.getvalue()[4:],
        "pickle": pickle.dumps({"w": [1, 2, 3]})[:-3],
    }[damage]
    (tmp_path / "dit.pth").write_bytes(data)
    (tmp_path / "vae.pth").write_bytes(data)
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint", tmp_path / "dit.pth",
                                  "--vae-checkpoint", tmp_path / "vae.pth"], "--dit-checkpoint", tmp_path,
                         keep={"in.png", "dit.pth", "vae.pth"})
    assert "dit.pth" in line


@pytest.mark.parametrize("case", ["missing", "scale"])
def test_bad_input_as_a_real_process(tmp_path, case):
    src = make_png(tmp_path / "in.png")
    args = {"missing": ["restore", tmp_path / "nope.png", "-o", tmp_path / "o.png"],
            "scale": ["restore", src, "-o", tmp_path / "o.png", "--scale", "-1"]}[case]
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), result.stderr
    assert leftovers(tmp_path, {"in.png"}) == []


@pytest.mark.multirank
def test_bad_input_two_ranks_one_message(tmp_path):
    result = run_cli("restore", tmp_path / "nope.mp4", "-o", tmp_path / "o.mp4", nproc=2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1 and "not found" in errors[0]  # (torchrun then adds its own failure report)
    assert leftovers(tmp_path) == []


def test_checkpoint_path_end_to_end(tmp_path, capsys, monkeypatch):
    """With checkpoints (here: the golden tiny weights, standing in for the 3B ones) the CLI loads them strictly,
    applies the wavelet colour fix by default, and writes exactly what the pipeline computes."""
    import torch
    from safetensors.torch import save_file

    from examples.seedvr2.media.color_fix import wavelet_color_fix
    from examples.seedvr2.media import frames_to_model, model_to_frames, plan_geometry, read_media
    from examples.seedvr2.pipeline import SeedVR2Pipeline
    from examples.seedvr2.restore.temporal import clip_noise
    from tests.test_pipeline import build_golden_models

    dit_state, vae_state, txt = golden_checkpoints(monkeypatch)
    assert any(k.endswith("attn.rope.rope.freqs") for k in dit_state)  # the reference layout, as released
    dit_ckpt, vae_ckpt, embeds = tmp_path / "dit.pth", tmp_path / "vae.safetensors", tmp_path / "emb.safetensors"
    torch.save(dit_state, dit_ckpt)
    save_file(vae_state, str(vae_ckpt))
    save_file({"pos": txt.to(torch.bfloat16), "neg": torch.zeros(3, 64)}, str(embeds))

    src = make_png(tmp_path / "in.png", h=40, w=56)
    out = tmp_path / "out.png"
    code = cli.main(["restore", src, "-o", str(out), "--dit-checkpoint", str(dit_ckpt), "--vae-checkpoint",
                     str(vae_ckpt), "--text-embeds", str(embeds), "--seed", "5", "--resolution", "56x40", "--quiet"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "WARNING" not in err and "colour wavelet" in err and "model at 48x32" in err

    dit, vae = build_golden_models()
    media = read_media(src)
    geometry = plan_geometry((40, 56), resolution=(40, 56))
    video = frames_to_model(media.frames, geometry)
    restored = SeedVR2Pipeline(dit, vae).restore(video, txt.to(torch.bfloat16).float(),
                                                noise=clip_noise(5, 0, 1, (4, 6), 16))
    fixed = wavelet_color_fix(restored.transpose(0, 1), video.transpose(0, 1)).transpose(0, 1)
    expected = model_to_frames(fixed, geometry)
    written = read_media(out).frames
    assert written.shape == (1, 40, 56, 3)
    assert np.abs(written.astype(int) - expected.astype(int)).max() <= 1


def test_height_sharding_needs_a_latent_row_per_rank(tmp_path):
    """Checked before any model is built or any collective runs (so every rank fails the same way)."""
    import torch

    src = make_png(tmp_path / "in.png", h=16, w=48)
    args = cli.build_parser().parse_args(["restore", src, "-o", str(tmp_path / "o.png"), "--vae-parallel", "height"])
    launch = cli.Launch(rank=0, world_size=3, device=torch.device("cpu"))
    with pytest.raises(cli.InputError, match="2 rows for 3 ranks"):
        cli.run_restore(args, launch, cli.StageProgress(cli.STAGES, enabled=False))
    assert leftovers(tmp_path, {"in.png"}) == []


# ---- options checked against the real input ----------------------------------------------------------------------


def test_scale_is_checked_against_the_real_input(tmp_path, capsys, monkeypatch):
    """--scale 0.2 of 192x128 is 38x26 (allowed); --scale 300 of 32x32 is 9600x9600 (allowed: the memory check is
    what refuses it here, naming that size); the hints are computed from the input."""
    from examples.seedvr2.memory import limits as memory_limits

    wide = make_png(tmp_path / "wide.png", h=128, w=192)
    assert cli.main(["restore", wide, "-o", str(tmp_path / "o.png"), "--scale", "0.2", "--quiet"]) == 0
    assert ": 38x26 (model at 32x16) |" in capsys.readouterr().err
    assert probe(tmp_path / "o.png")[1:3] == (26, 38)
    tiny = make_png(tmp_path / "tiny.png", h=32, w=32)
    monkeypatch.setattr(memory_limits, "usable_memory", lambda device: memory_limits.MemoryLimit(2**30, "told"))
    line = _expect_error(capsys, ["restore", tiny, "-o", tmp_path / "big.png", "--scale", "300",
                                  "--allow-large-output"], "nothing fits", tmp_path,
                         keep={"wide.png", "o.png", "tiny.png"})
    assert "at 9600x9600" in line and "pixels" not in line
    line = _expect_error(capsys, ["restore", tiny, "-o", tmp_path / "big.png", "--scale", "600"],
                         "output height 19200 is over the maximum of 16384", tmp_path,
                         keep={"wide.png", "o.png", "tiny.png"})
    assert "the input is 32x32: use --scale 512 or less" in line
    line = _expect_error(capsys, ["restore", wide, "-o", tmp_path / "small.png", "--scale", "0.1"],
                         "output height 13 is under the minimum", tmp_path, keep={"wide.png", "o.png", "tiny.png"})
    assert "the input is 192x128: use --scale 0.13 or more" in line


def test_batch_frames_longer_than_the_clip_is_clamped_and_said(tmp_path, capsys):
    src = make_mp4(tmp_path / "in.mp4", t=6)
    out = tmp_path / "o.mp4"
    assert cli.main(["restore", src, "-o", str(out), "--batch-frames", "100001", "--overlap", "8", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "note: --batch-frames 100001 is longer than the clip (6 frames): one batch of 6 frames (--batch-frames 9)" \
        in err
    summary = err.strip().splitlines()[-1]
    assert "| 1 batch |" in summary and ": 48x32, 6 frames" in summary and "100001" not in summary
    assert probe(out)[0] == 6


def test_summary_reports_the_batches_that_ran_for_an_image(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    assert cli.main(["restore", src, "-o", str(tmp_path / "o.png"), "--batch-frames", "21", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "| 1 batch |" in err.strip().splitlines()[-1]
    assert "note: --batch-frames 21 is longer than the clip (1 frame): one batch of 1 frame\n" in err


@pytest.mark.parametrize("color_fix", ["adain", "lab", "none"])
def test_every_color_fix_runs_and_is_said(tmp_path, capsys, color_fix):
    src = make_png(tmp_path / "in.png")
    assert cli.main(["restore", src, "-o", str(tmp_path / "o.png"), "--color-fix", color_fix, "--quiet"]) == 0
    assert f"colour {color_fix} |" in capsys.readouterr().err


def test_restore_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["restore", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--color-fix {wavelet,adain,lab,none}" in text and "Exit codes" in text
    for markup in ("``", ":mod:", ":func:", ":class:", ":meth:", "`"):
        assert markup not in text, f"reST markup {markup!r} in --help"
