"""The one range set (csrc/kvaddr/ranges.hpp) through ``_native.slices_inside``, against a plain Python reading.

A slice is ``0 < address``, ``0 <= size``, ``address + size <= 2**63 - 1``, and lies inside ONE allowed range
(overlapping ranges allowed; a slice spanning two adjacent ranges is outside).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_kvaddr import _native

TOP = 2**63 - 1


def reference(address: int, size: int, ranges: list[tuple[int, int]]) -> bool:
    if address <= 0 or size < 0 or address + size > TOP:
        return False
    return any(p <= address and address + size <= p + n for p, n in ranges if n > 0)


edges = st.sampled_from([0, 1, 4095, 4096, 4097, 8191, 8192, TOP - 4096, TOP - 1, TOP])
values = st.one_of(st.integers(-(2**63), TOP), edges, st.integers(0, 3 * 4096))


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[list[int]], list[list[int]]]:
    ranges = []
    for _ in range(draw(st.integers(0, 4))):
        p = draw(st.one_of(st.integers(0, 4 * 4096), st.sampled_from([TOP - 4096, TOP - 8192])))
        n = draw(st.integers(0, min(3 * 4096, TOP - p)))
        ranges.append((p, n))
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    addrs = [[draw(values) for _ in range(cols)] for _ in range(rows)]
    sizes = [[draw(st.one_of(values, st.integers(0, 4096))) for _ in range(cols)] for _ in range(rows)]
    return ranges, addrs, sizes


@settings(max_examples=400, deadline=None)
@given(cases())
def test_every_cell_equals_the_reference(case: tuple[list[tuple[int, int]], list[list[int]], list[list[int]]]) -> None:
    ranges, addrs, sizes = case
    a, s = np.array(addrs, np.int64), np.array(sizes, np.int64)
    got = _native.slices_inside(a, s, ranges)
    want = [[reference(x, y, ranges) for x, y in zip(ra, rs, strict=True)] for ra, rs in zip(addrs, sizes, strict=True)]
    assert got.tolist() == want
    assert _native.slices_inside(a[:, 0].copy(), s[:, 0].copy(), ranges).tolist() == [w[0] for w in want]
    built = _native.memory_ranges(ranges)  # converted once: the same answers
    assert _native.slices_inside(a, s, built).tolist() == want
    assert len(built) == sum(n > 0 for _, n in ranges)


def test_the_edges_of_the_rule() -> None:
    top_range = [(TOP - 4096, 4096)]  # ends exactly at 2**63 - 1
    cases = [
        ((TOP - 4096, 4096), top_range, True),  # ends at 2**63 - 1: the last valid slice
        ((TOP - 4096, 4097), top_range, False),
        ((TOP, 0), top_range, True),  # empty slice at the range's end
        ((4096, 0), [(4096, 4096)], True),
        ((8192, 0), [(4096, 4096)], True),
        ((8193, 0), [(4096, 4096)], False),
        ((0, 0), [(0, 4096)], False),  # a null address is never a slice
        ((4096, -1), [(4096, 4096)], False),
        ((-4096, 4096), [(4096, 4096)], False),
        ((4096, 8192), [(4096, 4096), (8192, 4096)], False),  # spans two adjacent buffers
        ((6000, 100), [(4096, 8192), (5000, 200)], True),  # inside the wider of two overlapping ranges
        ((4096, 1), [], False),
        ((4096, 0), [(4096, 0)], False),  # an empty range is ignored: it holds not even an empty slice
        ((12288, 0), [(4096, 4096), (12288, 0)], False),
    ]
    for (address, size), ranges, want in cases:
        got = _native.slices_inside(np.array([address], np.int64), np.array([size], np.int64), ranges)
        assert got.tolist() == [want], (address, size, ranges)


def test_bad_arguments_are_clear_errors() -> None:
    a = np.array([[4096]], np.int64)
    with pytest.raises(TypeError, match="int64"):
        _native.slices_inside(a.astype(np.uint64), a, [(4096, 1)])
    with pytest.raises(ValueError, match="same shape"):
        _native.slices_inside(a, np.zeros((1, 2), np.int64), [(4096, 1)])
    with pytest.raises(ValueError, match="1-D or 2-D"):
        _native.slices_inside(np.zeros((1, 1, 1), np.int64), np.zeros((1, 1, 1), np.int64), [])
    with pytest.raises(ValueError, match="C-contiguous"):
        _native.slices_inside(np.zeros((2, 2), np.int64).T, np.zeros((2, 2), np.int64), [])
    with pytest.raises(ValueError, match="not a valid memory range"):
        _native.slices_inside(a, a, [(-1, 10)])
    assert _native.slices_inside(np.zeros((0, 3), np.int64), np.zeros((0, 3), np.int64), []).shape == (0, 3)


def test_a_range_with_a_negative_or_overflowing_length_is_refused_not_ignored() -> None:
    """Only the begin of (-1, 10) was refused above: a negative byte count, or one whose end overflows int64,
    is refused too (named by its index), while an empty range is a valid (ignored) entry."""
    a, s = np.array([4096], np.int64), np.array([1], np.int64)
    for ptr, nbytes in [(4096, -1), (8192, -4096), (2**62, 2**62 + 2**61)]:
        with pytest.raises(ValueError, match=rf"allowed_ranges\[1\] = \({ptr}, {nbytes}\) is not a valid memory range"):
            _native.slices_inside(a, s, [(4096, 4096), (ptr, nbytes)])
    assert _native.slices_inside(a, s, [(4096, 4096), (8192, 0)]).tolist() == [True]
    assert _native.slices_inside(a, s, [(8192, 0)]).tolist() == [False]


def test_the_per_column_hint_never_widens_a_range() -> None:
    """Row 0 finds column j's range (the hint for the rows below); a later row of the same column that ends
    one byte past that range, or starts one byte before it, is still outside."""
    ranges = [(4096, 4096), (65536, 4096)]
    addrs = np.array([[4096, 65536], [4096 + 4000, 65536 + 4000], [4095, 65535], [8192, 69632]], np.int64)
    sizes = np.array([[64, 64], [97, 96], [64, 64], [0, 0]], np.int64)
    got = _native.slices_inside(addrs, sizes, ranges)
    assert got.tolist() == [[True, True], [False, True], [False, False], [True, True]]


def test_the_drivers_bounds_need_every_slice_of_a_row_inside() -> None:
    """RegisteredCaches.slices_inside / check_rows_inside (the driver's users of the range set): a key is
    inside only when each of its slices is; the first key with any slice outside is named."""
    from mooncake_kvaddr.driver.bounds import RegisteredCaches
    from mooncake_kvaddr.driver.paths import check_rows_inside

    regions = [np.zeros((4, 64), np.uint8), np.zeros((4, 64), np.uint8)]
    caches = RegisteredCaches.from_regions(regions, 4)
    b0, b1 = caches.bases
    addrs = np.array([[b0, b1], [b0 + 192, b1 + 192], [b0, b1 + 256], [b0 - 1, b1]], np.int64)
    sizes = np.full((4, 2), 64, np.int64)
    assert caches.slices_inside(addrs, sizes).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="key 2: its region lies outside"):
        check_rows_inside(caches, addrs, sizes)
    a, s = check_rows_inside(caches, addrs[:2], sizes[:2])
    assert a.tolist() == addrs[:2].tolist() and s.tolist() == sizes[:2].tolist()


def test_a_buffer_two_regions_share_is_recorded_with_its_largest_length() -> None:
    """Two regions may view one buffer from its first byte (one base, two block lengths): the driver's range set
    records that buffer once, with the longer region's length, whichever region comes first, so every slice of
    the longer region is inside."""
    from mooncake_kvaddr.driver.bounds import RegisteredCaches

    buf = np.zeros(512, np.uint8)
    base = int(buf.ctypes.data)
    for regions, lens in (([buf, buf[:256]], (128, 64)), ([buf[:256], buf], (64, 128))):
        caches = RegisteredCaches.from_regions(regions, 4)
        assert caches.bases == (base, base) and caches.block_lens == lens
        assert caches.buffers == ((base, 512),)
        last = np.array([[base + 3 * lens[0], base + 3 * lens[1]]], np.int64)  # block 3 of each region
        assert caches.slices_inside(last, np.array([lens], np.int64)).tolist() == [True]


def test_memory_ranges_are_converted_once_with_the_same_rule() -> None:
    """``memory_ranges`` refuses what ``slices_inside`` refuses, with the same message, and its result is
    taken as is by every range-taking call; it cannot be made, re-made or subclassed any other way."""
    a, s = np.array([4096], np.int64), np.array([1], np.int64)
    for bad, error in [([(-1, 10)], ValueError), ([(4096, 2**63 - 1)], ValueError), ([(1, 2, 3)], ValueError),
                       (5, TypeError), ([(4096, 1.5)], TypeError)]:
        with pytest.raises(error) as native_error:
            _native.memory_ranges(bad)
        with pytest.raises(error) as call_error:
            _native.slices_inside(a, s, bad)
        assert str(native_error.value) == str(call_error.value)
    built = _native.memory_ranges([(4096, 4096), (8192, 0)])
    assert len(built) == 1 and _native.slices_inside(a, s, built).tolist() == [True]
    with pytest.raises(TypeError):
        _native.MemoryRanges()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="not initialised"):
        _native.slices_inside(a, s, _native.MemoryRanges.__new__(_native.MemoryRanges))
    with pytest.raises(TypeError):
        type("Sub", (_native.MemoryRanges,), {})


class _Resizing:
    """An nbytes whose __index__ resizes the allowed_ranges list being converted (appends `extra`, or clears)."""

    def __init__(self, ranges: list[tuple[int, object]], value: int, extra: tuple[int, object] | None) -> None:
        self.ranges, self.value, self.extra = ranges, value, extra

    def __index__(self) -> int:
        if self.extra is None:
            self.ranges.clear()
        else:
            self.ranges.append(self.extra)
        return self.value


def test_allowed_ranges_are_read_at_the_length_they_had_when_the_conversion_started() -> None:
    """The one length rule (common.hpp's append_int64s): a pair's __index__ that grows the list is not followed
    (the appended range is never allowed; one that appends forever cannot hang the call), one that shrinks it
    makes the call raise instead of checking against the ranges read so far. Since 55dc88d the loop re-read the
    length: an appended range was allowed, an emptied list accepted."""
    a, s = np.array([[4096, 8192]], np.int64), np.array([[64, 64]], np.int64)
    grown: list[tuple[int, object]] = [(4096, 0)]
    grown[0] = (4096, _Resizing(grown, 64, (8192, 64)))
    assert _native.slices_inside(a, s, grown).tolist() == [[True, False]]
    assert len(grown) == 2

    forever: list[tuple[int, object]] = [(4096, 0)]

    class Again:
        def __index__(self) -> int:
            if len(forever) < 10_000:  # bounded here; unbounded it would never return
                forever.append((8192, Again()))
            return 64

    forever[0] = (4096, Again())
    assert _native.slices_inside(a, s, forever).tolist() == [[True, False]]
    assert len(forever) == 2

    for call in (lambda r: _native.slices_inside(a, s, r), _native.memory_ranges):
        emptied: list[tuple[int, object]] = [(4096, 0), (8192, 64)]
        emptied[0] = (4096, _Resizing(emptied, 64, None))
        with pytest.raises(RuntimeError, match="changed size"):
            call(emptied)
