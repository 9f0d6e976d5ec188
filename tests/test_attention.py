"""Window attention: every backend against the per-window SDPA oracle, plus segment bookkeeping."""

from __future__ import annotations

import math
from functools import partial
from itertools import pairwise

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_close
from winsp.attention.backends import flash_varlen, varlen
from winsp.attention.backends import torch_varlen as torch_varlen_backend
from winsp.attention.windows import (
    WindowAttention,
    WindowSegments,
    available_backends,
    reference_window_attention,
    select_backend,
    window_attention,
)

CPU_BACKENDS = ("grouped_sdpa", "batched_sdpa", "auto")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


# --------------------------------------------------------------------------- helpers
def make_inputs(segments, *, heads=3, head_dim=8, txt_rows=None, dtype=torch.float64, seed=0, grad=False):
    """Random q/k/v for ``segments``; the text tensor has ``txt_rows`` rows (default: just enough)."""
    gen = torch.Generator().manual_seed(seed)
    txt_rows = segments.txt_extent if txt_rows is None else txt_rows

    def draw(rows):
        t = torch.randn(rows, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
        return t.requires_grad_(grad)

    vid = [draw(segments.total_vid) for _ in range(3)]
    txt = [draw(txt_rows) for _ in range(3)]
    return (*vid, *txt)


def runnable_backends(segments):
    """The CPU backends that can run these segments (batched_sdpa only with at most one length)."""
    return [b for b in CPU_BACKENDS if b != "batched_sdpa" or len(segments.groups) <= 1]


def naive_window_attention(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments, scale=None):
    """An independent oracle written with explicit softmax (no SDPA), to check the reference itself."""
    scale = 1.0 / math.sqrt(q_vid.shape[-1]) if scale is None else scale
    vid_outs, txt_outs, row = [], [], 0
    for n_vid, n_txt, start in zip(segments.vid_counts, segments.txt_lengths, segments.txt_starts):
        q, k, v = (
            torch.cat([a[row : row + n_vid], b[start : start + n_txt]])
            for a, b in ((q_vid, q_txt), (k_vid, k_txt), (v_vid, v_txt))
        )
        weights = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale, dim=-1)
        out = torch.einsum("hqk,khd->qhd", weights, v)
        vid_outs.append(out[:n_vid])
        txt_outs.append(out[n_vid:])
        row += n_vid
    empty = q_vid.new_zeros((0, *q_vid.shape[1:]))
    return torch.cat(vid_outs) if vid_outs else empty, torch.cat(txt_outs) if txt_outs else empty


STRUCTURES = {
    # name: (vid_counts, window sample ids, text length of each sample)
    "ragged_one_sample": ([7, 4, 4, 9, 2], [0, 0, 0, 0, 0], [5]),
    "equal_windows": ([6, 6, 6, 6], [0, 0, 0, 0], [4]),
    "samples_with_different_text": ([5, 3, 5, 4, 6, 2], [0, 0, 1, 1, 2, 2], [2, 6, 3]),
    "no_text": ([5, 3, 5, 1], [0, 0, 0, 0], [0]),
    "one_window": ([11], [0], [3]),
    "empty_and_text_only_windows": ([0, 4, 0, 3], [0, 0, 1, 1], [3, 0]),
    "same_length_mixed_split": ([4, 6, 5], [0, 1, 2], [3, 1, 2]),
}


def structure(name):
    vid_counts, samples, txt_lengths = STRUCTURES[name]
    return WindowSegments.from_samples(vid_counts, samples, txt_lengths)


# --------------------------------------------------------------------------- forward parity
def test_reference_matches_explicit_softmax():
    segments = structure("samples_with_different_text")
    inputs = make_inputs(segments, txt_rows=segments.txt_extent + 2)
    for got, want in zip(reference_window_attention(*inputs, segments), naive_window_attention(*inputs, segments)):
        assert_close(got, want, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_backends_match_reference(name, dtype):
    segments = structure(name)
    inputs = make_inputs(segments, dtype=dtype, seed=hash(name) % 1000)
    want_vid, want_txt = reference_window_attention(*inputs, segments)
    assert want_vid.shape == (segments.total_vid, 3, 8)
    assert want_txt.shape == (segments.total_txt, 3, 8)
    for backend in runnable_backends(segments):
        vid_out, txt_out = window_attention(*inputs, segments, backend=backend)
        assert_close(vid_out, want_vid, TOL[dtype])
        assert_close(txt_out, want_txt, TOL[dtype])


@pytest.mark.parametrize("name", ["ragged_one_sample", "equal_windows", "samples_with_different_text"])
def test_bfloat16_close_to_exact_attention(name):
    segments = structure(name)
    inputs = make_inputs(segments, dtype=torch.bfloat16, seed=3)
    exact = reference_window_attention(*(t.double() for t in inputs), segments)
    for backend in runnable_backends(segments):
        outs = window_attention(*inputs, segments, backend=backend)
        for got, want in zip(outs, exact):
            assert got.dtype == torch.bfloat16
            # bf16 has 8 mantissa bits: outputs of magnitude ~1 carry ~4e-3 rounding; 3e-2 is a loose but
            # meaningful bound (a window mixed with the wrong text or rows would be off by ~1).
            assert (got.double() - want).abs().max().item() < 3e-2
            assert want.abs().max().item() > 0.3


def test_text_none_equals_zero_row_text():
    segments = structure("no_text")
    q, k, v, qt, kt, vt = make_inputs(segments)
    assert qt.shape[0] == 0
    for backend in runnable_backends(segments):
        with_none = window_attention(q, k, v, None, None, None, segments, backend=backend)
        with_empty = window_attention(q, k, v, qt, kt, vt, segments, backend=backend)
        for a, b in zip(with_none, with_empty):
            assert torch.equal(a, b)
        assert with_none[1].shape == (0, 3, 8)


def test_extra_text_rows_are_ignored():
    segments = structure("samples_with_different_text")
    inputs = make_inputs(segments, txt_rows=segments.txt_extent + 5)
    want = reference_window_attention(*inputs, segments)
    got = window_attention(*inputs, segments, backend="grouped_sdpa")
    for a, b in zip(got, want):
        assert_close(a, b, 1e-10)


def test_each_window_sees_only_its_own_sample_text():
    # Two windows of identical video but different samples must differ; moving text of sample 1 must not
    # change window 0's output.
    segments = WindowSegments.from_samples([4, 4], [0, 1], [2, 2])
    q, k, v, qt, kt, vt = make_inputs(segments)
    q, k, v = (torch.cat([t[:4], t[:4]]) for t in (q, k, v))
    vid_out, _ = window_attention(q, k, v, qt, kt, vt, segments, backend="grouped_sdpa")
    assert not torch.allclose(vid_out[:4], vid_out[4:])
    kt2 = kt.clone()
    kt2[2:] += 10.0
    vid_out2, _ = window_attention(q, k, v, qt, kt2, vt, segments, backend="grouped_sdpa")
    assert_close(vid_out2[:4], vid_out[:4], 1e-12)
    assert not torch.allclose(vid_out2[4:], vid_out[4:])


def test_non_contiguous_inputs():
    segments = structure("equal_windows")
    gen = torch.Generator().manual_seed(5)
    qkv_vid = torch.randn(segments.total_vid, 3, 2, 8, dtype=torch.float64, generator=gen)
    qkv_txt = torch.randn(segments.txt_extent, 3, 2, 8, dtype=torch.float64, generator=gen)
    inputs = (*qkv_vid.unbind(1), *qkv_txt.unbind(1))
    assert not inputs[0].is_contiguous()
    want = reference_window_attention(*(t.contiguous() for t in inputs), segments)
    for backend in runnable_backends(segments):
        for got, exp in zip(window_attention(*inputs, segments, backend=backend), want):
            assert_close(got, exp, 1e-10)


def test_softmax_scale_is_used():
    segments = structure("ragged_one_sample")
    inputs = make_inputs(segments)
    default = window_attention(*inputs, segments)
    scaled = window_attention(*inputs, segments, softmax_scale=0.05)
    want = naive_window_attention(*inputs, segments, scale=0.05)
    assert_close(scaled[0], want[0], 1e-10)
    assert not torch.allclose(default[0], scaled[0])
    assert_close(reference_window_attention(*inputs, segments, softmax_scale=0.05)[0], want[0], 1e-10)


# --------------------------------------------------------------------------- zero windows / empty
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_local_windows(backend, dtype):
    segments = WindowSegments(vid_counts=(), txt_lengths=(), txt_starts=())
    assert segments.cu_seqlens.tolist() == [0] and segments.max_seqlen == 0
    q, k, v, qt, kt, vt = make_inputs(segments, heads=5, head_dim=6, txt_rows=7, dtype=dtype, grad=True)
    for txt in ((qt, kt, vt), (None, None, None)):
        vid_out, txt_out = window_attention(q, k, v, *txt, segments, backend=backend)
        assert vid_out.shape == (0, 5, 6) and txt_out.shape == (0, 5, 6)
        assert vid_out.dtype == dtype and txt_out.dtype == dtype
        (vid_out.sum() + txt_out.sum()).backward()  # must not raise
    ref = reference_window_attention(q, k, v, qt, kt, vt, segments)
    assert ref[0].shape == (0, 5, 6) and ref[1].shape == (0, 5, 6)


def test_all_windows_empty():
    segments = WindowSegments(vid_counts=(0, 0), txt_lengths=(0, 0), txt_starts=(0, 3))
    q, k, v, qt, kt, vt = make_inputs(segments, txt_rows=4)
    for backend in CPU_BACKENDS:
        vid_out, txt_out = window_attention(q, k, v, qt, kt, vt, segments, backend=backend)
        assert vid_out.shape == (0, 3, 8) and txt_out.shape == (0, 3, 8)


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("name", ["ragged_one_sample", "samples_with_different_text", "equal_windows",
                                  "empty_and_text_only_windows", "same_length_mixed_split"])
def test_gradients_match_reference(name):
    segments = structure(name)
    inputs = make_inputs(segments, grad=True, seed=11)
    gen = torch.Generator().manual_seed(12)
    weights = [torch.randn(segments.total_vid, 3, 8, generator=gen, dtype=torch.float64),
               torch.randn(segments.total_txt, 3, 8, generator=gen, dtype=torch.float64)]

    def grads(fn):
        vid_out, txt_out = fn()
        loss = (vid_out * weights[0]).sum() + (txt_out * weights[1]).sum()
        return torch.autograd.grad(loss, inputs)

    want = grads(lambda: reference_window_attention(*inputs, segments))
    assert any(g.abs().max() > 1e-3 for g in want)
    for backend in runnable_backends(segments):
        got = grads(partial(window_attention, *inputs, segments, backend=backend))
        for g, w in zip(got, want):
            assert_close(g, w, 1e-10)


def test_gradcheck_grouped():
    segments = WindowSegments.from_samples([2, 3, 1], [0, 1, 1], [1, 2])
    inputs = make_inputs(segments, heads=2, head_dim=3, grad=True, seed=2)
    assert torch.autograd.gradcheck(
        lambda *x: window_attention(*x, segments, backend="grouped_sdpa"), inputs, eps=1e-6, atol=1e-7
    )


# --------------------------------------------------------------------------- random structures
@st.composite
def segment_structures(draw):
    num_samples = draw(st.integers(1, 3))
    txt = draw(st.lists(st.integers(0, 4), min_size=num_samples, max_size=num_samples))
    num_windows = draw(st.integers(0, 6))
    vid = draw(st.lists(st.integers(0, 6), min_size=num_windows, max_size=num_windows))
    samples = draw(st.lists(st.integers(0, num_samples - 1), min_size=num_windows, max_size=num_windows))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 5))
    extra_txt = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    return WindowSegments.from_samples(vid, samples, txt), heads, head_dim, extra_txt, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segment_structures())
def test_random_structures_forward_and_backward(case):
    segments, heads, head_dim, extra_txt, seed = case
    inputs = make_inputs(segments, heads=heads, head_dim=head_dim, txt_rows=segments.txt_extent + extra_txt,
                         seed=seed, grad=True)
    want = reference_window_attention(*inputs, segments)
    want_grads = torch.autograd.grad(want[0].sum() + 2 * want[1].sum(), inputs, allow_unused=True)
    for backend in runnable_backends(segments):
        got = window_attention(*inputs, segments, backend=backend)
        for g, w in zip(got, want):
            assert_close(g, w, 1e-10)
        got_grads = torch.autograd.grad(got[0].sum() + 2 * got[1].sum(), inputs, allow_unused=True)
        for g, w, x in zip(got_grads, want_grads, inputs):  # None means "unused": a zero gradient
            assert_close(torch.zeros_like(x) if g is None else g, torch.zeros_like(x) if w is None else w, 1e-10)


# --------------------------------------------------------------------------- segments
def test_segment_derived_data():
    segments = WindowSegments.from_samples([5, 3, 0, 4], [0, 0, 1, 1], [3, 2])
    assert segments.txt_lengths == (3, 3, 2, 2) and segments.txt_starts == (0, 0, 3, 3)
    assert segments.seq_lens == (8, 6, 2, 6)
    assert segments.cu_seqlens.dtype == np.int32 and segments.cu_seqlens.tolist() == [0, 8, 14, 16, 22]
    assert isinstance(segments.max_seqlen, int) and segments.max_seqlen == 8
    assert segments.total_vid == 12 and segments.total_txt == 10 and segments.txt_extent == 5
    assert segments.groups == ((8, (0,)), (6, (1, 3)), (2, (2,)))
    assert segments.pack_order == (0, 1, 3, 2)
    assert segments.packed_cu_seqlens.tolist() == [0, 8, 14, 20, 22]
    # packed rows in pack order, text rows offset by total_vid = 12
    assert segments.concat_index.tolist() == (
        [0, 1, 2, 3, 4, 12, 13, 14] + [5, 6, 7, 12, 13, 14] + [8, 9, 10, 11, 15, 16] + [15, 16]
    )
    # unpack(pack(x)) is the window-major [vid_out, txt_out] layout
    packed = segments.concat_index
    assert packed[segments.unpack_index][:12].tolist() == list(range(12))
    assert packed[segments.unpack_index][12:].tolist() == [12, 13, 14, 12, 13, 14, 15, 16, 15, 16]
    assert sorted(segments.unpack_index.tolist()) == list(range(segments.total_seq))
    with pytest.raises(ValueError):
        segments.cu_seqlens[0] = 1  # cached arrays are read-only


def test_segments_are_hashable_values():
    a = WindowSegments(vid_counts=[1, 2], txt_lengths=(0, 0), txt_starts=(0, 0))
    b = WindowSegments(vid_counts=(1, 2), txt_lengths=[0, 0], txt_starts=np.array([0, 0]))
    assert a == b and hash(a) == hash(b)
    assert a.vid_counts == (1, 2) and all(type(x) is int for x in b.txt_starts)


def test_index_tensors_on_a_device():
    segments = structure("ragged_one_sample")
    first = segments.index_tensors("cpu")
    assert first.pack_index.dtype == torch.int64 and first.packed_cu_seqlens.dtype == torch.int32
    assert first.pack_index.tolist() == segments.concat_index.tolist()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(vid_counts=(1, 2), txt_lengths=(0,), txt_starts=(0, 0)), "txt_lengths"),
        (dict(vid_counts=(1, 2), txt_lengths=(0, 0), txt_starts=(0,)), "txt_starts"),
        (dict(vid_counts=(1, -2), txt_lengths=(0, 0), txt_starts=(0, 0)), "vid_counts"),
        (dict(vid_counts=(1, 2), txt_lengths=(0, -1), txt_starts=(0, 0)), "txt_lengths"),
        (dict(vid_counts=(1, 2), txt_lengths=(0, 0), txt_starts=(0, -3)), "txt_starts"),
        (dict(vid_counts=(1, 2.5), txt_lengths=(0, 0), txt_starts=(0, 0)), "vid_counts"),
        (dict(vid_counts=(1, True), txt_lengths=(0, 0), txt_starts=(0, 0)), "vid_counts"),
        (dict(vid_counts="12", txt_lengths=(0, 0), txt_starts=(0, 0)), "vid_counts"),
        (dict(vid_counts=3, txt_lengths=(0,), txt_starts=(0,)), "vid_counts"),
    ],
)
def test_segment_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WindowSegments(**kwargs)


def test_from_samples_rejects_unknown_sample():
    with pytest.raises(ValueError, match="window_samples"):
        WindowSegments.from_samples([1, 1], [0, 2], [3, 3])


def test_cu_seqlens_int32_overflow_check_without_allocating():
    at_limit = WindowSegments(vid_counts=(2**30, 2**30 - 1), txt_lengths=(0, 0), txt_starts=(0, 0))
    assert at_limit.cu_seqlens.dtype == np.int32
    assert at_limit.cu_seqlens.tolist() == [0, 2**30, 2**31 - 1]
    huge = WindowSegments(vid_counts=(2**30, 2**30), txt_lengths=(1, 0), txt_starts=(0, 0))
    assert huge.max_seqlen == 2**30 + 1  # plain Python arithmetic still works
    with pytest.raises(ValueError, match="int32"):
        _ = huge.cu_seqlens
    with pytest.raises(ValueError, match="int32"):
        _ = huge.packed_cu_seqlens


# --------------------------------------------------------------------------- input validation
def test_input_validation():
    segments = structure("samples_with_different_text")
    q, k, v, qt, kt, vt = make_inputs(segments)
    with pytest.raises(ValueError, match="video rows"):
        window_attention(q[1:], k[1:], v[1:], qt, kt, vt, segments)
    with pytest.raises(ValueError, match="k_vid"):
        window_attention(q, k[:, :2], v, qt, kt, vt, segments)
    with pytest.raises(ValueError, match="text up to row"):
        window_attention(q, k, v, qt[:-1], kt[:-1], vt[:-1], segments)
    with pytest.raises(ValueError, match="all None"):
        window_attention(q, k, v, qt, None, vt, segments)
    with pytest.raises(ValueError, match="window-text rows"):
        window_attention(q, k, v, None, None, None, segments)
    with pytest.raises(ValueError, match="v_txt"):
        window_attention(q, k, v, qt, kt, vt.float(), segments)
    with pytest.raises(ValueError, match="q_txt"):
        window_attention(q, k, v, qt[:, :2], kt, vt, segments)
    with pytest.raises(TypeError, match="segments"):
        window_attention(q, k, v, qt, kt, vt, segments.vid_counts)


# --------------------------------------------------------------------------- backend selection
def test_available_backends_on_cpu():
    assert available_backends("cpu") == ["flex", "batched_sdpa", "grouped_sdpa"]


def test_auto_selection_on_cpu():
    assert select_backend("cpu", structure("equal_windows")) == "batched_sdpa"
    assert select_backend("cpu", structure("one_window")) == "batched_sdpa"
    assert select_backend("cpu", structure("same_length_mixed_split")) == "batched_sdpa"
    assert select_backend("cpu", structure("ragged_one_sample")) == "grouped_sdpa"
    # a rank without windows runs no kernel; any SDPA backend is a valid answer (the first one that can run)
    assert select_backend("cpu", WindowSegments((), (), ())) == "batched_sdpa"


@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen"])
def test_varlen_backends_refused_on_cpu(backend):
    with pytest.raises(ValueError, match=backend):
        select_backend("cpu", structure("equal_windows"), backend)
    segments = structure("equal_windows")
    with pytest.raises(ValueError, match=backend):
        window_attention(*make_inputs(segments, dtype=torch.bfloat16), segments, backend=backend)


def test_batched_refused_for_several_lengths_and_unknown_names():
    with pytest.raises(ValueError, match="batched_sdpa.*one segment length"):
        select_backend("cpu", structure("ragged_one_sample"), "batched_sdpa")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("cpu", structure("ragged_one_sample"), "xformers")
    with pytest.raises(ValueError, match="unknown attention backend"):
        WindowAttention(backend="xformers")


# --------------------------------------------------------------------------- varlen plumbing (fake kernel)
def fake_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """A CPU stand-in for a varlen kernel: SDPA over each [cu[i], cu[i+1]) segment of the packed rows."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    assert isinstance(max_q, int) and max_q == max_k
    scale = kwargs.get("softmax_scale", kwargs.get("scale"))
    cu = cu_q.tolist()
    assert cu[-1] == q.shape[0] and max(b - a for a, b in pairwise(cu)) == max_q
    outs = [
        F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=scale
        ).transpose(0, 1)
        for a, b in pairwise(cu)
    ]
    return torch.cat(outs)


@pytest.fixture
def pretend_cuda(monkeypatch):
    """Make the varlen backends look runnable on CPU with float64, running the fake kernel."""
    calls = []

    def flash(*args, **kwargs):
        assert set(kwargs) == {"dropout_p", "softmax_scale", "causal"} and kwargs["causal"] is False
        calls.append("flash_varlen")
        return fake_varlen_kernel(*args, **kwargs)

    def torch_varlen(*args, **kwargs):
        assert set(kwargs) == {"scale"}
        calls.append("torch_varlen")
        return fake_varlen_kernel(*args, **kwargs)

    monkeypatch.setattr(varlen, "cuda_reason", lambda device: None)
    monkeypatch.setattr(varlen, "VARLEN_DTYPES", (torch.float64, torch.bfloat16))
    monkeypatch.setattr(flash_varlen, "_import", lambda: flash)
    monkeypatch.setattr(torch_varlen_backend, "_import", lambda: torch_varlen)
    return calls


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_varlen_packing_with_fake_kernel(name, pretend_cuda):
    segments = structure(name)
    inputs = make_inputs(segments, grad=True, seed=4)
    want = reference_window_attention(*inputs, segments)
    for backend in ("flash_varlen", "torch_varlen"):
        got = window_attention(*inputs, segments, backend=backend)
        for g, w in zip(got, want):
            assert_close(g, w, 1e-10)
    assert pretend_cuda == ["flash_varlen", "torch_varlen"]


def test_auto_prefers_varlen_when_runnable(pretend_cuda, monkeypatch):
    segments = structure("ragged_one_sample")
    assert select_backend("cpu", segments, dtype=torch.bfloat16) == "flash_varlen"
    assert select_backend("cpu", segments, dtype=torch.float32) == "grouped_sdpa"
    monkeypatch.setattr(flash_varlen, "_import", lambda: None)
    assert select_backend("cpu", segments, dtype=torch.bfloat16) == "torch_varlen"
    with pytest.raises(ValueError, match="flash_varlen.*not importable"):
        select_backend("cpu", segments, "flash_varlen")
    with pytest.raises(ValueError, match="torch_varlen.*float16 or bfloat16"):
        select_backend("cpu", segments, "torch_varlen", dtype=torch.float32)


# --------------------------------------------------------------------------- module
def test_module_wraps_function():
    segments = structure("samples_with_different_text")
    inputs = make_inputs(segments)
    module = WindowAttention(backend="grouped_sdpa", softmax_scale=0.2)
    assert "grouped_sdpa" in repr(module)
    got = module(*inputs, segments)
    want = window_attention(*inputs, segments, backend="grouped_sdpa", softmax_scale=0.2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    with pytest.raises(TypeError):
        WindowAttention("grouped_sdpa")  # keyword-only
