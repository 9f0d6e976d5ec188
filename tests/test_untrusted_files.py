"""Checkpoint files are untrusted input: read right or refused in one line, never garbage, never unbounded.

The numbered cases of issue 30 that concern files: a GGUF whose counts lie (1), a big-endian GGUF and a re-zipped
.pth with compressed records (2), a GGUF ``orig_shape`` that does not fit and a checkpoint path that is a directory
(8). Then a seeded fuzz of all three formats in a child process under an address-space limit and a time limit.
"""

from __future__ import annotations

import io
import json
import os
import random
import struct
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from examples.seedvr2.checkpoints import gguf_file
from examples.seedvr2.checkpoints.file import read_checkpoint_file
from examples.seedvr2.weights.footprint import checkpoint_layout, resident_weight_bytes
from tests.gguf_writers import gguf_bytes, gguf_entry, gguf_string, gguf_tensor_entry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARRAY, STRING, UINT32, UINT64, INT64 = 9, 8, 4, 10, 11
F32, F16, Q8_0 = 0, 1, 8


def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def _f32_file(values: torch.Tensor, order: str = "<", **extra) -> bytes:
    raw = values.numpy().astype(order + "f4").tobytes()
    return gguf_bytes(tensors=[gguf_tensor_entry("w", list(reversed(values.shape)), F32, 0, order)], data=raw,
                      order=order, **extra)


# ---- (1) counts bounded by the file's size ------------------------------------------------------------------------


@pytest.mark.parametrize("item_type", [UINT32, STRING, ARRAY])
def test_a_metadata_array_of_2_62_items_in_a_tiny_file_is_refused_at_once(tmp_path, item_type):
    """The ``gguf`` package walked such an array item by item past the end of the file, growing without bound."""
    entry = gguf_entry("evil", ARRAY, struct.pack("<IQ", item_type, 2**62))
    path = _write(tmp_path, "evil.gguf", gguf_bytes([entry]))
    assert os.path.getsize(path) <= 64
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"'evil'.*is 4611686018427387904, more than the \d+ bytes left"):
        read_checkpoint_file(path)
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("field", ["tensor_count", "metadata_count"])
def test_lying_top_level_counts_are_refused(tmp_path, field):
    path = _write(tmp_path, "evil.gguf", _f32_file(torch.ones(4), **{field: 2**60}))
    with pytest.raises(ValueError, match=r"count is 1152921504606846976, more than the \d+ bytes left"):
        read_checkpoint_file(path)


def test_many_metadata_entries_parse_quickly_and_only_once(tmp_path, monkeypatch):
    """A file with 100k metadata entries (strings and string arrays) is read in seconds, and each file's header is
    parsed once for the memory plan and the loader together (a DiT's and a VAE's, as a run asks for them)."""
    entries = [gguf_entry(f"k{i}", STRING, gguf_string("v" * 8)) if i % 2 else
               gguf_entry(f"k{i}", ARRAY, struct.pack("<IQ", STRING, 2) + gguf_string("a") + gguf_string("b"))
               for i in range(100_000)]
    values = torch.arange(8.0)
    path = _write(tmp_path, "many.gguf", gguf_bytes(
        entries, [gguf_tensor_entry("w", [8], F32, 0)], data=values.numpy().tobytes()))
    parses = []
    parse = gguf_file._parse
    monkeypatch.setattr(gguf_file, "_parse", lambda *a: parses.append(1) or parse(*a))
    other = _write(tmp_path, "other.gguf", _f32_file(torch.ones(2)))  # the VAE's, planned between
    started = time.monotonic()
    assert resident_weight_bytes(path, compute_dtype=torch.float32) == 32
    assert resident_weight_bytes(other, compute_dtype=torch.float32) == 8
    assert torch.equal(read_checkpoint_file(path)["w"], values)
    assert torch.equal(read_checkpoint_file(other)["w"], torch.ones(2))
    assert len(parses) == 2 and time.monotonic() - started < 10


# ---- (2) byte order and compressed records ------------------------------------------------------------------------


def test_big_endian_float_gguf_loads_the_right_values(tmp_path):
    """Written by the ``gguf`` package's own big-endian writer: header and values swapped; read back unswapped."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "be.gguf"
    values = {"a": torch.randn(3, 5), "b": torch.randn(7).half()}
    writer = gguf.GGUFWriter(str(path), arch="seedvr2", endianess=gguf.GGUFEndian.BIG)
    for key, value in values.items():
        writer.add_tensor(key, value.numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    read = read_checkpoint_file(path)
    assert gguf_file.gguf_header(str(path)).big_endian
    for key, value in values.items():
        assert read[key].dtype == value.dtype and torch.equal(read[key], value), key


def test_big_endian_hand_written_f32_matches_little_endian(tmp_path):
    values = torch.randn(2, 3)
    little = read_checkpoint_file(_write(tmp_path, "le.gguf", _f32_file(values)))["w"]
    big = read_checkpoint_file(_write(tmp_path, "be.gguf", _f32_file(values, ">")))["w"]
    assert torch.equal(little, values) and torch.equal(big, values)


def test_big_endian_quantised_tensor_is_refused(tmp_path):
    path = _write(tmp_path, "be.gguf", gguf_bytes(tensors=[gguf_tensor_entry("q", [32], Q8_0, 0, ">")],
                                                  data=bytes(34), order=">"))
    with pytest.raises(ValueError, match=r"tensor 'q' is Q8_0 in a big-endian file"):
        read_checkpoint_file(path)


def test_pth_with_compressed_records_loads_the_right_values(tmp_path):
    """A re-zipped .pth (DEFLATE records): memory-mapped, its compressed bytes were taken for the weights."""
    state = {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.linspace(0, 1, 100)}
    plain = tmp_path / "plain.pth"
    torch.save(state, plain)
    rezipped = tmp_path / "rezipped.pth"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(rezipped, "w", zipfile.ZIP_DEFLATED) as dst:
        for record in src.infolist():
            dst.writestr(record.filename, src.read(record.filename))
    read = read_checkpoint_file(rezipped)
    assert all(torch.equal(read[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="compressed records"):
        checkpoint_layout(str(rezipped))  # the memory plan counts its uncompressed size instead


# ---- (8) errors that name the problem -----------------------------------------------------------------------------


def test_orig_shape_that_does_not_fit_names_the_tensor(tmp_path):
    """2^62 x 2^62 was reported by the memory plan as 'needs 7.9e28 GiB'; both paths now name the tensor."""
    shape = gguf_entry(gguf_file.ORIG_SHAPE_KEY + "w", ARRAY, struct.pack("<IQqq", INT64, 2, 2**62, 2**62))
    path = _write(tmp_path, "big.gguf", gguf_bytes([shape], [gguf_tensor_entry("w", [4], F32, 0)], data=bytes(16)))
    pattern = r"tensor 'w' has 4 values but its comfy\.gguf\.orig_shape\.w says \[4611686018427387904, "
    with pytest.raises(ValueError, match=pattern):
        read_checkpoint_file(path)
    with pytest.raises(ValueError, match=pattern):
        checkpoint_layout(path)


def test_tensor_past_the_end_and_unknown_type_are_named(tmp_path):
    past = _write(tmp_path, "past.gguf", gguf_bytes(tensors=[gguf_tensor_entry("w", [2**40], F32, 0)]))
    with pytest.raises(ValueError, match=r"tensor 'w' is truncated"):
        read_checkpoint_file(past)
    unknown = _write(tmp_path, "unknown.gguf", gguf_bytes(tensors=[gguf_tensor_entry("w", [4], 250, 0)]))
    with pytest.raises(ValueError, match=r"tensor 'w' has GGML type id 250, which is unknown"):
        read_checkpoint_file(unknown)


def test_checkpoint_path_that_is_a_directory_says_so(tmp_path):
    folder = tmp_path / "weights.safetensors"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"is a directory, not a file"):
        read_checkpoint_file(folder)


# ---- the fuzz: flips and truncations of valid files, in a child under limits --------------------------------------

FUZZ_CASES = 300
FUZZ_SEED = 30
#: address space the child may add to what it holds after its imports, and the wall time for all cases
FUZZ_MEMORY = 1 << 30
FUZZ_SECONDS = 120


def _valid_files() -> dict[str, bytes]:
    from safetensors.torch import save

    state = {"a.weight": torch.randn(4, 8), "b": torch.arange(6, dtype=torch.float16)}
    pth = io.BytesIO()
    torch.save(state, pth)
    shape = gguf_entry(gguf_file.ORIG_SHAPE_KEY + "c", ARRAY, struct.pack("<IQII", UINT32, 2, 2, 32))
    names = gguf_entry("names", ARRAY, struct.pack("<IQ", STRING, 2) + gguf_string("x") + gguf_string("yz"))
    data = torch.randn(32).numpy().tobytes() + torch.randn(64).half().numpy().tobytes()
    tensors = [gguf_tensor_entry("a.weight", [8, 4], F32, 0), gguf_tensor_entry("c", [64], F16, 128)]
    gguf = gguf_bytes([gguf_entry("general.alignment", UINT32, struct.pack("<I", 32)), names, shape], tensors,
                      data=data)
    return {".safetensors": save(state), ".pth": pth.getvalue(), ".gguf": gguf}


def _cases() -> list[tuple[str, bytes]]:
    rng = random.Random(FUZZ_SEED)
    bases = _valid_files()
    cases = []
    for i in range(FUZZ_CASES):
        suffix = sorted(bases)[i % len(bases)]
        base = bases[suffix]
        if rng.random() < 0.3:
            data = base[:rng.randrange(1, len(base))]
        else:
            flipped = bytearray(base)
            for _ in range(rng.randrange(1, 8)):
                at = rng.randrange(min(len(base), 200) if rng.random() < 0.7 else len(base))  # the header, mostly
                flipped[at] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1, 256)
            data = bytes(flipped)
        cases.append((suffix, data))
    return cases


_CHILD = r"""
import json, os, resource, sys, warnings
import torch
from examples.seedvr2.checkpoints.file import read_checkpoint_file
from examples.seedvr2.weights.footprint import resident_weight_bytes
held = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (held + int(sys.argv[2]), held + int(sys.argv[2])))
outcomes = []
for name in sorted(os.listdir(sys.argv[1])):
    path = os.path.join(sys.argv[1], name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            try:
                resident_weight_bytes(path, compute_dtype=torch.float32)  # the memory plan reads it first
            except ValueError:
                pass
            state = read_checkpoint_file(path)
            outcomes.append([name, "loaded", ""])
        except ValueError as err:
            outcomes.append([name, "refused", str(err)])
        except BaseException as err:
            outcomes.append([name, "escaped", f"{type(err).__name__}: {err}"])
print(json.dumps(outcomes))
"""


def test_fuzzed_files_load_or_raise_one_value_error_within_bounds(tmp_path):
    """300 flipped or truncated GGUF / safetensors / .pth files, read by the memory plan and the loader in a child
    whose address space may grow by at most 1 GiB: each loads or is one ValueError naming the file, all within
    FUZZ_SECONDS."""
    folder = tmp_path / "cases"
    folder.mkdir()
    for i, (suffix, data) in enumerate(_cases()):
        (folder / f"case{i:03d}{suffix}").write_bytes(data)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(FUZZ_MEMORY)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=FUZZ_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(outcomes) == FUZZ_CASES
    escaped = [o for o in outcomes if o[1] == "escaped"]
    assert not escaped, escaped[:5]
    for name, outcome, message in outcomes:
        if outcome == "refused":
            assert name in message and "\n" not in message.strip(), (name, message)
    refused = sum(o[1] == "refused" for o in outcomes)
    assert refused > FUZZ_CASES // 3, refused  # the fuzz did break files
