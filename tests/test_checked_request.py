"""A request's inputs are checked once, where they enter, into a CheckedRequest; nothing further in checks them."""

import dataclasses

import pytest
import torch

import winsp
import winsp.geometry.layout as layout_module
from winsp.geometry import Grids, check_grids
from winsp.runtime import CheckedRequest

REG = winsp.make_geometry("regular", (4, 3, 3))
SHIFT = winsp.make_geometry("shifted", (4, 3, 3))
GRIDS = [(3, 6, 6), (2, 4, 5)]


def _count_grid_checks(monkeypatch) -> list:
    """Record each grid that check_grids validates (it validates one grid at a time with check_grid)."""
    seen = []
    original = layout_module.check_grid

    def counting(grid, name="grid"):
        seen.append(tuple(grid))
        return original(grid, name)

    monkeypatch.setattr(layout_module, "check_grid", counting)
    return seen


def test_checked_grids_pass_through_check_grids_unchanged():
    grids = check_grids(GRIDS)
    assert isinstance(grids, Grids) and grids == tuple(GRIDS)
    assert check_grids(grids) is grids
    assert hash(grids) == hash(tuple(GRIDS))  # store keys made from plain tuples and from Grids agree


@pytest.mark.parametrize("schedule", [[REG, SHIFT, REG], [winsp.Stage((REG, SHIFT)),
                                                          winsp.Stage((REG,), merge=(1, 2, 2))]])
def test_a_request_checks_each_grid_once(monkeypatch, schedule):
    seen = _count_grid_checks(monkeypatch)
    runtime = winsp.WindowRuntime(schedule)
    request = runtime.request(GRIDS, [2, 3], dtype=torch.float32)
    assert seen == GRIDS  # the door, and nowhere further in (plans, stage grids, layouts, stage rows)
    assert isinstance(request.inputs, CheckedRequest) and request.grids is request.inputs.grids


def test_checked_request_is_frozen_and_normalised():
    checked = CheckedRequest.check([list(g) for g in GRIDS], None, device="cpu")
    assert checked.grids == tuple(GRIDS) and checked.text_lengths == (0, 0)
    assert checked.device == torch.device("cpu") and checked.dtype is None and checked.score_mods is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.grids = check_grids([(1, 1, 1)])  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    (dict(grids=(3, 6, 6)), "wrap it as"),
    (dict(grids=[(3, 0, 6)]), r"grids\[0\]"),
    (dict(grids=GRIDS, text_lengths=[1]), "text_lengths has 1 entries but there are 2 samples"),
    (dict(grids=GRIDS, text_lengths=[1, -1]), "text_lengths"),
    (dict(grids=GRIDS, dtype="float32"), "dtype must be a torch.dtype"),
    (dict(grids=GRIDS, score_mods=1), "score_mods must be True, False or None"),
])
def test_bad_inputs_are_refused_at_the_door(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckedRequest.check(**kwargs)
    with pytest.raises(ValueError, match=message):
        winsp.WindowRuntime([REG]).request(**kwargs)
