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
