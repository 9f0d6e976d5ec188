"""Score and mask modification in window attention: every backend against a dense per-window oracle written here.

The oracle builds each window's full score matrix and modifies it pair by pair with plain Python indices, so it
shares no code with winsp's broadcasting (SDPA backends) or vmapped (FlexAttention) paths.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_attention import STRUCTURES, make_inputs, structure
from winsp.attention.backends import explain_backend
from winsp.attention.windows import reference_window_attention, window_attention

TOL = 1e-10

# per local video row: a made-up 3D window-local position (what request.window_coords holds)
def _coords(num_rows: int, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (num_rows, 3), generator=gen)


def _rpb(heads: int, seed: int = 4) -> torch.Tensor:
    """A Swin-style relative position bias table [(2*3-1)^3, heads] for offsets in [-2, 2]^3."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(5 ** 3, heads, generator=gen, dtype=torch.float64)


def swin_bias(coords: torch.Tensor, table: torch.Tensor):
    """Relative position bias, Swin v1: a learned table indexed by the (dt, dh, dw) offset."""
    def score_mod(score, head, q, k):
        rel = coords[q] - coords[k] + 2
        return score + table[(rel[..., 0] * 5 + rel[..., 1]) * 5 + rel[..., 2], head]
    return score_mod


def alibi(coords: torch.Tensor, heads: int):
    """ALiBi-like decay: -slope_h * |dt| - ... (L1 distance), with a per-head slope."""
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(heads)], dtype=torch.float64)

    def score_mod(score, head, q, k):
        return score - slopes[head] * (coords[q] - coords[k]).abs().sum(-1)
    return score_mod


def cpb(coords: torch.Tensor, mlp: torch.nn.Module, logit_scale: torch.Tensor):
    """Swin v2-style: continuous position bias from an MLP over relative coordinates, and a scaled score."""
    rel = torch.stack(torch.meshgrid(*(torch.arange(-2, 3, dtype=torch.float64),) * 3, indexing="ij"), -1)
    def score_mod(score, head, q, k):
        table = 16 * torch.sigmoid(mlp(rel.view(-1, 3)))  # [125, heads], from parameters: gets gradients
        d = coords[q] - coords[k] + 2
        return score * logit_scale[head] + table[(d[..., 0] * 5 + d[..., 1]) * 5 + d[..., 2], head]
    return score_mod


def same_parity_mask(coords: torch.Tensor):
    """A mask: a query sees keys whose first coordinate has its parity (each row keeps itself)."""
    def mask_mod(head, q, k):
        return (coords[q][..., 0] % 2) == (coords[k][..., 0] % 2)
    return mask_mod


def dense_oracle(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, segments, score_mod=None, mask_mod=None):
    """Per window: explicit scores; the video x video block modified with the window's own row numbers, masked."""
    scale = 1.0 / math.sqrt(q_vid.shape[-1])
    heads = q_vid.shape[1]
    vid_outs, txt_outs, row = [], [], 0
    for n_vid, n_txt, start in zip(segments.vid_counts, segments.txt_lengths, segments.txt_starts):
        q, k, v = (torch.cat([a[row: row + n_vid], b[start: start + n_txt]])
                   for a, b in ((q_vid, q_txt), (k_vid, k_txt), (v_vid, v_txt)))
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        rows = torch.arange(row, row + n_vid)
        head, q_row, k_row = torch.arange(heads).view(-1, 1, 1), rows.view(1, -1, 1), rows.view(1, 1, -1)
        block = scores[:, :n_vid, :n_vid]
        if score_mod is not None:
            block = score_mod(block, head, q_row, k_row)
        if mask_mod is not None:
            block = block.masked_fill(~mask_mod(head, q_row, k_row), -math.inf)
        scores = torch.cat([torch.cat([block, scores[:, :n_vid, n_vid:]], 2), scores[:, n_vid:]], 1)
        if n_vid + n_txt:
            out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
            vid_outs.append(out[:n_vid])
            txt_outs.append(out[n_vid:])
        row += n_vid
    empty = q_vid.new_zeros((0, *q_vid.shape[1:]))
    return torch.cat(vid_outs) if vid_outs else empty, torch.cat(txt_outs) if txt_outs else empty


def _err(got, want) -> float:
    """max |got - want|, relative to max(1, max |want|); 0 for empty tensors."""
    if not want.numel():
        return 0.0
    return ((got - want).abs().max() / max(1.0, want.abs().max().item())).item()


def _mods(kind: str, num_rows: int, heads: int):
    """(score_mod, mask_mod, parameters that must receive gradients) for one kind of modification."""
    coords = _coords(num_rows)
    if kind == "swin_bias":
        table = _rpb(heads).requires_grad_()
        return swin_bias(coords, table), None, [table]
    if kind == "alibi":
        return alibi(coords, heads), None, []
    if kind == "cpb":
        torch.manual_seed(5)
        mlp = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, heads)).double()
        scale = torch.rand(heads, dtype=torch.float64).add(0.5).requires_grad_()
        return cpb(coords, mlp, scale), None, [scale, *mlp.parameters()]
    if kind == "mask":
        return None, same_parity_mask(coords), []
    if kind == "bias_and_mask":
        table = _rpb(heads).requires_grad_()
        return swin_bias(coords, table), same_parity_mask(coords), [table]
    raise AssertionError(kind)


KINDS = ("swin_bias", "alibi", "cpb", "mask", "bias_and_mask")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["ragged_one_sample", "samples_with_different_text", "no_text",
                                  "empty_and_text_only_windows", "equal_windows"])
def test_sdpa_backends_match_the_dense_oracle_forward_and_backward(kind, name):
    segments = structure(name)
    backends = ["grouped_sdpa", "auto"] + (["batched_sdpa"] if len(segments.groups) <= 1 else [])
    heads = 3
    score_mod, mask_mod, params = _mods(kind, segments.total_vid, heads)

    def run(fn):
        inputs = make_inputs(segments, heads=heads, grad=True, seed=7)
        vid, txt = fn(inputs)
        ((vid * torch.linspace(-1, 1, vid.numel(), dtype=vid.dtype).view_as(vid)).sum() + (txt ** 2).sum()).backward()
        grads = [t.grad for t in inputs] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return vid.detach(), txt.detach(), grads

    want = run(lambda x: dense_oracle(*x, segments, score_mod, mask_mod))
    ref = run(lambda x: reference_window_attention(*x, segments, score_mod=score_mod, mask_mod=mask_mod))
    for backend in backends + ["reference"]:
        got = ref if backend == "reference" else run(
            lambda x, backend=backend: window_attention(*x, segments, backend=backend, score_mod=score_mod,
                                                        mask_mod=mask_mod))
        for g, w in zip(got[:2], want[:2]):
            assert g.shape == w.shape and _err(g, w) <= TOL, backend
        for g, w in zip(got[2], want[2]):
            assert (g is None) == (w is None), backend
            assert w is None or _err(g, w) <= TOL, backend


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["ragged_one_sample", "samples_with_different_text", "empty_and_text_only_windows"])
def test_flex_backend_matches_the_dense_oracle_in_inference(kind, name):
    segments = structure(name)
    score_mod, mask_mod, _ = _mods(kind, segments.total_vid, 2)
    with torch.no_grad():
        inputs = make_inputs(segments, heads=2, head_dim=16, seed=9)
        want = dense_oracle(*inputs, segments, score_mod, mask_mod)
        got = window_attention(*inputs, segments, backend="flex", score_mod=score_mod, mask_mod=mask_mod)
    for g, w in zip(got, want):
        assert g.shape == w.shape and _err(g, w) <= TOL


def test_flex_backend_without_mods_is_plain_window_attention():
    segments = structure("samples_with_different_text")
    with torch.no_grad():
        inputs = make_inputs(segments, heads=2, head_dim=16, seed=1)
        for g, w in zip(window_attention(*inputs, segments, backend="flex"),
                        reference_window_attention(*inputs, segments)):
            assert _err(g, w) <= TOL


def test_flex_on_cpu_refuses_a_call_that_needs_gradients():
    segments = structure("ragged_one_sample")
    inputs = make_inputs(segments, heads=2, head_dim=16, grad=True)
    with pytest.raises(ValueError, match="inference-only.*grouped_sdpa"):
        window_attention(*inputs, segments, backend="flex", score_mod=alibi(_coords(segments.total_vid), 2))


def test_auto_choice_with_mods_and_its_reasons():
    segments = structure("equal_windows")
    assert explain_backend("cpu", segments, modded=True, dtype=torch.float32)[0] == "batched_sdpa"
    name, why = explain_backend("cpu", structure("ragged_one_sample"), modded=True, dtype=torch.float32)
    assert name == "grouped_sdpa"
    assert any(r.startswith("flash_varlen: it cannot take a score_mod") for r in why)
    assert any(r.startswith("flex: on CPU it runs eagerly") for r in why)
    assert explain_backend("cpu", segments, modded=False)[0] == "batched_sdpa"
    assert any(r.startswith("flex: it is used for calls with a score_mod")
               for r in explain_backend("cpu", segments, modded=False)[1])
    with pytest.raises(ValueError, match="'flash_varlen' cannot run"):
        explain_backend("cpu", segments, "flash_varlen", modded=True)


def test_mods_must_be_callable():
    segments = structure("one_window")
    inputs = make_inputs(segments)
    with pytest.raises(ValueError, match="score_mod must be a callable"):
        window_attention(*inputs, segments, score_mod=torch.zeros(3))
    with pytest.raises(ValueError, match="mask_mod must be a callable"):
        window_attention(*inputs, segments, mask_mod="causal")


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_a_mod_that_changes_nothing_changes_nothing(name):
    segments = structure(name)
    inputs = make_inputs(segments)
    plain = reference_window_attention(*inputs, segments)
    for got in (window_attention(*inputs, segments, score_mod=lambda s, h, q, k: s),
                window_attention(*inputs, segments, mask_mod=lambda h, q, k: q >= 0)):
        for g, w in zip(got, plain):
            assert g.shape == w.shape and _err(g, w) <= TOL
