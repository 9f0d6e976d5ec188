"""What a new user of ``winsp.parallelize`` runs into: hooks registered between ``parallelize()`` and the first
forward, a splitting planner on a plan that keeps windows whole, values of another head size."""

from __future__ import annotations

import pytest
import torch

import winsp
from tests.test_diffusion_adoption import attend, make_inputs, make_siblings, sibling_plan
from winsp.adoption import Swapped


class OwnSwap(Swapped):
    """A swapped attention of the user's own class (not what winsp.swapped builds): renumbering rebuilds it."""


@pytest.mark.parametrize("own", [False, True], ids=["winsp.swapped", "own module"])
def test_a_forward_hook_registered_right_after_parallelize_fires_when_the_first_forward_renumbers_the_layers(own):
    torch.manual_seed(0)
    model = make_siblings()
    plan = sibling_plan(model, ordered=False)  # registered coarse, fine, fine; run fine, fine, coarse
    if own:
        plan = winsp.ParallelPlan(**{**plan.__dict__, "make_attention": lambda original, layer: OwnSwap(
            attend, original, layer)})
    winsp.parallelize(model, plan)
    assert model._winsp_runtime.layer_names == ("coarse.0.attn", "fine.0.attn", "fine.1.attn")  # registration order
    before = model.coarse[0].attn
    seen, pre = [], []
    handles = [model.fine[0].attn.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape))),
               model.coarse[0].attn.register_forward_pre_hook(lambda m, a: pre.append(m.index))]
    model(*make_inputs())  # the recording renumbers: coarse runs last
    assert model._winsp_runtime.layer_names == ("fine.0.attn", "fine.1.attn", "coarse.0.attn")
    assert len(seen) == 1 and pre == [2]  # both hooks fired, and the module knows its new number
    assert (model.coarse[0].attn is before) != own  # winsp.swapped modules are kept, the user's own rebuilt
    for handle in handles:
        handle.remove()  # the user's handles still remove them
    model(*make_inputs())
    assert len(seen) == 1 and pre == [2]


def test_attention_refuses_values_of_another_head_size_naming_the_shapes():
    runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))])
    request = runtime.request([(1, 2, 2)])
    q = request.scatter(torch.randn(4, 2, 8))
    with pytest.raises(ValueError, match=r"v with q's head size\); got q \[4, 2, 8\], k \[4, 2, 8\], v \[4, 2, 4\]"):
        request.attention(q, q, torch.randn(4, 2, 4), layer=0)
