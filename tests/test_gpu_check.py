"""benchmarks/gpu_check.py: its CPU dry run runs every section of the one-shot GPU check (the same code at tiny sizes),
writes the JSON and the markdown table, and the figures in them are plausible (bf16 close to fp32, every backend that
runs agrees with the float32 reference, the CUDA-only ones say why they cannot run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_dry_run_runs_every_section_and_writes_json_and_markdown(tmp_path):
    gpu_check = _load()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = gpu_check.main(["--dry-run", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(previous)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, {k: v.get("error") for k, v in report["sections"].items()}
    sections = report["sections"]
    assert set(sections) == {"dit", "bf16_vs_fp32", "vae", "attention", "neighborhood", "memory_constants"}
    constants = sections["memory_constants"]
    assert constants["measured"].startswith("nothing: no CUDA device") and constants["stated"]["cuda_context_mib"] > 0
    for name in ("720p x 21 frames", "1080p image"):
        assert sections["dit"][name]["forward_ms"] > 0
    assert sections["dit"]["config"]["num_layers"] == gpu_check.DRY.dit["num_layers"]
    assert 0 < sections["bf16_vs_fp32"]["relative_l2"] < 2e-2
    vae = sections["vae"]
    assert vae["encode"]["ms"] > 0 and vae["decode"]["ms"] > 0
    assert vae["decoded_shape"][2:] == list(gpu_check.DRY.vae_clip)
    backends = sections["attention"]["backends"]
    assert list(backends) == list(gpu_check.ATTENTION_BACKENDS)
    for label, entry in backends.items():
        if "unavailable" in entry:
            assert "cannot run" in entry["unavailable"], label
            continue
        assert "error" not in entry, (label, entry)
        assert entry["ms"] > 0 and entry["max_err_vs_fp32_reference"] < 3e-2, (label, entry)
    assert {"flash SDPA", "flex", "flex + score_mod"} <= {k for k, e in backends.items() if "ms" in e}
    runs = sections["neighborhood"]["runs"]
    assert list(runs) == list(gpu_check.NEIGHBORHOOD_RUNS)
    for label, entry in runs.items():
        if label.startswith("natten"):
            assert "unavailable" in entry or "ms" in entry, (label, entry)
            continue
        assert "error" not in entry, (label, entry)
        assert entry["max_err_out"] < (3e-2 if "bf16" in label else 1e-5), (label, entry)
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| 720p x 21 frames |" in table and "| flex + score_mod |" in table and "| encode |" in table


def test_without_cuda_the_real_run_refuses_with_a_clear_message(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real run would start")
    assert _load().main(["--out", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.json").exists()
