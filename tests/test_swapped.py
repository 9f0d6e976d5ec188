"""winsp.swapped: a plan's module swap written as one function, adopting the original's tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import winsp


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("table", torch.arange(3.0), persistent=False)

    def forward(self, x):
        return self.proj(x) * self.scale


def test_the_swapped_module_adopts_the_original_and_runs_fn_with_its_index():
    original = _Block().eval()
    seen = []

    def double(module, x, *rest):
        seen.append((module.index, rest))
        return 2 * module.proj(x) * module.scale + module.table

    new = winsp.swapped(double)(original, 4)
    assert new.state_dict(keep_vars=True).keys() == original.state_dict(keep_vars=True).keys()
    assert all(a is b for a, b in zip(new.state_dict(keep_vars=True).values(),
                                      original.state_dict(keep_vars=True).values()))
    assert new.table is original.table and not new.training
    x = torch.randn(2, 3)
    torch.testing.assert_close(new(x, "extra"), 2 * original(x) + original.table)
    assert seen == [(4, ("extra",))] and "_Block -> " in repr(new)
    assert winsp.swapped(double)(original).index is None  # a plain swap: no layer index


def test_refuses_what_would_shadow_the_original():
    class HasIndex(_Block):
        index = 3

    with pytest.raises(ValueError, match="attribute 'index'"):
        winsp.swapped(lambda m, x: x)(HasIndex())
    with pytest.raises(ValueError, match="needs a function"):
        winsp.swapped("not a function")


def test_the_swapped_module_keeps_the_originals_plain_attributes():
    original = _Block()
    original.n_heads, original.window = 4, (2, 3, 3)
    new = winsp.swapped(lambda module, x: module.proj(x) * module.n_heads)(original, 1)
    assert new.n_heads == 4 and new.window == (2, 3, 3) and new.training == original.training
    assert new.proj is original.proj and "n_heads" not in dict(new.named_parameters())


def test_row_dropout_reproduces_the_originals_draws_on_local_rows():
    drop = winsp.RowDropout.like(nn.Dropout(0.3)).train()
    x = torch.randn(2, 3, 4, 5, 6, dtype=torch.float64)
    torch.manual_seed(7)
    want = nn.functional.dropout(x, 0.3, True)
    runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))])
    request = runtime.request([(3, 4, 5)] * 2)
    rows = request.scatter(x.reshape(-1, 6))
    torch.manual_seed(7)
    with request.active():
        got = request.gather(drop(rows))
    assert torch.equal(got, want.reshape(-1, 6))
    with pytest.raises(ValueError, match="Dropout2d drops whole channels"):
        winsp.RowDropout.like(nn.Dropout2d(0.1))


class _WithMethods(_Block):
    @property
    def doubled(self):
        return 2 * self.scale

    def mix(self, a, b):
        return torch.lerp(a, b, self.scale)

    @staticmethod
    def offset():
        return 1.0


def test_the_swapped_module_keeps_the_originals_methods_bound_to_itself():
    original = _WithMethods()
    new = winsp.swapped(lambda m, a, b: m.mix(a, b) + m.offset())(original)
    a, b = torch.zeros(3), torch.ones(3)
    assert torch.equal(new(a, b), original.mix(a, b) + 1.0)
    assert new.mix.__self__ is new and torch.equal(new.doubled, 2 * original.scale)
    with pytest.raises(AttributeError):
        new.missing  # noqa: B018


def _checkpointed(checkpoint: bool):
    """A window layer swapped with checkpoint=True: recomputed in backward with its request and layout."""
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double()
    calls = []

    def attend(m, x):  # the rows are in the layer's layout already (the layer is its own entry)
        calls.append(torch.is_grad_enabled())
        out, _ = m.request.attention(x[:, None], x[:, None], x[:, None], layer=m.index)
        return torch.nn.functional.linear(out[:, 0], m.weight, m.bias)

    plan = winsp.ParallelPlan(region=winsp.Region("", ""), attention="*",
                              make_attention=winsp.swapped(attend, checkpoint=checkpoint),
                              stages=[winsp.Stage([winsp.FixedWindows((1, 2, 2)), winsp.FixedWindows((1, 2, 2),
                                                                                                    (0, 1, 1))])])
    return original, plan, calls


def test_swapped_with_checkpoint_recomputes_with_the_forwards_request_and_equals_without():
    results = []
    for checkpoint in (False, True):
        model, plan, calls = _checkpointed(checkpoint)
        winsp.parallelize(model, winsp.ParallelPlan(**{**plan.__dict__, "layer_entry": "*"}))
        x = torch.randn(1, 1, 4, 6, 4, dtype=torch.float64, requires_grad=True)
        out = model.train()(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()], list(calls)))
    (out0, gx0, gp0, calls0), (out1, gx1, gp1, calls1) = results
    assert torch.equal(out0, out1) and torch.allclose(gx0, gx1, rtol=1e-13, atol=1e-13)
    assert all(torch.allclose(a, b, rtol=1e-13, atol=1e-13) for a, b in zip(gp0, gp1, strict=True))
    assert len(calls0) == 2 and len(calls1) == 4  # each layer ran again in backward, after the region had ended
