"""torch.compile with inductor of blocks whose attention takes a score_mod read from a layout hook.

Blocks compile with ``fullgraph=True`` (a graph break raises): the bias index is prepared by the layout hook in the
planning phase and the request is made with ``dtype`` and ``score_mods=True``, so the block reads prepared tensors
only. Compiled output and gradients equal eager.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import winsp
from examples.toy_biased_windows import BiasedBlock


class BiasedAttention(nn.Module):
    """One block's attention: qkv, the relative position bias as a score_mod, the output projection."""

    def __init__(self, block: BiasedBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, txt, request: winsp.runtime.WindowRequest):
        b = self.block
        key = request.layout_data("bias_key")
        center = b.center()

        def score_mod(score, head, q_row, k_row):
            return score + b.bias[key[q_row] - key[k_row] + center, head]

        def mask_mod(head, q_row, k_row):  # a mask that keeps every pair within 6 bias slots of the diagonal
            return (key[q_row] - key[k_row]).abs() <= 6 * (head + 1)

        a, at = request.attention(*b.split(b.qkv(x)), *b.split(b.qkv(txt)), layer=b.layer, score_mod=score_mod,
                                  mask_mod=mask_mod)
        return x + b.out(a.flatten(1)), txt + b.out(at.flatten(1))


def _setup():
    torch.manual_seed(0)
    block = BiasedBlock(16, 2, (2, 3, 4), layer=1)
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    runtime = winsp.WindowRuntime([winsp.FixedWindows((2, 3, 4)), winsp.FixedWindows((2, 3, 4), shift=(1, 1, 2))])
    strides = torch.tensor(block.strides())
    runtime.register_layout_hook("bias_key", lambda local, device: torch.from_numpy(local.grid_coords) @ strides)
    return BiasedAttention(block), runtime


def _step(module, runtime, vid, txt):
    request = runtime.request([(3, 6, 8)], [3], dtype=torch.float32, score_mods=True)
    x = request.to_layer(request.scatter(vid), 1)
    out, out_txt = module(x, txt, request)
    loss = (request.gather(out) * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + (out_txt ** 2).sum()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_inductor_fullgraph_block_with_score_and_mask_mod_equals_eager():
    module, runtime = _setup()
    gen = torch.Generator().manual_seed(1)
    vid, txt = torch.randn(144, 16, generator=gen), torch.randn(3, 16, generator=gen)
    eager_out, eager_grads = _step(module, runtime, vid, txt)
    module.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="inductor", fullgraph=True)
    out, grads = _step(compiled, runtime, vid, txt)
    assert (out - eager_out).abs().max() <= 1e-5
    assert {n.removeprefix("_orig_mod.") for n in grads} == set(eager_grads) and "block.bias" in eager_grads
    for name, g in grads.items():
        want = eager_grads[name.removeprefix("_orig_mod.")]
        assert (g - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item()), name


@pytest.mark.slow
def test_inductor_compiles_the_flex_backend_on_cpu_for_inference():
    """torch compiles FlexAttention on CPU for inference only: the whole biased model, flex backend, no_grad.

    Without text: with text rows in the packed sequence, torch 2.13's CPU FlexAttention template emits C++ that does
    not compile (``cur_qSplitSize3`` undeclared; a torch bug, recorded in benchmarks/README.md), so on CPU the flex
    backend with text runs eagerly unless the user compiles and that template works for their shapes.
    """
    from examples.toy_biased_windows import BiasedWindows, PlainBiasedWindows

    torch.manual_seed(0)
    plain = PlainBiasedWindows()
    model = BiasedWindows()
    model.load_state_dict(plain.state_dict())
    model.build_runtime(winsp.DiffusionParallelConfig(attention_backend="flex"))
    gen = torch.Generator().manual_seed(1)
    grids, lengths = [(3, 6, 8), (2, 5, 4)], [0, 0]
    vid, txt = torch.randn(184, 16, generator=gen), torch.zeros(0, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend="inductor")
        assert (compiled(vid, txt, grids, lengths) - plain(vid, txt, grids, lengths)).abs().max() <= 1e-5
