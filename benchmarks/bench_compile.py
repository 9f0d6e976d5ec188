"""torch.compile on CPU: the SeedVR2 DiT forward with inductor-compiled blocks against eager, same process, SP = 1.

Run from the repository root: ``python -m pytest benchmarks/bench_compile.py --benchmark-only -q -s``.
Model and input: the tiny 3B-architecture golden model (4 blocks, dim 96, 3 heads x 32) on its golden input
(post-patch grid (5, 32, 56) = 8960 tokens, 17 text tokens), float32, one intra-op thread.

* ``eager``: ``SeedVR2NaDiT.forward`` as is.
* ``compiled``: after ``model.compile_blocks()`` (regional compilation: every block ``torch.compile``-d with
  ``fullgraph=True``, inductor backend; planning stays eager). Compilation happens in the warm-up, outside the timing.
The compiled output must equal eager to 1e-4. Reported: compiled / eager median forward time.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark")

import torch  # noqa: E402

try:  # pytest puts this folder on sys.path (rootdir-less "prepend" import mode)
    from bench_dit import load_golden  # noqa: E402
except ImportError:  # pragma: no cover
    from benchmarks.bench_dit import load_golden  # noqa: E402

_medians: dict[str, float] = {}


@pytest.fixture(scope="module")
def models():
    eager, inputs = load_golden()
    compiled, _ = load_golden()
    compiled.compile_blocks()  # inductor, fullgraph=True
    args = (inputs["vid"], inputs["txt"], inputs["vid_shape"], inputs["txt_shape"], inputs["timestep"])
    with torch.no_grad():
        err = (compiled(*args) - eager(*args)).abs().max().item()  # also the compilation itself
    assert err <= 1e-4, f"compiled forward differs from eager by {err}"
    return {"eager": eager, "compiled": compiled}, args


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_forward_compiled_vs_eager(benchmark, goal_report, models, path):
    by_path, args = models
    model = by_path[path]
    benchmark.group = "SeedVR2 DiT forward, tiny golden model, CPU, SP = 1"
    with torch.no_grad():
        benchmark.pedantic(model, args=args, rounds=15, iterations=1, warmup_rounds=3)
    median = goal_report.median_seconds(benchmark)
    if median is None:
        return
    _medians[path] = median
    if len(_medians) == 2:
        goal_report.goal("compiled / eager forward time (CPU, inductor)", _medians["compiled"] / _medians["eager"],
                         None, unit="x")
