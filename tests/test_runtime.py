"""DiffusionParallelConfig validation and WindowRuntime construction / reporting."""

import dataclasses

import pytest
import torch

import winsp
from winsp.testing import RankError, run_ranks

REG = winsp.make_geometry("regular", (4, 3, 3))
SHIFT = winsp.make_geometry("shifted", (4, 3, 3))


@pytest.mark.parametrize("kwargs, option", [
    (dict(ring_degree=2), "ring_degree"),
    (dict(allgather=True), "allgather"),
    (dict(advanced_uaa=True), "advanced_uaa"),
    (dict(ulysses_mode="advanced_uaa"), "ulysses_mode"),
    (dict(ulysses_a2a_permute=True), "ulysses_a2a_permute"),
])
def test_head_sharded_options_are_refused_with_the_reason(kwargs, option):
    with pytest.raises(ValueError, match=option) as err:
        winsp.DiffusionParallelConfig(ulysses_degree=2, **kwargs)
    assert "whole-window SP" in str(err.value)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_degree_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="ulysses_degree"):
        winsp.DiffusionParallelConfig(ulysses_degree=bad)


def test_sp_degree_is_the_plain_name_of_ulysses_degree():
    by_plain = winsp.DiffusionParallelConfig(sp_degree=4)
    assert by_plain.ulysses_degree == by_plain.sp_degree == 4
    assert by_plain == winsp.DiffusionParallelConfig(ulysses_degree=4)
    assert winsp.DiffusionParallelConfig(4, sp_degree=4).sp_degree == 4  # both, agreeing
    assert winsp.DiffusionParallelConfig().sp_degree == 1
    with pytest.raises(ValueError, match="sp_degree=2 and ulysses_degree=3 disagree"):
        winsp.DiffusionParallelConfig(ulysses_degree=3, sp_degree=2)
    with pytest.raises(ValueError, match="sp_degree must be a positive integer"):
        winsp.DiffusionParallelConfig(sp_degree=0)
    assert dataclasses.replace(by_plain, ulysses_degree=2).sp_degree == 2
    assert dataclasses.replace(by_plain, planner="lpt").sp_degree == 4


def test_no_head_count_divisibility_anywhere():
    # 20 heads (SeedVR2 3B) at degree 8, 3 heads at degree 4: nothing in the config cares
    assert winsp.DiffusionParallelConfig(ulysses_degree=8).sp_degree == 8


def test_single_rank_runtime_needs_no_process_group():
    rt = winsp.WindowRuntime.from_config(None, [REG, SHIFT])
    assert rt.world_size == 1 and rt.rank == 0
    assert "single rank" in rt.execution_path
    rt = winsp.WindowRuntime.from_config(winsp.DiffusionParallelConfig(ulysses_degree=1), [REG])
    assert rt.world_size == 1


def test_degree_above_one_without_a_world_is_an_actionable_error():
    with pytest.raises(ValueError, match="torch.distributed"):
        winsp.WindowRuntime.from_config(winsp.DiffusionParallelConfig(ulysses_degree=2), [REG])


def test_schedule_and_request_validation():
    with pytest.raises(ValueError, match="empty"):
        winsp.WindowRuntime([])
    with pytest.raises(ValueError, match="schedule\\[1\\]"):
        winsp.WindowRuntime([REG, "shifted"])
    rt = winsp.WindowRuntime([REG, SHIFT])
    with pytest.raises(ValueError, match="text_lengths"):
        rt.request([(2, 8, 8)], [1, 2])
    req = rt.request([(2, 8, 8)], [3])
    with pytest.raises(RuntimeError, match="scatter"):
        req.to_layer(torch.zeros(128, 2), 1)
    with pytest.raises(ValueError, match="rows"):
        req.scatter(torch.zeros(127, 2))
    x = req.scatter(torch.zeros(128, 2))
    with pytest.raises(ValueError, match="layer 5"):
        req.to_layer(x, 5)
    q = torch.zeros(128, 1, 4)
    with pytest.raises(ValueError, match="text"):
        req.attention(q, q, q, layer=0)
    with pytest.raises(ValueError, match="video rows"):
        req.attention(q[:5], q[:5], q[:5], torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), layer=0)


def _degree_mismatch(rank, world_size):
    winsp.WindowRuntime.from_config(winsp.DiffusionParallelConfig(ulysses_degree=3), [REG])


def _subgroup_runtime(rank, world_size):
    import torch.distributed as dist

    sub = dist.new_group([0, 1])
    other = dist.new_group([2, 3])
    mine = sub if rank < 2 else other
    rt = winsp.WindowRuntime.from_config(winsp.DiffusionParallelConfig(ulysses_degree=2), [REG, SHIFT], group=mine)
    req = rt.request([(5, 32, 56)])
    x = torch.arange(5 * 32 * 56, dtype=torch.float64).unsqueeze(1) + 1000 * (rank // 2)
    y = req.gather(req.to_layer(req.scatter(x), 1))
    return rt.execution_path, rt.world_size, rt.rank, bool(torch.equal(x, y))


def test_the_sp_group_size_must_equal_the_degree():
    with pytest.raises(RankError, match="ulysses_degree=3 but the SP group has 2 ranks"):
        run_ranks(_degree_mismatch, 2, timeout=60)


def test_subgroups_of_the_world_run_independent_requests():
    results = run_ranks(_subgroup_runtime, 4, timeout=120)
    for rank, (path, size, sub_rank, ok) in enumerate(results):
        assert path.startswith("window-aligned SP, Plan A (auto), 2 ranks")
        assert size == 2 and sub_rank == rank % 2 and ok


def test_run_ranks_turns_a_deadlock_into_a_timeout():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_ranks(_one_rank_skips_the_collective, 2, timeout=3)


def _one_rank_skips_the_collective(rank, world_size):
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: a deadlock
    else:
        import time
        time.sleep(60)


def test_attention_can_skip_the_text_output():
    rt = winsp.WindowRuntime([REG])
    req = rt.request([(2, 8, 8)], [3])
    q = req.scatter(torch.randn(128, 2, 4))
    t = torch.randn(3, 2, 4)
    vid_a, txt_a = req.attention(q, q, q, t, t, t, layer=0)
    vid_b, txt_b = req.attention(q, q, q, t, t, t, layer=0, text_output=False)
    assert txt_a.shape == (3, 2, 4) and txt_b is None
    assert torch.equal(vid_a, vid_b)


def test_from_config_logs_the_execution_path(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="winsp"):
        winsp.WindowRuntime.from_config(None, [REG, SHIFT, REG])
    assert "single rank" in caplog.text and "2 layout transitions" in caplog.text


def test_from_config_rejects_other_config_types():
    with pytest.raises(ValueError, match="DiffusionParallelConfig"):
        winsp.WindowRuntime.from_config({"ulysses_degree": 2}, [REG])


def test_nn_modules_compose_the_request_steps():
    from winsp.runtime.nn import EnsureLayout, GatherWindows, ReplicatedTextWindowAttention, ScatterWindows

    rt = winsp.WindowRuntime([REG, SHIFT])
    grid = (5, 32, 56)
    x = torch.randn(5 * 32 * 56, 2, 8, dtype=torch.float64)
    t = torch.randn(4, 2, 8, dtype=torch.float64)

    req = rt.request([grid], [4])
    local = ScatterWindows()(x.flatten(1), req).unflatten(1, (2, 8))
    local = EnsureLayout(1)(local, req)
    vid, txt = ReplicatedTextWindowAttention(1)(req, local, local, local, t, t, t)
    out = GatherWindows()(vid.flatten(1), req)

    ref = rt.request([grid], [4])
    ref_local = ref.to_layer(ref.scatter(x), 1)
    ref_vid, ref_txt = ref.attention(ref_local, ref_local, ref_local, t, t, t, layer=1)
    assert torch.allclose(out, ref.gather(ref_vid).flatten(1), rtol=0, atol=1e-12)
    assert torch.allclose(txt, ref_txt, rtol=0, atol=1e-12)
    assert "layer=1" in repr(EnsureLayout(1))


# ---- bad input is refused early, with a ValueError that says what to do ------------------------------------------

def test_attention_refuses_text_rows_that_text_lengths_do_not_describe():
    rt = winsp.WindowRuntime([REG])
    req = rt.request([(2, 8, 8)], [5])
    q = req.scatter(torch.randn(128, 2, 4))
    t = torch.randn(7, 2, 4)
    with pytest.raises(ValueError, match=r"q_txt has 7 rows but the request's text_lengths \(5,\) describe 5"):
        req.attention(q, q, q, t, t, t, layer=0)
    short = torch.randn(4, 2, 4)
    with pytest.raises(ValueError, match="q_txt has 4 rows"):
        req.attention(q, q, q, short, short, short, layer=0)


@pytest.mark.parametrize("lengths, match", [
    ([2.7], r"text_lengths\[0\] must be an integer"),
    ([True], r"text_lengths\[0\] must be an integer"),
    ([-1], r"text_lengths\[0\] must be non-negative"),
    ("5", "text_lengths must be a sequence of integers"),
])
def test_request_refuses_non_integer_text_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        winsp.WindowRuntime([REG]).request([(2, 8, 8)], lengths)


def test_layers_must_be_integers():
    req = winsp.WindowRuntime([REG, SHIFT]).request([(2, 8, 8)])
    x = req.scatter(torch.zeros(128, 2))
    for bad in (True, 1.0, "1", None):
        with pytest.raises(ValueError, match="layer must be an integer"):
            req.to_layer(x, bad)
    with pytest.raises(ValueError, match="layer must be an integer"):
        req.scatter(torch.zeros(128, 2), layer=False)
    assert req.to_layer(x, 1).shape == x.shape


def test_config_refuses_unknown_backends_and_planners_at_construction():
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'"):
        winsp.DiffusionParallelConfig(attention_backend="bogus")
    with pytest.raises(ValueError, match="unknown planner"):
        winsp.DiffusionParallelConfig(planner="bogus")
    with pytest.raises(ValueError, match="unknown attention backend"):
        winsp.WindowRuntime([REG], attention_backend="bogus")
    assert winsp.DiffusionParallelConfig(attention_backend="grouped_sdpa").attention_backend == "grouped_sdpa"


def test_no_runtime_inside_a_multi_rank_world_is_an_error():
    results = run_ranks(_unbuilt_runtime, 2, timeout=60)
    assert all("build_runtime() was never called" in r for r in results)


def _unbuilt_runtime(rank, world_size):
    from examples.toy_windowed_block import ToyWindowedDiT

    try:
        ToyWindowedDiT()(torch.zeros(4 * 4 * 4, 16), torch.zeros(2, 16), [(4, 4, 4)], [2])
    except RuntimeError as err:
        return str(err)
    return "ran unsharded"
