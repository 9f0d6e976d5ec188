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

from winsp.attention.windows import WindowSegments, reference_window_attention, window_attention  # noqa: E402

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


# ---- score modification: SDPA (materialised scores) vs FlexAttention (eager / compiled), inference --------------
# Swin-like windows: a (4, 28, 28) grid in (2, 7, 7) windows (32 windows of 98 tokens), no text, 4 heads x 32, a
# relative position bias table looked up per pair. FlexAttention on CPU runs eagerly (every score of the packed
# sequence materialised) unless compiled; torch compiles it on CPU for inference only.

SWIN_GRID, SWIN_WINDOW = (4, 28, 28), (2, 7, 7)
SWIN_SEGMENTS = grid_windows([2, 2], [7] * 4, [7] * 4)
SWIN_SEGMENTS = WindowSegments.from_samples(SWIN_SEGMENTS.vid_counts, [0] * SWIN_SEGMENTS.num_windows, [0])


def _swin_bias():
    """A score_mod adding a learned table at each pair's window-local (dt, dh, dw) offset."""
    gen = torch.Generator().manual_seed(1)
    t, h, w = SWIN_WINDOW
    local = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    strides = torch.tensor([(2 * h - 1) * (2 * w - 1), 2 * w - 1, 1])
    key = (local.reshape(-1, 3) @ strides).repeat(SWIN_SEGMENTS.num_windows)
    center = int(((torch.tensor(SWIN_WINDOW) - 1) * strides).sum())
    table = torch.randn((2 * t - 1) * (2 * h - 1) * (2 * w - 1), HEADS, generator=gen)

    def score_mod(score, head, q_row, k_row):
        return score + table[key[q_row] - key[k_row] + center, head]
    return score_mod


MOD_CASES = ["grouped_sdpa_plain", "grouped_sdpa", "flex_eager", "flex_compiled"]


@pytest.mark.parametrize("case", MOD_CASES)
def test_window_attention_with_score_mod(benchmark, goal_report, case):
    from winsp.attention.backends import bind_backend
    from winsp.attention.windows import attend

    segments = SWIN_SEGMENTS
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(segments.total_vid, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    score_mod = None if case == "grouped_sdpa_plain" else _swin_bias()
    backend = "grouped_sdpa" if case.startswith("grouped") else "flex"
    index = segments.index_tensors("cpu")
    runner = bind_backend(backend, segments, index)
    from winsp.attention.score_mods import check_score_mods

    mods = check_score_mods(score_mod, None)

    def call(q, k, v):
        return attend(q, k, v, None, None, None, segments, index, runner, mods=mods)[0]

    fn = torch.compile(call, backend="inductor", fullgraph=True) if case == "flex_compiled" else call
    benchmark.group = "window attention with a relative position bias (4x28x28, 7x7x2 windows), forward"
    with torch.no_grad():
        fn(q, k, v)  # compile / warm up outside the timing
        out = benchmark(fn, q, k, v)
        want = reference_window_attention(q, k, v, None, None, None, segments, score_mod=score_mod)[0]
    assert torch.allclose(out, want, atol=1e-4)
    goal_report.goal(f"score_mod attention, {case}", goal_report.median_seconds(benchmark), None)
