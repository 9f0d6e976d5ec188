"""CPU benchmark of the window-attention backends against the per-window reference loop.

Run: ``OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_attention.py --benchmark-only``.
Two window sets cut from a (5, 32, 56) token grid with one 24-token prompt, 4 heads x 32:
``ragged`` (edge windows smaller, 18 windows in 8 segment lengths) and ``equal`` (16 windows, one length).
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("pytest_benchmark")

import torch  # noqa: E402

from winsp.attention import WindowSegments, reference_window_attention, window_attention  # noqa: E402

HEADS, HEAD_DIM, TEXT = 4, 32, 24


def grid_windows(t_sizes, h_sizes, w_sizes) -> WindowSegments:
    """One sample's windows: every (t, h, w) block of the given split sizes, all sharing one prompt."""
    counts = [t * h * w for t, h, w in itertools.product(t_sizes, h_sizes, w_sizes)]
    return WindowSegments.from_samples(counts, [0] * len(counts), [TEXT])


WINDOW_SETS = {
    "ragged": grid_windows([3, 2], [11, 11, 10], [19, 19, 18]),  # (5, 32, 56) cut unevenly
    "equal": grid_windows([5], [8, 8, 8, 8], [14, 14, 14, 14]),  # (5, 32, 56) cut evenly
}


def inputs_for(segments: WindowSegments):
    gen = torch.Generator().manual_seed(0)

    def draw(rows):
        return torch.randn(rows, HEADS, HEAD_DIM, generator=gen)

    return [draw(segments.total_vid) for _ in range(3)] + [draw(TEXT) for _ in range(3)]


CASES = [
    ("ragged", "grouped_sdpa"),
    ("ragged", "reference"),
    ("equal", "batched_sdpa"),
    ("equal", "grouped_sdpa"),
    ("equal", "reference"),
]


@pytest.mark.parametrize("window_set, backend", CASES)
def test_window_attention_forward(benchmark, window_set, backend):
    segments = WINDOW_SETS[window_set]
    inputs = inputs_for(segments)
    benchmark.group = f"window attention forward, {window_set} windows"
    if backend == "reference":
        vid_out, txt_out = benchmark(reference_window_attention, *inputs, segments)
    else:
        segments.index_tensors("cpu")  # indices are built once per device, outside the hot path
        vid_out, txt_out = benchmark(window_attention, *inputs, segments, backend=backend)
    want_vid, want_txt = reference_window_attention(*inputs, segments)
    assert torch.allclose(vid_out, want_vid, atol=1e-5) and torch.allclose(txt_out, want_txt, atol=1e-5)
