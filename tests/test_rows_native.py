"""``_native.multi_buffer_arrays`` (the vLLM staged transport's list-to-matrix conversion) against a plain
Python reading, and under hostile input: mutating ``__index__``, lying sequences, bad types and values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_kvaddr import _native

I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SIZE = st.integers(min_value=0, max_value=2**63 - 1)


def reference(addr_rows: list[list[int]], size_rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows padded with (0, 0) to the widest one."""
    width = max((len(r) for r in addr_rows), default=0)
    a = np.zeros((len(addr_rows), width), np.int64)
    s = np.zeros((len(addr_rows), width), np.int64)
    for k, (ar, sr) in enumerate(zip(addr_rows, size_rows, strict=True)):
        a[k, : len(ar)] = ar
        s[k, : len(sr)] = sr
    return a, s


@st.composite
def ragged(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]]]:
    lengths = draw(st.lists(st.integers(0, 6), max_size=8))
    addrs = [draw(st.lists(I64, min_size=n, max_size=n)) for n in lengths]
    sizes = [draw(st.lists(SIZE, min_size=n, max_size=n)) for n in lengths]
    return addrs, sizes


@settings(max_examples=300, deadline=None)
@given(ragged(), st.booleans())
def test_equals_the_plain_reading(rows: tuple[list[list[int]], list[list[int]]], as_tuples: bool) -> None:
    addrs, sizes = rows
    args: Any = (tuple(map(tuple, addrs)), tuple(map(tuple, sizes))) if as_tuples else (addrs, sizes)
    got_a, got_s = _native.multi_buffer_arrays(*args)
    want_a, want_s = reference(addrs, sizes)
    assert got_a.dtype == np.int64 and got_s.dtype == np.int64
    assert got_a.shape == want_a.shape and np.array_equal(got_a, want_a) and np.array_equal(got_s, want_s)


def test_results_never_alias() -> None:
    a1, s1 = _native.multi_buffer_arrays([[1, 2]], [[3, 4]])
    a2, _ = _native.multi_buffer_arrays([[1, 2]], [[3, 4]])
    a1[0, 0] = 99
    assert a2[0, 0] == 1 and not np.shares_memory(a1, s1)


class ClearsItsRow:
    """An address whose ``__index__`` empties the caller's lists while the conversion runs."""

    def __init__(self, value: int, victims: list[list[Any]]) -> None:
        self.value = value
        self.victims = victims

    def __index__(self) -> int:
        for victim in self.victims:
            victim.clear()
        return self.value


def test_index_that_mutates_the_input_cannot_change_what_is_read() -> None:
    row: list[Any] = [0, 10, 20]
    sizes_row = [1, 2, 3]
    outer = [row]
    row[0] = ClearsItsRow(5, [row, sizes_row, outer])
    a, s = _native.multi_buffer_arrays(outer, [sizes_row])
    assert a.tolist() == [[5, 10, 20]] and s.tolist() == [[1, 2, 3]]


class Raises(Exception):
    pass


class BadIndex:
    def __index__(self) -> int:
        raise Raises("from __index__")


class LyingRow:
    """Claims more items than it yields."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> int:
        if i >= 2:
            raise IndexError(i)
        return i

    def __iter__(self) -> Iterator[int]:
        yield from (0, 1)


def test_user_exceptions_propagate_unchanged() -> None:
    with pytest.raises(Raises, match="from __index__"):
        _native.multi_buffer_arrays([[BadIndex()]], [[1]])


def test_a_lying_row_is_read_as_it_iterates_or_refused() -> None:
    try:
        a, s = _native.multi_buffer_arrays([LyingRow()], [[7, 8]])
    except (ValueError, TypeError):
        return
    assert a.tolist() == [[0, 1]] and s.tolist() == [[7, 8]]


@pytest.mark.parametrize(
    ("addrs", "sizes", "error"),
    [
        ([[1, 2]], [[1]], ValueError),  # row lengths differ
        ([[1]], [[1, 2]], ValueError),  # a size row longer than its address row (not cut short)
        ([[1]], [[1], [2]], ValueError),  # key counts differ
        ([[1]], [[-1]], ValueError),  # negative size
        ([[2**63]], [[1]], OverflowError),  # address past int64
        ([[-(2**63) - 1]], [[1]], OverflowError),
        ([[1]], [[2**64]], OverflowError),
        ([[1.5]], [[1]], TypeError),
        ([["1"]], [[1]], TypeError),
        ([None], [[1]], TypeError),
        (None, [[1]], TypeError),
        ([[1]], 5, TypeError),
    ],
)
def test_bad_input_is_a_clear_error(addrs: Any, sizes: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        _native.multi_buffer_arrays(addrs, sizes)


def test_empty_batches() -> None:
    a, s = _native.multi_buffer_arrays([], [])
    assert a.shape == (0, 0) and s.shape == (0, 0)
    a, s = _native.multi_buffer_arrays([[], []], [[], []])
    assert a.shape == (2, 0)
