"""Staged transfers: one contiguous staging slot per key, filled and drained natively with the GIL released.

Mooncake's multi-buffer calls convert every region with the GIL held and pay per region on TCP; a staged object
is the same bytes in one slot (docs/transfer-modes.md, "The three paths"; docs/gil-policy.md). Slot planning,
the checked native copies and :func:`run_staged` live here; buffers, the pool and leases in ``staging_buffers``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.plan import SlotPlan
from mooncake_kvaddr.driver import per_key
from mooncake_kvaddr.driver.outcomes import CODE_TRANSFER_FAILED

# Buffers, pool and leases live in staging_buffers; every public name this module offered is re-exported here.
from mooncake_kvaddr.driver.staging_buffers import (
    SLOT_ALIGNMENT,
    MemoryRange,
    StagingArg,
    StagingBuffer,
    StagingLease,
    StagingPool,
    _staging_range,
    check_staging,
)
from mooncake_kvaddr.driver.staging_buffers import BufferRegistrar as BufferRegistrar

__all__ = [
    "SLOT_ALIGNMENT",
    "STREAMING_STORES",
    "CopyBackend",
    "HostCopyBackend",
    "MemoryRange",
    "SlotPlan",
    "StagedRun",
    "StagingBuffer",
    "StagingLease",
    "StagingPool",
    "check_staging",
    "gather",
    "plan_batches",
    "plan_slots",
    "read_whole",
    "run_staged",
    "scatter",
]

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
#: A selection of keys: one flag per key (nonzero / True = copy the key).
KeySelection = npt.NDArray[np.bool_] | npt.NDArray[np.uint8]

#: Whether this build copies with streaming stores (x86 SSE2); elsewhere the copy is plain ``memcpy``.
STREAMING_STORES: Final[bool] = _native.STAGING_STREAMING_STORES


def plan_slots(sizes: Int64Array, alignment: int = SLOT_ALIGNMENT) -> SlotPlan:
    """Lay out one slot per key, in key order, each starting at a multiple of ``alignment`` (a power of two).

    ``sizes`` is the ``(keys, regions)`` int64 matrix. Raises ``ValueError`` for a negative size (naming the
    key and region) and ``OverflowError`` if the layout does not fit in int64.
    """
    offsets, object_sizes, total = _native.staging_plan_slots(sizes, alignment)
    return SlotPlan(offsets, object_sizes, total)


def plan_batches(plan: SlotPlan, span_bytes: int, max_keys: int | None = None) -> list[tuple[int, int]]:
    """Split a plan's keys into consecutive ``[start, end)`` batches whose slots fit in ``span_bytes``.

    A batch keeps the plan's layout, shifted to start at 0 (``plan.offsets[start:end] - plan.offsets[start]``,
    still aligned because every offset is), so it fits when its last slot ends within ``span_bytes`` of its
    first slot's start. Batches are as large as the span allows: one batch when the whole plan fits.
    ``max_keys`` caps the keys of a batch. Raises ``ValueError`` if one key's object alone is larger than
    ``span_bytes``.
    """
    if span_bytes < 0:
        raise ValueError(f"span_bytes must be >= 0, got {span_bytes}")
    if max_keys is not None and max_keys < 1:
        raise ValueError(f"max_keys must be >= 1, got {max_keys}")
    n = len(plan.offsets)
    if n == 0:
        return []
    if plan.total_bytes <= span_bytes and (max_keys is None or n <= max_keys):
        return [(0, n)]
    too_big = np.flatnonzero(plan.object_sizes > span_bytes)
    if too_big.size:
        key = int(too_big[0])
        raise ValueError(
            f"key {key}: its {int(plan.object_sizes[key])}-byte object does not fit in a {span_bytes}-byte "
            "staging span; raise the staging buffer size"
        )
    # Slot ends never decrease (each slot starts at or after the previous one's end), so the last key of a
    # batch is found by binary search.
    ends = plan.offsets + plan.object_sizes
    batches: list[tuple[int, int]] = []
    start = 0
    while start < n:
        end = int(np.searchsorted(ends, int(plan.offsets[start]) + span_bytes, side="right"))
        if max_keys is not None:
            end = min(end, start + max_keys)
        end = max(end, start + 1)
        batches.append((start, end))
        start = end
    return batches


def read_whole(codes: Sequence[int] | Int64Array, expected: Int64Array) -> BoolArray:
    """Per key: the get succeeded and read exactly the ``expected`` object size (a short read is a failure).
    ``RuntimeError`` when Mooncake answered another number of codes than keys."""
    got = _codes(codes, expected.size)
    whole: BoolArray = (got == expected) & (got > 0)
    return whole


def _codes(answer: Sequence[int] | Int64Array, n: int) -> Int64Array:
    """A batch call's answer for ``n`` keys as int64 codes: a flat sequence of exactly ``n``, else
    ``RuntimeError`` (a scalar or nested answer too, whatever its number of values)."""
    got = np.asarray(answer, dtype=np.int64)
    if got.ndim != 1:
        raise RuntimeError(f"Mooncake returned {got.size} results for {n} keys")
    per_key.check_count(got, n)
    return got


class StagedRun(NamedTuple):
    """What :func:`run_staged` did, per key of the plan.

    ``codes``: Mooncake's answer, a get's short read replaced by ``CODE_TRANSFER_FAILED`` (what Mooncake's
    multi-buffer get answers when the regions hold more than the object); keys without an answer (never
    reached, a failed gather, an abandoned call) also read ``CODE_TRANSFER_FAILED``. ``done``: stored (put:
    code 0) or read whole and scattered (get). ``short``: how many gets read fewer bytes than the object.
    """

    codes: Int64Array
    done: BoolArray
    short: int


def run_staged(
    get: bool,
    plan: SlotPlan,
    lease: StagingLease,
    call: Callable[[int, int, list[int], list[int]], Sequence[int] | None],
    copy: Callable[[int, int, Int64Array, BoolArray | None], bool],
    proceed: Callable[[int], bool] | None = None,
) -> StagedRun:
    """Move ``plan``'s keys through ``lease`` in as few batches as its span allows (:func:`plan_batches`).

    Per batch ``[start, end)`` with slot offsets ``slots`` relative to the lease: ``proceed(start)`` (when
    given) may stop the run before the batch; a put calls ``copy(start, end, slots, None)`` (the gather: False
    skips the batch's call) then ``call(start, end, slot pointers, object sizes)``; a get makes the call, then
    ``copy(start, end, slots, whole)`` with the keys read whole (the scatter, which copies only those). A call
    returning ``None`` stops the run (an abandoned call); an answer of another length raises ``RuntimeError``.
    The lease stays the caller's to release.
    """
    n = len(plan.offsets)
    codes = np.full(n, CODE_TRANSFER_FAILED, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    short = 0
    for start, end in plan_batches(plan, lease.nbytes):
        if proceed is not None and not proceed(start):
            break
        slots = plan.offsets[start:end] - plan.offsets[start]
        sizes = plan.object_sizes[start:end]
        if end <= start or int(slots[-1]) + int(sizes[-1]) > lease.nbytes:
            # Mooncake writes (get) or reads (put) these slots unchecked: a batch must lie inside the lease.
            raise RuntimeError(f"staged batch [{start}, {end}) does not fit its {lease.nbytes}-byte lease")
        if not get and not copy(start, end, slots, None):
            continue  # nothing gathered: the batch is never put
        answer = call(start, end, (slots + lease.ptr).tolist(), sizes.tolist())
        if answer is None:
            break
        got = _codes(answer, end - start)
        if get:
            ok = read_whole(got, sizes)
            short += int(np.count_nonzero((got >= 0) & ~ok))
            codes[start:end] = np.where(ok | (got < 0), got, CODE_TRANSFER_FAILED)
            copy(start, end, slots, ok)
        else:
            ok = got == 0
            codes[start:end] = got
        done[start:end] = ok
    return StagedRun(codes, done, short)


def gather(
    addrs: Int64Array,
    sizes: Int64Array,
    staging: StagingArg,
    offsets: Int64Array,
    allowed_ranges: Sequence[MemoryRange] | _native.MemoryRanges,
    *,
    select: KeySelection | None = None,
    threads: int = 0,
    streaming: bool = True,
) -> int:
    """Copy each selected key's slices, in region order, into its staging slot; return the bytes copied.

    ``addrs``/``sizes`` are ``(keys, regions)`` int64 C-contiguous arrays, ``offsets`` the ``(keys,)`` slot
    offsets (see :func:`plan_slots`). Every non-empty slice must lie inside one of ``allowed_ranges`` and
    outside the staging buffer, every slot inside the staging buffer, and slots must not overlap; otherwise
    ``ValueError`` is raised and nothing is copied. ``select`` (bool/uint8, one flag per key) limits the copy
    to some keys; unselected keys are neither read nor checked. ``threads=0`` picks a count by job size;
    ``streaming=False`` uses plain ``memcpy`` (for comparison).
    """
    return _held_copy(_native._staging_gather, staging, addrs, sizes, offsets, allowed_ranges, select=select,
                      threads=threads, streaming=streaming)  # fmt: skip


def scatter(
    addrs: Int64Array,
    sizes: Int64Array,
    staging: StagingArg,
    offsets: Int64Array,
    allowed_ranges: Sequence[MemoryRange] | _native.MemoryRanges,
    *,
    select: KeySelection | None = None,
    threads: int = 0,
    streaming: bool = True,
) -> int:
    """Copy each selected key's staging slot back out to its slices, in region order; return the bytes copied.

    The inverse of :func:`gather`, with the same checks (slots may overlap: they are only read). Pass the
    per-key success of the Mooncake get as ``select`` so a failed key's regions are never written from stale
    staging bytes. Destination slices of different keys should not overlap: which write lands is unspecified.
    """
    return _held_copy(_native._staging_scatter, staging, addrs, sizes, offsets, allowed_ranges, select=select,
                      threads=threads, streaming=streaming)  # fmt: skip


def _held_copy(copy: Callable[..., int], staging: StagingArg, *job: Any, **options: Any) -> int:
    """The native ``copy`` of ``job`` (``addrs, sizes, offsets, allowed_ranges``) on ``staging``'s proven range
    (checked first), the buffer that owns it held until the copy returned."""
    addrs, sizes, *rest = job
    ptr, nbytes, owner = _staging_range(staging)
    try:
        return copy(addrs, sizes, ptr, nbytes, *rest, **options)
    finally:
        del owner  # held until the native copy returned


class HostCopyBackend:
    """The copy backend of the staged transports: native streaming-store copies with the GIL released.

    ``allowed_ranges`` are the registered KV-cache buffers as ``(ptr, nbytes)``; update them with
    :meth:`set_allowed_ranges` when the caches are re-registered. ``threads`` and ``streaming`` are passed to
    :func:`gather`/:func:`scatter`. Safe to share between threads (it holds no per-call state).
    """

    def __init__(self, allowed_ranges: Sequence[MemoryRange], *, threads: int = 0, streaming: bool = True) -> None:
        if threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = auto), got {threads}")
        self.threads = threads
        self.streaming = streaming
        self.set_allowed_ranges(allowed_ranges)

    @property
    def memory_kind(self) -> Literal["host", "device"]:
        """Always ``"host"``."""
        return "host"

    @property
    def allowed_ranges(self) -> tuple[MemoryRange, ...]:
        """The memory ranges slices may touch."""
        return self._allowed

    def set_allowed_ranges(self, allowed_ranges: Sequence[MemoryRange]) -> None:
        """Replace the memory ranges slices may touch (the registered KV-cache buffers); ``ValueError`` for a
        negative range or one whose end overflows int64 (the copies' own check, made once here)."""
        allowed = tuple((int(ptr), int(nbytes)) for ptr, nbytes in allowed_ranges)
        self._allowed, self._ranges = allowed, _native.memory_ranges(allowed)  # converted once, not per copy

    def gather(
        self,
        addrs: Int64Array,
        sizes: Int64Array,
        staging: StagingArg,
        offsets: Int64Array,
        *,
        select: KeySelection | None = None,
    ) -> int:
        """See :func:`gather`."""
        return self._copy(gather, addrs, sizes, staging, offsets, select=select)

    def scatter(
        self,
        addrs: Int64Array,
        sizes: Int64Array,
        staging: StagingArg,
        offsets: Int64Array,
        *,
        select: KeySelection | None = None,
    ) -> int:
        """See :func:`scatter`."""
        return self._copy(scatter, addrs, sizes, staging, offsets, select=select)

    def _copy(self, copy: Callable[..., int], *job: Any, select: KeySelection | None) -> int:
        """``copy`` (:func:`gather` or :func:`scatter`) of ``job`` (``addrs, sizes, staging, offsets``) over this
        backend's allowed ranges, with its threads and streaming."""
        return copy(*job, self._ranges, select=select, threads=self.threads, streaming=self.streaming)

    def __repr__(self) -> str:
        return (
            f"HostCopyBackend({len(self._allowed)} allowed ranges, threads={self.threads}, streaming={self.streaming})"
        )


#: Deprecated name of :class:`HostCopyBackend`, the one copy backend (it was a protocol with that one
#: implementation).
CopyBackend = HostCopyBackend
