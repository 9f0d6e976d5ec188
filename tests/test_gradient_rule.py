"""winsp's gradient convention holds wherever ``scatter`` / ``gather`` sit (float64, SP = 2, 3, 4).

The rule: every rank computes the same loss from replicated values, each rank's copy of a replicated value is its own
contribution, and ``winsp.sync_gradients`` averages over the SP group. Checked here on random chains of: replicated
ops with parameters before ``scatter``, SeedVR2-like window blocks (separate or shared stream weights, modulation by a
timestep embedding, layout changes between layers), ``gather``, replicated ops between two sharded regions (a
hierarchical model's stage boundary, with an optional 2x2 patch merge), a head after the final ``gather``, losses on
the video and the text outputs. Every parameter and input gradient must equal one rank's (<= 1e-9 relative).

One spawned world of 4 ranks serves every SP degree (subgroups {0, 1}, {0, 1, 2} and the world); inside it each
SP group runs a fixed number of hypothesis examples, derandomised, so all ranks of a group draw the same chains and
decide pass / fail together (the errors are summed over the group before asserting).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import winsp
from winsp.comm.group import SPGroup, new_subgroup
from winsp.testing import run_ranks

DIM, HEADS = 8, 2
WINDOWS = [(1, 2, 2), (2, 2, 2), (1, 2, 3), (2, 4, 4)]
GRID_SETS = [((2, 4, 4),), ((1, 4, 6), (2, 2, 4)), ((1, 2, 2),), ((3, 4, 4), (1, 2, 6)), ((2, 3, 5),)]
TINY = ((1, 2, 2),)  # one window for most geometries: ranks without windows at every SP degree


@dataclass(frozen=True)
class Chain:
    """A model as a sequence of steps. ``ops`` items: ("rep", "linear" | "mix"), ("txt",), ("merge",), ("scatter",),
    ("block", shared, modulated, window, shifted), ("gather",), ("head",)."""

    grids: tuple
    text_lengths: tuple
    ops: tuple
    text_loss: bool
    seed: int
    planner: str = "auto"  # the default splits windows where whole ones cannot balance; "lpt" keeps ranks empty


# ---- the model a chain describes ----------------------------------------------------------------------------


class RuleBlock(nn.Module):
    """SeedVR2-like: pre-norm attention over [window video, text] + MLP, separate or shared stream weights,
    optional modulation of both streams by the timestep embedding (per sample: ``request.row_sample``)."""

    def __init__(self, shared: bool, modulated: bool) -> None:
        super().__init__()
        self.norm_vid, self.norm_txt = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv_vid, self.out_vid = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp_vid = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        if shared:
            self.qkv_txt, self.out_txt, self.mlp_txt = self.qkv_vid, self.out_vid, self.mlp_vid
        else:
            self.qkv_txt, self.out_txt = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
            self.mlp_txt = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        self.ada = nn.Linear(DIM, 2 * DIM) if modulated else None

    def forward(self, vid, txt, emb, text_sample, request, layer):
        v, t = self.norm_vid(vid), self.norm_txt(txt)
        if self.ada is not None:
            mod = self.ada(emb)  # [samples, 2 * DIM]: scale, shift
            mv, mt = mod.index_select(0, request.row_sample), mod.index_select(0, text_sample)
            v = v * (1 + mv[:, :DIM]) + mv[:, DIM:]
            t = t * (1 + mt[:, :DIM]) + mt[:, DIM:]
        qv, kv, vv = self.qkv_vid(v).unflatten(-1, (3, HEADS, -1)).unbind(-3)
        qt, kt, vt = self.qkv_txt(t).unflatten(-1, (3, HEADS, -1)).unbind(-3)
        attn_vid, attn_txt = request.attention(qv, kv, vv, qt, kt, vt, layer=layer)
        vid = vid + self.out_vid(attn_vid.flatten(1))
        txt = txt + self.out_txt(attn_txt.flatten(1))
        return vid + self.mlp_vid(vid), txt + self.mlp_txt(txt)


def _merge(x: torch.Tensor, grids) -> tuple[torch.Tensor, tuple]:
    """2x2 patch merging of canonical rows (every sample's H and W even): [N, D] -> [N / 4, 4 D]."""
    parts, offset, merged = [], 0, []
    for t, h, w in grids:
        n = t * h * w
        y = x[offset:offset + n].reshape(t, h // 2, 2, w // 2, 2, -1).permute(0, 1, 3, 2, 4, 5)
        parts.append(y.reshape(t * (h // 2) * (w // 2), -1))
        merged.append((t, h // 2, w // 2))
        offset += n
    return torch.cat(parts), tuple(merged)


class ChainModel(winsp.WindowParallel, nn.Module):
    def __init__(self, chain: Chain) -> None:
        super().__init__()
        torch.manual_seed(chain.seed)
        self.chain = chain
        self.time_embed = nn.Sequential(nn.Linear(1, DIM), nn.SiLU(), nn.Linear(DIM, DIM))
        steps = []
        for op in chain.ops:
            if op[0] in ("rep", "txt", "head"):
                steps.append(nn.Linear(DIM, DIM))
            elif op[0] == "merge":
                steps.append(nn.Linear(4 * DIM, DIM))
            elif op[0] == "block":
                steps.append(RuleBlock(shared=op[1], modulated=op[2]))
            else:
                steps.append(nn.Identity())
        self.steps = nn.ModuleList(steps)
        self.double()

    def window_schedule(self):
        return [winsp.FixedWindows(op[3], shift=tuple(k // 2 for k in op[3]) if op[4] else (0, 0, 0))
                for op in self.chain.ops if op[0] == "block"]

    def forward(self, vid, txt, timestep):
        chain, runtime = self.chain, self.require_runtime()
        grids = chain.grids
        emb = self.time_embed(timestep.unsqueeze(-1))
        text_sample = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor(chain.text_lengths))
        x, request, layer = vid, None, -1
        for op, step in zip(chain.ops, self.steps):
            kind = op[0]
            if kind == "rep":  # tokenwise, or mixing neighbouring rows (not something a sharded region could do)
                x = x + torch.tanh(step(x if op[1] == "linear" else x.roll(1, 0)))
            elif kind == "txt":
                txt = txt + torch.tanh(step(txt))
            elif kind == "merge":
                x, grids = _merge(x, grids)
                x = step(x)
            elif kind == "scatter":
                request = runtime.request(grids, chain.text_lengths, dtype=x.dtype)
                x = request.scatter(x, layer + 1)
            elif kind == "block":
                layer += 1
                x = request.to_layer(x, layer)
                x, txt = step(x, txt, emb, text_sample, request, layer)
            elif kind == "gather":
                x = request.gather(x)
            elif kind == "head":
                x = step(x)
        return x, txt


def _inputs(chain: Chain, data_seed: int = 0):
    g = torch.Generator().manual_seed(chain.seed + 1 + 1000 * data_seed)
    n = sum(t * h * w for t, h, w in chain.grids)
    vid = torch.randn(n, DIM, generator=g, dtype=torch.float64).requires_grad_(True)
    txt = torch.randn(sum(chain.text_lengths), DIM, generator=g, dtype=torch.float64).requires_grad_(True)
    timestep = torch.rand(len(chain.grids), generator=g, dtype=torch.float64).requires_grad_(True)
    return vid, txt, timestep


def gradients(chain: Chain, runtime_group: SPGroup | None, data_seed: int = 0, sp_sync: bool = True,
              sync=lambda model, inputs: None) -> dict[str, torch.Tensor]:
    """Forward + backward of the chain's loss (the same on every rank), synced; every gradient by name.

    ``sync(model, inputs)`` runs after ``winsp.sync_gradients`` (or instead of it with ``sp_sync=False``): another
    averaging, e.g. over a DP group.
    """
    model = ChainModel(chain)
    schedule = model.window_schedule()
    runtime = winsp.WindowRuntime(schedule, group=runtime_group or SPGroup(None), planner=chain.planner)
    object.__setattr__(model, "_winsp_runtime", runtime)  # as build_runtime attaches it
    vid, txt, timestep = _inputs(chain, data_seed)
    out, txt_out = model(vid, txt, timestep)
    g = torch.Generator().manual_seed(chain.seed + 2)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    if chain.text_loss:
        loss = loss + (txt_out * torch.randn(txt_out.shape, generator=g, dtype=txt_out.dtype)).sum()
    loss.backward()
    if sp_sync:
        winsp.sync_gradients(model)  # the runtime attached to the model gives the group
        winsp.sync_gradients([vid, txt, timestep], model)
    sync(model, [vid, txt, timestep])
    grads = {f"param:{n}": p.grad for n, p in model.named_parameters()}
    grads.update({"input:vid": vid.grad, "input:txt": txt.grad, "input:timestep": timestep.grad,
                  "output": out.detach(), "text_output": txt_out.detach()})
    return grads


def relative_errors(got: dict, want: dict) -> dict[str, float]:
    """max |got - want| / max(|want|, 1e-300) per name (a missing gradient on either side is an error of inf)."""
    errors = {}
    for name in sorted(set(got) | set(want)):
        a, b = got.get(name), want.get(name)
        if a is None or b is None:
            errors[name] = 0.0 if a is None and b is None else float("inf")
            continue
        errors[name] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if b.numel() else 0.0
    return errors


# ---- chains -----------------------------------------------------------------------------------------------------


@st.composite
def chains(draw) -> Chain:
    grids = draw(st.sampled_from(GRID_SETS))
    text_lengths = tuple(draw(st.integers(1, 3)) for _ in grids)
    block = st.tuples(st.just("block"), st.booleans(), st.booleans(), st.sampled_from(WINDOWS), st.booleans())
    rep = st.tuples(st.just("rep"), st.sampled_from(["linear", "mix"]))
    ops = list(draw(st.lists(rep, max_size=1)))
    mergeable = all(h % 2 == 0 and w % 2 == 0 for _, h, w in grids)
    for stage in range(draw(st.integers(1, 3))):
        if stage:  # a stage boundary: replicated ops between two sharded regions
            ops += draw(st.lists(st.one_of(rep, st.just(("txt",))), min_size=1, max_size=2))
            if mergeable and draw(st.booleans()):
                ops.append(("merge",))
                mergeable = False
        ops.append(("scatter",))
        ops += draw(st.lists(block, min_size=1, max_size=3))
        ops.append(("gather",))
    if draw(st.booleans()):
        ops.append(("head",))
    return Chain(grids, text_lengths, tuple(ops), draw(st.booleans()), draw(st.integers(0, 2**16)))


BLOCK = ("block", False, True, (2, 2, 2), False)
SHIFTED_SHARED = ("block", True, True, (2, 2, 2), True)
# the failure modes: a head after the final gather (was P times too large), a replicated op between two
# sharded regions (0.30-0.78 of the right gradient upstream), a text loss (had to be divided by the SP degree)
HEAD_AFTER_GATHER = Chain(((2, 4, 4),), (3,), (("scatter",), BLOCK, SHIFTED_SHARED, ("gather",), ("head",)), True, 1)
STAGE_BOUNDARY = Chain(((1, 4, 6), (2, 2, 4)), (2, 3),
                       (("rep", "linear"), ("scatter",), BLOCK, ("gather",), ("rep", "mix"), ("txt",), ("merge",),
                        ("scatter",), SHIFTED_SHARED, ("gather",), ("head",)), True, 2)
NO_WINDOWS = Chain(TINY, (2,), (("scatter",), ("block", False, True, (2, 4, 4), False), ("gather",), ("rep", "mix"),
                               ("scatter",), SHIFTED_SHARED, ("gather",), ("head",)), True, 3, planner="lpt")
EXAMPLES_PER_GROUP = 6


def _check_group(sp: SPGroup, failures: list) -> tuple[int, float]:
    """Run the explicit chains and the hypothesis examples on one SP group; returns how many chains ran and the
    largest relative error seen (summed over the group's ranks)."""
    ran, largest = [], [0.0]

    @settings(max_examples=EXAMPLES_PER_GROUP, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(chains())
    @example(HEAD_AFTER_GATHER)
    @example(STAGE_BOUNDARY)
    @example(NO_WINDOWS)
    def check(chain: Chain) -> None:
        errors = relative_errors(gradients(chain, sp), gradients(chain, None))
        names = sorted(errors)
        mine = torch.tensor([errors[n] for n in names], dtype=torch.float64)
        mine = torch.where(torch.isfinite(mine), mine, torch.full_like(mine, 1e300))
        worst = sp.all_reduce_sum_(mine.clone())  # every rank of the group takes the same branch (and shrinks alike)
        ran.append(chain)
        largest[0] = max(largest[0], worst.max().item())
        bad = [(names[i], worst[i].item()) for i in range(len(names)) if worst[i] > 1e-9]
        if bad:
            failures.append((sp.size, chain, bad))
        assert not bad, f"SP={sp.size}: gradients differ from one rank: {bad}"

    check()
    return len(ran), largest[0]


def _sp_times_dp(rank: int, sp_groups, dp_groups) -> dict[str, float]:
    """World of 4 = 2 SP groups x 2 DP replicas on different data: SP average then DP average, or one average over
    the world, both give the mean of the two replicas' one-rank gradients."""
    chain = STAGE_BOUNDARY
    replica, sp = rank // 2, SPGroup(sp_groups[rank // 2])
    dp = SPGroup(dp_groups[rank % 2])
    want = [gradients(chain, None, data_seed=d) for d in (0, 1)]
    params = {n: (want[0][n] + want[1][n]) / 2 for n in want[0] if n.startswith("param:")}

    def then_dp(model, inputs):
        winsp.sync_gradients(model.parameters(), dp)

    sp_then_dp = gradients(chain, sp, data_seed=replica, sync=then_dp)
    errors = {f"sp_then_dp {n}": e for n, e in relative_errors(
        {k: v for k, v in sp_then_dp.items() if k in params}, params).items()}
    # one average over the whole world (what DDP over all ranks does), no SP sync at all
    world_only = gradients(chain, sp, data_seed=replica, sp_sync=False,
                           sync=lambda model, inputs: winsp.sync_gradients(model.parameters(), SPGroup.world()))
    errors.update({f"world {n}": e for n, e in relative_errors(
        {k: v for k, v in world_only.items() if k in params}, params).items()})
    return errors


def _gather_eager_and_compiled(rank: int) -> dict:
    """``winsp::all_gather_rows`` with uneven rows (one rank has none), eager and compiled (aot_eager, fullgraph)."""
    sp, sizes = SPGroup.world(), [3, 0, 2, 1]
    weight = torch.randn(sum(sizes), 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = {}
    for mode in ("eager", "compiled"):
        x = (torch.arange(2 * sizes[rank], dtype=torch.float64).reshape(-1, 2) + 10 * rank).requires_grad_(True)

        def gather(t):
            return sp.all_gather_rows(t, sizes)

        fn = torch.compile(gather, backend="aot_eager", fullgraph=True) if mode == "compiled" else gather
        y = fn(x)
        (y * weight).sum().backward()
        out[mode] = (y.detach(), x.grad)
    return out


def _spatial_gradients(group: SPGroup) -> dict[str, torch.Tensor]:
    """Height bands (winsp.comm.spatial, as the VAE's): halo, convolution, group norm over all bands, gather; synced."""
    from winsp.comm.spatial import band_sizes, distributed_group_norm, gather_bands, halo_exchange, take_band

    torch.manual_seed(5)
    conv, norm = nn.Conv2d(4, 4, 3).double(), nn.GroupNorm(2, 4).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(1, 4, 9, 5, dtype=torch.float64, requires_grad=True)
    sizes = band_sizes(9, group.size)
    band = halo_exchange(take_band(x, 2, sizes, group.rank), 2, 1, 1, group, sizes)
    y = F.conv2d(band, conv.weight, conv.bias, padding=(0, 1))
    y = distributed_group_norm(y, 2, norm.weight, norm.bias, 1e-5, group)
    out = gather_bands(y, 2, group, sizes)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=out.dtype)).sum().backward()
    tensors = [conv.weight, conv.bias, norm.weight, norm.bias, x]
    winsp.sync_gradients(tensors, group)
    return dict(zip(["conv.weight", "conv.bias", "norm.weight", "norm.bias", "x"], [t.grad for t in tensors]))


def _rank_main(rank: int, world_size: int):
    groups = {2: new_subgroup([0, 1]), 3: new_subgroup([0, 1, 2])}  # every rank makes every subgroup, in order
    sp_groups = [groups[2], new_subgroup([2, 3])]
    dp_groups = [new_subgroup([0, 2]), new_subgroup([1, 3])]
    out = {"sp_x_dp": _sp_times_dp(rank, sp_groups, dp_groups), "gather": _gather_eager_and_compiled(rank),
           "spatial": relative_errors(_spatial_gradients(SPGroup.world()), _spatial_gradients(SPGroup(None)))}
    try:  # inside a multi-rank world, no group and no runtime attached is refused, not treated as one rank
        winsp.sync_gradients(nn.Linear(2, 2))
        out["unattached"] = None
    except ValueError as e:
        out["unattached"] = str(e)
    for size in (2, 3, 4):
        if rank >= size:
            continue
        sp = SPGroup(groups[size]) if size < world_size else SPGroup.world()
        plans = winsp.planning.plan_schedule(TINY, [winsp.FixedWindows((2, 4, 4))], size, NO_WINDOWS.planner)
        no_windows = 0 in plans[0].rank_token_counts
        failures: list = []
        if size == 3:
            out["head"] = _head_gradients(sp)
        ran, largest = _check_group(sp, failures)
        out[size] = dict(ran=ran, largest=largest, no_windows=no_windows, failures=failures)
    return out


@pytest.fixture(scope="module")
def world():
    return run_ranks(_rank_main, 4, timeout=300)


@pytest.mark.multirank
def test_all_gather_rows_backward_is_a_reduce_scatter_eager_and_compiled(world):
    sizes, weight = [3, 0, 2, 1], torch.randn(6, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    everything = torch.cat([torch.arange(2 * n, dtype=torch.float64).reshape(-1, 2) + 10 * r
                            for r, n in enumerate(sizes)])
    for rank, result in enumerate(world):
        start = sum(sizes[:rank])
        for mode in ("eager", "compiled"):
            y, grad = result["gather"][mode]
            assert torch.equal(y, everything), (rank, mode)
            # 4 ranks each hold a copy whose gradient is ``weight``: this rank's rows get the sum of their blocks
            assert torch.equal(grad, 4 * weight[start:start + sizes[rank]]), (rank, mode)


@pytest.mark.multirank
def test_height_sharded_spatial_ops_follow_the_same_rule(world):
    """winsp.comm.spatial (halo exchange, group norm statistics over all bands, gather): averaged = one rank's."""
    for rank, result in enumerate(world):
        assert len(result["spatial"]) == 5
        assert max(result["spatial"].values()) <= 1e-9, (rank, result["spatial"])


@pytest.mark.multirank
def test_sync_without_a_group_inside_a_world_is_refused(world):
    assert "no winsp runtime attached" in world[0]["unattached"]


def test_sync_finds_the_runtime_attached_to_the_model_or_its_submodules():
    inner = ChainModel(HEAD_AFTER_GATHER)
    runtime = inner.build_runtime(None)
    outer = nn.Sequential(nn.Linear(2, 2), inner)
    assert winsp.runtime.gradients.attached_runtime(inner) is runtime
    assert winsp.runtime.gradients.attached_runtime(outer) is runtime
    assert winsp.runtime.gradients.attached_runtime(nn.Linear(2, 2)) is None
    assert winsp.sync_gradients(outer) == 0  # one rank: nothing to average
    other = ChainModel(HEAD_AFTER_GATHER)
    other.build_runtime(None)
    both = nn.Sequential(inner, other)  # two regions on one group (here: one rank): that group
    assert winsp.runtime.gradients.attached_runtime(both) in (runtime, other.runtime) and winsp.sync_gradients(both) == 0
    with pytest.raises(ValueError, match="Linear has no winsp runtime attached"):
        winsp.sync_gradients([torch.zeros(1)], nn.Linear(2, 2))


@pytest.mark.multirank
def test_sp_times_dp_is_a_plain_mean_over_the_world(world):
    for rank, result in enumerate(world):
        errors = result["sp_x_dp"]
        assert len(errors) > 20
        bad = {n: e for n, e in errors.items() if e > 1e-9}
        assert not bad, (rank, bad)


@pytest.mark.multirank
@pytest.mark.parametrize("size", [2, 3, 4])
def test_random_chains_match_one_rank(world, size):
    result = world[0][size]
    assert result["no_windows"]  # the tiny chain leaves ranks without windows
    assert result["ran"] >= EXAMPLES_PER_GROUP  # explicit chains + generated ones
    assert not result["failures"] and result["largest"] <= 1e-9


def _head_gradients(group: SPGroup) -> dict[str, torch.Tensor]:
    """HEAD_AFTER_GATHER's parameter gradients after backward, before any sync."""
    model = ChainModel(HEAD_AFTER_GATHER)
    model.build_runtime(winsp.DiffusionParallelConfig(ulysses_degree=group.size), group=group)
    vid, txt, timestep = _inputs(HEAD_AFTER_GATHER)
    out, txt_out = model(vid, txt, timestep)
    (out.sum() + txt_out.sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.multirank
def test_before_sync_every_rank_holds_its_own_whole_contribution(world):
    """The head after the final gather gets the whole gradient on every rank (each rank's copy is its own), so the
    average over ranks is the one-rank gradient; parameters inside windows hold shares that average to it."""
    single = _head_gradients(SPGroup(None))
    ranks = [world[rank]["head"] for rank in range(3)]
    head = "steps.4.weight"
    for r in ranks:
        assert (r[head] - single[head]).abs().max() <= 1e-12 * single[head].abs().max()
    inside = "steps.1.qkv_vid.weight"
    mean = sum(r[inside] for r in ranks) / len(ranks)
    assert (ranks[0][inside] - single[inside]).abs().max() > 1e-6 * single[inside].abs().max()
    assert (mean - single[inside]).abs().max() <= 1e-12 * single[inside].abs().max()
