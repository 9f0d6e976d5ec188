"""The script benchmarks (argparse commands, not pytest-benchmark files) run under the pytest benchmark command.

``python -m pytest benchmarks/ --benchmark-only`` runs each of them once, in a fresh interpreter from the repository
root with one intra-op thread, at a quick size (the arguments below), and prints its table in the terminal summary;
a script that fails fails its test. Run a script by hand for its full-size figures (each file's docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

ROOT = Path(__file__).resolve().parents[1]

# script -> quick arguments (defaults where the default is already quick)
QUICK = {
    "bench_split.py": ["--clips", "9x256x384", "--repeats", "1", "--planners", "heads", "auto"],
    "bench_split_exchange.py": [],
    "bench_transition.py": ["--world-sizes", "2", "4", "--repeats", "5"],
    "bench_swin3d.py": ["--frames", "8", "--size", "64", "--repeats", "2"],
    "bench_swin3d.py --comm": ["--comm", "--frames", "32", "--size", "224", "--world", "2", "4", "8"],
    "bench_pipeline.py": ["--repeats", "1"],
    "bench_whole_command.py": ["--quick"],  # one 96x64x9 clip, one round: P1 against torchrun (or --ranks) 2
    "bench_whole_command.py --vae-channels": ["--quick", "--vae-channels", "32,32,64,64", "--one-thread-baseline"],
    "bench_restore_profile.py": ["--quick"],
    "bench_resume_store.py": ["--quick"],  # one 96x64x9 clip, one round, with and without the batch store
    "bench_serve.py": ["--quick"],  # 3 clips of 48x32x5 through serve, 3 restores and one folder run
    "bench_vae.py": ["--threads", "1"],
    "bench_neighborhood.py": ["--repeats", "1"],  # the bytes table, one cold planning, the speed-up (1 forward a rank)
    "bench_strided.py": ["--tiny", "--repeats", "1"],  # the bytes and work table, the speed-up on a tiny grid
    "gpu_check.py --dry-run": ["--dry-run", "--out", ".benchmarks/gpu_check_dry_run"],  # .benchmarks/ is ignored
}


def run_script(name: str, args: list[str], timeout: float = 540.0) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = ROOT / "benchmarks" / name.split()[0]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return f"$ python benchmarks/{script.name} {' '.join(args)}   ({seconds:.1f} s)\n{done.stdout.rstrip()}"


@pytest.mark.parametrize("name", list(QUICK))
def test_script(benchmark, goal_report, name):
    benchmark.group = "script benchmarks, quick sizes (one run each; the printed tables are the figures)"
    text = benchmark.pedantic(run_script, args=(name, QUICK[name]), rounds=1, iterations=1)
    goal_report.text(f"benchmarks/{name}", text)
