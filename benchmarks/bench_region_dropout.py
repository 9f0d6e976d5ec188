"""What watching functional dropout costs: the hourglass example (one rank, float32) with and without the region's
:class:`winsp.adoption.region_dropout.RegionDropout` mode.

    OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_region_dropout.py --benchmark-only -q

A training forward + backward pushes the mode (every torch call of the region's forward passes its Python
``__torch_function__``); "off" is the same forward with the mode not pushed (as before functional dropout was
watched). An eval forward pushes nothing: both eval cases run the same code and are there to show it. The batch
scales the work per torch call, not the number of calls, so the mode's share falls as the batch grows.
"""

from __future__ import annotations

import pytest
import torch

import winsp
from examples.hourglass import HourglassNet, hourglass_plan
from winsp.adoption import region_dropout


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["on", "off"])
def test_region_dropout_mode_cost(benchmark, monkeypatch, batch, train, mode):
    torch.manual_seed(0)
    model = HourglassNet()
    winsp.parallelize(model, hourglass_plan(model))
    model.train(train)
    x = torch.randn(batch, 2, 8, 6, 3)
    if mode == "off":
        monkeypatch.setattr(region_dropout, "enter", lambda policy, start: None)

    def step():
        if train:
            model(x).sum().backward()
        else:
            with torch.no_grad():
                model(x)

    benchmark.pedantic(step, rounds=30, warmup_rounds=3)
