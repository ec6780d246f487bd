"""Staging gather/scatter against a pure-numpy reference: bytes, selection, bounds, threads, the GIL."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_kvaddr import _native
from mooncake_kvaddr.driver.staging import (
    SLOT_ALIGNMENT,
    CopyBackend,
    HostCopyBackend,
    StagingBuffer,
    StagingPool,
    gather,
    plan_slots,
    read_whole,
    run_staged,
    scatter,
)

ODD_SIZES = (1, 7, 63, 64, 255, 256, 257, 2048, 2049, 8192)

CopyFn = Callable[..., int]


@dataclass
class Layout:
    """KV-cache stand-in: ``arenas`` (the registered buffers) and a (keys, regions) slice matrix into them."""

    arenas: list[np.ndarray]
    addrs: np.ndarray
    sizes: np.ndarray

    @property
    def allowed(self) -> list[tuple[int, int]]:
        return [(a.ctypes.data, a.nbytes) for a in self.arenas]

    def view(self, addr: int, size: int) -> np.ndarray:
        """The arena bytes behind one slice."""
        for arena in self.arenas:
            base = arena.ctypes.data
            if base <= addr and addr + size <= base + arena.nbytes:
                return arena[addr - base : addr - base + size]
        raise AssertionError(f"slice {addr:#x}+{size} is in no arena")

    def objects(self) -> list[bytes]:
        """Reference gather: each key's slices concatenated in region order."""
        keys, regions = self.sizes.shape
        return [
            b"".join(self.view(int(self.addrs[k, r]), int(self.sizes[k, r])).tobytes() for r in range(regions))
            for k in range(keys)
        ]

    def snapshot(self) -> list[np.ndarray]:
        return [a.copy() for a in self.arenas]

    def fill_random(self, rng: np.random.Generator) -> None:
        for arena in self.arenas:
            arena[:] = rng.integers(0, 256, arena.nbytes, dtype=np.uint8)


def make_layout(
    rng: np.random.Generator, sizes: np.ndarray, n_arenas: int = 1, max_gap: int = 67, shuffle: bool = True
) -> Layout:
    """Disjoint slices at odd alignments (random gaps, shuffled placement) spread over ``n_arenas`` buffers."""
    keys, regions = sizes.shape
    cells = [(k, r) for k in range(keys) for r in range(regions)]
    if shuffle:
        rng.shuffle(cells)
    per_arena = [cells[i::n_arenas] for i in range(n_arenas)]
    arenas = []
    addrs = np.zeros((keys, regions), dtype=np.int64)
    for members in per_arena:
        gaps = rng.integers(0, max_gap + 1, len(members) + 1)
        total = int(sum(int(sizes[k, r]) for k, r in members) + gaps.sum())
        arena = rng.integers(0, 256, max(total, 1), dtype=np.uint8)
        cursor = int(gaps[0])
        for (k, r), gap in zip(members, gaps[1:], strict=True):
            addrs[k, r] = arena.ctypes.data + cursor
            cursor += int(sizes[k, r]) + int(gap)
        arenas.append(arena)
    return Layout(arenas, addrs, sizes)


def random_sizes(rng: np.random.Generator, keys: int, regions: int) -> np.ndarray:
    return rng.choice(np.array((0, *ODD_SIZES), dtype=np.int64), size=(keys, regions))


def slots_bytes(staging: StagingBuffer, offsets: np.ndarray, object_sizes: np.ndarray) -> list[bytes]:
    return [staging.array[o : o + n].tobytes() for o, n in zip(offsets, object_sizes, strict=True)]


def all_arenas_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# --- plan_slots -------------------------------------------------------------------------------------------


def test_plan_slots_pads_each_slot_and_sums_object_sizes() -> None:
    sizes = np.array([[1, 7], [64, 0], [0, 0], [2049, 3]], dtype=np.int64)
    plan = plan_slots(sizes)
    assert plan.object_sizes.tolist() == [8, 64, 0, 2052]
    assert plan.offsets.tolist() == [0, 64, 128, 128]
    assert plan.total_bytes == 128 + 2052
    assert all(o % SLOT_ALIGNMENT == 0 for o in plan.offsets.tolist())


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_plan_slots_alignment(alignment: int) -> None:
    rng = np.random.default_rng(alignment)
    sizes = random_sizes(rng, 50, 5)
    plan = plan_slots(sizes, alignment)
    end = 0
    for offset, size, row in zip(plan.offsets, plan.object_sizes, sizes, strict=True):
        assert offset % alignment == 0 and end <= offset < end + alignment
        assert size == row.sum()
        end = offset + size
    assert plan.total_bytes == end


def test_plan_slots_empty() -> None:
    for shape in [(0, 0), (0, 100), (5, 0)]:
        plan = plan_slots(np.zeros(shape, dtype=np.int64))
        assert plan.offsets.shape == (shape[0],) and plan.offsets.dtype == np.int64
        assert plan.object_sizes.tolist() == [0] * shape[0]
        assert plan.total_bytes == 0


def test_read_whole_counts_a_key_only_when_its_whole_object_came_back() -> None:
    """Per key: read whole when the get's code is exactly the object size, including an object of one byte; a
    short read, a zero and an error code are not; another number of codes than keys is Mooncake's error."""
    expected = np.array([1, 1, 4096, 4096, 8, 8], np.int64)
    codes = [1, 0, 4096, 4095, -704, 9]
    assert read_whole(codes, expected).tolist() == [True, False, True, False, False, False]
    assert read_whole(np.array(codes, np.int64), expected).tolist() == [True, False, True, False, False, False]
    with pytest.raises(RuntimeError, match="5 results for 6 keys"):
        read_whole(codes[:5], expected)


@pytest.mark.parametrize("answer", [8, [[8]], [[8, 8]]])
def test_read_whole_refuses_an_answer_that_is_not_one_flat_code_per_key(answer: Any) -> None:
    """A scalar or nested answer is not Mooncake's list of codes, even when it holds as many numbers as keys:
    refused as before cf6cef7 (which flattened it and read it as the keys' codes)."""
    expected = np.full(np.size(answer), 8, np.int64)
    with pytest.raises(RuntimeError, match=f"Mooncake returned {expected.size} results for {expected.size} keys"):
        read_whole(answer, expected)


@pytest.mark.parametrize("get", [True, False])
def test_run_staged_refuses_a_nested_answer(get: bool) -> None:
    """A batch answered with a nested list (one row holding a code per key) is Mooncake's error for the put and
    the get alike (as before cf6cef7): no key counts as stored or read, nothing is scattered from it."""
    plan = plan_slots(np.full((2, 1), 64, np.int64))
    pool = StagingPool(4 * SLOT_ALIGNMENT)
    lease = pool.acquire(plan.total_bytes, 4 * SLOT_ALIGNMENT)
    copied: list[Any] = []
    answer = [[64, 64]] if get else [[0, 0]]
    try:
        with pytest.raises(RuntimeError, match="Mooncake returned 2 results for 2 keys"):
            run_staged(get, plan, lease, lambda *a: answer, lambda *a: copied.append(a[3]) or True)
        assert copied == ([] if get else [None])  # a put gathered first; a get scattered nothing
    finally:
        lease.release()


@pytest.mark.parametrize("get", [True, False])
def test_a_staged_batch_that_does_not_fit_its_lease_never_reaches_mooncake(
    monkeypatch: pytest.MonkeyPatch, get: bool
) -> None:
    """Mooncake reads or writes the slots of a staged call unchecked: should the batch planning ever hand
    ``run_staged`` a batch longer than its lease, the run raises before the call (and before any copy)."""
    from mooncake_kvaddr.driver import staging

    plan = plan_slots(np.full((4, 2), 1024, np.int64))
    pool = StagingPool(2 * SLOT_ALIGNMENT)
    lease = pool.acquire(SLOT_ALIGNMENT, 2 * SLOT_ALIGNMENT)
    assert lease.nbytes < plan.total_bytes
    monkeypatch.setattr(staging, "plan_batches", lambda plan, span: [(0, len(plan.offsets))])  # a planning bug
    touched: list[str] = []
    with pytest.raises(RuntimeError, match=r"staged batch \[0, 4\) does not fit its"):
        run_staged(get, plan, lease, lambda *a: touched.append("call") or [0] * 4,
                   lambda *a: touched.append("copy") or True)  # fmt: skip
    assert touched == []
    lease.release()


def test_plan_slots_errors() -> None:
    with pytest.raises(ValueError, match="key 1 region 2: negative size -5"):
        plan_slots(np.array([[1, 1, 1], [1, 1, -5]], dtype=np.int64))
    with pytest.raises(OverflowError, match="key 0: object size"):
        plan_slots(np.array([[2**62, 2**62]], dtype=np.int64))
    with pytest.raises(OverflowError, match="key 1: staging offset"):
        plan_slots(np.array([[2**63 - 10], [1]], dtype=np.int64))
    for alignment in (0, -64, 48):
        with pytest.raises(ValueError, match="power of two"):
            plan_slots(np.ones((1, 1), dtype=np.int64), alignment)
    with pytest.raises(TypeError, match="int64"):
        plan_slots(np.ones((1, 1), dtype=np.int32))


# --- round trips --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("regions", [1, 3, 100, 160])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("streaming", [True, False])
def test_gather_then_scatter_round_trips(regions: int, threads: int, streaming: bool) -> None:
    rng = np.random.default_rng(regions * 10 + threads)
    keys = max(4, 2000 // regions)
    sizes = random_sizes(rng, keys, regions)
    layout = make_layout(rng, sizes, n_arenas=min(regions, 4))
    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    expected = layout.objects()

    copied = gather(layout.addrs, sizes, staging, plan.offsets, layout.allowed, threads=threads, streaming=streaming)
    assert copied == int(sizes.sum())
    assert slots_bytes(staging, plan.offsets, plan.object_sizes) == expected

    original = layout.snapshot()
    for arena in layout.arenas:
        arena[:] = 0
    copied = scatter(layout.addrs, sizes, staging, plan.offsets, layout.allowed, threads=threads, streaming=streaming)
    assert copied == int(sizes.sum())
    # Gaps between slices were zeroed too and must stay zero: compare slices and gaps separately.
    assert layout.objects() == expected
    written = [np.zeros(a.nbytes, dtype=bool) for a in layout.arenas]
    for k in range(keys):
        for r in range(regions):
            view = layout.view(int(layout.addrs[k, r]), int(sizes[k, r]))
            for arena, mask in zip(layout.arenas, written, strict=True):
                if view.base is arena:
                    start = view.ctypes.data - arena.ctypes.data
                    mask[start : start + view.nbytes] = True
    for arena, mask, before in zip(layout.arenas, written, original, strict=True):
        assert not arena[~mask].any()
        assert np.array_equal(arena[mask], before[mask])


@pytest.mark.parametrize("misalign", [1, 3, 8, 17])
def test_odd_staging_alignment(misalign: int) -> None:
    """Slots at odd addresses (a sub-range of a pool, alignment 1) copy the same bytes."""
    rng = np.random.default_rng(misalign)
    sizes = random_sizes(rng, 40, 9)
    layout = make_layout(rng, sizes)
    plan = plan_slots(sizes, alignment=1)
    pool = StagingBuffer(plan.total_bytes + misalign)
    staging = pool.span(misalign, plan.total_bytes)
    gather(layout.addrs, sizes, staging, plan.offsets, layout.allowed, threads=2)
    expected = layout.objects()
    got = [pool.array[misalign + o : misalign + o + n].tobytes() for o, n in zip(plan.offsets, plan.object_sizes)]
    assert got == expected
    layout.fill_random(rng)
    scatter(layout.addrs, sizes, staging, plan.offsets, layout.allowed, threads=2)
    assert layout.objects() == expected


def test_threaded_equals_serial_at_headline_shape() -> None:
    """2,258-ish keys x 100 regions of 2 KiB, scaled down to 300 keys to stay quick; auto threads too."""
    rng = np.random.default_rng(7)
    sizes = np.full((300, 100), 2048, dtype=np.int64)
    sizes[-1, 50:] = 0  # a short tail chunk
    layout = make_layout(rng, sizes, n_arenas=4, max_gap=0, shuffle=False)
    plan = plan_slots(sizes)
    results = []
    for threads in (1, 2, 0):
        staging = StagingBuffer(plan.total_bytes)
        gather(layout.addrs, sizes, staging, plan.offsets, layout.allowed, threads=threads)
        results.append(staging.array.tobytes())
    assert results[0] == results[1] == results[2]


# --- selection -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8])
@pytest.mark.parametrize("threads", [1, 2])
def test_scatter_selection_leaves_unselected_untouched(dtype: type, threads: int) -> None:
    rng = np.random.default_rng(11)
    sizes = random_sizes(rng, 60, 12)
    layout = make_layout(rng, sizes)
    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    staging.array[:] = rng.integers(0, 256, staging.nbytes, dtype=np.uint8)
    select = rng.integers(0, 2, 60).astype(dtype)
    if dtype is np.uint8:
        select *= 7  # any nonzero selects
    before = layout.objects()
    copied = scatter(layout.addrs, sizes, staging, plan.offsets, layout.allowed, select=select, threads=threads)
    assert copied == int(sizes[select.astype(bool)].sum())
    after = layout.objects()
    slots = slots_bytes(staging, plan.offsets, plan.object_sizes)
    for k in range(60):
        assert after[k] == (slots[k] if select[k] else before[k])


def test_gather_selection_writes_only_selected_slots() -> None:
    rng = np.random.default_rng(12)
    sizes = random_sizes(rng, 30, 5)
    layout = make_layout(rng, sizes)
    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    staging.array[:] = 0xAB
    select = np.arange(30) % 3 == 0
    gather(layout.addrs, sizes, staging, plan.offsets, layout.allowed, select=select)
    expected = layout.objects()
    for k, got in enumerate(slots_bytes(staging, plan.offsets, plan.object_sizes)):
        assert got == (expected[k] if select[k] else b"\xab" * len(got))


def test_unselected_keys_are_not_validated() -> None:
    """A failed key's row may be anything: it is never read."""
    rng = np.random.default_rng(13)
    sizes = random_sizes(rng, 4, 3) + 1
    layout = make_layout(rng, sizes)
    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    addrs = layout.addrs.copy()
    addrs[2] = 16  # nowhere
    sizes2 = sizes.copy()
    sizes2[2, 0] = -1
    select = np.array([True, True, False, True])
    scatter(addrs, sizes2, staging, plan.offsets, layout.allowed, select=select)


# --- bounds: all or nothing --------------------------------------------------------------------------------


class Fixture:
    """A valid 20-key layout and staging buffer; tests break one entry of the LAST key."""

    def __init__(self, regions: int = 6, keys: int = 20) -> None:
        rng = np.random.default_rng(99)
        self.sizes = random_sizes(rng, keys, regions) + 1
        self.layout = make_layout(rng, self.sizes, n_arenas=2)
        self.plan = plan_slots(self.sizes)
        self.staging = StagingBuffer(self.plan.total_bytes + 64)
        self.staging.array[:] = rng.integers(0, 256, self.staging.nbytes, dtype=np.uint8)
        self.addrs = self.layout.addrs.copy()
        self.offsets = self.plan.offsets.copy()

    def run(self, fn: CopyFn, **kwargs: Any) -> None:
        arenas = self.layout.snapshot()
        staging = self.staging.array.copy()
        kwargs.setdefault("staging", self.staging.span(0, self.plan.total_bytes))
        kwargs.setdefault("allowed_ranges", self.layout.allowed)
        try:
            fn(self.addrs, self.sizes, offsets=self.offsets, threads=2, **kwargs)
        finally:
            assert all_arenas_equal(arenas, self.layout.arenas), "KV bytes changed"
            assert np.array_equal(staging, self.staging.array), "staging bytes changed"


@pytest.mark.parametrize("fn", [gather, scatter])
class TestBoundsRaiseBeforeAnyCopy:
    def test_slice_one_byte_past_its_buffer(self, fn: CopyFn) -> None:
        f = Fixture()
        arena = f.layout.arenas[1]
        f.addrs[-1, 3] = arena.ctypes.data + arena.nbytes - int(f.sizes[-1, 3]) + 1
        with pytest.raises(ValueError, match=r"key 19 region 3: slice \[0x[0-9a-f]+, \+\d+\) is not inside"):
            f.run(fn)

    def test_slice_before_its_buffer(self, fn: CopyFn) -> None:
        f = Fixture()
        f.addrs[-1, 0] = f.layout.arenas[0].ctypes.data - 1
        with pytest.raises(ValueError, match="key 19 region 0: slice"):
            f.run(fn)

    def test_slice_spanning_two_adjacent_ranges(self, fn: CopyFn) -> None:
        """Each range is allowed, their union is not one range: rejected."""
        f = Fixture()
        r = int(np.flatnonzero(f.sizes[-1] >= 2)[0])
        split = int(f.addrs[-1, r]) + 1  # inside this slice only (slices are disjoint)
        allowed = []
        for base, nbytes in f.layout.allowed:
            if base < split < base + nbytes:
                allowed += [(base, split - base), (split, base + nbytes - split)]
            else:
                allowed.append((base, nbytes))
        with pytest.raises(ValueError, match=f"key 19 region {r}: slice"):
            f.run(fn, allowed_ranges=allowed)

    def test_negative_size(self, fn: CopyFn) -> None:
        f = Fixture()
        f.sizes[-1, 5] = -1
        with pytest.raises(ValueError, match="key 19 region 5: negative size -1"):
            f.run(fn)

    def test_address_plus_size_overflows(self, fn: CopyFn) -> None:
        f = Fixture()
        f.addrs[-1, 2] = 2**63 - 5
        with pytest.raises(ValueError, match="key 19 region 2"):
            f.run(fn)

    def test_slot_one_byte_past_staging_end(self, fn: CopyFn) -> None:
        f = Fixture()
        f.offsets[-1] += 1
        with pytest.raises(ValueError, match=r"key 19: slot .* does not fit in the .*-byte staging buffer"):
            f.run(fn)

    def test_negative_slot_offset(self, fn: CopyFn) -> None:
        f = Fixture()
        f.offsets[-1] = -64
        with pytest.raises(ValueError, match="key 19: slot"):
            f.run(fn)

    def test_slice_overlapping_staging(self, fn: CopyFn) -> None:
        f = Fixture()
        ptr, nbytes = f.staging.range
        allowed = [*f.layout.allowed, (ptr, nbytes)]
        f.addrs[-1, 1] = ptr + 1  # allowed (it is a registered range) but aliases the slots
        with pytest.raises(ValueError, match=r"key 19 region 1: slice .* overlaps the staging buffer"):
            f.run(fn, allowed_ranges=allowed)

    def test_bad_staging_range(self, fn: CopyFn) -> None:
        f = Fixture()
        with pytest.raises(ValueError, match="staging buffer"):
            f.run(fn, staging=(f.staging.ptr, -1))

    def test_invalid_allowed_range(self, fn: CopyFn) -> None:
        f = Fixture()
        with pytest.raises(ValueError, match=r"allowed_ranges\[1\]"):
            f.run(fn, allowed_ranges=[f.layout.allowed[0], (-1, 10)])
        with pytest.raises(ValueError, match=r"allowed_ranges\[0\] must be a \(ptr, nbytes\) pair"):
            f.run(fn, allowed_ranges=[(1, 2, 3)])
        with pytest.raises(TypeError, match="allowed_ranges"):
            f.run(fn, allowed_ranges=5)

    def test_no_allowed_ranges_rejects_everything_non_empty(self, fn: CopyFn) -> None:
        f = Fixture()
        with pytest.raises(ValueError, match="key 0 region 0"):
            f.run(fn, allowed_ranges=[])

    def test_large_job_faults_are_raised_after_the_gil_release(self, fn: CopyFn) -> None:
        """Past the GIL-release threshold validation runs without the GIL: the error must still surface."""
        f = Fixture(regions=200, keys=200)
        f.sizes[-1, -1] = -3
        with pytest.raises(ValueError, match="key 199 region 199: negative size -3"):
            f.run(fn)


def test_gather_rejects_overlapping_slots() -> None:
    f = Fixture()
    f.offsets[-1] = f.offsets[-2]  # hand-made layout, out of order
    with pytest.raises(ValueError, match=r"key 18: slot .* overlaps the slot of key 19"):
        f.run(gather)


def test_gather_accepts_adjacent_slots_out_of_order() -> None:
    """Hand-made slots in reverse key order, packed so that each ends exactly where the next one by offset
    starts: adjacent, not overlapping, so the gather fills every one."""
    f = Fixture(regions=3, keys=4)
    reversed_sizes = f.plan.object_sizes[::-1]
    ends = np.cumsum(reversed_sizes)
    f.offsets = np.ascontiguousarray((ends - reversed_sizes)[::-1])  # key 3 at 0, key 2 right after it, ...
    assert f.offsets.tolist() == sorted(f.offsets.tolist(), reverse=True)
    copied = gather(f.addrs, f.sizes, f.staging.span(0, int(ends[-1])), f.offsets, f.layout.allowed)
    assert copied == int(f.sizes.sum())
    got = slots_bytes(f.staging, f.offsets, f.plan.object_sizes)
    assert got == f.layout.objects()


def test_gather_ignores_the_slot_of_an_unselected_key() -> None:
    """An unselected key is not read, its offset included: lying inside another key's slot is no overlap."""
    rng = np.random.default_rng(14)
    sizes = random_sizes(rng, 4, 3) + 1
    layout = make_layout(rng, sizes)
    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    offsets = plan.offsets.copy()
    offsets[2] = offsets[0] + 1  # inside key 0's slot
    select = np.array([True, True, False, True])
    copied = gather(layout.addrs, sizes, staging, offsets, layout.allowed, select=select)
    assert copied == int(sizes[select].sum())
    expected = layout.objects()
    got = slots_bytes(staging, offsets, plan.object_sizes)
    assert [got[k] for k in (0, 1, 3)] == [expected[k] for k in (0, 1, 3)]


@pytest.mark.parametrize("fn", [gather, scatter])
@pytest.mark.parametrize("side", ["ends_at_staging", "starts_at_staging_end"])
def test_a_slice_touching_the_staging_buffer_is_not_an_overlap(fn: CopyFn, side: str) -> None:
    """A slice that ends exactly where the staging buffer begins, or begins exactly where it ends, shares no byte
    with it: copied like any other (one allocation, its halves the KV range and the staging span)."""
    half, size = 4096, 256
    buf = StagingBuffer(2 * half)
    buf.array[:] = np.random.default_rng(3).integers(0, 256, buf.nbytes, dtype=np.uint8)
    kv_at, staging_at = (0, half) if side == "ends_at_staging" else (half, 0)
    at = half - size if side == "ends_at_staging" else half  # the slice's offset in the allocation
    before = buf.array.copy()
    addrs = np.array([[buf.ptr + at]], dtype=np.int64)
    sizes = np.array([[size]], dtype=np.int64)
    copied = fn(addrs, sizes, buf.span(staging_at, half), np.zeros(1, np.int64), [(buf.ptr + kv_at, half)])
    assert copied == size
    slot, kv = slice(staging_at, staging_at + size), slice(at, at + size)
    dst, src = (slot, kv) if fn is gather else (kv, slot)
    np.testing.assert_array_equal(buf.array[dst], before[src])


def test_scatter_accepts_overlapping_slots() -> None:
    """Scatter only reads slots: one slot may feed two keys' slices."""
    f = Fixture()
    f.sizes[-1] = f.sizes[-2]
    f.offsets[-1] = f.offsets[-2]
    scatter(f.addrs, f.sizes, f.staging, f.offsets, f.layout.allowed)
    assert f.layout.objects()[-1] == f.layout.objects()[-2]


def test_overlapping_allowed_ranges_are_searched_exactly() -> None:
    """A slice inside a big range that starts before a smaller, later-starting range is accepted."""
    rng = np.random.default_rng(5)
    sizes = np.full((3, 2), 100, dtype=np.int64)
    layout = make_layout(rng, sizes)
    base, nbytes = layout.allowed[0]
    allowed = [(base, nbytes), (base + 1, 3), (base + 10, 5)]
    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    gather(layout.addrs, sizes, staging, plan.offsets, allowed)
    assert slots_bytes(staging, plan.offsets, plan.object_sizes) == layout.objects()


# --- argument types ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [gather, scatter])
def test_argument_types_and_shapes(fn: CopyFn) -> None:
    f = Fixture()

    def call(**kw: Any) -> int:
        addrs, sizes, offsets = kw.pop("addrs", f.addrs), kw.pop("sizes", f.sizes), kw.pop("offsets", f.offsets)
        return fn(addrs, sizes, f.staging, offsets, f.layout.allowed, **kw)

    with pytest.raises(TypeError, match="addrs must have dtype int64"):
        call(addrs=f.addrs.astype(np.uint64))
    with pytest.raises(TypeError, match="sizes must have dtype int64"):
        call(sizes=f.sizes.astype(np.int32))
    with pytest.raises(TypeError, match="sizes must have dtype int64"):
        call(sizes=f.sizes.astype(np.float64))
    with pytest.raises(TypeError, match="addrs must be a numpy int64 array, not list"):
        call(addrs=f.addrs.tolist())
    with pytest.raises(ValueError, match="addrs must be 2-D"):
        call(addrs=f.addrs.ravel())
    with pytest.raises(ValueError, match=r"same .keys, regions. shape"):
        call(sizes=f.sizes[:, :-1].copy())
    with pytest.raises(ValueError, match="C-contiguous"):
        call(addrs=np.asfortranarray(f.addrs))
    with pytest.raises(ValueError, match=r"offsets must have shape \(20,\) \(one slot per key\), got \(19,\)$"):
        call(offsets=f.offsets[:-1].copy())
    with pytest.raises(ValueError, match=r"offsets must have shape \(20,\) \(one slot per key\), got \(21,\)$"):
        call(offsets=np.append(f.offsets, f.offsets[-1]))  # one slot per key: a longer vector too
    with pytest.raises(TypeError, match="select must have dtype bool or uint8"):
        call(select=np.ones(20, dtype=np.int64))
    with pytest.raises(TypeError, match="select must be None or a numpy"):
        call(select=[True] * 20)
    with pytest.raises(ValueError, match=r"select must have shape \(20,\)"):
        call(select=np.ones(19, dtype=bool))
    with pytest.raises(ValueError, match="threads must be >= 0"):
        call(threads=-1)
    # Byte-swapped int64 is not int64 in memory.
    with pytest.raises(TypeError, match="dtype int64"):
        call(addrs=f.addrs.astype(">i8"))
    # Equivalent spellings of int64 are accepted; read-only arrays too.
    ro = f.addrs.astype(np.longlong)
    ro.flags.writeable = False
    call(addrs=ro)


# --- empty inputs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [gather, scatter])
@pytest.mark.parametrize("shape", [(0, 0), (0, 100), (7, 0), (3, 4)])
def test_empty_inputs_copy_nothing(fn: CopyFn, shape: tuple[int, int]) -> None:
    sizes = np.zeros(shape, dtype=np.int64)
    addrs = np.full(shape, 12345, dtype=np.int64)  # never dereferenced: every slice is empty
    plan = plan_slots(sizes)
    staging = StagingBuffer(0)
    assert fn(addrs, sizes, staging, plan.offsets, [], threads=2) == 0
    assert fn(addrs, sizes, (0, 0), plan.offsets, []) == 0


# --- property-based differential test ----------------------------------------------------------------------


@st.composite
def jobs(draw: st.DrawFn) -> tuple[np.ndarray, int, int, bool, np.ndarray | None, int, int]:
    keys = draw(st.integers(0, 12))
    regions = draw(st.integers(0, 10))
    size_values = st.one_of(st.sampled_from((0, *ODD_SIZES)), st.integers(0, 600))
    sizes = np.array([[draw(size_values) for _ in range(regions)] for _ in range(keys)], dtype=np.int64).reshape(
        keys, regions
    )
    seed = draw(st.integers(0, 2**32 - 1))
    threads = draw(st.integers(0, 4))
    streaming = draw(st.booleans())
    select = draw(
        st.none() | st.lists(st.booleans(), min_size=keys, max_size=keys).map(lambda v: np.array(v, dtype=bool))
    )
    alignment = draw(st.sampled_from((1, 2, 8, 64, 256)))
    shift = draw(st.integers(0, 63))
    return sizes, seed, threads, streaming, select, alignment, shift


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_differential_against_numpy(job: tuple[np.ndarray, int, int, bool, np.ndarray | None, int, int]) -> None:
    sizes, seed, threads, streaming, select, alignment, shift = job
    rng = np.random.default_rng(seed)
    layout = make_layout(rng, sizes, n_arenas=int(rng.integers(1, 4)))
    plan = plan_slots(sizes, alignment)
    pool = StagingBuffer(plan.total_bytes + shift)
    pool.array[:] = 0x5A
    staging = pool.span(shift, plan.total_bytes)
    chosen = np.ones(sizes.shape[0], dtype=bool) if select is None else select.astype(bool)
    kw = {"select": select, "threads": threads, "streaming": streaming}

    # gather: selected slots hold the reference objects, every other staging byte is untouched.
    expected_staging = pool.array.copy()
    objects = layout.objects()
    for k in np.flatnonzero(chosen):
        o = shift + int(plan.offsets[k])
        expected_staging[o : o + int(plan.object_sizes[k])] = np.frombuffer(objects[k], dtype=np.uint8)
    copied = gather(layout.addrs, sizes, staging, plan.offsets, layout.allowed, **kw)
    assert copied == int(sizes[chosen].sum())
    assert np.array_equal(pool.array, expected_staging)

    # scatter fresh slot bytes: selected slices receive them in region order, the rest of the KV is untouched.
    pool.array[:] = rng.integers(0, 256, pool.nbytes, dtype=np.uint8)
    expected_kv = layout.snapshot()
    for k in np.flatnonzero(chosen):
        cursor = shift + int(plan.offsets[k])
        for r in range(sizes.shape[1]):
            n = int(sizes[k, r])
            # Map the live slice to the same offset in the expected copy.
            view = layout.view(int(layout.addrs[k, r]), n)
            for live, exp in zip(layout.arenas, expected_kv, strict=True):
                if n and view.base is live:
                    start = view.ctypes.data - live.ctypes.data
                    exp[start : start + n] = pool.array[cursor : cursor + n]
            cursor += n
    copied = scatter(layout.addrs, sizes, staging, plan.offsets, layout.allowed, **kw)
    assert copied == int(sizes[chosen].sum())
    assert all_arenas_equal(layout.arenas, expected_kv)


# --- the façade ---------------------------------------------------------------------------------------------


def test_staging_buffer_is_aligned_and_bounded() -> None:
    for nbytes in (0, 1, 4096, 3 * 4096 + 5):
        for alignment in (64, 4096):
            buf = StagingBuffer(nbytes, alignment=alignment)
            assert buf.ptr % alignment == 0
            assert buf.nbytes == nbytes == buf.array.nbytes
            assert buf.range == (buf.ptr, nbytes)
    buf = StagingBuffer(100)
    assert buf.span(10, 90) == (buf.ptr + 10, 90)
    for offset, n in ((0, 101), (-1, 1), (50, -1), (101, 0)):
        with pytest.raises(ValueError, match="outside the 100-byte staging buffer"):
            buf.span(offset, n)
    for alignment in (32, 96, 4096 + 64):  # too small, or not a power of two
        with pytest.raises(ValueError, match="power of two"):
            StagingBuffer(10, alignment=alignment)
    with pytest.raises(ValueError, match="nbytes"):
        StagingBuffer(-1)


def test_pool_spans_freed_in_order_merge_with_the_first_free_span() -> None:
    pool = StagingPool(4 * SLOT_ALIGNMENT, prefault=False)
    a, b = pool.acquire(SLOT_ALIGNMENT, SLOT_ALIGNMENT), pool.acquire(SLOT_ALIGNMENT, SLOT_ALIGNMENT)
    rest = pool.acquire(1, 4 * SLOT_ALIGNMENT)
    assert (a.offset, b.offset, rest.offset) == (0, SLOT_ALIGNMENT, 2 * SLOT_ALIGNMENT)
    a.release()
    b.release()  # the span before it is the first free span: they merge into one
    both = pool.acquire(2 * SLOT_ALIGNMENT, timeout=0.2)
    assert (both.offset, both.nbytes) == (0, 2 * SLOT_ALIGNMENT)
    both.release()
    rest.release()
    assert pool.acquire(4 * SLOT_ALIGNMENT, timeout=0.2).nbytes == 4 * SLOT_ALIGNMENT


def test_host_backend_is_a_copy_backend_and_round_trips() -> None:
    rng = np.random.default_rng(21)
    sizes = random_sizes(rng, 25, 7)
    layout = make_layout(rng, sizes, n_arenas=3)
    backend = HostCopyBackend(layout.allowed, threads=2)
    assert isinstance(backend, CopyBackend)
    assert backend.memory_kind == "host"
    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    expected = layout.objects()
    assert backend.gather(layout.addrs, sizes, staging, plan.offsets) == int(sizes.sum())
    layout.fill_random(rng)
    select = np.ones(25, dtype=bool)
    select[3] = False
    keep = layout.objects()[3]
    backend.scatter(layout.addrs, sizes, staging, plan.offsets, select=select)
    got = layout.objects()
    assert got[3] == keep
    assert got[:3] + got[4:] == expected[:3] + expected[4:]
    backend.set_allowed_ranges([])
    with pytest.raises(ValueError, match="not inside any allowed memory range"):
        backend.gather(layout.addrs, sizes, staging, plan.offsets)
    with pytest.raises(ValueError, match="threads"):
        HostCopyBackend([], threads=-1)


# --- the GIL ---------------------------------------------------------------------------------------------


def test_gil_is_released_during_a_large_copy() -> None:
    """A Python thread keeps running while a 32 MiB gather copies."""
    rng = np.random.default_rng(3)
    sizes = np.full((256, 64), 2048, dtype=np.int64)
    layout = make_layout(rng, sizes, max_gap=0, shuffle=False)
    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        progressed = []
        for _ in range(5):
            before = counter[0]
            gather(layout.addrs, sizes, staging, plan.offsets, layout.allowed, threads=1)
            progressed.append(counter[0] - before)
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(old)
    assert max(progressed) > 0
    assert slots_bytes(staging, plan.offsets, plan.object_sizes) == layout.objects()


def test_native_constants() -> None:
    assert _native.STAGING_SLOT_ALIGNMENT == SLOT_ALIGNMENT == 64
    assert isinstance(_native.STAGING_STREAMING_STORES, bool)


def test_a_staging_buffer_collected_during_a_lookup_cannot_deadlock() -> None:
    # A staging buffer freed by the cyclic GC while a raw (ptr, nbytes) range is being checked: the collection
    # runs inside the check (any allocation may start it). It must neither deadlock nor break the check. Run
    # in a subprocess: a deadlock there times out instead of hanging the suite.
    import subprocess
    import textwrap

    script = textwrap.dedent(
        """
        import gc
        import numpy as np
        from mooncake_kvaddr.driver.staging import HostCopyBackend, StagingBuffer

        region = np.arange(4096, dtype=np.uint8)
        backend = HostCopyBackend([(region.ctypes.data, region.nbytes)])
        addrs = np.array([[region.ctypes.data]], dtype=np.int64)
        sizes = np.array([[64]], dtype=np.int64)
        offsets = np.array([0], dtype=np.int64)
        keep = StagingBuffer(4096)
        gc.set_threshold(1, 1, 1)
        for i in range(3000):
            doomed = StagingBuffer(4096)
            doomed.cycle = doomed  # freed only by the cyclic GC, at some allocation to come
            del doomed
            backend.gather(addrs, sizes, (keep.ptr, 4096), offsets)
        print("done")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-3000:]


def test_a_zero_byte_staging_range_stays_zero_bytes_and_any_byte_more_must_be_owned() -> None:
    """A ``(ptr, 0)`` staging range outside any staging buffer is taken as zero bytes (nothing can be copied
    into it); the same pointer with one byte is refused, as it is no memory this package allocated."""
    from mooncake_kvaddr.driver.staging_buffers import _staging_range

    wild = 0x7000_0000_1000
    assert _staging_range((wild, 0)) == (wild, 0, None)
    with pytest.raises(ValueError, match="not inside a live staging buffer"):
        _staging_range((wild, 1))
