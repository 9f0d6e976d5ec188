"""The dtypes of attention's inputs, checked on every rank of a group at once.

q/k/v that are not floating point reach a backend's kernel and fail deep inside it; q/k/v whose dtype differs
between ranks reach a collective with buffers of different sizes, which gloo answers with an abort (SIGABRT) and
NCCL with a hang. So before a request's first attention each rank encodes its input dtypes as small integers
(:func:`dtype_codes`), the group all-gathers them (one collective per request), and every rank reads the same table
with :func:`dtype_problem`, so that all of them raise the same error naming the tensors, dtypes and ranks.

On a GPU, reading that table back would stall the device inside the first layer (a host sync in compute). There
each rank checks its own row on the host (no device value needed) and the group compares the rows on the device
(:meth:`winsp.comm.group.SPGroup.assert_same_ints`): a mismatch between ranks stops every rank with a device-side
assertion instead of a hang, without a sync when they agree.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["QKV_NAMES", "dtype_codes", "dtype_problem"]

QKV_NAMES = ("q_vid", "k_vid", "v_vid", "q_txt", "k_txt", "v_txt")
_ABSENT = -1
_OTHER = 0
#: the dtypes named in messages; anything else is "another dtype" (code 0)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool] + [
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
_FLOATING = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


def dtype_codes(tensors: Sequence[Optional[torch.Tensor]]) -> list[int]:
    """One small integer per tensor: -1 for None, 0 for a dtype not listed here, else its position + 1."""
    return [_ABSENT if t is None else (_DTYPES.index(t.dtype) + 1 if t.dtype in _DTYPES else _OTHER)
            for t in tensors]


def _name(code: int) -> str:
    return "another dtype" if code == _OTHER else str(_DTYPES[code - 1]).replace("torch.", "")


def dtype_problem(rows: Sequence[Sequence[int]], names: Sequence[str] = QKV_NAMES, first_rank: int = 0
                  ) -> Optional[str]:
    """What is wrong with every rank's input dtypes (``rows[rank]`` from :func:`dtype_codes`), or None.

    Refused: a tensor that is not real floating point (float8 included: the backends compute in 16 bits and more),
    inputs of one rank in different dtypes, and dtypes that differ between ranks. ``first_rank``: the rank of
    ``rows[0]`` (a single rank's row checks that rank alone)."""
    for rank, row in enumerate(rows, start=first_rank):
        for name, code in zip(names, row, strict=True):
            if code != _ABSENT and (code == _OTHER or _DTYPES[code - 1] not in _FLOATING):
                return (f"attention inputs must be floating point (float32, float64, float16, bfloat16): {name} is "
                        f"{_name(code)} on rank {rank}")
    for rank, row in enumerate(rows, start=first_rank):
        present = {code for code in row if code != _ABSENT}
        if len(present) > 1:
            listed = ", ".join(f"{n} {_name(c)}" for n, c in zip(names, row, strict=True) if c != _ABSENT)
            return f"attention inputs must share one dtype, but on rank {rank} they are {listed}"
    firsts = [next((c for c in row if c != _ABSENT), _ABSENT) for row in rows]
    if len(set(firsts)) > 1:
        listed = ", ".join(f"rank {rank} {_name(c)}" for rank, c in enumerate(firsts))
        return (f"attention inputs must have the same dtype on every rank of the SP group (the collectives "
                f"exchange their bytes), but they are: {listed}")
    return None
