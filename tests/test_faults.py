"""The attack on ``--ranks``, folder input, weights discovery, checkpoints and ``--shard-weights`` (issue 38), case by
case: every failure is one line from rank 0 or the launcher, nothing partial is left, no process is left behind,
and nothing falls back silently. The signal cases run the real launcher and signal its real children by PID.

``R`` below is ``python -m examples.seedvr2 restore``; "rank k" is the launcher's child with ``RANK=k``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from fractions import Fraction

import pytest

av = pytest.importorskip("av")

from examples.seedvr2 import cli  # noqa: E402
from examples.seedvr2.cli import stages  # noqa: E402 - where the stages look up what the tests replace
from examples.seedvr2.cli.launcher import LAUNCHED_ENV, env_rank, launched_rank, wants_launcher  # noqa: E402
from tests.test_cli import PREFIX, REPO, _expect_error, leftovers, make_mp4, make_png  # noqa: E402
from tests.test_cli_stop import _rank_0_names_rank_1_stuck, _wait_for  # noqa: E402
from tests.test_launcher import _env, _torch_debug_log  # noqa: E402

TIMEOUT = 240
STOPPED = "python -m examples.seedvr2: stopped"


# ---- the real launcher and its real children ------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += _children(child)
    return out


def _rank_pids(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the launcher's children, from the ``RANK`` in each one's environment."""
    ranks = {}
    for child in _children(launcher):
        try:
            with open(f"/proc/{child}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = child
    return ranks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Launched:
    """``R ARGS --ranks N --quiet`` started in a session of its own (a Ctrl-C can go to its whole process group)."""

    def __init__(self, *args, ranks: int = 2, **env):
        self.proc = subprocess.Popen([sys.executable, "-m", "examples.seedvr2", "restore", *map(str, args), "--ranks",
                                      str(ranks), "--quiet"], cwd=REPO, env=_env(**env), stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.ranks = ranks
        self.seen: set[int] = set()  # every process of the run, to check that none outlives it

    def rank(self, k: int) -> int:
        _wait_for(lambda: len(self._note(_rank_pids(self.proc.pid))) == self.ranks or self.proc.poll() is not None,
                  TIMEOUT, "the ranks")
        return _rank_pids(self.proc.pid)[k]

    def _note(self, pids):
        self.seen.update(_descendants(self.proc.pid))
        return pids

    def finish(self) -> tuple[int, list[str], float]:
        """(exit code, stderr's lines less torch's own debug log and the demo's warning, seconds to exit)."""
        self.seen.update(_descendants(self.proc.pid))
        started = time.monotonic()
        try:
            _, err = self.proc.communicate(timeout=TIMEOUT)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        took = time.monotonic() - started
        _wait_for(lambda: not any(_alive(p) for p in self.seen), 10, "every process of the run to end")
        lines = [line for line in err.splitlines()
                 if line.strip() and "DEMO" not in line and not _torch_debug_log(line)]
        assert "Traceback" not in err, err
        return self.proc.returncode, lines, took


def _partial_exists(directory) -> bool:
    return any(".partial" in n for n in os.listdir(directory))


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory):
    """A clip that takes two ranks several batches (the output is being written for a while)."""
    return make_mp4(tmp_path_factory.mktemp("long") / "in.mp4", t=41, h=32, w=48, fps=Fraction(12))


def _mid_run(tmp_path, clip, **env) -> Launched:
    run = Launched(clip, "-o", tmp_path / "out.mp4", "--batch-frames", "5", "--overlap", "0", **env)
    run.rank(1)
    _wait_for(lambda: _partial_exists(tmp_path) or run.proc.poll() is not None, TIMEOUT, "the partial output")
    assert run.proc.poll() is None, "the restore ended before the fault"
    run.seen.update(_descendants(run.proc.pid))
    return run


# ---- 1-3: a rank killed, stopped alone, or stopped answering mid-run ---------------------------------------------


def test_1_rank_0_killed_leaves_no_partial_output(tmp_path, long_clip):
    run = _mid_run(tmp_path, long_clip)
    os.kill(run.rank(0), signal.SIGKILL)
    code, lines, _ = run.finish()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"{PREFIX} rank 0 was killed by SIGKILL"), lines
    assert "its partial output .out." in lines[0] and "removed" in lines[0], lines
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGQUIT, marks=pytest.mark.slow)],
                         ids=lambda s: s.name)
def test_2_a_signal_to_one_non_zero_rank_is_one_line(tmp_path, long_clip, signum):
    run = _mid_run(tmp_path, long_clip)
    os.kill(run.rank(1), signum)
    code, lines, _ = run.finish()
    assert code == 128 + signum, lines
    assert lines == [f"{STOPPED}: rank 1 was stopped by {signum.name} (sent to it alone); the other ranks were "
                     f"stopped"], lines
    assert leftovers(tmp_path) == []


@pytest.mark.slow  # waits out a collective timeout
def test_3_a_stopped_rank_is_named(tmp_path, long_clip):
    """SIGSTOP to rank 1: after the collective timeout rank 0's roll call names it, and the launcher prints that."""
    run = _mid_run(tmp_path, long_clip, WINSP_COLLECTIVE_TIMEOUT="3")
    os.kill(run.rank(1), signal.SIGSTOP)
    code, lines, took = run.finish()
    assert code == 2, lines
    _rank_0_names_rank_1_stuck(lines, "\n".join(lines))
    assert took < 60, took
    assert leftovers(tmp_path) == []


# ---- 5, 6: stopped during start-up -------------------------------------------------------------------------------


def test_5_ctrl_c_during_start_up_is_one_line_and_quick(tmp_path):
    """Ctrl-C reaches the terminal's whole process group: the launcher and its 3 ranks, while they import torch."""
    run = Launched(make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png", ranks=3)
    run.rank(2)
    sent = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    code, lines, _ = run.finish()
    assert code == 130, lines
    assert len(lines) == 1 and lines[0].startswith(f"{STOPPED} by SIGINT"), lines
    assert time.monotonic() - sent < 15
    assert leftovers(tmp_path, {"in.png"}) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)],
                         ids=lambda s: s.name)
def test_6_a_stop_signal_during_start_up_is_one_line(tmp_path, signum):
    run = Launched(make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png", ranks=3)
    run.rank(2)
    os.kill(run.proc.pid, signum)  # to the launcher, which forwards it
    code, lines, _ = run.finish()
    assert code == 128 + signum, lines
    assert len(lines) == 1 and lines[0].startswith(f"{STOPPED} by {signum.name}"), lines
    assert leftovers(tmp_path, {"in.png"}) == []


def test_6_a_stop_signal_to_one_rank_during_start_up_is_one_line(tmp_path):
    run = Launched(make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png")
    os.kill(run.rank(1), signal.SIGTERM)
    code, lines, _ = run.finish()
    assert code == 143, lines
    assert lines == [f"{STOPPED}: rank 1 was stopped by SIGTERM (sent to it alone); the other ranks were stopped"]
    assert leftovers(tmp_path, {"in.png"}) == []


# ---- 4: the launcher's port taken before rank 0 binds it ---------------------------------------------------------


@pytest.mark.slow  # the ranks start twice: about 20 s on the shared 2-core machine
def test_4_a_taken_port_is_retried(tmp_path):
    """The first port the launcher picks is held by another program (listening) when rank 0 binds it: the ranks are
    started again on another port and the run succeeds, with no traceback."""
    src = make_png(tmp_path / "in.png")
    out = tmp_path / "o.png"
    code = ("import socket, sys\n"
            "from examples.seedvr2.cli import launcher\n"
            "held = socket.socket(); held.bind(('127.0.0.1', 0)); held.listen()\n"
            "ports = [held.getsockname()[1]]\n"
            "free = launcher.free_port\n"
            "launcher.free_port = lambda: ports.pop() if ports else free()\n"
            f"sys.exit(launcher.launch(['restore', {str(src)!r}, '-o', {str(out)!r}, '--ranks', '2', '--quiet']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "EADDRINUSE" not in done.stderr, done.stderr
    assert out.exists() and leftovers(tmp_path, {"in.png", "o.png"}) == []


# ---- 7: a stray RANK, an inherited SEEDVR2_LAUNCHED ---------------------------------------------------------------


def test_7_a_stray_rank_without_a_world_is_ignored(tmp_path, capsys, monkeypatch):
    """``RANK=1`` without ``WORLD_SIZE`` describes no world: the process is rank 0 of 1 and speaks."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert env_rank() == 0
    _expect_error(capsys, ["restore", tmp_path / "in.png", "--crf", "abc"], "--crf", tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert env_rank() == 1


def test_7_sigterm_with_a_stray_rank_is_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "examples.seedvr2", "restore", make_png(tmp_path / "in.png"), "-o",
                             str(tmp_path / "o.png")], cwd=REPO, env=_env(RANK="1"), stderr=subprocess.PIPE,
                            text=True)
    time.sleep(0.3)  # importing torch
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 143, err
    assert err.splitlines() == [f"{STOPPED} by SIGTERM during start-up: nothing was written"], err


def test_7_an_inherited_launched_marker_is_ignored(tmp_path):
    """``SEEDVR2_LAUNCHED=1`` from a shell made ``--ranks`` run one rank; it now names the launcher's process id, so
    an inherited value is not taken for one (here the launcher itself answers ``--ranks 0``)."""
    assert launched_rank({LAUNCHED_ENV: str(os.getppid())}) and not launched_rank({LAUNCHED_ENV: "1"})
    assert wants_launcher(["restore", "a.mp4", "--ranks", "2"], env={LAUNCHED_ENV: "1"})
    done = subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", str(tmp_path / "in.png"), "--ranks",
                           "0"], cwd=REPO, env=_env(**{LAUNCHED_ENV: "1"}), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"{PREFIX} --ranks must be at least 1, got 0 (see python -m examples.seedvr2 restore --help)"], done.stderr


# ---- 8 (and issue 40): a bad checkpoint under --ranks N is one line ---------------------------------------------


def test_8_a_missing_checkpoint_is_refused_before_the_ranks_start(tmp_path):
    started = time.monotonic()
    run = Launched(make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png", "--dit-checkpoint",
                   tmp_path / "dit.safetensors", "--vae-checkpoint", tmp_path / "vae.safetensors", ranks=3)
    code, lines, _ = run.finish()
    assert code == 2 and lines == [f"{PREFIX} --dit-checkpoint: file not found: {tmp_path / 'dit.safetensors'}"]
    assert time.monotonic() - started < 10  # no rank started (each would import torch first)


def test_8_a_missing_input_is_refused_before_the_ranks_start(tmp_path):
    started = time.monotonic()
    run = Launched(tmp_path / "nope.mp4", "-o", tmp_path / "o.mp4", ranks=3)
    code, lines, _ = run.finish()
    assert code == 2 and lines == [f"{PREFIX} input file not found: {tmp_path / 'nope.mp4'}"], lines
    assert time.monotonic() - started < 10


def test_8_the_launcher_tells_inputs_from_option_values_as_the_parser_does():
    """preflight's torch-free tables hold every option of ``restore``, so that it never takes a value for an input."""
    from examples.seedvr2.cli.launcher import FLAG_OPTIONS, VALUE_OPTIONS, restore_inputs

    parser = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["restore"]
    takes_value = {o for a in parser._actions if a.option_strings and a.nargs != 0 for o in a.option_strings}
    flags = {o for a in parser._actions if a.option_strings and a.nargs == 0 for o in a.option_strings}
    assert (set(VALUE_OPTIONS), set(FLAG_OPTIONS)) == (takes_value, flags)
    argv = ["restore", "-o", "x", "--seed", "-3", "a.mp4", "b.png", "--scale=2", "--quiet", "--ranks", "2"]
    assert restore_inputs(argv) == ["a.mp4", "b.png"] == parser.parse_args(argv[1:]).input
    assert restore_inputs(["restore", "--out", "x", "a.mp4"]) is None  # an abbreviation: left to the parser
    assert restore_inputs(["restore", "a.mp4", "--quiet", "b.png"]) is None  # the parser refuses it
    assert restore_inputs(["restore", "a", "-o", "a", "b"]) is None


def test_8_a_bad_checkpoint_under_ranks_is_one_line_from_rank_0(tmp_path):
    dit, vae = tmp_path / "dit.safetensors", tmp_path / "vae.safetensors"
    dit.write_bytes(os.urandom(4096))
    vae.write_bytes(os.urandom(4096))
    run = Launched(make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png", "--dit-checkpoint", dit,
                   "--vae-checkpoint", vae)
    code, lines, _ = run.finish()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"{PREFIX} --dit-checkpoint {dit}: checkpoint"), lines
    assert "is not a readable safetensors file" in lines[0]
    assert leftovers(tmp_path, {"in.png", "dit.safetensors", "vae.safetensors"}) == []


# ---- 9-12: folders and several inputs ----------------------------------------------------------------------------


def _must_not_run(monkeypatch):
    """Nothing may be read or loaded: the refusal comes before anything runs."""
    from examples.seedvr2.media import reading as media

    def must_not_run(*args, **kwargs):
        raise AssertionError("read or loaded before the refusal")

    monkeypatch.setattr(media, "probe_media", must_not_run)
    monkeypatch.setattr(stages, "load_models", must_not_run)


def test_9_colliding_outputs_without_o_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """``R a.m4v a.ts --overwrite``: both would be written to ``a_restored.mp4`` (the second replacing the first)."""
    src = make_mp4(tmp_path / "a.m4v")
    os.link(src, tmp_path / "a.ts")
    _must_not_run(monkeypatch)
    line = _expect_error(capsys, ["restore", tmp_path / "a.m4v", tmp_path / "a.ts", "--overwrite"],
                         f"{tmp_path / 'a.m4v'} and {tmp_path / 'a.ts'} would both be written to "
                         f"{tmp_path / 'a_restored.mp4'}", tmp_path, keep={"a.m4v", "a.ts"})
    assert "restore them separately" in line


def test_9_an_output_that_is_another_input_is_refused(tmp_path, capsys, monkeypatch):
    make_png(tmp_path / "a.png")
    make_png(tmp_path / "a_restored.png")
    _must_not_run(monkeypatch)
    _expect_error(capsys, ["restore", tmp_path / "a.png", tmp_path / "a_restored.png", "--overwrite"],
                  f"the output {tmp_path / 'a_restored.png'} of {tmp_path / 'a.png'} is the input", tmp_path,
                  keep={"a.png", "a_restored.png"})


def test_9_colliding_outputs_in_a_folder_are_refused(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "in"
    folder.mkdir()
    make_mp4(folder / "a.m4v")
    make_mp4(folder / "a.ts")
    _must_not_run(monkeypatch)
    _expect_error(capsys, ["restore", folder], f"would both be written to {tmp_path / 'in_restored' / 'a.mp4'}",
                  tmp_path, keep={"in"})


def test_10_failing_names_with_escapes_and_newlines_are_printed_escaped(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("a\x1b[2J.mp4", "b\nc.mp4"):
        (folder / name).write_text("not a video\n")
    assert cli.main(["restore", str(folder), "-o", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err, err
    lines = err.splitlines()
    assert len(lines) == 3, err  # one error line a file, then the summary
    assert f"{folder}/a\\x1b[2J.mp4" in lines[0] and f"{folder}/b\\x0ac.mp4" in lines[1], lines
    assert lines[2].endswith("FAILED 2: a\\x1b[2J.mp4, b\\x0ac.mp4"), lines


def test_11_an_unreadable_input_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """A folder without read permission (simulated: root reads any folder) is named, not a PermissionError."""
    import examples.seedvr2.media.inputs as inputs

    folder = tmp_path / "in"
    folder.mkdir()
    listdir = os.listdir

    def refuse(path="."):
        if os.fspath(path) == str(folder):
            raise PermissionError(13, "Permission denied", str(folder))
        return listdir(path)

    monkeypatch.setattr(inputs.os, "listdir", refuse)
    _expect_error(capsys, ["restore", folder], f"cannot read the input folder {folder} (Permission denied)", tmp_path,
                  keep={"in"})


def test_11_an_unreadable_input_folder_for_real(tmp_path, capsys):
    """A folder whose name is a symbolic link loop (ELOOP even for root) is one line naming it."""
    from examples.seedvr2.media.inputs import media_in_folder
    from examples.seedvr2.media import MediaError

    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    with pytest.raises(MediaError, match=f"cannot read the input folder {loop}"):
        media_in_folder(str(loop))


@pytest.mark.parametrize("target", ["/proc/x", "/sys/x"])
def test_12_an_output_folder_that_cannot_be_created_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch,
                                                                                     target):
    folder = tmp_path / "in"
    folder.mkdir()
    make_png(folder / "a.png")
    _must_not_run(monkeypatch)
    _expect_error(capsys, ["restore", folder, "-o", target], f"cannot create the output folder {target}", tmp_path,
                  keep={"in"})


def test_12_an_output_folder_that_takes_no_files_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "in"
    folder.mkdir()
    make_png(folder / "a.png")
    _must_not_run(monkeypatch)
    _expect_error(capsys, ["restore", folder, "-o", "/proc"], "cannot write to the output directory /proc", tmp_path,
                  keep={"in"})


# ---- 13-15: weights discovery ------------------------------------------------------------------------------------


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A working directory and a Hugging Face cache of this test's own (no SEEDVR2_HOME, no other cache)."""
    for name in ("SEEDVR2_HOME", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    cwd = tmp_path / "work"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd, hub


def test_13_an_undecodable_refs_main_is_one_line_naming_it(world, capsys):
    from tests.test_weights_discovery import _hub_snapshot

    cwd, hub = world
    _hub_snapshot(str(hub), "ByteDance-Seed/SeedVR2-3B", {"seedvr2_ema_3b.pth": b"x", "ema_vae.pth": b"y"},
                  main=False)
    ref = hub / "models--ByteDance-Seed--SeedVR2-3B" / "refs" / "main"
    ref.parent.mkdir()
    ref.write_bytes(b"\xff\xfe\x80 not text")
    _expect_error(capsys, ["restore", make_png(cwd / "in.png")], f"the hub revision file {ref} does not hold a "
                  f"revision", cwd, keep={"in.png"})


def test_14_an_unreadable_snapshot_is_an_error_not_the_demo(world, capsys):
    """A snapshot that cannot be read (here a link loop, ELOOP even for root) was skipped, and the demo ran."""
    cwd, hub = world
    snapshots = hub / "models--ByteDance-Seed--SeedVR2-3B" / "snapshots"
    snapshots.mkdir(parents=True)
    os.symlink(snapshots / "abc", snapshots / "abc")
    _expect_error(capsys, ["restore", make_png(cwd / "in.png")], f"cannot read the weights snapshot "
                  f"{snapshots / 'abc'}", cwd, keep={"in.png"})


def test_14_a_folder_without_permission_is_an_error(world, monkeypatch):
    """``./ckpts`` (or a snapshot folder) that cannot be listed (simulated: root lists any folder)."""
    import examples.seedvr2.weights.discovery as discovery

    cwd, hub = world
    (cwd / "ckpts").mkdir()
    listdir = os.listdir

    def refuse(path="."):
        if os.fspath(path) == str(cwd / "ckpts"):
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(discovery.os, "listdir", refuse)
    with pytest.raises(discovery.WeightsError, match=f"cannot read the weights folder {cwd / 'ckpts'} "
                                                     r"\(Permission denied\)"):
        discovery.find_weights(cwd=str(cwd))


def test_15_the_plain_7b_anywhere_is_preferred_to_the_sharp_7b(world):
    from examples.seedvr2.weights.discovery import find_weights
    from tests.test_weights_discovery import _file, _hub_snapshot

    cwd, hub = world
    _file(cwd / "ckpts" / "seedvr2_ema_7b_sharp.pth")
    _file(cwd / "ckpts" / "ema_vae.pth")
    snapshot = _hub_snapshot(str(hub), "ByteDance-Seed/SeedVR2-7B", {"seedvr2_ema_7b.pth": b"plain"})
    found = find_weights(cwd=str(cwd), env={"HF_HUB_CACHE": str(hub)})
    assert (found.model, found.dit, found.vae) == ("7b", os.path.join(snapshot, "seedvr2_ema_7b.pth"),
                                                   str(cwd / "ckpts" / "ema_vae.pth"))
    assert find_weights("7b", cwd=str(cwd), env={"HF_HUB_CACHE": str(hub)}).dit == found.dit
    os.remove(os.path.join(snapshot, "seedvr2_ema_7b.pth"))  # no plain 7B anywhere: the sharp one
    assert find_weights(cwd=str(cwd), env={"HF_HUB_CACHE": str(hub)}).dit == str(cwd / "ckpts" /
                                                                                "seedvr2_ema_7b_sharp.pth")


# ---- 16, 17: a tensor of the wrong kind where a weight belongs ----------------------------------------------------


def _int8_dit(tmp_path, kind="int8") -> tuple[str, str]:
    """A small DiT file: one block bias of the released 3B's shape, stored as int8 (or bool); and a VAE file."""
    import torch
    from safetensors.torch import save_file

    from tests.streamed_checkpoint import manifest

    shapes = manifest("seedvr2_3b_dit")
    key = min((k for k in shapes if k.startswith("blocks.0.") and k.endswith(".bias")), key=lambda k: shapes[k])
    dit, vae = tmp_path / "dit.safetensors", tmp_path / "vae.safetensors"
    save_file({key: torch.zeros(shapes[key], dtype=getattr(torch, kind))}, str(dit))
    save_file({"x": torch.zeros(1)}, str(vae))
    return str(dit), key


@pytest.mark.parametrize("kind", ["int8", "bool"])
def test_16_an_integer_weight_is_one_line(tmp_path, capsys, kind):
    dit, key = _int8_dit(tmp_path, kind)
    line = _expect_error(capsys, ["restore", make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png",
                                  "--dit-checkpoint", dit, "--vae-checkpoint", tmp_path / "vae.safetensors"],
                         f"{key}: checkpoint {kind} where the model has float32", tmp_path,
                         keep={"in.png", "dit.safetensors", "vae.safetensors"})
    assert "dtypes the model cannot take" in line


def test_17_the_sharded_loader_refuses_what_the_whole_one_does_with_the_same_message(tmp_path):
    import torch

    from examples.seedvr2.models.dit import load_dit_checkpoint
    from examples.seedvr2.pipeline import released_models_on_meta
    from examples.seedvr2.weights.sharded import load_sharded_dit

    dit, key = _int8_dit(tmp_path)
    messages = []
    for load in (load_dit_checkpoint, lambda model, path: load_sharded_dit(model, path, None)):
        model, _ = released_models_on_meta("3b", torch.float32)
        with pytest.raises(ValueError) as info:
            load(model, dit)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and f"{key}: checkpoint int8 where the model has float32" in messages[0]


@pytest.mark.slow  # two ranks: about 20 s here
def test_17_shard_weights_under_ranks_refuses_an_integer_weight_in_one_line(tmp_path):
    dit, key = _int8_dit(tmp_path)
    run = Launched(make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png", "--dit-checkpoint", dit,
                   "--vae-checkpoint", tmp_path / "vae.safetensors", "--shard-weights")
    code, lines, _ = run.finish()
    assert code == 2 and len(lines) == 1 and f"{key}: checkpoint int8 where the model has float32" in lines[0], lines
    assert leftovers(tmp_path, {"in.png", "dit.safetensors", "vae.safetensors"}) == []


# ---- a raw pickle as --text-embeds ---------------------------------------------------------------------------------


def test_a_raw_pickle_text_embedding_is_exactly_one_line(tmp_path, capsys):
    import pickle

    embeds = tmp_path / "txt.pt"
    embeds.write_bytes(pickle.dumps({"pos": [1.0, 2.0]}, protocol=4))
    _expect_error(capsys, ["restore", make_png(tmp_path / "in.png"), "-o", tmp_path / "o.png", "--text-embeds",
                           embeds], f"refused to read text embeddings {embeds}: it is not a plain tensor file",
                  tmp_path, keep={"in.png", "txt.pt"})
    assert capsys.readouterr().err == ""


# ---- distributed checkpoints: a manifest, and no pickled code -------------------------------------------------------


class _RunsCode:
    """Unpickled, it creates ``path``: what a planted pickle would do (here harmless)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _state(seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}, "step": 7,
            "optim": {"lr": 0.01, "betas": (0.9, 0.99)}}


def _empty_state() -> dict:
    import torch

    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "step": 0, "optim": {"lr": 0.0, "betas": (0, 0)}}


def _forge_manifest(path) -> None:
    """Rewrite the manifest to match the folder as it is now (an attacker who can write the folder can do that)."""
    from winsp.runtime.checkpoint import _files, _sha256, _write_manifest

    _write_manifest(str(path), {n: (os.path.getsize(path / n), _sha256(str(path / n))) for n in _files(str(path))})


def test_a_checkpoint_round_trips_with_its_manifest(tmp_path):
    import json

    import torch

    import winsp

    winsp.save_checkpoint(_state(), tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / winsp.runtime.checkpoint.MANIFEST).read_text())
    assert set(manifest["files"]) == {n for n in os.listdir(tmp_path / "ckpt")} - {"winsp_manifest.json"}
    assert ".metadata" in manifest["files"] and all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    state = _empty_state()
    winsp.load_checkpoint(state, tmp_path / "ckpt")
    want = _state()
    assert torch.equal(state["model"]["w"], want["model"]["w"]) and torch.equal(state["model"]["b"], want["model"]["b"])
    assert state["step"] == 7 and state["optim"] == {"lr": 0.01, "betas": (0.9, 0.99)}


@pytest.mark.parametrize("forged", [False, True], ids=["manifest kept", "manifest forged"])
def test_a_planted_metadata_never_runs(tmp_path, forged):
    """A ``.metadata`` replaced by a pickle that runs code: refused by the manifest, and (manifest forged to match)
    by the unpickler, which builds only DCP's metadata classes. torch's own dcp.load would have run it."""
    import pickle

    import winsp

    ckpt, ran = tmp_path / "ckpt", tmp_path / "ran"
    winsp.save_checkpoint(_state(), ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(ran))))
    if forged:
        _forge_manifest(ckpt)
    with pytest.raises(winsp.CheckpointError) as info:
        winsp.load_checkpoint(_empty_state(), ckpt)
    message = str(info.value)
    assert "\n" not in message and "'.metadata'" in message and not ran.exists(), message
    assert ("is not DCP metadata" if forged else "replaced") in message


def test_a_non_tensor_value_that_unpickles_code_never_runs(tmp_path):
    """A checkpoint (with its manifest) whose non-tensor value unpickles code: torch's own ``dcp.load`` runs it (its
    planner reads such values with ``torch.load(weights_only=False)``); ``load_checkpoint`` reads them with
    ``weights_only=True`` and runs nothing."""
    import shutil

    import torch.distributed.checkpoint as dcp

    import winsp

    ckpt, ran = tmp_path / "ckpt", tmp_path / "ran"
    winsp.save_checkpoint(dict(_state(), step=_RunsCode(str(ran))), ckpt)
    with pytest.raises(winsp.CheckpointError, match="the value of 'step' is not plain data"):
        winsp.load_checkpoint(_empty_state(), ckpt)
    assert not ran.exists()
    shutil.copytree(ckpt, tmp_path / "copy")
    dcp.load(_empty_state(), checkpoint_id=str(tmp_path / "copy"), no_dist=True)
    assert ran.exists()  # what torch's own loader does with the same folder


def test_a_shard_swapped_in_from_another_run_is_refused(tmp_path):
    import winsp

    winsp.save_checkpoint(_state(0), tmp_path / "a")
    winsp.save_checkpoint(_state(1), tmp_path / "b")  # the same shapes, other values
    shard = next(n for n in os.listdir(tmp_path / "a") if n.endswith(".distcp"))
    os.replace(tmp_path / "b" / shard, tmp_path / "a" / shard)
    with pytest.raises(winsp.CheckpointError, match=f"'{shard}' is not the file that was saved"):
        winsp.load_checkpoint(_empty_state(), tmp_path / "a")


def test_a_folder_without_a_manifest_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    import winsp

    dcp.save(_state(), checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    with pytest.raises(winsp.CheckpointError, match="has no winsp_manifest.json: it was not written by "
                                                    "winsp.save_checkpoint"):
        winsp.load_checkpoint(_empty_state(), tmp_path / "plain")


def _dcp_two_ranks(rank: int, world: int, path: str) -> list[str]:
    """Save on two ranks (two shards), load; then swap in rank 1's shard of another run and load again."""
    import torch.distributed as dist

    import winsp

    outcomes = []
    for swap in (False, True):
        folder = os.path.join(path, f"swap{int(swap)}")
        winsp.save_checkpoint(_state(rank), os.path.join(folder, "a"))  # each rank's own values: two shards
        if swap:
            winsp.save_checkpoint(_state(10 + rank), os.path.join(folder, "b"))
            if rank == 0:
                os.replace(os.path.join(folder, "b", "__1_0.distcp"), os.path.join(folder, "a", "__1_0.distcp"))
        dist.barrier()
        try:
            winsp.load_checkpoint(_empty_state(), os.path.join(folder, "a"))
            outcomes.append("loaded")
        except winsp.CheckpointError as exc:
            outcomes.append(str(exc))
    return outcomes


def test_two_ranks_load_a_whole_checkpoint_and_agree_on_a_swapped_shard(tmp_path):
    from winsp.testing import run_ranks

    results = run_ranks(_dcp_two_ranks, 2, str(tmp_path), timeout=TIMEOUT)
    assert [r[0] for r in results] == ["loaded", "loaded"], results
    assert results[0][1] == results[1][1] and "'__1_0.distcp' is not the file that was saved" in results[0][1]
