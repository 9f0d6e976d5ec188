"""The README's runnable examples ('use winsp in your model': parallelize on torchvision's Video Swin, then the
request API on a toy DiT) run as written and match the original / one rank."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("index", [0, 1])
def test_readme_example_runs_and_matches_one_rank(tmp_path, index):
    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "__main__" in b]
    assert len(blocks) == 2, "README should have two runnable python examples"
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[index])
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    error = float(run.stdout.strip().split("=")[-1])
    assert error <= 1e-10
