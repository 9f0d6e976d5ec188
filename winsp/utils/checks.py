"""Argument checks shared by the public entry points: refuse what would otherwise be silently coerced."""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["count_tuple"]


def count_tuple(name: str, values: object) -> tuple[int, ...]:
    """``values`` as a tuple of non-negative Python ints, or a ValueError naming ``name`` and the bad entry.

    Integers of any kind (Python, numpy, 0-d tensors with ``__index__``) are accepted; bools, floats and strings are
    refused rather than truncated.
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    out = []
    for position, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name}[{position}] must be an integer, got a bool")
        try:
            number = operator.index(value)
        except TypeError:
            raise ValueError(f"{name}[{position}] must be an integer, got {value!r}") from None
        if number < 0:
            raise ValueError(f"{name}[{position}] must be non-negative, got {number}")
        out.append(int(number))
    return tuple(out)
