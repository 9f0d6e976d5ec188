"""k-diffusion's hourglass diffusion transformer (HDiT, vendored unchanged in ``tests/third_party/k_diffusion_hdit``),
adopted from its own code as one plan (``tests/third_party/hdit_adapter.py``): a level of shifted windows rolled by
``+window_shift``, a level of neighborhood attention, a global middle split across ranks, AdaRMSNorm broadcasting the
conditioning over ``[N, H, W, C]``, token merges and lerp-to-skip splits, dropout everywhere. Outputs and every
gradient equal the original's (float64, training mode, 2 and 3 ranks); with k-diffusion's own activation
checkpointing too. natten 0.21 has neither the ``na2d_qk`` / ``na2d_av`` the model calls off its fused path nor
float64 or gradients on CPU: the model gets a dense reference of them (``tests/na_oracle.py``'s neighbourhood rule).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

os.environ["K_DIFFUSION_USE_COMPILE"] = "0"  # k-diffusion's own switches: no torch.compile, no flash attention
os.environ["K_DIFFUSION_USE_FLASH_2"] = "0"
pytest.importorskip("einops")

import torch  # noqa: E402

import winsp  # noqa: E402
from examples.adapter_lines import model_specific_lines  # noqa: E402
from tests.na_oracle import oracle_mask  # noqa: E402
from tests.third_party import hdit_adapter  # noqa: E402
from tests.third_party.k_diffusion_hdit import flags  # noqa: E402
from tests.third_party.k_diffusion_hdit import image_transformer_v2 as hdit  # noqa: E402
from winsp.testing import check_parallel  # noqa: E402


def _scores(q, k, kernel_size):
    """natten's na2d_qk as a dense masked product: q, k [N, heads, H, W, D] -> [N, heads, H, W, H * W]."""
    h, w = q.shape[2:4]
    mask = oracle_mask([(1, h, w)], winsp.Neighborhood((kernel_size, kernel_size))).to(q.device)
    s = torch.einsum("nahwd,nakd->nahwk", q, k.flatten(2, 3))
    return s.masked_fill(~mask.reshape(h, w, h * w), float("-inf"))


def _mix(a, v, kernel_size):
    """natten's na2d_av on the dense weights of :func:`_scores`."""
    return torch.einsum("nahwk,nakd->nahwd", a, v.flatten(2, 3))


hdit.natten = SimpleNamespace(has_fused_na=lambda: False, functional=SimpleNamespace(na2d_qk=_scores, na2d_av=_mix))

LEVELS = [hdit.LevelSpec(2, 16, 24, hdit.ShiftedWindowAttentionSpec(8, 4), 0.1),
          hdit.LevelSpec(2, 16, 24, hdit.NeighborhoodAttentionSpec(8, 3), 0.1),
          hdit.LevelSpec(1, 24, 32, hdit.GlobalAttentionSpec(8), 0.1)]


def make_model() -> hdit.ImageTransformerDenoiserModelV2:
    model = hdit.ImageTransformerDenoiserModelV2(LEVELS, hdit.MappingSpec(1, 16, 24, 0.0), 3, 3, (2, 2)).double()
    with torch.no_grad():  # k-diffusion zero-initialises projections, norms' linears and the output: draw them all
        for p in model.parameters():
            p.uniform_(-0.4, 0.4) if p.dim() > 1 else p.uniform_(0.3, 1.5)
    return model


def make_parallel(model, world_size: int):
    return winsp.parallelize(model, hdit_adapter.PLAN, winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def make_inputs():
    x = torch.randn(2, 3, 16, 24, dtype=torch.float64).requires_grad_()  # grids 8 x 12, 4 x 6, middle 2 x 3
    return x, torch.tensor([0.4, 2.5], dtype=torch.float64)


def test_hdit_equals_the_original_in_outputs_and_every_gradient_in_training():
    report = check_parallel(make_model, make_parallel, make_inputs, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0 and report.max_error("input") > 0
    assert len([d for d in report.items.values() if d.kind == "param"]) == len(list(make_model().parameters()))


def make_checkpointed_parallel(model, world_size: int):
    class Checkpointed(torch.nn.Module):  # k-diffusion's flags.checkpointing() around the forward
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
    assert model_specific_lines(hdit_adapter.__file__) <= 15
    model = make_parallel(make_model(), 1)
    assert isinstance(model.mid_level[0].self_attn, winsp.adoption.Swapped)
    runtime = model._winsp_runtime
    assert [type(g).__name__ for g in runtime.schedule] == ["RolledWindows"] * 2 + ["Neighborhood"] * 2 + [
        "GlobalWindow"] + ["Neighborhood"] * 2 + ["RolledWindows"] * 2
    lines = runtime.describe("cpu").splitlines()  # every kind of layer, with its backend and module paths
    assert lines[1] == ("  windows (grouped SDPA): down_levels.0.0.self_attn, down_levels.0.1.self_attn, "
                        "up_levels.0.0.self_attn, up_levels.0.1.self_attn")
    assert lines[2].startswith("  neighborhood halos (tiled kernel): down_levels.1.0.self_attn, ")
    assert lines[3] == "  split windows (heads across ranks, grouped SDPA): mid_level.0.self_attn"


def test_the_rolled_windows_are_hdits_own_mask():
    """The geometry the plan gives a shifted level equals the mask HDiT builds (its make_shifted_window_masks)."""
    h, w, size, shift = 8, 12, 4, 2
    pos = torch.roll(torch.arange(h * w).reshape(h, w), (shift, shift), dims=(0, 1))
    windows = hdit.window(size, pos[..., None])[..., 0]  # [h / size, w / size, size, size] original positions
    mask = hdit.make_shifted_window_masks(h // size, w // size, size, size, shift)
    allowed = torch.zeros(h * w, h * w, dtype=torch.bool)
    ids = windows.reshape(h // size, w // size, -1)
    allowed[ids[..., :, None], ids[..., None, :]] = mask.reshape(h // size, w // size, size * size, size * size)
    geometry = winsp.geometry.RolledWindows((size, size), (shift, shift))
    group = torch.full((h, w), -1)
    for i, (_, a, b) in enumerate(geometry.slices((1, h, w))):
        group[a, b] = i
    flat = group.reshape(-1)
    assert torch.equal(allowed, flat[:, None] == flat[None, :])
