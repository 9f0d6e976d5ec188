"""Every ``python`` block of the README, of ``docs/*.md`` and of ``examples/*/README.md`` runs as the README says:
saved as a file outside the repository and run from the repository root with ``PYTHONPATH=. python FILE.py``.

A block is a complete script. One that starts ranks (``run_ranks``, ``check_parallel``) guards them with
``if __name__ == "__main__":`` (spawned ranks import the file again). One whose last line prints ``max ... = <number>``
compares a parallel run with the original or with one rank: the number must be <= 1e-10. Fragments are fenced as
``text``; any other fence is a language the test knows it does not run (``bash``, ``c++``). Blocks that call
``torch.compile`` (inductor from a cold cache: tens of seconds on a CPU), the examples' READMEs and the guides'
multi-rank scripts run under ``-m slow``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").glob("*/README.md"))]
FENCE = re.compile(r"^[ \t]*```([^\s`]*)[^\n]*\n(.*?)^[ \t]*```", flags=re.S | re.M)
NOT_RUN = {"text", "bash", "c++"}
HOW_TO_RUN = "run it from the repository\nroot with `PYTHONPATH=. python FILE.py`"


def _blocks():
    found = []
    for path in DOCUMENTS:
        blocks = [code for lang, code in FENCE.findall(path.read_text()) if lang == "python"]
        for index, code in enumerate(blocks):
            name = f"{path.relative_to(ROOT)}#{index}"
            # slow: inductor from a cold cache, the examples' READMEs (their adapters have their own tests), and the
            # guides' multi-rank scripts (5-11 s each; the README's own blocks always run)
            starts_ranks = "run_ranks(" in code or "check_parallel(" in code
            slow = ("torch.compile(" in code or path.parent.parent.name == "examples"
                    or (path.parent.name == "docs" and starts_ranks))
            marks = [pytest.mark.slow] if slow else []
            found.append(pytest.param(code, id=name, marks=marks))
    return found


BLOCKS = _blocks()


def test_the_readme_says_how_its_python_blocks_run():
    readme = (ROOT / "README.md").read_text()
    assert " ".join(HOW_TO_RUN.split()) in " ".join(readme.split())
    assert sum(p.id.startswith("README.md#") for p in BLOCKS) >= 2, "the parallelize and request API examples"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_fence_is_run_or_marked_as_not_python(path):
    """A fence spelled ``py``, ``python3`` or left bare would escape the run: each is python, or a known other kind."""
    langs = [lang for lang, _ in FENCE.findall(path.read_text())]
    unknown = sorted({lang or "(none)" for lang in langs} - NOT_RUN - {"python"})
    assert not unknown, f"{path.name}: code fences {unknown}: use python (run by this test), text or bash"


@pytest.mark.parametrize("block", BLOCKS)
def test_python_block_runs_as_a_file_from_the_root(tmp_path, block):
    starts_ranks = "run_ranks(" in block or "check_parallel(" in block
    if starts_ranks:
        assert 'if __name__ == "__main__":' in block, "a block that starts ranks needs the __main__ guard"
    script = tmp_path / "block.py"  # outside the repository
    script.write_text(block)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "PYTHONPATH": "."}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    last = (run.stdout.strip().splitlines() or [""])[-1]
    if last.startswith("max ") and "=" in last:
        assert float(last.split("=")[-1]) <= 1e-10, last
