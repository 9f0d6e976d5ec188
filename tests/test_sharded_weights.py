"""The DiT's block weights sharded over the SP group (``--shard-weights``): layouts, parity, per-rank memory, refusals.

Parity is exact (``torch.equal``): a rank's gathered block holds the very bytes the replicated model loaded, and the
forward then runs the same operations on the same values in the same order.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import winsp
from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT, load_dit_checkpoint
from examples.seedvr2.weights.sharded import load_sharded_dit, shard_loaded_dit, sharded_weights_of
from tests.test_dit import GOLDEN, random_batch, read_golden, run
from winsp.comm.group import SPGroup
from winsp.runtime.weight_shards import FlatShardLayout, GatheredModules, module_layout, shard_of_module
from winsp.testing import run_ranks

TIMEOUT = 180.0
GOLDEN_FILES = {"3b": GOLDEN / "nadit3b_tiny.safetensors", "7b": GOLDEN / "nadit7b_tiny.safetensors"}


# ---- the flat layout (pure) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_layout_pieces_cover_every_element_once(parts):
    tensors = [("a", (7, 5), torch.float32), ("b", (3,), torch.bfloat16), ("c", (2, 9), torch.float16),
               ("d", (1,), torch.uint8), ("e", (11, 13), torch.bfloat16)]
    layout = FlatShardLayout.of(tensors, parts)
    assert layout.total_bytes >= layout.tensor_bytes and layout.total_bytes % parts == 0
    seen = {name: torch.zeros(int(torch.tensor(shape).prod()), dtype=torch.int64) for name, shape, _ in tensors}
    for rank in range(parts):
        for piece in layout.pieces(rank):
            assert 0 <= piece.chunk_offset < layout.chunk_bytes
            seen[piece.name][piece.start:piece.stop] += 1
    assert all(bool((count == 1).all()) for count in seen.values())
    with pytest.raises(ValueError, match="rank 9"):
        layout.pieces(9)


def test_shards_of_a_module_gather_back_to_its_parameters():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3)).to(
        torch.bfloat16)
    for parts in (1, 2, 3):
        layout = module_layout(module, parts)
        flat = torch.cat([shard_of_module(module, layout, r) for r in range(parts)])
        views = layout.views(flat)
        assert all(torch.equal(views[n], p) for n, p in module.named_parameters())


def test_gathered_modules_at_one_rank_run_the_module_unchanged():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    x = torch.randn(2, 4)
    expected = blocks[2](blocks[1](blocks[0](x)))
    layouts = [module_layout(b, 1) for b in blocks]
    shards = [shard_of_module(b, layout, 0) for b, layout in zip(blocks, layouts, strict=True)]
    whole = sum(p.numel() * p.element_size() for p in blocks.parameters())
    gathered = GatheredModules(list(blocks), layouts, shards, None)
    assert all(p.numel() == 0 for p in blocks.parameters())
    assert whole <= gathered.shard_bytes <= whole + 64 * 6  # one rank: everything, each tensor aligned
    with torch.no_grad():
        assert torch.equal(blocks[2](blocks[1](blocks[0](x))), expected)
    assert all(p.numel() == 0 for p in blocks.parameters())  # emptied again after each block
    with pytest.raises(ValueError, match="split 2 ways"):
        GatheredModules(list(blocks), [module_layout(torch.nn.Linear(4, 4), 2)] * 3, shards, None)


# ---- SP 2: sharded vs replicated ---------------------------------------------------------------------------------


def _save(tmp_path, which: str, suffix: str, dtype: torch.dtype) -> str:
    _, state, _, _ = read_golden(GOLDEN_FILES[which])
    state = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("freqs") else v) for k, v in state.items()}
    path = str(tmp_path / f"dit_{which}{suffix}")
    if suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)
    return path


def _block_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks.parameters())


#: small packed inputs (two samples, post-patch grids (1, 4, 6) and (2, 3, 4)): a fast forward on every block
SMALL = dict(shapes=[(1, 8, 12), (2, 6, 8)], text_lengths=[3, 5], timesteps=[999.0, 250.0])


def _rank_parity(rank: int, world: int, cases: list) -> list:
    results = []
    for which, path, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        meta, _, _, _ = read_golden(GOLDEN_FILES[which])
        config = NaDiTConfig.from_metadata(meta)
        inputs = random_batch(config, SMALL["shapes"], SMALL["text_lengths"], SMALL["timesteps"], seed=3)
        parallel = winsp.DiffusionParallelConfig(ulysses_degree=world)
        whole = SeedVR2NaDiT(config).to(dtype).eval()
        load_dit_checkpoint(whole, path)
        whole.build_runtime(parallel)
        whole_bytes = _block_bytes(whole)
        reference = run(whole, inputs, dtype)

        with torch.device("meta"):
            model = SeedVR2NaDiT(config).to(dtype)
        gathered = load_sharded_dit(model, path, SPGroup.world())
        model.eval().build_runtime(parallel)
        first, second = run(model, inputs, dtype), run(model, inputs, dtype)
        empty_after = all(p.numel() == 0 for p in model.blocks.parameters())
        gathered.prefetch = False  # the same shards, each gathered only when its block starts
        unprefetched = run(model, inputs, dtype)

        shard_loaded_dit(whole, SPGroup.world())  # the in-memory path: a loaded model keeps its rank's chunks
        in_memory = run(whole, inputs, dtype)
        results.append({
            "equal": torch.equal(first, reference), "again": torch.equal(second, reference),
            "unprefetched": torch.equal(unprefetched, reference), "in_memory": torch.equal(in_memory, reference),
            "empty_after": empty_after, "shard_bytes": gathered.shard_bytes, "whole_bytes": whole_bytes,
            "in_memory_bytes": sharded_weights_of(whole).shard_bytes})
    return results


@pytest.mark.multirank
def test_sharded_dit_equals_replicated_at_sp2_with_half_the_block_weights(tmp_path):
    """Two ranks, the 3B architecture from an fp32 safetensors file and the 7B from a bf16 .pth (the meta model in
    bf16 and fp32): the DiT loaded sharded (each rank reading only its chunks) gives bitwise the replicated output,
    with and without prefetch and on a second forward, and so does a loaded DiT sharded in memory; each rank holds
    half the block weights (plus alignment)."""
    cases = [("3b", _save(tmp_path, "3b", ".safetensors", torch.float32), "float32"),
             ("7b", _save(tmp_path, "7b", ".pth", torch.bfloat16), "bfloat16"),
             ("7b", _save(tmp_path, "7b", ".pth", torch.bfloat16), "float32")]
    results = run_ranks(_rank_parity, 2, cases, timeout=TIMEOUT)
    for rank, per_case in enumerate(results):
        for case, res in zip(cases, per_case, strict=True):
            assert res["equal"] and res["again"] and res["unprefetched"] and res["in_memory"], (rank, case, res)
            assert res["empty_after"], (rank, case)
            share = res["shard_bytes"] / res["whole_bytes"]
            assert 0.5 <= share <= 0.51, (rank, case, share)
            assert res["in_memory_bytes"] == res["shard_bytes"], (rank, case)


# ---- refusals -----------------------------------------------------------------------------------------------------


def _meta_model(which: str):
    meta, _, _, _ = read_golden(GOLDEN_FILES[which])
    with torch.device("meta"):
        return SeedVR2NaDiT(NaDiTConfig.from_metadata(meta))


def test_fp8_gguf_and_fp8_conversion_are_refused_in_one_line(tmp_path):
    _, state, _, _ = read_golden(GOLDEN_FILES["3b"])
    fp8 = tmp_path / "dit_fp8.safetensors"
    save_file({k: (v.to(torch.float8_e4m3fn) if v.dim() == 2 else v) for k, v in state.items()}, str(fp8))
    with pytest.raises(ValueError, match=r"^--shard-weights does not take fp8 checkpoints .*'blocks\.") as err:
        load_sharded_dit(_meta_model("3b"), str(fp8))
    assert "\n" not in str(err.value)
    gguf = tmp_path / "dit.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="GGUF"):
        from examples.seedvr2.weights.sharded import check_shardable_checkpoint

        check_shardable_checkpoint(str(gguf), {}, "stored")
    plain = _save(tmp_path, "3b", ".safetensors", torch.float32)
    with pytest.raises(ValueError, match="--weights fp8"):
        load_sharded_dit(_meta_model("3b"), plain, weights="fp8")


def test_a_mismatched_checkpoint_is_refused_before_anything_is_read(tmp_path):
    path = _save(tmp_path, "7b", ".safetensors", torch.float32)
    with pytest.raises(ValueError, match="missing keys: .*vid_out_norm|unexpected keys"):
        load_sharded_dit(_meta_model("3b"), path)


def test_a_truncated_safetensors_file_is_refused_in_one_line(tmp_path):
    path = _save(tmp_path, "3b", ".safetensors", torch.float32)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 4096)
    with pytest.raises(ValueError, match="not a readable safetensors file .*beyond the file's data") as err:
        load_sharded_dit(_meta_model("3b"), path)
    assert "\n" not in str(err.value)


def _rank_pipeline(rank: int, world: int) -> dict:
    from examples.seedvr2.pipeline import SeedVR2Pipeline
    from tests.test_pipeline import build_golden_models, restore_small

    dit, vae = build_golden_models()
    whole = restore_small(SeedVR2Pipeline(dit, vae, "height", group=SPGroup.world()))
    pipe = SeedVR2Pipeline(dit, vae, "height", group=SPGroup.world(), shard_weights=True)
    return {"equal": torch.equal(restore_small(pipe), whole), "describe": pipe.describe(),
            "empty": all(p.numel() == 0 for p in dit.blocks.parameters())}


@pytest.mark.multirank
def test_pipeline_shard_weights_restores_the_same_video_at_sp2():
    """``SeedVR2Pipeline(..., shard_weights=True)`` on the golden restore models: the same video, bit for bit."""
    for rank, res in enumerate(run_ranks(_rank_pipeline, 2, timeout=TIMEOUT)):
        assert res["equal"] and res["empty"], (rank, res)
        assert "DiT blocks sharded x2" in res["describe"], res["describe"]
