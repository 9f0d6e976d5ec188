"""Every ``python`` block of the README runs as the README says: saved as a file outside the repository and run from
the repository root with ``PYTHONPATH=. python FILE.py``. Each is a complete script whose last line prints
``... = <max difference>`` (parallel against the original, or against one rank), which must be <= 1e-10."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
HOW_TO_RUN = "run it from the repository\nroot with `PYTHONPATH=. python FILE.py`"


def test_the_readme_says_how_its_python_blocks_run():
    assert HOW_TO_RUN in README
    assert len(BLOCKS) >= 3, "the parallelize, request API and relative position bias examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_as_a_file_from_the_root(tmp_path, index):
    block = BLOCKS[index]
    assert 'if __name__ == "__main__":' in block, f"python block {index} is not a complete script (tag it text?)"
    script = tmp_path / f"readme_block_{index}.py"  # outside the repository
    script.write_text(block)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "PYTHONPATH": "."}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    error = float(run.stdout.strip().splitlines()[-1].split("=")[-1])
    assert error <= 1e-10
