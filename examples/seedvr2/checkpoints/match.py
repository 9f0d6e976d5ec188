"""One check of a checkpoint against the model it goes into: its keys, each tensor's shape and its dtype.

Shared by the DiT loader (whole weights), the sharded DiT loader (``--shard-weights``, which sees only the file's
header), the VAE loader, and the CLI's check before the ranks start (from the headers too), so each refuses the same
files with the same message. A floating-point model entry takes any real floating-point tensor (fp32/fp16/bf16 are
cast, fp8 and GGUF-quantised ones kept packed or expanded, see :mod:`.dtypes`); an integer, bool or complex
tensor there is refused, never cast (a cast int8 or bool "weight" would run, and restore nothing). A non-floating
model entry takes its own dtype only.

Entries are ``(shape, kind)``: ``kind`` is a torch dtype, or a dtype name as the files spell it (torch's ``int8``,
safetensors' ``I8`` / ``BOOL`` / ``F8_E4M3``, GGUF's ``Q4_K`` / ``I32``). Pure functions of names and shapes.
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

import torch

__all__ = ["check_checkpoint_matches", "castable_to_float", "entry_kind"]

Kind = Union[str, torch.dtype]
Entry = tuple[Sequence[int], Kind]
_LIMIT = 8


#: safetensors' dtype names as torch spells them (so a header and a loaded tensor give the same message)
_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def entry_kind(kind: Kind) -> str:
    """A dtype or dtype name as the messages spell it: torch's name (``int8``, ``float8_e4m3fn``), or GGUF's block
    type (``Q4_K``)."""
    name = str(kind).replace("torch.", "")
    return _TORCH_NAMES.get(name, name)


def castable_to_float(kind: Kind) -> bool:
    """Whether a stored tensor of ``kind`` can become a floating-point weight: a real floating-point type (fp8 and
    GGUF block types included), not an integer, bool or complex one."""
    name = entry_kind(kind).lower()
    if name == "bool" or name.startswith(("int", "uint", "u", "complex", "c")):
        return False
    return not (name.startswith("i") and not name.startswith("iq"))  # GGUF's I8..I64; IQ2_XXS etc. are quantised


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_LIMIT])
    return shown + (f", ... ({len(items)} in all)" if len(items) > _LIMIT else "")


def check_checkpoint_matches(expected: Mapping[str, Entry], found: Mapping[str, Entry]) -> None:
    """``ValueError`` naming every missing, unexpected, wrongly shaped or wrongly typed key of a checkpoint
    (``found``, after any key renames) against the model's (``expected``); nothing when they agree."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    both = sorted(set(expected) & set(found))
    mismatched = [f"{k}: checkpoint {tuple(found[k][0])} vs model {tuple(expected[k][0])}" for k in both
                  if tuple(found[k][0]) != tuple(expected[k][0])]
    wrong_type = []
    for k in both:
        want, have = expected[k][1], found[k][1]
        floating = want.is_floating_point if isinstance(want, torch.dtype) else castable_to_float(want)
        if (not castable_to_float(have)) if floating else entry_kind(have) != entry_kind(want):
            wrong_type.append(f"{k}: checkpoint {entry_kind(have)} where the model has {entry_kind(want)}")
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched[:_LIMIT])}")
    if wrong_type:
        problems.append(f"dtypes the model cannot take (an integer, bool or complex tensor is never cast to a "
                        f"floating-point weight): {'; '.join(wrong_type[:_LIMIT])}")
    if problems:
        raise ValueError("checkpoint does not match the model: " + " | ".join(problems))
