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
