"""examples/seedvr2's shape: folders that are its layers, small modules, and the old module paths still working.

The layers' one-way order and the absence of import circles are checked by ``lint-imports`` (pyproject.toml).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "examples" / "seedvr2"


def _folders() -> list[Path]:
    return sorted(p.parent for p in ROOT.rglob("__init__.py"))


def test_no_module_over_600_lines_and_no_folder_over_12_modules():
    long = {str(p.relative_to(REPO)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines: {long}"
    crowded = {str(d.relative_to(REPO)): n for d in _folders() if (n := len(list(d.glob("*.py")))) > 12}
    assert not crowded, f"folders over 12 modules: {crowded}"


def test_every_folder_says_what_it_is():
    for folder in _folders():
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc, f"{folder.relative_to(REPO)}/__init__.py has no docstring"
        assert len(doc.splitlines()[0]) <= 120, folder


def test_every_folder_is_a_layer_of_the_contract():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c.get("containers") == ["examples.seedvr2"])
    assert contract["type"] == "layers"
    folders = {d.name for d in ROOT.iterdir() if (d / "__init__.py").exists()}
    assert folders == set(contract["layers"])
    assert contract["layers"][0] == "serve" and contract["layers"][-1] == "checkpoints"
    acyclic = [c for c in config["contracts"] if c["type"] == "acyclic_siblings"]
    assert any(c["ancestors"] == ["examples.seedvr2"] for c in acyclic)


@pytest.mark.parametrize("path", ["examples.seedvr2.cli", "examples.seedvr2.media", "examples.seedvr2.pipeline"])
def test_the_old_module_paths_still_name_every_old_name(path):
    old = importlib.import_module(path)
    assert old.MOVED, path
    for name, home in old.MOVED.items():
        assert getattr(old, name) is getattr(importlib.import_module(home), name), (path, name, home)
        assert name in dir(old)
    with pytest.raises(AttributeError, match=f"{path}.*no_such_name"):
        old.no_such_name


def test_the_old_paths_cover_the_names_users_import():
    from examples.seedvr2.cli import StageProgress, build_parser, main, plan_memory, run_restore
    from examples.seedvr2.cli.parser import build_parser as parser_home
    from examples.seedvr2.cli.restore import main as main_home
    from examples.seedvr2.media import MediaWriter, iter_frames, plan_geometry, probe_media
    from examples.seedvr2.media.writing import MediaWriter as writer_home
    from examples.seedvr2.pipeline import SeedVR2Pipeline, causal_frame_count, estimate_restore_bytes
    from examples.seedvr2.restore.pipeline import SeedVR2Pipeline as pipeline_home

    assert (main, build_parser, MediaWriter, SeedVR2Pipeline) == (main_home, parser_home, writer_home, pipeline_home)
    assert all(callable(f) for f in (StageProgress, plan_memory, run_restore, iter_frames, plan_geometry, probe_media,
                                     causal_frame_count, estimate_restore_bytes))


def test_the_launcher_and_the_old_cli_path_import_no_torch():
    """``python -m examples.seedvr2 --ranks N`` is a launcher that never imports torch; the old paths stay lazy."""
    code = ("import sys\n"
            "import examples.seedvr2.cli, examples.seedvr2.media\n"
            "from examples.seedvr2.cli.launcher import launch, wants_launcher\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
