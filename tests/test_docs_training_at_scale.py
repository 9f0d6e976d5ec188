"""Every ``python`` block of ``docs/training_at_scale.md`` runs as a complete file from the repository root
(``PYTHONPATH=. python FILE.py``) and its last line ends with ``= <max difference>``, which must be <= 1e-10."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "training_at_scale.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", GUIDE, flags=re.S)


def test_the_guide_has_its_script():
    assert len(BLOCKS) == 1 and "shard_weights" in BLOCKS[0] and 'mesh["sp"]' in BLOCKS[0]
    assert "## How winsp's hooks and FSDP2's meet" in GUIDE and "dcp.save" in GUIDE


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_guide_python_block_runs_as_a_file(tmp_path, index):
    script = tmp_path / f"training_at_scale_{index}.py"  # outside the repository
    script.write_text(BLOCKS[index])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "PYTHONPATH": "."}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=420, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.strip().splitlines()[-1].split("=")[-1]) <= 1e-10
