"""Issue 40, the other commands: benchmark scripts refuse a missing input in one line and write under a folder they
are given (never the current directory), and no two restore commands of one document write the same output."""

from __future__ import annotations

import collections
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag, make, said", [
    ("--fit-vae", lambda d: d / "missing.json", "file not found"),
    ("--fit-wall", lambda d: d, "is a folder"),
    ("--fit-gloo", lambda d: (d / "bad.json").write_text("{not json") and d / "bad.json", "cannot read"),
])
def test_cost_model_refuses_a_bad_input_file_in_one_line(tmp_path, flag, make, said):
    path = make(tmp_path)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cost_model.py"), flag, str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cost_model.py: error: {flag}:") and said in lines[0], done.stderr
    assert str(path) in lines[0] and done.stdout == ""


def test_gpu_check_reports_go_to_a_folder_of_their_own(tmp_path, monkeypatch, capsys):
    gpu_check = _load("gpu_check")
    out = gpu_check.output_folder
    assert out(tmp_path / "given", True, {"OUT": "/elsewhere"}) == tmp_path / "given"
    assert out(None, True, {"OUT": str(tmp_path / "env")}) == tmp_path / "env"
    assert out(None, False, {}) == Path("gpu_check_out")
    dry = out(None, True, {})
    assert dry.is_dir() and dry.resolve() != Path.cwd().resolve() and dry.name.startswith("gpu_check_dry_run_")
    # the dry run without --out (one stand-in section that fails at once: the wiring, not the figures) leaves the
    # current folder empty
    def stand_in(*args):
        raise RuntimeError("stand-in section")

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(gpu_check, "SECTIONS", [("dit", stand_in)])
    assert gpu_check.main(["--dry-run", "--sections", "dit"]) == 1  # the section failed, as it was made to
    assert list(tmp_path.iterdir()) == []
    written = re.search(r"wrote (\S+gpu_check\.json) and (\S+gpu_check\.md)", capsys.readouterr().out)
    assert written and Path(written.group(1)).is_file() and Path(written.group(1)).parent.name.startswith(
        "gpu_check_dry_run_")


def _restore_outputs(text: str) -> list[str]:
    """The output each ``restore`` command of a document's bash blocks writes: ``-o``, else the default beside the
    input (``<input>_restored``)."""
    outputs = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in re.split(r"(?<!\\)\n", block):
            if "examples.seedvr2 restore" not in command:
                continue
            given = re.search(r"(?:-o|--output)[ =](\S+)", command)
            outputs.append(given.group(1) if given else "default for " + command.split(" restore ")[1].split()[0])
    return outputs


@pytest.mark.parametrize("document", ["README.md", "docs/seedvr2.md", "docs/memory.md", "docs/failures.md"])
def test_no_two_restore_commands_of_a_document_write_the_same_output(document):
    """Run one after the other, as a reader does, the second would be refused (the output exists)."""
    outputs = _restore_outputs((ROOT / document).read_text())
    twice = [path for path, n in collections.Counter(outputs).items() if n > 1]
    assert not twice, f"{document}: several commands write {twice}"
