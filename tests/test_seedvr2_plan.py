"""The planning/compute split of SeedVR2 on the CPU build: the pieces that need no fake GPU (the memory planner's pure
parts and its one-line refusal on a CPU-only torch, the batch's deferred NaN checks, RoPE sharing keyed on the host).
The fake-GPU runs themselves are in tests/test_seedvr2_fake_gpu.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from examples.seedvr2.pipeline import FiniteChecks, NonFiniteOutput
from examples.seedvr2.memory.planner import GiB, _batch_count, parse_bytes, sp_degrees


def test_memory_sizes_read_as_gpu_specs_write_them():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("80GB") == parse_bytes("80g") == parse_bytes("80 GiB") == 80 * GiB
    assert parse_bytes("141GiB") == 141 * GiB and parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="80 gigs"):
        parse_bytes("80 gigs")


def test_sp_degrees_prefer_groups_when_the_clip_has_enough_batches():
    # one batch: every GPU on it (the largest degree first)
    assert sp_degrees(8, 1)[0] == 8
    # eight batches on 8 GPUs: eight groups of one are as fast as one group of 8, with no communication
    assert sp_degrees(8, 8)[0] == 1
    # three batches on 4 GPUs: one group of 4 takes three rounds of 1/4 (0.75); groups of 2 two rounds of 1/2 and
    # groups of 1 one round of 1 tie at 1.0, the smaller degree first
    assert sp_degrees(4, 3) == [4, 1, 2]
    assert sorted(sp_degrees(6, 5)) == [1, 2, 3, 6]


def test_sp_degrees_on_gpu_counts_that_are_not_powers_of_two():
    # only divisors (restore needs --ranks to be a multiple of --sp-size): 5 and 7 GPUs are one group or single ranks
    assert sp_degrees(5, 1) == [5, 1] and sp_degrees(7, 4) == [7, 1]
    # three batches on 3 GPUs: groups of one take them in one round (1.0), one group of 3 in three rounds of 1/3 (1.0)
    assert sp_degrees(3, 3) == [1, 3]
    # four batches on 6 GPUs: 2 groups of 3 and 1 group of 6 both take 2/3; groups of 2 (two rounds of 1/2) and of
    # one (one round) take 1
    assert sp_degrees(6, 4) == [3, 6, 1, 2]
    assert sp_degrees(7, 1)[0] == 7  # one batch: every GPU on it


def test_batch_count_follows_the_overlapping_temporal_batches():
    assert _batch_count(21, 21, 5) == 1
    assert _batch_count(22, 21, 5) == 2
    assert _batch_count(121, 21, 5) == 1 + -(-(121 - 21) // 16)


def test_plan_on_a_cpu_only_torch_says_so_in_one_line():
    if torch.backends.cuda.is_built():
        pytest.skip("this torch is a CUDA build: the planner traces instead")
    run = subprocess.run([sys.executable, "-m", "examples.seedvr2", "plan", "--gpus", "2", "--gpu-memory", "80GiB",
                          "--model", "7b", "--resolution", "3840x2160", "--frames", "121"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA build of torch" in lines[0] and "CPU-only" in lines[0], run.stderr


def test_finite_checks_name_the_first_bad_stage_with_one_read():
    checks = FiniteChecks()
    good = checks.add(torch.ones(4), "the VAE encoder")
    assert torch.equal(good, torch.ones(4))
    checks.add(torch.tensor([1.0, float("nan"), float("inf")]), "the DiT")
    checks.add(torch.tensor([float("nan")]), "the VAE decoder")
    with pytest.raises(NonFiniteOutput, match=r"^the DiT produced 2 non-finite values \(NaN or inf\) of 3"):
        checks.raise_if_any()
    clean = FiniteChecks()
    clean.add(torch.zeros(3), "the DiT")
    clean.raise_if_any()


def test_rope_keys_follow_loads_and_moves_without_reading_the_buffers():
    from examples.seedvr2.models.dit.rope import RotaryEmbedding3d

    a, b = RotaryEmbedding3d(24), RotaryEmbedding3d(24)
    assert a.frequency_key() == b.frequency_key() == ("exact", "mmrope3d", 24)
    a.to(torch.bfloat16)  # a move or cast keeps the (float32) values: the key stays known
    assert a.freqs.dtype == torch.float32 and a.frequency_key() == ("exact", "mmrope3d", 24)
    changed = {"freqs": a.freqs * 2}
    b.load_state_dict(changed, assign=True)  # a new tensor: read once, keyed by its values
    assert b.frequency_key() != a.frequency_key() and b.frequency_key()[0] == "values"
    b.load_state_dict({"freqs": a.exact_frequencies()})  # copied in place: read again, equal to the exact ones
    assert b.frequency_key() == a.frequency_key()


def _plan_table_cells() -> dict:
    """docs/memory.md's plan table: (model, clip, memory, GPUs) -> (SP, batch, exact VAE, peak GiB), None if nothing
    fits."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text()
    header = re.search(r"^\| model \| clip \| GPUs \| (.*) \|$", text, re.MULTILINE)
    assert header is not None
    memories = [int(m.split()[0]) for m in header.group(1).split(" | ")]
    cells = {}
    for line in re.findall(r"^\| [37]b \|.*\|$", text, re.MULTILINE):
        model, clip, gpus, *row = [c.strip() for c in line.strip("|").split("|")]
        for memory, cell in zip(memories, row, strict=True):
            m = re.fullmatch(r"SP (\d+), batch (\d+), (\w+)(?: \d+)?(?:, shard)?: ([\d.]+)", cell)
            cells[(model, clip, memory, int(gpus))] = m and (int(m.group(1)), int(m.group(2)), m.group(3) != "tiled",
                                                             float(m.group(4)))
    return cells


def test_the_plan_table_covers_one_to_eight_gpus():
    cells = _plan_table_cells()
    for model in ("3b", "7b"):
        for clip in ("1280x720x21", "1920x1072x61", "3840x2160x121"):
            for memory in (24, 48, 80, 141):
                for gpus in range(1, 9):
                    cell = cells[(model, clip, memory, gpus)]
                    assert cell is None or gpus % cell[0] == 0, (model, clip, memory, gpus, cell)


def test_the_plan_table_needs_more_memory_only_for_a_faster_plan():
    """With more GPUs of the same size, a cell needs more memory a rank only when its plan is faster by the planner's
    own measure (rounds of 1/SP: :func:`sp_degrees`) or runs a longer temporal batch (the order tried, best first)."""
    frames = {"1280x720x21": 21, "1920x1072x61": 61, "3840x2160x121": 121}
    cells = _plan_table_cells()

    def cost(clip, gpus, cell):
        sp, batch = cell[0], cell[1]
        return -(-_batch_count(frames[clip], batch, 5) // (gpus // sp)) / sp

    compared = 0
    for (model, clip, memory, gpus), a in cells.items():
        for more in range(gpus + 1, 9):
            b = cells.get((model, clip, memory, more))
            if a is None or b is None or b[3] <= a[3]:
                continue
            compared += 1
            assert cost(clip, more, b) < cost(clip, gpus, a) or b[1] > a[1], (
                f"{model} {clip} {memory} GiB: {more} GPUs need {b[3]} GiB a rank, {gpus} GPUs {a[3]}, with no faster "
                f"plan")
    assert compared > 100
