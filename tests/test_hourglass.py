"""An hourglass (U-net) model nobody adapted before, as ONE region in forward order: levels that register in another
order than they run, merges down, splits up (cropped to odd skip grids), skips across levels, a global middle level
split across ranks, element-wise dropout drawn as the original. Checked against the original model
(``examples/hourglass/model.py``, plain PyTorch) with ``winsp.testing.check_parallel``: outputs and every gradient,
float64, training mode, 2 and 3 ranks. Plus the refusals: a plan out of forward order (before any rows move), an
unswapped dropout, a module that reshapes local rows; and ``sync_gradients`` / ``check_parallel`` on a model with two
regions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import winsp
from examples.hourglass import HourglassNet, hourglass_plan, parallelize
from examples.hourglass.model import Level
from winsp.geometry import GlobalWindow
from winsp.testing import check_parallel, run_ranks

GRID = (2, 8, 6)  # levels: (2, 8, 6) -> (2, 4, 3) -> middle (2, 2, 2); the way up crops (2, 4, 4) to (2, 4, 3)


def make_model() -> HourglassNet:
    return HourglassNet().double()


def parallel_model(original: HourglassNet, world_size: int) -> HourglassNet:
    return parallelize(original, winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def clip() -> torch.Tensor:
    return torch.randn(1, *GRID, 3, dtype=torch.float64).requires_grad_()


def test_the_hourglass_equals_the_original_in_outputs_and_every_gradient():
    report = check_parallel(make_model, parallel_model, clip, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0 and report.max_error("input") > 0
    assert len([d for d in report.items.values() if d.kind == "param"]) == len(list(make_model().parameters()))


def test_the_plan_is_at_most_15_lines():
    source = Path(__file__).parents[1] / "examples" / "hourglass" / "adapter.py"
    fn = next(n for n in ast.parse(source.read_text()).body
              if isinstance(n, ast.FunctionDef) and n.name == "hourglass_plan")
    lines = source.read_text().splitlines()[fn.lineno - 1:fn.end_lineno]
    assert len([line for line in lines if line.strip() and not line.strip().startswith("#")]) <= 15


def _plain_plan(model: HourglassNet, forward_order=None) -> winsp.ParallelPlan:
    """The hourglass plan written out by hand: stages, grid changes, (optionally) a stated forward order."""
    from examples.hourglass.adapter import attend, resize

    level = [winsp.FixedWindows(b.attn.window, b.attn.shift) for b in model.body.down[0].blocks]
    return winsp.ParallelPlan(
        region=winsp.Region("body", "body"), attention="body.**.attn", make_attention=winsp.swapped(attend),
        stages=[winsp.Stage(level), winsp.Stage(level, merge=(1, 2, 2)),
                winsp.Stage([GlobalWindow()], merge=(1, 2, 2), split_windows=True),
                winsp.Stage(level, split=(1, 2, 2), like=1), winsp.Stage(level, split=(1, 2, 2), like=0)],
        grid_changes=("body.merges.*", "body.splits.*"), make_grid_change=winsp.swapped(resize),
        swaps=[("body.**.mlp.2", winsp.RowDropout.like)], forward_order=forward_order)


def _one_region(rank: int, world_size: int) -> dict:
    """One forward at SP = world_size: gathers, the middle level's plan, rows the grid changes move; a plan without a
    forward order (recorded: the same output); then a stated order that is wrong, refused on every rank before any
    rows move (no collective at all)."""
    torch.manual_seed(0)
    model = parallel_model(make_model().eval(), world_size)
    gathers, exchanges = [], []
    group_type = type(model._winsp_runtime.group)
    original_gather, original_exchange = group_type.all_gather_rows, group_type.all_to_all_single

    def counting(self, tensor, sizes):
        gathers.append(tensor.shape[0])
        return original_gather(self, tensor, sizes)

    def counting_exchange(self, tensor, *sizes):
        exchanges.append(tensor.shape[0])
        return original_exchange(self, tensor, *sizes)

    group_type.all_gather_rows, group_type.all_to_all_single = counting, counting_exchange
    try:
        x = clip()
        model(x)
        runtime = model._winsp_runtime
        request = runtime.request([GRID])
        mid = request.plan(runtime.first_layer[2])
        moved = [request.runtime._grid_step(request, request.prepared.slot_of_layer[runtime.first_layer[s] - 1], s)
                 .rows_moved for s in (1, 2)]
        recorded = make_model().eval()  # a plain plan in registration order: the forward order is recorded
        recorded.load_state_dict(model.state_dict())
        winsp.parallelize(recorded, _plain_plan(recorded), winsp.DiffusionParallelConfig(ulysses_degree=world_size))
        same = torch.equal(recorded(x), model(x))
        wrong = make_model().eval()
        winsp.parallelize(wrong, _plain_plan(wrong, forward_order=("body.down", "body.up", "body.merges",
                                                                   "body.splits", "body.mid")),
                          winsp.DiffusionParallelConfig(ulysses_degree=world_size))
        gathers_before, exchanges_before = len(gathers), len(exchanges)
        try:
            wrong(x)
            refusal = None
        except ValueError as err:
            refusal = str(err)
    finally:
        group_type.all_gather_rows, group_type.all_to_all_single = original_gather, original_exchange
    two_groups = nn.ModuleList([model, nn.Linear(1, 1)])
    two_groups[1]._winsp_runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))])  # one rank: another group
    try:
        winsp.sync_gradients(two_groups)
        groups_refusal = None
    except ValueError as err:
        groups_refusal = str(err)
    return dict(same=same, gathers=gathers[:gathers_before - 2], mid_split=mid.has_split_windows,
                groups_refusal=groups_refusal,
                mid_rows=mid.rank_token_counts, moved=moved, refusal=refusal,
                moves_after_refusal=len(gathers) - gathers_before + len(exchanges) - exchanges_before)


def test_one_region_one_gather_a_split_global_level_and_an_order_refused_on_every_rank():
    for result in run_ranks(_one_region, 2, timeout=240):
        assert len(result["gathers"]) == 1  # only the region's end: no gather between levels
        assert result["same"]  # the plan without a forward order, its order recorded, gives the same output
        assert result["mid_split"] and min(result["mid_rows"]) > 0  # the global window runs on both ranks
        assert all(0 <= m < 96 for m in result["moved"])  # merges move some rows, never all of them
        assert "does not follow the order the model runs its modules in" in result["refusal"]
        assert "'body.mid' (window layer 8)" in result["refusal"]
        assert "'body.up.0.blocks.0' (window layer 4)" in result["refusal"]
        assert "before any rows moved" in result["refusal"] and result["moves_after_refusal"] == 0
        assert "winsp runtimes on 2 different SP groups" in result["groups_refusal"]


def test_a_forward_order_that_does_not_match_the_forward_is_refused_naming_both_steps():
    model = make_model().eval()
    order = ("body.down", "body.merges", "body.mid", "body.splits.0", "body.up.0", "body.splits.1", "body.up.1")
    winsp.parallelize(model, _plain_plan(model, forward_order=order))
    with pytest.raises(ValueError, match=r"runs 'body.splits.1' \(the grid change into stage 4\) where the plan "
                                         r"expects 'body.splits.0' \(the grid change into stage 3\).*meta tensors"):
        model(clip())
    assert winsp.runtime.context.current_request_or_none() is None
    model._winsp_parallel.order.dry_run_done = True  # as for a model that runs on no meta tensors: checked as it runs
    with pytest.raises(ValueError, match=r"runs 'body.splits.1' .*Refused before 'body.splits.1' moved any rows"):
        model(clip())
    assert winsp.runtime.context.current_request_or_none() is None
    with pytest.raises(ValueError, match="'body.up.0.blocks.0.attn', which no glob of ParallelPlan.forward_order"):
        winsp.parallelize(make_model(), _plain_plan(make_model(), forward_order=order[:2]))


def test_an_unswapped_dropout_is_refused_by_name_in_training():
    model = make_model()
    winsp.parallelize(model, winsp.ParallelPlan(**{**hourglass_plan(model).__dict__, "dropout": "refuse"}))
    model.eval()
    model(clip())  # eval: dropout is the identity, nothing to refuse
    model.train()
    with pytest.raises(ValueError, match=r"'body.down.0.blocks.0.mlp.2' \(Dropout, p=0.1\).*winsp.RowDropout.like"):
        model(clip())


class ToBatch(nn.Module):
    """A feed-forward step that assumes it sees every token of a one-sample batch: [..., C] -> [1, 1, L, C]."""

    def forward(self, x):
        return x.reshape(1, 1, -1, x.shape[-1])


def test_a_module_that_reshapes_local_rows_is_caught_where_it_happens():
    model = make_model().eval()
    model.body.down[1].blocks[0].mlp[1] = ToBatch()
    parallelize(model)
    with pytest.raises(ValueError, match=r"'body.down.1.blocks.0.mlp.1' \(ToBatch\) took local rows \[24, 24\] and "
                                         r"returned \[1, 1, 24, 24\]"):
        model(clip())


def test_swapped_modules_keep_the_originals_attributes():
    model = parallelize(make_model())
    attn = model.body.mid.attn
    assert isinstance(attn, winsp.adoption.Swapped) and attn.heads == 2 and attn.window is None
    assert model.body.down[0].blocks[1].attn.shift == (1, 1, 1)


class TwoRegions(nn.Module):
    """Two levels with a replicated linear between them: each level its own parallel region."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.mix, self.b = Level(8, 2, (2, 3, 3), (1, 1, 1), 0.0), nn.Linear(8, 8), Level(8, 2, (2, 3, 3),
                                                                                                   (0, 1, 1), 0.0)

    def forward(self, x):
        return self.b(self.mix(self.a(x)))


def _level_plan(level: Level) -> winsp.ParallelPlan:
    from examples.hourglass.adapter import attend

    return winsp.ParallelPlan(
        region=winsp.Region("", ""), attention="blocks.*.attn", make_attention=winsp.swapped(attend),
        stages=[winsp.Stage([winsp.FixedWindows(b.attn.window, b.attn.shift) for b in level.blocks])])


def make_two() -> TwoRegions:
    return TwoRegions().double()


def parallel_two(original: TwoRegions, world_size: int) -> None:
    config = winsp.DiffusionParallelConfig(ulysses_degree=world_size)
    for level in (original.a, original.b):
        winsp.parallelize(level, _level_plan(level), config)


def two_input() -> torch.Tensor:
    return torch.randn(2, 2, 5, 4, 8, dtype=torch.float64).requires_grad_()


def test_sync_gradients_and_check_parallel_on_a_model_with_two_regions():
    model = make_two()
    parallel_two(model, 1)
    assert winsp.runtime.gradients.attached_runtime(model) is not None  # two runtimes, one group: no error
    report = check_parallel(make_two, parallel_two, two_input, world_sizes=(2,), timeout=240)
    assert report.ok and report.max_error("param") > 0


def test_the_forward_on_meta_tensors_is_invisible_to_the_models_own_hooks():
    model = parallelize(make_model().eval())
    calls = []
    model.body.mid.register_forward_hook(lambda module, args, output: calls.append(output.device.type))
    model(clip())
    assert model._winsp_parallel.order.dry_run_done and calls == ["cpu"]
