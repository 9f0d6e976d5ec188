"""Weights discovery (examples/seedvr2/weights/discovery.py): every location, precedence, broken files, and the CLI's
use of it, on fake folders and fake Hugging Face cache layouts (small files, no network)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from examples.seedvr2.weights.discovery import (
    DIT_FILES,
    VAE_FILES,
    WeightsError,
    find_weights,
    resolve_cli_weights,
    search_folders,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _file(path, data: bytes = b"weights") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _hub_snapshot(hub, repo: str, files: dict, rev: str = "0123abc", main: bool = True) -> str:
    """A hub cache repository as huggingface_hub lays it out: blobs, snapshots/<rev>/<name> -> ../../blobs/<hash>,
    refs/main. A value of None makes a dangling link (an interrupted download)."""
    repo_dir = os.path.join(hub, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(repo_dir, "snapshots", rev)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(repo_dir, "blobs"), exist_ok=True)
    for i, (name, data) in enumerate(files.items()):
        blob = os.path.join(repo_dir, "blobs", f"{rev}{i:04d}")
        if data is not None:
            _file(blob, data)
        os.symlink(os.path.join("..", "..", "blobs", os.path.basename(blob)), os.path.join(snapshot, name))
    if main:
        _file(os.path.join(repo_dir, "refs", "main"), rev.encode())
    return snapshot


@pytest.fixture
def place(tmp_path):
    """An empty world: a working directory, a home, no SEEDVR2_HOME / HF variables."""
    cwd, home = tmp_path / "work", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    return str(cwd), {"HOME": str(home)}


def test_nothing_found(place):
    cwd, env = place
    found = find_weights(env=env, cwd=cwd)
    assert found.nothing and found.model == "3b"
    assert found.searched[0] == os.path.join(cwd, "ckpts")


def test_ckpts_folder(place):
    cwd, env = place
    dit = _file(os.path.join(cwd, "ckpts", "seedvr2_ema_3b.pth"))
    vae = _file(os.path.join(cwd, "ckpts", "ema_vae.pth"))
    found = find_weights(env=env, cwd=cwd)
    assert (found.model, found.dit, found.vae) == ("3b", dit, vae)
    assert "3B" in found.describe() and dit in found.describe() and vae in found.describe()


def test_seedvr2_home_and_the_7b(place, tmp_path):
    cwd, env = place
    home = str(tmp_path / "models")
    env = dict(env, SEEDVR2_HOME=home)
    dit = _file(os.path.join(home, "seedvr2_ema_7b_fp8_e4m3fn.safetensors"))
    vae = _file(os.path.join(home, "ema_vae_fp16.safetensors"))
    found = find_weights(env=env, cwd=cwd)
    assert (found.model, found.dit, found.vae) == ("7b", dit, vae)
    with pytest.raises(WeightsError, match="ckpts"):  # --model 3b: no 3B here (asked through the CLI resolution)
        resolve_cli_weights(_args(model="3b"), env=env, cwd=cwd)


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME", "HOME"])
def test_hub_cache_locations(place, tmp_path, variable):
    cwd, env = place
    root = str(tmp_path / "hf")
    hub = {"HF_HUB_CACHE": root, "HF_HOME": os.path.join(root, "hub"),
           "HOME": os.path.join(root, ".cache", "huggingface", "hub")}[variable]
    env = dict(env, **{variable: root})
    snapshot = _hub_snapshot(hub, "ByteDance-Seed/SeedVR2-3B", {"seedvr2_ema_3b.pth": b"dit", "ema_vae.pth": b"vae"})
    found = find_weights(env=env, cwd=cwd)
    assert found.dit == os.path.join(snapshot, "seedvr2_ema_3b.pth")
    assert found.vae == os.path.join(snapshot, "ema_vae.pth")


def test_hub_refs_main_first_and_gguf_repacks(place, tmp_path):
    cwd, env = place
    hub = str(tmp_path / "hub")
    env = dict(env, HF_HUB_CACHE=hub)
    _hub_snapshot(hub, "cmeka/SeedVR2-GGUF", {"seedvr2_ema_7b-Q4_K_M.gguf": b"old"}, rev="aaa", main=False)
    new = _hub_snapshot(hub, "cmeka/SeedVR2-GGUF", {"seedvr2_ema_7b-Q4_K_M.gguf": b"new"}, rev="bbb")
    vae = _hub_snapshot(hub, "numz/SeedVR2_comfyUI", {"ema_vae_fp16.safetensors": b"vae"})
    found = find_weights(env=env, cwd=cwd)
    assert found.model == "7b"
    assert found.dit == os.path.join(new, "seedvr2_ema_7b-Q4_K_M.gguf")
    assert found.vae == os.path.join(vae, "ema_vae_fp16.safetensors")


def test_precedence(place, tmp_path):
    """./ckpts before $SEEDVR2_HOME before the hub cache; the 3B before the 7B; --model picks; released names before
    repacks within a folder."""
    cwd, env = place
    home, hub = str(tmp_path / "models"), str(tmp_path / "hub")
    env = dict(env, SEEDVR2_HOME=home, HF_HUB_CACHE=hub)
    _hub_snapshot(hub, "ByteDance-Seed/SeedVR2-3B", {"seedvr2_ema_3b.pth": b"d", "ema_vae.pth": b"v"})
    home_dit = _file(os.path.join(home, "seedvr2_ema_3b_fp16.safetensors"))
    seven = _file(os.path.join(cwd, "ckpts", "seedvr2_ema_7b.pth"))
    home_vae = _file(os.path.join(home, "ema_vae.pth"))
    found = find_weights(env=env, cwd=cwd)
    assert (found.model, found.dit, found.vae) == ("3b", home_dit, home_vae)  # a 3B anywhere beats the 7B
    assert find_weights("7b", env=env, cwd=cwd).dit == seven
    released = _file(os.path.join(home, "seedvr2_ema_3b.pth"))
    assert find_weights(env=env, cwd=cwd).dit == released
    ckpts = _file(os.path.join(cwd, "ckpts", "seedvr2_ema_3b-Q8_0.gguf"))
    assert find_weights(env=env, cwd=cwd).dit == ckpts


def test_names_lists():
    assert DIT_FILES["3b"][0] == "seedvr2_ema_3b.pth" and DIT_FILES["7b"][0] == "seedvr2_ema_7b.pth"
    assert "seedvr2_ema_7b_sharp.pth" in DIT_FILES["7b"] and "seedvr2_ema_3b_fp8_e4m3fn.safetensors" in DIT_FILES["3b"]
    assert VAE_FILES[0] == "ema_vae.pth" and "ema_vae_fp16.safetensors" in VAE_FILES


@pytest.mark.parametrize("broken", ["dangling", "empty", "folder"])
def test_a_broken_file_is_an_error_naming_it(place, tmp_path, broken):
    cwd, env = place
    hub = str(tmp_path / "hub")
    env = dict(env, HF_HUB_CACHE=hub)
    good = _hub_snapshot(hub, "ByteDance-Seed/SeedVR2-7B", {"seedvr2_ema_7b.pth": b"d", "ema_vae.pth": b"v"})
    path = os.path.join(cwd, "ckpts", "seedvr2_ema_3b.pth")
    os.makedirs(os.path.dirname(path))
    if broken == "dangling":
        os.symlink(os.path.join(cwd, "gone.pth"), path)
    elif broken == "empty":
        _file(path, b"")
    else:
        os.mkdir(path)
    with pytest.raises(WeightsError, match=path.replace(".", r"\.")):
        find_weights(env=env, cwd=cwd)
    assert good  # a good 7B elsewhere does not hide the broken 3B


def _args(**kw):
    base = dict(model=None, dit_checkpoint=None, vae_checkpoint=None, demo=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_resolution_for_the_cli(place):
    cwd, env = place
    args = _args()
    assert resolve_cli_weights(args, env=env, cwd=cwd) is None and args.dit_checkpoint is None  # demo
    dit = _file(os.path.join(cwd, "ckpts", "seedvr2_ema_3b.pth"))
    with pytest.raises(WeightsError, match="no SeedVR2 3B VAE found.*ema_vae.pth"):  # part of a set: an error
        resolve_cli_weights(_args(), env=env, cwd=cwd)
    vae = _file(os.path.join(cwd, "ckpts", "ema_vae.pth"))
    args = _args()
    line = resolve_cli_weights(args, env=env, cwd=cwd)
    assert (args.dit_checkpoint, args.vae_checkpoint, args.model, args.found_weights) == (dit, vae, "3b", True)
    assert line.startswith("weights: SeedVR2 3B")
    args = _args(dit_checkpoint="/x/my_seedvr2_ema_7b.safetensors")  # one flag: the other is found
    resolve_cli_weights(args, env=env, cwd=cwd)
    assert (args.vae_checkpoint, args.model) == (vae, "7b")
    args = _args(demo=True)
    assert resolve_cli_weights(args, env=env, cwd=cwd) is None and args.dit_checkpoint is None
    with pytest.raises(WeightsError, match="--demo"):
        resolve_cli_weights(_args(demo=True, dit_checkpoint=dit), env=env, cwd=cwd)


def _run(cwd, env, *args):
    env = dict({k: v for k, v in os.environ.items() if k not in ("SEEDVR2_HOME", "HF_HOME", "HF_HUB_CACHE")},
               OMP_NUM_THREADS="1", PYTHONPATH=REPO, **env)
    return subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_found_corrupt_file_is_one_line_naming_it(place):
    pytest.importorskip("av")
    from tests.test_cli import make_png

    cwd, env = place
    src = make_png(os.path.join(cwd, "in.png"))
    dit = _file(os.path.join(cwd, "ckpts", "seedvr2_ema_3b.pth"), b"not a checkpoint at all")
    _file(os.path.join(cwd, "ckpts", "ema_vae.pth"), b"nor this")
    done = _run(cwd, env, src, "-o", os.path.join(cwd, "out.png"))
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and dit in errors[0] and "Traceback" not in done.stderr
    assert "weights: SeedVR2 3B DiT " + dit in done.stderr  # the line saying which files were used
    assert not os.path.exists(os.path.join(cwd, "out.png"))


def test_cli_demo_fallback_says_how_to_get_weights(place):
    pytest.importorskip("av")
    from tests.test_cli import make_png

    cwd, env = place
    src = make_png(os.path.join(cwd, "in.png"), h=16, w=16)
    done = _run(cwd, env, src, "-o", os.path.join(cwd, "out.png"), "--quiet")
    assert done.returncode == 0, done.stderr
    assert "DEMO weights" in done.stderr and "ByteDance-Seed/SeedVR2-3B" in done.stderr


def test_search_folders_order(place, tmp_path):
    cwd, env = place
    env = dict(env, SEEDVR2_HOME=str(tmp_path / "m"))
    assert search_folders(env, cwd)[:2] == [os.path.join(cwd, "ckpts"), str(tmp_path / "m")]
