"""Recording the forward order of a model whose swaps nest (an attention swapped inside a block that is swapped too),
registered in another order than its forward runs them: the first forward renumbers the layers, re-applies the plan,
and the model equals the original (it used to fail with a bare StopIteration looking up the inner swap's parent)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import winsp
from winsp.adoption import Swapped


class Attention(nn.Module):  # attention inside each frame of [B, T, H, W, C]
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, t, h, w, c = x.shape
        q, k, v = self.qkv(x).reshape(b * t, h * w, 3, c).unbind(2)
        return F.scaled_dot_product_attention(q, k, v).reshape(x.shape)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(), nn.Linear(8, 8)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class Net(nn.Module):  # registers `late` first, runs `early` first
    def __init__(self) -> None:
        super().__init__()
        self.late, self.early = Block(), Block()

    def forward(self, x):
        return self.late(self.early(x))


def attend(m, x):
    q, k, v = m.qkv(x)[:, None].chunk(3, -1)
    return m.request.attention(q, k, v, layer=m.index)[0].flatten(1)


def block(m, x):  # the block, swapped too (as an adapter that rewrites it would)
    x = x + m.attn(x)
    return x + m.mlp(x)


class OwnAttention(Swapped):
    """An attention module of the user's own class: a renumbering builds it again."""


@pytest.mark.parametrize("own", [False, True], ids=["winsp.swapped", "own attention module"])
def test_nested_swaps_are_recorded_renumbered_and_exact(own):
    make_attention = (lambda original, layer: OwnAttention(attend, original, layer)) if own else winsp.swapped(attend)
    plan = winsp.ParallelPlan(region=winsp.Region("", ""), attention="*.attn", make_attention=make_attention,
                              stages=[winsp.Stage([winsp.FixedWindows((1, 1 << 20, 1 << 20))] * 2)],
                              swaps=[("late", winsp.swapped(block)), ("early", winsp.swapped(block))])
    torch.manual_seed(0)
    original = Net().double()
    model = winsp.parallelize(Net().double(), plan)
    model.load_state_dict(original.state_dict())
    x = torch.randn(1, 2, 3, 3, 8, dtype=torch.float64)
    assert model._winsp_runtime.layer_names == ("late.attn", "early.attn")  # registration order, before the forward
    torch.testing.assert_close(model(x), original(x), rtol=0, atol=1e-12)
    assert model._winsp_runtime.layer_names == ("early.attn", "late.attn")  # recorded: the forward's order
    assert [model.early.attn.index, model.late.attn.index] == [0, 1]
    assert model.late.attn is model.late._modules["attn"]  # the swapped block holds the renumbered attention
    torch.testing.assert_close(model(x), original(x), rtol=0, atol=1e-12)
    winsp.unparallelize(model)
    assert type(model.late) is Block and type(model.late.attn) is Attention
