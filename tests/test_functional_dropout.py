"""Functional dropout inside a ``winsp.parallelize`` region: a block that calls ``F.dropout`` itself (no module to
swap).

The model below is written without winsp: 2 x 2 window attention blocks on channels-last ``[B, H, W, C]``, whose MLP
calls ``F.dropout`` on the hidden tokens, then an ``nn.Dropout``, and a gate drawn per sample by ``F.dropout`` of a
conditioning vector ``[B, C]`` (not local rows: the same draws on every rank). With ``ParallelPlan.dropout="rows"``
the parallel model draws exactly the original's masks (outputs and every gradient, float64, 2 and 3 ranks); without
the mode it does not; by default the call is refused naming the block; channel-wise dropout is refused by name.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import winsp
from winsp.adoption import region_dropout
from winsp.testing import check_parallel

GRID, DIM, HEADS, COND = (4, 6), 8, 2, 5


class Attention(nn.Module):
    """Attention inside each 2 x 2 window of ``x [B, H, W, C]``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        qkv = self.qkv(x).reshape(b, h // 2, 2, w // 2, 2, 3, HEADS, -1).permute(5, 0, 1, 3, 6, 2, 4, 7)
        q, k, v = qkv.reshape(3, b * (h // 2) * (w // 2), HEADS, 4, -1)
        out = F.scaled_dot_product_attention(q, k, v).reshape(b, h // 2, w // 2, HEADS, 2, 2, -1)
        return self.proj(out.permute(0, 1, 4, 2, 5, 3, 6).reshape(b, h, w, c))


class Gate(nn.Module):
    """A per-sample gate from the conditioning, dropped out per sample: ``h * dropout(lin(cond))[:, None, None]``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin, self.p = nn.Linear(COND, DIM), p

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return h * F.dropout(self.lin(cond), self.p, self.training)[:, None, None, :]


class Block(nn.Module):
    def __init__(self, p: float, module_p: float, gate_p: float, kind: str) -> None:
        super().__init__()
        self.attn, self.gate = Attention(), Gate(gate_p)
        self.fc1, self.fc2, self.drop = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM), nn.Dropout(module_p)
        self.p, self.kind = p, kind

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        h = F.gelu(self.fc1(x))
        if self.kind == "dropout":
            h = F.dropout(h, self.p, self.training)
        elif self.kind == "torch.dropout":
            h = torch.dropout(h, self.p, self.training)
        else:  # a channel-wise or alpha dropout: no row-wise equivalent
            h = getattr(F, self.kind)(h, self.p, self.training)
        return x + self.gate(self.drop(self.fc2(h)), cond)


class Net(nn.Module):
    """``recompute``: the second block is activation-checkpointed (its dropout draws again during backward)."""

    def __init__(self, p: float = 0.3, module_p: float = 0.2, gate_p: float = 0.4, kind: str = "dropout",
                 recompute: bool = False) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(3, DIM), nn.Linear(DIM, 3)
        self.body = Body(p, module_p, gate_p, kind, recompute)

    def forward(self, image: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(image), cond))


class Body(nn.Module):
    def __init__(self, *args) -> None:
        super().__init__()
        *args, self.recompute = args
        self.blocks = nn.ModuleList([Block(*args), Block(*args)])

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x, cond)
        if self.recompute:
            return checkpoint(self.blocks[1], x, cond, use_reentrant=False)
        return self.blocks[1](x, cond)


# ---- the adapter ---------------------------------------------------------------------------------------------------

def attend(m, x):
    q, k, v = m.qkv(x).unflatten(-1, (3, HEADS, -1)).unbind(-3)
    return m.proj(winsp.current_request().attention(q, k, v, layer=m.index)[0].flatten(1))


def gate(m, h, cond):
    return h * winsp.current_request().sample_rows(F.dropout(m.lin(cond), m.p, m.training))


def plan(dropout: str = "refuse") -> winsp.ParallelPlan:
    return winsp.ParallelPlan(
        region=winsp.Region("body", "body", winsp.ChannelsLast(spatial_dims=2)),
        stages=[winsp.Stage([winsp.FixedWindows((1, 2, 2))] * 2)],
        attention="body.blocks.*.attn", make_attention=winsp.swapped(attend),
        swaps=[("body.blocks.*.gate", winsp.swapped(gate))], dropout=dropout)


def make_original(**kw) -> Net:
    return Net(**kw).double()


def make_parallel(original: Net, world_size: int, dropout: str = "rows", watched: bool = True) -> Net:
    if not watched:  # the parallel model as it was before functional dropout was watched: nothing pushed
        region_dropout.enter = lambda policy, start: None
    config = winsp.DiffusionParallelConfig(ulysses_degree=world_size) if world_size > 1 else None
    return winsp.parallelize(original, plan(dropout), config)


def make_inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(2, *GRID, 3, dtype=torch.float64, generator=g).requires_grad_(),
            torch.randn(2, COND, dtype=torch.float64, generator=g))


def test_functional_dropout_on_local_rows_draws_the_originals_masks_in_outputs_and_gradients():
    # the second block is activation-checkpointed: its recomputation during backward draws the same masks again
    original = functools.partial(make_original, recompute=True)
    report = check_parallel(original, make_parallel, make_inputs, world_sizes=(2, 3), train=True, timeout=120)
    assert report.ok and report.max_error("output") <= 1e-12


def _worst_difference(model: Net, reference: Net) -> float:
    """Largest difference of the training outputs and parameter gradients of ``model`` and ``reference``."""
    reference.load_state_dict(model.state_dict())
    results = []
    for net in (model.train(), reference.train()):
        torch.manual_seed(4)
        net(*make_inputs()).sum().backward()
        results.append([net(*make_inputs()).detach()] + [p.grad for _, p in sorted(net.named_parameters())])
    return max((a - b).abs().max().item() for a, b in zip(*results))


@pytest.mark.parametrize("kind", ["dropout", "torch.dropout"])
def test_one_rank_reproduces_too_and_without_the_mode_the_draws_differ(kind, monkeypatch):
    # one rank holds every row, in window order (not the original's row-major order): drawn locally, the masks differ
    assert _worst_difference(_one_rank("rows", kind=kind), make_original(kind=kind)) <= 1e-12
    monkeypatch.setattr(region_dropout, "enter", lambda policy, start: None)
    assert _worst_difference(_one_rank("rows", kind=kind), make_original(kind=kind)) > 1e-3


def _one_rank(dropout: str = "refuse", **kw) -> Net:
    torch.manual_seed(0)
    return make_parallel(make_original(**kw), 1, dropout)


def test_functional_dropout_is_refused_by_default_naming_the_block_the_function_and_the_fix():
    model = _one_rank().train()
    with pytest.raises(ValueError, match=r"'body.blocks.0' calls torch.nn.functional.dropout\(p=0.3, training=True\) "
                                         r"on local rows \[48, 16\].*ParallelPlan\(..., dropout='rows'\)"):
        model(*make_inputs())
    assert winsp.runtime.context.current_request_or_none() is None and not model._winsp_parallel.dropouts
    assert not torch.overrides._get_current_function_mode_stack()  # the mode left with the refused region
    with pytest.raises(ValueError, match=r"'body.blocks.0' calls torch.dropout\(p=0.3"):
        _one_rank(kind="torch.dropout").train()(*make_inputs())
    with pytest.raises(ValueError, match="ParallelPlan.dropout must be one of"):
        plan("local")


@pytest.mark.parametrize("kind", ["dropout2d", "alpha_dropout"])
def test_channel_and_alpha_dropout_are_refused_by_name_even_with_rows(kind):
    with pytest.raises(ValueError, match=rf"'body.blocks.0' calls torch.nn.functional.{kind}\(p=0.3.*no row-wise "
                                         r"equivalent"):
        _one_rank("rows", kind=kind).train()(*make_inputs())


def test_eval_p0_and_non_row_dropout_run_unchanged_and_the_module_refusal_stands():
    model = _one_rank().eval()
    torch.manual_seed(0)
    reference = make_original().eval()
    modes = []
    model.body.blocks[0].fc1.register_forward_hook(
        lambda *_: modes.append(len(torch.overrides._get_current_function_mode_stack())))
    assert torch.allclose(model(*make_inputs()), reference(*make_inputs()), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="calls torch.nn.functional.dropout"):
        model.train()(*make_inputs())
    assert modes == [0, 1]  # an eval forward pushes no mode: inference pays nothing
    # training, functional dropout at p = 0: the gate's per-sample dropout ([B, C], not local rows) runs unchanged, and
    # the unswapped nn.Dropout is still refused by path before it runs
    with pytest.raises(ValueError, match=r"'body.blocks.0.drop' \(Dropout, p=0.2\).*winsp.RowDropout.like.*"
                                         r"dropout='rows'"):
        _one_rank(p=0.0).train()(*make_inputs())
    model, reference = _one_rank(p=0.0, module_p=0.0), make_original(p=0.0, module_p=0.0)
    reference.load_state_dict(model.state_dict())
    outs = []
    for net in (model.train(), reference.train()):
        torch.manual_seed(5)
        outs.append(net(*make_inputs()))
    assert torch.allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)  # the gate drew the same per-sample mask
    undropped = make_original(p=0.0, module_p=0.0, gate_p=0.0)
    undropped.load_state_dict(model.state_dict())
    assert not torch.allclose(outs[1], undropped.train()(*make_inputs()))  # it did drop


def test_row_dropout_inside_the_mode_is_not_refused():
    # one rank: the full mask RowDropout draws has as many rows as the local rows; the mode must not see that draw
    model = _one_rank(p=0.0)
    model.body.blocks[0].drop = winsp.RowDropout(0.2)
    model.body.blocks[1].drop = winsp.RowDropout(0.2)
    assert torch.isfinite(model.train()(*make_inputs())).all()


@pytest.mark.slow  # the default run's budget
def test_the_mode_composes_with_torch_compile():
    torch._dynamo.reset()
    try:
        model = _one_rank("rows")
        reference = make_original()
        reference.load_state_dict(model.state_dict())
        model.body.blocks[1].drop = winsp.RowDropout(0.2)  # a swapped dropout in the compiled block, under the mode
        model.body.blocks[1].compile(backend="eager")
        outs = []
        for net in (model.train(), reference.train()):
            torch.manual_seed(2)
            outs.append(net(*make_inputs()))
        assert torch.allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)
        refusing = _one_rank(module_p=0.0)
        refusing.body.blocks[1].compile(backend="eager")
        refusing.body.blocks[0].p = 0.0  # the compiled block's call is the one refused
        with pytest.raises(ValueError, match="'body.blocks.1' calls torch.nn.functional.dropout"):
            refusing.train()(*make_inputs())
    finally:
        torch._dynamo.reset()


def test_the_mode_alone_passes_what_is_not_a_training_dropout_of_local_rows():
    runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))])
    request = runtime.request([(3, 4, 5)] * 2)
    x = torch.randn(2, 3, 4, 5, 6, dtype=torch.float64)
    rows, cond = request.scatter(x.reshape(-1, 6)), torch.randn(2, 6, dtype=torch.float64)
    with request.active(), region_dropout.RegionDropout("refuse", "net"):
        assert F.dropout(rows, 0.3, training=False) is rows and torch.dropout(rows, 0.0, True) is rows
        torch.manual_seed(1)
        got = F.dropout(cond, 0.3, True)  # not local rows: drawn as the original draws it
        with pytest.raises(ValueError, match=r"'net' calls torch.dropout_\(p=0.3, training=True\) on local rows "
                                             r"\[120, 6\] \(rank 0\)"):
            torch.dropout_(rows, 0.3, True)
    torch.manual_seed(1)
    assert torch.equal(got, F.dropout(cond, 0.3, True))
    for inplace in (False, True):
        torch.manual_seed(7)
        want = F.dropout(x, 0.3, True)
        torch.manual_seed(7)
        with request.active(), region_dropout.RegionDropout("rows", "net"):
            local = rows.clone()
            out = F.dropout(local, 0.3, True, inplace)
        assert (out is local) == inplace and torch.equal(request.gather(out), want.reshape(-1, 6))


def test_unchecked_pushes_no_mode_and_still_refuses_dropout_modules():
    """``dropout="unchecked"`` skips the per-call cost of watching: the functional call then draws locally, unlike
    the original (the user's responsibility), while an unswapped ``nn.Dropout`` is still refused by path."""
    modes = []
    model = _one_rank("unchecked", module_p=0.0)
    model.body.blocks[0].fc1.register_forward_hook(
        lambda *_: modes.append(len(torch.overrides._get_current_function_mode_stack())))
    model.train()(*make_inputs())  # not refused: nothing watches the F.dropout call
    assert modes == [0]
    assert _worst_difference(_one_rank("unchecked", module_p=0.0), make_original(module_p=0.0)) > 1e-3
    with pytest.raises(ValueError, match=r"'body.blocks.0.drop' \(Dropout, p=0.2\)"):
        _one_rank("unchecked").train()(*make_inputs())
