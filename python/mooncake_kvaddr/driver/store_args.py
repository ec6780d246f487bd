"""Argument checks and batch splitting for :class:`~mooncake_kvaddr.driver.store.MooncakeStore`.

Pure functions over a call's keys and rows, apart from the store so that its module holds only admission,
set-up and close, and the calls themselves. ``driver.store`` re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------------------- validation


def _check_keys(keys: Sequence[str] | Sequence[bytes]) -> int:
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys: expected a sequence of keys, got a single " + type(keys).__name__)
    try:
        return len(keys)
    except TypeError:
        raise TypeError(f"keys: expected a sequence (list/tuple) of str, got {type(keys).__name__}") from None


_INT64_MAX = (1 << 63) - 1


def _first_out_of_range(rows: Any) -> tuple[int, int]:
    """(row, column) of the first value outside ``[0, 2**63)``; only called once we know one exists."""
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if not 0 <= value <= _INT64_MAX:
                return i, j
    raise AssertionError("no value out of range")


def _why_out_of_range(value: Any) -> str:
    if value < 0:
        return f"is negative ({value}); must be >= 0"
    return f"is {value}, not below 2**63 (no address or size is that large)"


def _out_of_range(values: Any, flat: bool) -> bool:
    """Some value is negative or >= 2**63 (a uint64 array passes a ``min() >= 0`` check with any value)."""
    if isinstance(values, np.ndarray):
        return bool(values.size) and (int(values.min()) < 0 or int(values.max()) > _INT64_MAX)
    if flat:
        return bool(min(values) < 0 or max(values) > _INT64_MAX)
    # The builtins over each row: ~14 ns per int, no Python loop.
    return bool(min(map(min, values)) < 0 or max(map(max, values)) > _INT64_MAX)


def _check_rows(n: int, addrs: Any, sizes: Any, check_values: bool) -> list[int]:
    """Validate the per-key region rows; returns the region count of each key."""
    if len(addrs) != n or len(sizes) != n:
        raise ValueError(
            f"{n} keys but {len(addrs)} address rows and {len(sizes)} size rows: need one row of each per key"
        )
    if isinstance(addrs, np.ndarray) and isinstance(sizes, np.ndarray) and addrs.ndim == sizes.ndim == 2:
        counts = [addrs.shape[1]] * n  # every row of a matrix has the same length: no per-row loop
        pairs: Any = [(addrs.shape[1], sizes[0])] if n else ()  # so key 0 is checked for all
    else:
        counts = [len(a) for a in addrs]
        pairs = zip(counts, sizes, strict=True)
    for i, (count, row) in enumerate(pairs):
        if count != len(row):
            # Mooncake's get indexes sizes[j] past the end when a size row is the shorter one.
            raise ValueError(f"key {i}: {count} addresses but {len(row)} sizes; rows must be the same length")
        if count == 0:
            raise ValueError(f"key {i}: no regions; every key needs at least one (address, size) region")
    if check_values and n:
        for name, rows in (("address", addrs), ("size", sizes)):
            if _out_of_range(rows, flat=False):
                i, j = _first_out_of_range(rows)
                raise ValueError(f"key {i}: {name} [{j}] {_why_out_of_range(rows[i][j])}")
    return counts


def _check_flat(n: int, ptrs: Any, sizes: Any, check_values: bool) -> None:
    if len(ptrs) != n or len(sizes) != n:
        raise ValueError(f"{n} keys but {len(ptrs)} pointers and {len(sizes)} sizes: need one of each per key")
    if check_values and n:
        for name, values in (("pointer", ptrs), ("size", sizes)):
            if _out_of_range(values, flat=True):
                i = next(k for k, v in enumerate(values) if not 0 <= v <= _INT64_MAX)
                raise ValueError(f"key {i}: {name} {_why_out_of_range(values[i])}")


def _check_address(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")


# ------------------------------------------------------------------------------------------- splitting


def _plan(counts: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Split keys into [start, end) spans whose region counts sum to <= budget (a bigger key goes alone)."""
    n = len(counts)
    if sum(counts) <= budget:
        return [(0, n)]
    spans: list[tuple[int, int]] = []
    start = 0
    total = 0
    for i, count in enumerate(counts):
        if i > start and total + count > budget:
            spans.append((start, i))
            start, total = i, 0
        total += count
    spans.append((start, n))
    return spans


def _unique_spans(keys: Sequence[Any], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` split further so that no span names one key twice (order kept).

    Mooncake's batch gets read a key named twice in one call into only one of its destinations while
    reporting both read: the other keeps stale bytes (docs/transfer-modes.md, "Repeated keys").
    """
    if len(set(keys)) == len(keys):
        return spans
    out: list[tuple[int, int]] = []
    for start, end in spans:
        seen: set[Any] = set()
        first = start
        for i in range(start, end):
            if keys[i] in seen:
                out.append((first, i))
                first, seen = i, set()
            seen.add(keys[i])
        out.append((first, end))
    return out
