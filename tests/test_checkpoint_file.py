"""Unreadable checkpoints always become one ``ValueError`` (the CLI's one ``error:`` line), never a stray exception.

A seeded fuzz of :func:`read_checkpoint_file`: random bytes, truncations and byte mutations of small valid zip-format
and legacy-format ``.pth`` files and ``.safetensors`` files. A mutated file may still load (a changed tensor value is
not detectable); what must never happen is any other exception type, or a warning printed on the way.
"""

from __future__ import annotations

import io
import random
import warnings

import pytest
import torch

from examples.seedvr2.checkpoints.file import read_checkpoint_file

FUZZ_FILES = 400


def _valid_files() -> dict[str, list[bytes]]:
    state = {"blocks.0.weight": torch.arange(12.0).reshape(3, 4), "blocks.0.bias": torch.ones(5, dtype=torch.float16)}
    zipped, legacy = io.BytesIO(), io.BytesIO()
    torch.save(state, zipped)
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    from safetensors.torch import save

    return {".pth": [zipped.getvalue(), legacy.getvalue()], ".safetensors": [save(state)]}


def _fuzzed(rng: random.Random, bases: dict[str, list[bytes]]) -> tuple[str, str, bytes]:
    suffix = rng.choice(sorted(bases))
    base = rng.choice(bases[suffix])
    kind = rng.choice(["random", "truncated", "mutated", "magic"])
    if kind == "random":
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400)))
    elif kind == "truncated":
        data = base[: rng.randrange(len(base))]
    elif kind == "magic":  # the first bytes (zip magic / pickle protocol / safetensors header length) overwritten
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9))) + base[8:]
    else:
        mutated = bytearray(base)
        for _ in range(rng.randrange(1, 10)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        data = bytes(mutated)
    return suffix, kind, data


def test_fuzzed_checkpoints_only_ever_raise_value_error(tmp_path):
    rng = random.Random(20251130)
    bases = _valid_files()
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(FUZZ_FILES):
        suffix, kind, data = _fuzzed(rng, bases)
        path = tmp_path / f"case{i}{suffix}"
        path.write_bytes(data)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning would be a second line on the user's terminal
            try:
                state = read_checkpoint_file(path)
            except ValueError as err:
                outcomes["refused"] += 1
                assert str(path) in str(err) and "\n" not in str(err).strip(), (kind, str(err))
            except Exception as err:  # noqa: BLE001 - this is what the test is looking for
                pytest.fail(f"case {i} ({kind} {suffix}, {len(data)} bytes) escaped as {type(err).__name__}: {err}")
            else:
                outcomes["loaded"] += 1
                assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
        path.unlink()
    assert outcomes["refused"] > FUZZ_FILES // 2, outcomes  # the fuzz really produced broken files


@pytest.mark.parametrize("suffix", [".pth", ".pt", ".safetensors"])
def test_empty_file_is_refused(tmp_path, suffix):
    path = tmp_path / f"weights{suffix}"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"is empty \(0 bytes\)"):
        read_checkpoint_file(path)
