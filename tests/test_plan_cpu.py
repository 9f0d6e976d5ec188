"""``python -m examples.seedvr2 plan --device cpu`` against the measured peak RSS of the restore it plans.

Each configuration: the planner (the CPU twin, in its own process, as a user runs it) names the settings and each
stage's peak per rank; the restore is then run with exactly those flags on a clip of that size (the demo weights), in
a process of its own whose children's peak RSS (``ru_maxrss``: the largest rank, or the launcher) is read; the
largest stage peak must be within 25 % of it. Figures and their reading: benchmarks/README.md ("The CPU twin against
measured peak RSS").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples.seedvr2.memory.planner import GiB

ROOT = Path(__file__).resolve().parents[1]

#: the restore in a process of its own, so that ``RUSAGE_CHILDREN`` holds its peak and no earlier test's
_MEASURE = ("import resource, subprocess, sys\n"
            "run = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "sys.stderr.write(run.stderr)\n"
            "print(run.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n")


def _clip(path: Path, frames: int, width: int, height: int) -> Path:
    """The demo's sample frames as H.264: a natural clip, not ``tests.test_cli.make_mp4``'s, whose busier frames cost
    the decoder and encoder more (measured: 0.73 GiB of peak RSS at one rank, not 0.69) than the planner assumes."""
    import av

    from examples.seedvr2.models.demo import sample_frames

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in sample_frames(frames, height, width).numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def _plan(ranks: int, width: int, height: int, frames: int) -> tuple[list[str], float, str]:
    """The planner's flags for restore and its largest stage peak per rank (GiB)."""
    run = subprocess.run([sys.executable, "-m", "examples.seedvr2", "plan", "--device", "cpu", "--demo", "--ranks",
                          str(ranks), "--memory", "8GiB", "--resolution", f"{width}x{height}", "--frames",
                          str(frames)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    flags = re.search(r"^flags: (.*) \(--ranks (\d+)\)$", out, re.MULTILINE)
    peaks = re.search(r"^peak per rank: (.*)$", out, re.MULTILINE)
    assert flags and peaks and int(flags.group(2)) == ranks, out
    stages = {name: float(gib) for name, gib in re.findall(r"(weights|DiT|VAE encode|VAE decode) ([0-9.]+) GiB",
                                                            peaks.group(1))}
    assert set(stages) == {"weights", "DiT", "VAE encode", "VAE decode"}, out
    return flags.group(1).split(), max(stages.values()), out


@pytest.mark.parametrize("ranks, frames", [(1, 5), pytest.param(2, 9, marks=pytest.mark.slow)],
                         ids=["1-rank", "2-ranks-sp2"])
def test_plan_on_the_cpu_agrees_with_the_restores_peak_rss(tmp_path, ranks, frames):
    width, height = 256, 144  # activations (the VAE's unfolded convolutions) outweigh the 0.3 GiB process
    flags, predicted, plan_out = _plan(ranks, width, height, frames)
    assert "--demo" in flags and "--sp-size" in flags
    clip = _clip(tmp_path / "in.mp4", frames, width, height)
    restore = [sys.executable, "-m", "examples.seedvr2", "restore", str(clip), "-o", str(tmp_path / "out.mp4"),
               "--quiet", *flags] + (["--ranks", str(ranks)] if ranks > 1 else [])
    run = subprocess.run([sys.executable, "-c", _MEASURE, *restore], capture_output=True, text=True, cwd=ROOT,
                         timeout=900)
    code, peak = (int(v) for v in run.stdout.split())
    assert code == 0, run.stderr[-3000:]
    assert (tmp_path / "out.mp4").is_file()
    measured = peak / GiB
    ratio = predicted / measured
    print(f"\n{ranks} rank(s), 256x144 x {frames}: plan --device cpu {predicted:.2f} GiB, restore's peak RSS "
          f"{measured:.2f} GiB, ratio {ratio:.2f}")
    assert 0.75 <= ratio <= 1.25, (f"plan --device cpu said {predicted:.2f} GiB a rank, the restore peaked at "
                                   f"{measured:.2f} GiB (ratio {ratio:.2f})\n{plan_out}")


def test_demo_plans_only_a_cpu_run():
    run = subprocess.run([sys.executable, "-m", "examples.seedvr2", "plan", "--demo", "--gpus", "1", "--gpu-memory",
                          "80GiB", "--resolution", "256x144", "--frames", "5"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        "plan: --demo plans the tiny demo weights' CPU run; add --device cpu"), run.stderr


def test_the_twin_counts_the_cpu_convolutions_unfolded_input():
    import torch

    from examples.seedvr2.memory.cpu_twin import trace_on_cpu, unfold_bytes

    def run():
        conv = torch.nn.Conv3d(8, 8, 3, padding=1)
        with torch.no_grad():
            return conv(torch.randn(1, 8, 4, 32, 32))

    trace = trace_on_cpu(run)
    frame = 4 * 32 * 32 * 4  # one channel of the input (= of the output), float32
    unfolded = 8 * 27 * frame
    assert trace.peak_bytes >= unfolded + 2 * 8 * frame  # input, output and the unfolded matrix at once
    assert trace.peak_bytes < unfolded + 3 * 8 * frame
    pointwise = torch.ops.aten.convolution.default
    x, w1 = torch.empty(1, 8, 4, 32, 32), torch.empty(8, 8, 1, 1, 1)
    out = torch.empty(1, 8, 4, 32, 32)
    assert unfold_bytes(pointwise, (x, w1, None, [1, 1, 1], [0, 0, 0], [1, 1, 1], False, [0, 0, 0], 1), out) == 0
    assert unfold_bytes(pointwise, (x.bfloat16(), torch.empty(8, 8, 3, 3, 3).bfloat16(), None, [1] * 3, [1] * 3,
                                    [1] * 3, False, [0] * 3, 1), out) == 0
    # a large input (batch x channels x frames x height > 20,480) goes to oneDNN, which does not unfold
    big, w3 = torch.empty(1, 128, 5, 64, 64), torch.empty(128, 128, 3, 3, 3)
    assert unfold_bytes(pointwise, (big, w3, None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1), big) == 0
    small = torch.empty(1, 16, 5, 64, 64)
    assert unfold_bytes(pointwise, (small, torch.empty(16, 16, 3, 3, 3), None, [1] * 3, [1] * 3, [1] * 3, False,
                                    [0] * 3, 1), small) == 16 * 27 * 5 * 64 * 64 * 4


def test_the_twin_traces_a_convolution_sent_to_onednn_by_name():
    """The VAE's band of rows asks for oneDNN by name (``band_conv3d``); the twin traces it as the same convolution."""
    import torch

    from examples.seedvr2.memory.cpu_twin import trace_on_cpu

    def run():
        x, w = torch.randn(1, 8, 4, 16, 16), torch.randn(8, 8, 3, 3, 3)
        return torch.mkldnn_convolution(x, w, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1).shape

    trace = trace_on_cpu(run)
    assert tuple(trace.result) == (1, 8, 4, 16, 16)
    assert trace.peak_bytes == (2 * 8 * 4 * 16 * 16 + 8 * 8 * 27) * 4  # input, weight, output: nothing unfolded
