"""The bound of every count an argument gives (micro-batches, steps, bytes, processes): what this process holds.

Python's ints have no limit, but the counts go into torch's int64 tensors (the loss scale's counters, the window's
divisor), into indices and lengths (``sys.maxsize``), and are compared with Lightning's step counters: a count beyond
2**63 - 1 would overflow there, far into a run, or never be reached. It is refused at construction instead.
"""

from __future__ import annotations

import sys
from typing import TypeGuard

__all__ = ["MAX_COUNT", "check_count_fits", "is_count", "is_int"]

MAX_COUNT = min(sys.maxsize, 2**63 - 1)  # (the largest int64; Python's largest index on a 64-bit build)
_BOUND_TEXT = f"{MAX_COUNT} (2**63 - 1, the largest int64 this process's counters and indices hold)"


def check_count_fits(name: str, value: object, owner: str = "") -> None:
    """``ValueError`` naming the argument, the value and the bound where an int ``value`` exceeds ``MAX_COUNT`` (or
    lies below ``-MAX_COUNT``); other values are left to the caller's own check."""
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) <= MAX_COUNT:
        return
    where = f"{owner}({name}={value!r})" if owner else f"{name}={value!r}"
    raise ValueError(f"{where} is too large: a count must be at most {_BOUND_TEXT}; pass a smaller value.")


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (in a file's fields and in arguments ``True`` is not a number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: object) -> TypeGuard[int]:
    """An int >= 0 that is not a bool."""
    return is_int(value) and value >= 0
