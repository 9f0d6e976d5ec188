"""A model that reshapes its own batches between per-frame ``[B*T, S, C]`` and per-position ``[B*S, T, C]``
(``examples/latent_video``), made parallel by ``ParallelPlan(space_time=SpaceTime(...))`` with its reshapes, its
positional table for one frame and its frame table untouched; and the refusals that name what does not fit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import winsp
from examples.adapter_lines import model_specific_lines
from examples.latent_video.adapter import video_plan
from examples.latent_video.model import LatentVideoDiT
from winsp.adoption import SpaceTime, is_parallelized
from winsp.testing import check_parallel


def make_model() -> LatentVideoDiT:
    return LatentVideoDiT().double()


def make_parallel(model, world_size: int):
    return winsp.parallelize(model, video_plan(), winsp.DiffusionParallelConfig(ulysses_degree=world_size))


def make_inputs():  # 2 frames of 3 x 4: at SP 3 one rank holds no frame (no window of the spatial layers)
    return torch.randn(1, 2, 3, 4, 4, dtype=torch.float64).requires_grad_(), torch.tensor([0.7], dtype=torch.float64)


def test_the_latent_video_dit_equals_the_original_in_outputs_and_every_gradient():
    report = check_parallel(make_model, make_parallel, make_inputs, world_sizes=(2, 3), train=True, timeout=300)
    assert report.ok and report.max_error("param") > 0 and report.max_error("input") > 0
    params = {name for (kind, name) in report.items if kind == "param"}
    assert {"pos", "frame_pos"} <= params and len(params) == len(list(make_model().parameters()))


def test_its_adapter_is_at_most_15_lines():
    assert model_specific_lines(str(Path(__file__).parents[1] / "examples" / "latent_video" / "adapter.py")) <= 15


def _pair():
    torch.manual_seed(0)
    original = make_model()
    return original, copy.deepcopy(original)


def test_one_rank_equals_the_original_and_unparallelize_restores_the_tables():
    original, model = _pair()
    winsp.parallelize(model, video_plan())
    x, t = torch.randn(1, 3, 3, 4, 4, dtype=torch.float64), torch.tensor([0.2], dtype=torch.float64)
    torch.testing.assert_close(model(x, t), original(x, t), rtol=0, atol=1e-12)
    assert model.pos.shape == (1, 12, 16)  # outside a region the tables are the parameters
    assert {k for k, _ in model.named_parameters()} == {k for k, _ in original.named_parameters()}
    winsp.unparallelize(model)
    assert type(model._parameters) is dict and model.pos is model._parameters["pos"]


def test_a_batch_of_two_samples_is_refused_by_name():
    _, model = _pair()
    winsp.parallelize(model, video_plan())
    with pytest.raises(ValueError, match=r"SpaceTime: a batch of 2 samples .* one sample at a time"):
        model(torch.randn(2, 2, 3, 4, 4, dtype=torch.float64), torch.tensor([0.1, 0.2], dtype=torch.float64))


def test_a_block_listed_under_the_wrong_batches_is_named_with_the_shape_it_got():
    _, model = _pair()
    plan = video_plan()
    swapped = SpaceTime(frames="blocks.[13]", positions="blocks.[02]", tables=plan.space_time.tables)
    winsp.parallelize(model, winsp.ParallelPlan(**{**plan.__dict__, "space_time": swapped}))
    with pytest.raises(ValueError, match=r"'blocks.0' runs on per-position batches, so its input must be this "
                                         r"rank's 24 rows as \[L, 1, C\] .* got \[1, 24, 16\]"):
        model(torch.randn(1, 2, 3, 4, 4, dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64))


@pytest.mark.parametrize("space_time, message", [
    (SpaceTime(frames="blocks.[02]", positions="nothing.*"), r"SpaceTime.positions='nothing.\*' matches no layer "
                                                             r"entry"),
    (SpaceTime(frames="blocks.*", tables=(("no_table", "frames"),)), r"'no_table' is not a parameter or buffer"),
])
def test_plans_that_do_not_fit_the_model_are_refused_naming_the_glob_or_table(space_time, message):
    _, model = _pair()
    with pytest.raises(ValueError, match=message):
        winsp.parallelize(model, winsp.ParallelPlan(**{**video_plan().__dict__, "space_time": space_time}))
    assert not is_parallelized(model) and type(model.blocks[0].attn).__name__ == "Attention"


def test_row_dropout_is_refused_for_per_position_batches():
    with pytest.raises(ValueError, match=r"per-position batches \[B\*S, T, C\] are not"):
        winsp.ParallelPlan(**{**video_plan().__dict__, "dropout": "rows"})


def test_space_time_declarations_are_checked():
    with pytest.raises(ValueError, match="needs frames= or positions="):
        SpaceTime()
    with pytest.raises(ValueError, match=r"\(parameter or buffer path, 'frames' \| 'positions'\) pairs"):
        SpaceTime(frames="a", tables=(("pos", "space"),))


def test_grid_rows_takes_a_table_over_some_axes_shared_along_the_others():
    runtime = winsp.WindowRuntime([winsp.FixedWindows((1, 2, 2))])
    request = runtime.request([(2, 3, 2)])
    request.scatter(torch.zeros(12, 1))
    t, h, w = request.grid_coords.unbind(1)
    frames, positions = torch.arange(2.0)[:, None] * 10, torch.arange(6.0).reshape(3, 2, 1)
    assert torch.equal(request.grid_rows(frames, axes="t")[:, 0], (t * 10).float())
    assert torch.equal(request.grid_rows(positions, axes="hw")[:, 0], (h * 2 + w).float())
    assert torch.equal(request.grid_rows(positions.flatten(0, 1), axes="hw")[:, 0], (h * 2 + w).float())
    with pytest.raises(ValueError, match=r"axes must be grid axes in \(t, h, w\) order"):
        request.grid_rows(frames, axes="ht")
    with pytest.raises(ValueError, match=r"does not start with stage 0's sizes \[3, 2\] along 'hw'"):
        request.grid_rows(frames, axes="hw")


class TwoLists(LatentVideoDiT):
    """The same model with its spatial and temporal blocks in two lists (registered spatial first, run alternating),
    as Latte keeps them: the recording renumbers the layers."""

    def __init__(self) -> None:
        super().__init__()
        blocks = list(self.blocks)
        del self.blocks
        self.spatial, self.temporal = torch.nn.ModuleList(blocks[0::2]), torch.nn.ModuleList(blocks[1::2])
        self.blocks = [b for pair in zip(self.spatial, self.temporal, strict=True) for b in pair]  # a plain list


def test_blocks_in_two_lists_are_renumbered_in_forward_order_and_exact():
    torch.manual_seed(0)
    original = TwoLists().double()
    plan = winsp.ParallelPlan(**{**video_plan().__dict__, "attention": ("spatial.*.attn", "temporal.*.attn"),
                                 "space_time": SpaceTime(frames="spatial.*", positions="temporal.*",
                                                         tables=(("pos", "frames"), ("frame_pos", "positions")))})
    model = winsp.parallelize(copy.deepcopy(original), plan)
    x, t = torch.randn(1, 3, 3, 4, 4, dtype=torch.float64), torch.tensor([0.2], dtype=torch.float64)
    torch.testing.assert_close(model(x, t), original(x, t), rtol=0, atol=1e-12)
    assert model._winsp_runtime.layer_names == ("spatial.0.attn", "temporal.0.attn", "spatial.1.attn",
                                                "temporal.1.attn")
