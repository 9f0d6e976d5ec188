"""Issue 40: what a new user meets first. Every mistake names its real cause in one line, before any slow work
(weights searched, models built); values that cannot mean what was typed are refused; a very large output is
refused unless asked for, with an up-front time estimate."""

from __future__ import annotations

import os
import pickle
import re

import pytest

pytest.importorskip("av")

from examples.seedvr2 import cli  # noqa: E402
from examples.seedvr2.cli import stages  # noqa: E402 - where the stages look up what the tests replace
from examples.seedvr2.cli.launcher import LaunchError, check_ranks  # noqa: E402
from tests.test_cli import PREFIX, _expect_error, golden_checkpoints, make_png  # noqa: E402


def _forbid(monkeypatch, name: str) -> None:
    """Make ``stages.<name>`` (slow work: weight search, model loading) fail the test if it is reached."""
    def reached(*args, **kwargs):
        raise AssertionError(f"{name} ran before the mistake was reported")
    monkeypatch.setattr(stages, name, reached)


def _no_weights_anywhere(monkeypatch, tmp_path) -> None:
    for name in ("SEEDVR2_HOME", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-cache"))
    monkeypatch.chdir(tmp_path)


def _only_line(capsys, argv, match: str) -> str:
    """Run ``argv``; exit code 2 and exactly one line on stderr (no WARNING or note before it) containing match."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert match in lines[0], lines[0]
    return lines[0]


# ---- errors that name the real cause ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, said", [(["clips/", "-o", "restored/"], "input folder not found: clips/"),
                                        (["clips", "-o", "restored"], "input not found: clips"),
                                        (["clips/"], "input folder not found: clips/")])
def test_missing_input_folder_is_named_not_the_output_extension(tmp_path, capsys, monkeypatch, argv, said):
    monkeypatch.chdir(tmp_path)
    line = _only_line(capsys, ["restore", *argv], said)
    assert "extension" not in line
    assert list(tmp_path.iterdir()) == []


def test_a_random_pth_given_as_the_dit_is_named_not_the_missing_vae(tmp_path, capsys, monkeypatch):
    import torch

    _no_weights_anywhere(monkeypatch, tmp_path)
    src = make_png(tmp_path / "in.png")
    torch.save({"a": torch.zeros(3)}, tmp_path / "random.pth")
    line = _only_line(capsys, ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint", tmp_path / "random.pth"],
                      "not a SeedVR2 DiT checkpoint")
    assert "random.pth" in line and "'a'" in line and "VAE" not in line


def test_a_missing_checkpoint_is_said_before_any_memory_warning(tmp_path, capsys, monkeypatch):
    """At 3840x2160 under 22 GiB the memory plan would choose tiles and say so loudly; the missing file comes first."""
    from examples.seedvr2.memory import limits as memory_limits

    monkeypatch.setattr(memory_limits, "usable_memory",
                        lambda device: memory_limits.MemoryLimit(22 * 2**30, "free RAM"))
    _forbid(monkeypatch, "load_models")
    src = make_png(tmp_path / "in.png")
    _only_line(capsys, ["restore", src, "-o", tmp_path / "o.png", "--resolution", "3840x2160", "--dit-checkpoint",
                        tmp_path / "nope.pth", "--vae-checkpoint", tmp_path / "nope2.pth"],
               f"--dit-checkpoint: file not found: {tmp_path / 'nope.pth'}")


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_checkpoint_that_would_run_code_is_refused_without_torchs_unsafe_advice(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    for name in ("dit.pth", "vae.pth"):
        (tmp_path / name).write_bytes(pickle.dumps({"w": _RunsCode()}, protocol=2))
    line = _expect_error(capsys, ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint", tmp_path / "dit.pth",
                                  "--vae-checkpoint", tmp_path / "vae.pth"], "not a plain tensor checkpoint",
                         tmp_path, keep={"in.png", "dit.pth", "vae.pth"})
    for advice in ("False", "Re-running", "trusted source", "safe_globals", "file an issue", "Check the documentation"):
        assert advice not in line, line
    assert "system" in line  # what was refused: the global it would have called


def test_read_error_reason_strips_the_advice_from_torchs_own_message(tmp_path):
    import torch

    from examples.seedvr2.checkpoints.file import read_error_reason

    path = tmp_path / "x.pth"
    path.write_bytes(pickle.dumps({"w": _RunsCode()}, protocol=2))
    with pytest.raises(pickle.UnpicklingError) as raised:
        torch.load(path, weights_only=True)
    assert "False" in str(raised.value)  # torch's text carries the advice to load with weights_only=False ...
    reason = read_error_reason(raised.value)
    assert "False" not in reason and "weights_only" not in reason and "\n" not in reason and reason  # ... not this


@pytest.mark.parametrize("content", [b"garbage" * 100, b""])
def test_garbage_text_embeddings_are_one_clean_line_before_the_models_load(tmp_path, capsys, monkeypatch, content):
    _forbid(monkeypatch, "load_models")
    src = make_png(tmp_path / "in.png")
    (tmp_path / "emb.safetensors").write_bytes(content)
    line = _only_line(capsys, ["restore", src, "-o", tmp_path / "o.png", "--text-embeds",
                               tmp_path / "emb.safetensors"], "not a readable safetensors file")
    assert "SafetensorError" not in line and "deserializing" not in line


def test_crf_is_checked_before_weights_are_searched(tmp_path, capsys, monkeypatch):
    _forbid(monkeypatch, "resolve_cli_weights")
    src = make_png(tmp_path / "in.png")
    for value in ("99", "-1", "x"):
        line = _only_line(capsys, ["restore", src, "-o", tmp_path / "o.mp4", "--crf", value], "--crf")
        assert "0 (lossless) to 51" in line


def test_bf16_checkpoint_that_does_not_fit_in_fp32_names_dtype_bf16(tmp_path, capsys, monkeypatch):
    """On a CPU without --dtype the run computes in fp32; when only that is what does not fit, the line says that
    --dtype bf16 fits. With --dtype fp32 given, no such hint."""
    import torch
    from safetensors.torch import save_file

    from examples.seedvr2.memory import limits as memory_limits

    dit_state, vae_state, _ = golden_checkpoints(monkeypatch)
    save_file({k: v.to(torch.bfloat16) for k, v in dit_state.items()}, str(tmp_path / "dit.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in vae_state.items()}, str(tmp_path / "vae.safetensors"))
    src = make_png(tmp_path / "in.png", h=128, w=128)
    base = ["restore", src, "-o", tmp_path / "o.png", "--dit-checkpoint", tmp_path / "dit.safetensors",
            "--vae-checkpoint", tmp_path / "vae.safetensors"]

    def frugal_need(dtype: str) -> float:  # the most frugal settings' need, read from the refusal at 1 byte
        monkeypatch.setattr(memory_limits, "usable_memory", lambda device: memory_limits.MemoryLimit(1, "told"))
        line = _only_line(capsys, base + ["--dtype", dtype], "nothing fits")
        value, unit = re.search(r"most frugal about ([\d.]+) (MiB|GiB)", line).groups()
        return float(value) * (2**20 if unit == "MiB" else 2**30)

    fp32, bf16 = frugal_need("fp32"), frugal_need("bf16")
    assert bf16 < fp32 - 2**20, (bf16, fp32)
    limit = int((fp32 + bf16) / 2)
    monkeypatch.setattr(memory_limits, "usable_memory", lambda device: memory_limits.MemoryLimit(limit, "told"))
    line = _only_line(capsys, base, "nothing fits")
    assert "add --dtype bf16, which fits" in line and "fp32" in line
    line = _only_line(capsys, base + ["--dtype", "fp32"], "nothing fits")
    assert "--dtype bf16" not in line


# ---- values that are refused --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1280*720", "1280:720", "+1280x720", "1280x-720"])
def test_resolution_with_another_separator_is_refused(tmp_path, capsys, text):
    src = make_png(tmp_path / "in.png")
    _only_line(capsys, ["restore", src, "-o", tmp_path / "o.png", "--resolution", text], "WIDTHxHEIGHT")


def test_resolution_accepts_an_x_either_case():
    from examples.seedvr2.media import parse_resolution

    assert parse_resolution("1280x720") == parse_resolution("1280X720") == parse_resolution(" 1280 x 720 ") == (720,
                                                                                                             1280)


def test_fp8_weights_with_shard_weights_are_refused_as_documented(tmp_path, capsys):
    src = make_png(tmp_path / "in.png")
    _only_line(capsys, ["restore", src, "-o", tmp_path / "o.png", "--weights", "fp8", "--shard-weights"],
               "--shard-weights cannot go with --weights fp8")


def test_ranks_limit_message_states_what_actually_runs():
    assert check_ranks("8", 0, 2) == 8  # 4 a core on 2 cores: allowed
    with pytest.raises(LaunchError) as refused:
        check_ranks("99", 0, 2)
    message = str(refused.value)
    assert "--ranks 8 at most" in message and "2 cores" in message
    assert check_ranks(re.search(r"--ranks (\d+) at most", message).group(1), 0, 2) == 8


def test_an_output_over_8k_is_refused_with_a_time_estimate_unless_allowed(tmp_path, capsys, monkeypatch):
    from examples.seedvr2.memory import limits as memory_limits

    _forbid(monkeypatch, "load_models")
    src = make_png(tmp_path / "in.png", h=64, w=96)  # --scale 100: 9600x6400, as the sample image gives
    line = _only_line(capsys, ["restore", src, "-o", tmp_path / "o.png", "--scale", "100"],
                      "the output would be 9600x6400, larger than 8K UHD (7680x4320)")
    assert "--allow-large-output" in line and re.search(r"takes about \d+m\d\ds \(61\.4 megapixel-frames\)", line)
    # allowed, it goes on to the memory plan (refused here by a small limit, so that nothing heavy runs)
    monkeypatch.setattr(memory_limits, "usable_memory", lambda device: memory_limits.MemoryLimit(2**30, "told"))
    _only_line(capsys, ["restore", src, "-o", tmp_path / "o.png", "--scale", "100", "--allow-large-output"],
               "nothing fits")
    # 8K itself is allowed without the flag
    _only_line(capsys, ["restore", src, "-o", tmp_path / "o.png", "--resolution", "7680x4320"], "nothing fits")
    # allowed and fitting, the estimate is said before the models load (stopped there: nothing heavy runs)
    monkeypatch.setattr(memory_limits, "usable_memory", lambda device: memory_limits.MemoryLimit(2**40, "told"))

    def stop(*args, **kwargs):
        raise cli.InputError("stopped where the models would load")

    monkeypatch.setattr(stages, "load_models", stop)
    assert cli.main(["restore", str(src), "-o", str(tmp_path / "o.png"), "--scale", "100",
                     "--allow-large-output"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"note: the output is 9600x6400, larger than 8K \(7680x4320\): at the speed measured on a "
                     r"2-core CPU its restore takes about \d+m\d\ds", err), err
    assert err.index("larger than 8K") < err.index("stopped where the models would load")


def test_time_estimate_follows_the_measured_rates():
    import torch

    from examples.seedvr2.media import plan_geometry

    geometry = plan_geometry((720, 1280))
    demo = cli.estimate_restore_time(geometry, 9, True, torch.device("cpu"))
    assert "about 1m02s (8.3 megapixel-frames)" in demo  # the demo's measured 62.2 s for 1280x720 x 9
    assert "at least" in cli.estimate_restore_time(geometry, 9, False, torch.device("cpu"))
    assert "no cuda speed has been measured" in cli.estimate_restore_time(geometry, 9, False, torch.device("cuda"))
