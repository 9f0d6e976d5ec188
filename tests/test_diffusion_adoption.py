"""Adopting a model whose blocks take more than the tokens: a per-sample conditioning vector broadcast over the tokens
(adaLN: ``cond[:, None, None, :]``) and positions given per grid position (axial RoPE from ``[H, W, 2]``), on
channels-last ``[N, H, W, C]`` activations, with a neighbourhood and global level, a 2 x 2 merge and a global level.

The model below is written without winsp (as a diffusion transformer of this kind would be); its adapter takes the
conditioning per row with ``request.sample_rows`` and the positions with ``request.grid_rows``, and is checked
against it in outputs and every gradient (float64, 2 and 3 ranks). Also the messages a new user meets on the way:
an unswapped adaLN norm (named, with the fix), a 2D model given one int as its neighbourhood kernel, activation
checkpointing inside the region (exact where a module is recomputed, refused by its cause where not), and the shifted
windows of a model that rolls its grid forward.
"""

from __future__ import annotations

import functools
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import winsp
from tests.na_oracle import oracle_mask
from winsp.testing import check_parallel, run_ranks

GRID, DIM, HEADS, COND = (8, 6), 8, 2, 5


class AdaNorm(nn.Module):
    """RMS norm scaled per sample by the conditioning: ``x [N, H, W, C]``, ``cond [N, D]``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(COND, DIM)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.linear(cond)[:, None, None, :])


def rotate(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first 2 * angle.shape[-1] channels of ``x [..., heads, d]`` by ``angle [..., d']``."""
    n = angle.shape[-1]
    cos, sin = angle.cos()[..., None, :], angle.sin()[..., None, :]
    a, b = x[..., :n], x[..., n:2 * n]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., 2 * n:]], dim=-1)


class Attention(nn.Module):
    """Axial-RoPE attention over a sample's ``[H, W]`` grid: a neighbourhood of ``kernel`` (dense, masked) or global."""

    def __init__(self, kernel=None) -> None:
        super().__init__()
        self.kernel = kernel
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.freqs = nn.Parameter(torch.randn(2, 2))  # angle = pos [.., 2] @ freqs: 2 rotated pairs

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        n, h, w, c = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, -1)).unbind(-3)  # [N, H, W, heads, d]
        q, k = rotate(q, pos @ self.freqs), rotate(k, pos @ self.freqs)
        mask = None if self.kernel is None else oracle_mask([(1, h, w)], winsp.Neighborhood(self.kernel)).to(x.device)
        out = F.scaled_dot_product_attention(*(t.reshape(n, h * w, HEADS, -1).transpose(1, 2) for t in (q, k, v)),
                                             attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(n, h, w, c))


class Block(nn.Module):
    """``recompute``: None, or which call is activation-checkpointed and how: ``"attn"`` / ``"attn-reentrant"`` (the
    attention module), ``"norm+attn"`` (a function of the norm and the attention)."""

    def __init__(self, kernel=None, recompute: Optional[str] = None) -> None:
        super().__init__()
        self.norm, self.attn, self.recompute = AdaNorm(), Attention(kernel), recompute
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        if self.recompute in ("attn", "attn-reentrant"):
            x = x + checkpoint(self.attn, self.norm(x, cond), pos, use_reentrant=self.recompute == "attn-reentrant")
        elif self.recompute == "norm+attn":
            x = x + checkpoint(lambda h, p, c: self.attn(self.norm(h, c), p), x, pos, cond, use_reentrant=False)
        else:
            x = x + self.attn(self.norm(x, cond), pos)
        return x + self.mlp(x)


class Merge(nn.Module):
    """2 x 2 tokens -> one: their channels concatenated row-major, then a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, h, w, c = x.shape
        return self.proj(x.reshape(n, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(n, h // 2, w // 2, -1))


class Body(nn.Module):
    """A level of two neighbourhood blocks and a global one, a 2 x 2 merge (channels of each 2 x 2 patch, row-major),
    a global level."""

    def __init__(self, recompute: Optional[str] = None) -> None:
        super().__init__()
        inner = None if recompute == "block" else recompute  # "block": each whole block (a layer entry) checkpointed
        self.fine = nn.ModuleList([Block((3, 3), inner), Block((5, 3), inner), Block(None, inner)])
        self.merge = Merge()
        self.coarse = nn.ModuleList([Block(None, inner)])
        self.recompute = recompute

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        run = (lambda block, *a: checkpoint(block, *a, use_reentrant=False)) if self.recompute == "block" else \
            (lambda block, *a: block(*a))
        for block in self.fine:
            x = run(block, x, pos, cond)
        x = run(self.merge, x)
        h, w = pos.shape[:2]
        pos = pos.reshape(h // 2, 2, w // 2, 2, 2).mean((1, 3))
        for block in self.coarse:
            x = run(block, x, pos, cond)
        return x


class CondNet(nn.Module):
    def __init__(self, recompute: Optional[str] = None) -> None:
        super().__init__()
        self.embed, self.cond, self.body, self.head = nn.Linear(3, DIM), nn.Linear(1, COND), Body(recompute), \
            nn.Linear(DIM, 3)

    def forward(self, image: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h, w = image.shape[1:3]
        pos = torch.stack(torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij"), -1)
        return self.head(self.body(self.embed(image), pos.to(image.dtype), self.cond(t[:, None])))


# ---- the adapter ---------------------------------------------------------------------------------------------------

def attend(m, x, pos):
    request = winsp.current_request()
    q, k, v = m.qkv(x).unflatten(-1, (3, HEADS, -1)).unbind(-3)
    angle = request.grid_rows(pos, spatial_dims=2) @ m.freqs  # this rank's rows of the [H, W, 2] positions
    return m.proj(request.attention(rotate(q, angle), rotate(k, angle), v, layer=m.index)[0].flatten(1))


def ada_norm(m, x, cond):
    scale = 1 + winsp.current_request().sample_rows(m.linear(cond))  # each local row's sample's [C]
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


def merge(m, x):
    return m.proj(winsp.current_request().to_grid(x, m.index))


def plan(model: CondNet, *, norms: bool = True) -> winsp.ParallelPlan:
    fine = [winsp.Neighborhood(b.attn.kernel) if b.attn.kernel else winsp.FixedWindows((1 << 20,) * 3)
            for b in model.body.fine]
    return winsp.ParallelPlan(
        region=winsp.Region("body", "body", winsp.ChannelsLast(spatial_dims=2)),
        stages=[winsp.Stage(fine), winsp.Stage([winsp.FixedWindows((1 << 20,) * 3)], merge=(1, 2, 2),
                                               split_windows=True)],
        attention="body.*.*.attn", make_attention=winsp.swapped(attend),
        grid_changes="body.merge", make_grid_change=winsp.swapped(merge),
        swaps=[("body.*.*.norm", winsp.swapped(ada_norm))] if norms else [])


def make_original() -> CondNet:
    return CondNet().double()


def make_parallel(original: CondNet, world_size: int) -> CondNet:
    return winsp.parallelize(original, plan(original), winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def make_inputs():
    return torch.randn(2, *GRID, 3, dtype=torch.float64).requires_grad_(), torch.tensor([0.3, 1.7],
                                                                                        dtype=torch.float64)


def test_conditioning_and_positions_per_row_equal_the_original_in_outputs_and_every_gradient():
    report = check_parallel(make_original, make_parallel, make_inputs, world_sizes=(2, 3), timeout=300)
    assert report.ok and report.max_error("param") > 0 and report.max_error("input") > 0
    grads = [d for d in report.items.values() if d.kind == "param"]
    assert {d.name for d in grads} >= {"body.fine.0.norm.linear.weight", "body.coarse.0.attn.freqs"}


def test_an_unswapped_adaln_norm_is_named_with_the_per_sample_fix():
    torch.manual_seed(0)
    model = make_original()
    winsp.parallelize(model, plan(model, norms=False))
    with pytest.raises(ValueError, match=r"'body\.fine\.0\.norm' \(AdaNorm\) took local rows \[96, 8\] and returned "
                                         r"\[2, 1, 96, 8\].*per-sample tensor.*ParallelPlan\(per_sample="
                                         r"'body\.fine\.0\.norm'\).*sample_rows"):
        model(*make_inputs())


def test_a_changed_row_count_that_is_not_a_broadcast_keeps_the_reshape_hint():
    torch.manual_seed(0)
    model = make_original()
    p = plan(model)
    winsp.parallelize(model, winsp.ParallelPlan(**{**p.__dict__, "swaps": p.swaps + (
        ("body.fine.0.mlp.1", lambda m: winsp.swapped(lambda _, x: x.reshape(2, -1, x.shape[-1]))(m)),)}))
    with pytest.raises(ValueError, match=r"'body\.fine\.0\.mlp\.1'.*pooling over tokens needs the whole grid.*grid_rows"):
        model(*make_inputs())


def _rows_of(rank: int, world_size: int) -> list:
    """grid_rows / sample_rows against the rows scatter gives of the same values laid out canonically, on a padded
    stage (Swin's whole windows) and after a merge."""
    runtime = winsp.WindowRuntime(
        [winsp.Stage([winsp.SwinWindows((1, 3, 3), pad=True)]), winsp.Stage([winsp.FixedWindows((1, 2, 2))],
                                                                            merge=(1, 2, 2))],
        group=winsp.comm.SPGroup.world())
    request = runtime.request([(1, 5, 4), (1, 5, 4)])
    table = torch.arange(5 * 4 * 2, dtype=torch.float64).reshape(5, 4, 2)
    per_sample = torch.tensor([[10.0], [20.0]], dtype=torch.float64)
    out = []
    x = request.scatter(torch.cat([table.reshape(20, 2)] * 2))
    out.append(torch.equal(request.grid_rows(table, spatial_dims=2), x))
    out.append(torch.equal(request.grid_rows(table[None], spatial_dims=3), x))
    out.append(bool((request.grid_rows(table, spatial_dims=2)[~request.valid_rows] == 0).all()))
    out.append(torch.equal(request.sample_rows(per_sample)[:, 0], 10.0 * (1 + request.row_sample.double())))
    request.to_grid(x, 1)
    out.append(request.grid_rows(table[:3, :2], spatial_dims=2).shape == (request.layout().num_rows, 2))
    for bad in (lambda: request.grid_rows(table, spatial_dims=2),  # stage 1's grid is (1, 3, 2)
                lambda: request.sample_rows(per_sample[:1]), lambda: request.grid_rows(table, spatial_dims=4)):
        try:
            bad()
            out.append("accepted")
        except ValueError as err:
            out.append(str(err).split(":")[0])
    return out


def test_grid_rows_and_sample_rows_are_the_rows_scatter_gives():
    for result in run_ranks(_rows_of, 2, timeout=120):
        assert result == [True] * 5 + ["grid_rows", "sample_rows", "grid_rows"]


def test_grid_rows_refuses_samples_on_different_grids():
    request = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))]).request([(1, 4, 4), (1, 2, 4)])
    request.scatter(torch.zeros(24, 1))
    with pytest.raises(ValueError, match=r"different grids \[\(1, 2, 4\), \(1, 4, 4\)\]"):
        request.grid_rows(torch.zeros(4, 4, 1), spatial_dims=2)


def test_one_int_kernel_on_a_2d_grid_says_to_give_the_2d_kernel():
    with pytest.raises(ValueError, match=r"along t needs at least 7 tokens.*Neighborhood\(\(7, 7\)\)"):
        winsp.Neighborhood(7).check_fits((1, 16, 16))
    with pytest.raises(ValueError, match=r"along w needs at least 7 tokens there, the grid has 5 \([^;]*\)$"):
        winsp.Neighborhood((7, 7)).check_fits((1, 16, 5))  # no 2D hint where the axis is just too small


def make_recomputed(mode: str) -> CondNet:
    return CondNet(recompute=mode).double()


@pytest.mark.parametrize("mode", ["attn", "attn-reentrant", "block"])
def test_activation_checkpointing_inside_the_region_equals_the_original(mode):
    """A module recomputed during backward (the attention, reentrant or not; a whole block, whose entry then moves
    rows again) runs in the layout it ran in, through the same collectives: equal to the original in every gradient."""
    report = check_parallel(functools.partial(make_recomputed, mode), make_parallel, make_inputs, world_sizes=(2,),
                            timeout=300)
    assert report.ok and report.max_error("param") > 0


def test_a_checkpointed_function_whose_modules_get_recomputed_tensors_is_refused_by_its_cause():
    torch.manual_seed(0)
    model = make_recomputed("norm+attn")  # the attention's input is recomputed (the norm's output): no note for it
    winsp.parallelize(model, plan(model))
    out = model(*make_inputs())
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        out.sum().backward()


def _rolled_window_ids(size: int, window: int, shift: int) -> torch.Tensor:
    """Window of each position when the model rolls its grid forward by ``shift`` and cuts every ``window`` (the
    first window split in two by its mask, as the roll brings the end of the grid to its start)."""
    rolled = torch.roll(torch.arange(size), shift)  # rolled[r] = the position the roll put at r
    ids = torch.empty(size, dtype=torch.long)
    ids[rolled] = torch.arange(size) // window * 2 + ((torch.arange(size) < shift) & (torch.arange(size) < window))
    return ids


@pytest.mark.parametrize("window,shift", [(4, 2), (6, 2), (5, 2)])
def test_a_grid_rolled_forward_by_s_has_the_windows_of_fixed_windows_shifted_by_window_minus_s(window, shift):
    size = 3 * window
    rolled = _rolled_window_ids(size, window, shift)
    cuts = winsp.FixedWindows((1, 1, window), (0, 0, window - shift)).slices((1, 1, size))
    fixed = torch.empty(size, dtype=torch.long)
    for i, (_, _, w) in enumerate(cuts):
        fixed[w] = i
    same = rolled[:, None] == rolled[None, :]
    assert torch.equal(same, fixed[:, None] == fixed[None, :])


class Siblings(nn.Module):
    """The levels run by the model's own forward (no container holds them), registered in another order than they
    run: the coarse level, the merge, then the fine level."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cond, self.head = nn.Linear(3, DIM), nn.Linear(1, COND), nn.Linear(DIM, 3)
        self.coarse, self.merge = nn.ModuleList([Block(None)]), Merge()
        self.fine = nn.ModuleList([Block((3, 3)), Block((5, 3))])

    def forward(self, image: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h, w = image.shape[1:3]
        axes = (torch.linspace(-1, 1, n, dtype=image.dtype, device=image.device) for n in (h, w))  # meta-friendly
        pos = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1)
        x, cond = self.embed(image), self.cond(t[:, None])
        for block in self.fine:
            x = block(x, pos, cond)
        x, pos = self.merge(x), pos.reshape(h // 2, 2, w // 2, 2, 2).mean((1, 3))
        for block in self.coarse:
            x = block(x, pos, cond)
        return self.head(x)


def sibling_plan(model: Siblings, *, ordered: bool = True) -> winsp.ParallelPlan:
    return winsp.ParallelPlan(
        region=winsp.Region("fine.0", "coarse.0", winsp.ChannelsLast(spatial_dims=2)),
        stages=[winsp.Stage([winsp.Neighborhood(b.attn.kernel) for b in model.fine]),
                winsp.Stage([winsp.FixedWindows((1 << 20,) * 3)], merge=(1, 2, 2), split_windows=True)],
        forward_order=("fine", "merge", "coarse") if ordered else None,
        attention="*.*.attn", make_attention=winsp.swapped(attend), grid_changes="merge",
        make_grid_change=winsp.swapped(merge), swaps=[("*.*.norm", winsp.swapped(ada_norm))])


def make_siblings() -> Siblings:
    return Siblings().double()


def parallel_siblings(original: Siblings, world_size: int) -> Siblings:
    return winsp.parallelize(original, sibling_plan(original),
                             winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def test_a_region_between_two_sibling_levels_equals_the_original():
    report = check_parallel(make_siblings, parallel_siblings, make_inputs, world_sizes=(2,), timeout=300)
    assert report.ok and report.max_error("param") > 0


def test_a_region_between_sibling_levels_in_registration_order_gets_its_order_recorded():
    torch.manual_seed(0)
    stated, recorded = make_siblings(), make_siblings()
    recorded.load_state_dict(stated.state_dict())
    winsp.parallelize(stated, sibling_plan(stated))
    winsp.parallelize(recorded, sibling_plan(recorded, ordered=False))
    inputs = make_inputs()
    assert torch.equal(recorded(*inputs), stated(*inputs))
    assert recorded._winsp_runtime.layer_names == ("fine.0.attn", "fine.1.attn", "coarse.0.attn")


def test_a_region_between_sibling_levels_in_a_wrong_stated_order_is_refused_by_the_forward_on_meta_tensors():
    torch.manual_seed(0)
    model = make_siblings()
    plan = sibling_plan(model)
    winsp.parallelize(model, winsp.ParallelPlan(**{**plan.__dict__, "forward_order": ("coarse", "merge", "fine")}))
    scatters = []
    original_scatter = winsp.runtime.WindowRequest.scatter
    try:
        winsp.runtime.WindowRequest.scatter = lambda self, *a, **k: (scatters.append(1)
                                                                     or original_scatter(self, *a, **k))
        for _ in range(2):  # refused again on the next call, not only once
            with pytest.raises(ValueError, match=r"the forward runs 'fine\.0' \(window layer 1\) where the plan "
                                                 r"expects 'coarse\.0' \(window layer 0\).*Found by a forward on meta"):
                model(*make_inputs())
    finally:
        winsp.runtime.WindowRequest.scatter = original_scatter
    assert scatters == []  # no request scattered any rows
