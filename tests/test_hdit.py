"""The hourglass diffusion transformer of the ``hdit`` package (k-diffusion's HDiT, installed from the package index,
untouched), adopted from its own code as one plan (``examples/hdit/adapter.py``): a level of shifted windows rolled by
``+window_shift``, a level of neighborhood attention, a global middle split across ranks, AdaRMSNorm broadcasting the
conditioning over ``[N, H, W, C]``, token merges and lerp-to-skip splits, dropout everywhere. Outputs and every
gradient equal the original's (float64, training mode, 2 and 3 ranks); with the model's own activation checkpointing
too. natten 0.21 has neither the ``na2d_qk`` / ``na2d_av`` the model calls off its fused path nor float64 or gradients
on CPU: the model's module gets a dense reference of them (``tests/na_oracle.py``'s neighbourhood rule).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ["K_DIFFUSION_USE_COMPILE"] = "0"  # hdit's (k-diffusion's) own switches: no torch.compile, no flash attention
os.environ["K_DIFFUSION_USE_FLASH_2"] = "0"

import torch  # noqa: E402

from examples.swin3d.load_torchvision import import_torchvision  # noqa: E402

import_torchvision()  # hdit imports torchvision: beside a CPU torch the index's CUDA wheel needs the loader's shim
pytest.importorskip("hdit")

import winsp  # noqa: E402
from examples.adapter_lines import model_specific_lines  # noqa: E402
from examples.hdit import adapter  # noqa: E402
from tests.na_oracle import oracle_mask  # noqa: E402
from winsp.testing import check_parallel  # noqa: E402

from hdit import HDiT  # noqa: E402  isort: skip
from hdit.modules import flags  # noqa: E402  isort: skip
from hdit.modules.attention import GlobalTransformerLayer, NeighborhoodTransformerLayer  # noqa: E402  isort: skip
from hdit.modules.attention import ShiftedWindowTransformerLayer  # noqa: E402  isort: skip
from hdit.modules.attention import neighborhood_attention, shifted_self_attention  # noqa: E402  isort: skip


def _scores(q, k, kernel_size):
    """natten's na2d_qk as a dense masked product: q, k [N, heads, H, W, D] -> [N, heads, H, W, H * W]."""
    h, w = q.shape[2:4]
    mask = oracle_mask([(1, h, w)], winsp.Neighborhood((kernel_size, kernel_size))).to(q.device)
    s = torch.einsum("nahwd,nakd->nahwk", q, k.flatten(2, 3))
    return s.masked_fill(~mask.reshape(h, w, h * w), float("-inf"))


def _mix(a, v, kernel_size):
    """natten's na2d_av on the dense weights of :func:`_scores`."""
    return torch.einsum("nahwk,nakd->nahwd", a, v.flatten(2, 3))


neighborhood_attention.natten = SimpleNamespace(has_fused_na=lambda: False,
                                                functional=SimpleNamespace(na2d_qk=_scores, na2d_av=_mix))

# levels (hdit numbers them down 0, 1, middle 2, up 3, 4): shifted windows 4 (shift 2 on odd blocks, as k-diffusion),
# neighborhoods of 3, a global middle; heads of 8, feed-forwards 24 (32 in the middle), dropout 0.1
BLOCKS = {
    0: lambda c: ShiftedWindowTransformerLayer(c.width, 24, 8, c.mapping_width, 4, 2 * (c.block_index % 2), 0.1),
    1: lambda c: NeighborhoodTransformerLayer(c.width, 24, 8, c.mapping_width, 3, 0.1),
    2: lambda c: GlobalTransformerLayer(c.width, 32, 8, c.mapping_width, 0.1),
}
BLOCKS.update({3: BLOCKS[1], 4: BLOCKS[0]})


def make_model() -> HDiT:
    model = HDiT(3, 3, patch_size=(2, 2), widths=[16, 16], middle_width=24, depths=[2, 2], middle_depth=1,
                 block_builders=BLOCKS, mapping_width=16, mapping_depth=1, mapping_feed_forward_dim=24).double()
    with torch.no_grad():  # hdit zero-initialises projections, norms' linears and the output: draw them all
        for p in model.parameters():
            p.uniform_(-0.4, 0.4) if p.dim() > 1 else p.uniform_(0.3, 1.5)
    return model


def make_parallel(model, world_size: int):
    return winsp.parallelize(model, adapter.PLAN, winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def make_inputs():
    x = torch.randn(2, 3, 16, 24, dtype=torch.float64).requires_grad_()  # grids 8 x 12, 4 x 6, middle 2 x 3
    return x, torch.tensor([0.4, 2.5], dtype=torch.float64)


def test_hdit_equals_the_original_in_outputs_and_every_gradient_in_training():
    report = check_parallel(make_model, make_parallel, make_inputs, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0 and report.max_error("input") > 0
    assert len([d for d in report.items.values() if d.kind == "param"]) == len(list(make_model().parameters()))


def make_checkpointed_parallel(model, world_size: int):
    class Checkpointed(torch.nn.Module):  # the model's own flags.checkpointing() around the forward
        def __init__(self, inner):
            super().__init__()
            self.module = inner

        def forward(self, *args):
            with flags.checkpointing():
                return self.module(*args)

    return Checkpointed(make_parallel(model, world_size))


@pytest.mark.slow  # about 40 s on a shared 2-core machine; the same model without checkpointing runs by default
def test_hdit_with_its_own_activation_checkpointing_equals_the_original():
    report = check_parallel(make_model, make_checkpointed_parallel, make_inputs, world_sizes=(2,), train=True,
                            timeout=300)
    assert report.ok and report.max_error("param") > 0


def test_the_adapter_is_one_plan_of_few_lines():
    assert model_specific_lines(adapter.__file__) <= 15
    model = make_parallel(make_model(), 1)
    assert isinstance(model.middle_level[0].self_attn, winsp.adoption.Swapped)
    runtime = model._winsp_runtime
    assert [type(g).__name__ for g in runtime.schedule] == ["RolledWindows"] * 2 + ["Neighborhood"] * 2 + [
        "GlobalWindow"] + ["Neighborhood"] * 2 + ["RolledWindows"] * 2
    assert [g.roll for g in runtime.schedule[:2]] == [(0, 0, 0), (0, 2, 2)]
    lines = runtime.describe("cpu").splitlines()  # every kind of layer, with its backend and module paths
    assert lines[1] == ("  windows (grouped SDPA): down_levels.0.0.self_attn, down_levels.0.1.self_attn, "
                        "up_levels.0.0.self_attn, up_levels.0.1.self_attn")
    assert lines[2].startswith("  neighborhood halos (tiled kernel): down_levels.1.0.self_attn, ")
    assert lines[3] == "  split windows (heads across ranks, grouped SDPA): middle_level.0.self_attn"


def test_a_plan_that_leaves_out_tokens_is_told_to_give_them():
    """The levels take [N, H, W, C]; without Hourglass(tokens=ChannelsLast(2)) the default reads [N, T, H, W, C]."""
    plan = dataclasses.replace(adapter.PLAN, stages=dataclasses.replace(adapter.PLAN.stages, tokens=None))
    model = winsp.parallelize(make_model(), plan)
    with pytest.raises(ValueError, match=r"must be a \[B, T, H, W, C\] tensor, got \(2, 8, 12, 16\).*tokens=.*"
                                         r"Hourglass\(\.\.\., tokens=\).*winsp\.ChannelsLast\(2\) for \[B, H, W, C\]"):
        model(*make_inputs())


def test_the_guide_shows_the_shipped_plan():
    """docs/adopting_a_model.md runs the adapter's code as its own block: the two must not drift apart."""
    source = Path(adapter.__file__).read_text()
    code = source[source.index("def attend"):].strip()
    assert code in (Path(__file__).parents[1] / "docs" / "adopting_a_model.md").read_text()


def test_the_rolled_windows_are_hdits_own_mask():
    """The geometry the plan gives a shifted level equals the mask HDiT builds (its make_shifted_window_masks)."""
    h, w, size, shift = 8, 12, 4, 2
    pos = torch.roll(torch.arange(h * w).reshape(h, w), (shift, shift), dims=(0, 1))
    windows = shifted_self_attention.window(size, pos[..., None])[..., 0]  # [h / size, w / size, size, size]
    mask = shifted_self_attention.make_shifted_window_masks(h // size, w // size, size, size, shift)
    allowed = torch.zeros(h * w, h * w, dtype=torch.bool)
    ids = windows.reshape(h // size, w // size, -1)
    allowed[ids[..., :, None], ids[..., None, :]] = mask.reshape(h // size, w // size, size * size, size * size)
    geometry = winsp.geometry.RolledWindows((size, size), (shift, shift))
    group = torch.full((h, w), -1)
    for i, (_, a, b) in enumerate(geometry.slices((1, h, w))):
        group[a, b] = i
    flat = group.reshape(-1)
    assert torch.equal(allowed, flat[:, None] == flat[None, :])
