"""The guide's "Hourglass models" section: each of its python blocks runs as a file from the repository root (the
block adopts examples/hourglass with winsp.adoption.Hourglass and prints its difference from the original)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
GUIDE = (ROOT / "docs" / "parallelize_your_model.md").read_text()
SECTION = GUIDE[GUIDE.index("### Hourglass models"):GUIDE.index("### Swin's windows")]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, flags=re.S)


def test_the_section_has_a_python_block():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_the_hourglass_section_block_runs_as_a_file(tmp_path, index):
    script = tmp_path / f"hourglass_{index}.py"
    script.write_text(BLOCKS[index])
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    difference = float(run.stdout.rsplit("max difference from the original:", 1)[1])
    assert difference < 1e-12 and "split windows (heads across ranks" in run.stdout
