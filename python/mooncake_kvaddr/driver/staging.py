"""Staged transfers: one contiguous staging slot per key, filled and drained natively with the GIL released.

Mooncake's multi-buffer calls convert every ``(address, size)`` pair with the GIL held and pay per slice on
TCP (docs/gil-policy.md). Staging moves each key through one contiguous slot instead:
:func:`gather` copies a chunk's region slices, in region order, into its slot before a put, and
:func:`scatter` copies a slot back out to the slices after a get. A Mooncake object is the concatenation of
its regions, so staged objects are byte-identical to multi-buffer ones and the two modes interoperate.

The copy is C++ with streaming (non-temporal) stores, optionally on several native threads. Every slice is
checked against the allowed memory ranges (the registered KV-cache buffers) and every slot against the
staging buffer before any byte moves: a bad layout raises ``ValueError`` naming the key and region, and
nothing is copied.

Staging is project-owned memory only (SECURITY.md): ``staging`` is a :class:`StagingBuffer`, a
:class:`StagingLease`, or a ``(ptr, nbytes)`` range that lies inside a :class:`StagingBuffer` that is still
alive; anything else raises ``ValueError`` before the native copy runs. The buffer is held for the whole copy.

Typical use (``addrs``/``sizes`` from ``ChunkedTokenDatabase.prepare_values_array``)::

    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    backend = HostCopyBackend(kv_buffers)            # [(ptr, nbytes), ...] of the KV caches
    backend.gather(addrs, sizes, staging.range, plan.offsets)
    # store.batch_put_from(keys, staging.ptr + plan.offsets, plan.object_sizes)

:class:`~mooncake_kvaddr.driver.transfer.KVTransfer` does this per request in its ``"staged"`` mode, with a
:class:`StagingPool` shared by its threads: each request leases one span (the whole request when it fits),
and :func:`plan_batches` cuts the request into as few batches as the span allows.

Design for GPU KV caches (not built here; the host path is the one implemented)
-------------------------------------------------------------------------------

The driver only talks to a :class:`CopyBackend` and a :class:`StagingPool`; a device backend plugs in by
providing both for device memory:

* **Staging in device memory** (or pinned host memory next to the GPU). :class:`StagingPool` needs nothing of
  its buffer but ``(ptr, nbytes)`` and a one-time touch: a device pool is the same span allocator over one
  ``cudaMalloc`` range, registered with Mooncake once as one range (with its device location, so that RDMA
  reads and writes it directly, GPUDirect). Leases, batch planning and slot alignment are unchanged; align
  slots to 256 B for coalesced device copies.
* **A device** :class:`CopyBackend` (``memory_kind == "device"``): one gather/scatter kernel launch per
  batch (a thread block per key walking its slices in region order) or one copy-engine batch
  (``cudaMemcpyBatchAsync``-style, one descriptor per slice); never one Python-level call per key or slice.
  The ``(keys, regions)`` address/size matrices, the slot offsets and the ``select`` mask go to the device
  once per batch through a small pinned buffer.
* **The same contract as the host backend**: all-or-nothing validation on the host before the launch (a
  kernel cannot raise), bytes returned, ``select`` honoured so a failed key's blocks are never written.
* **Stream ordering**: ``gather`` runs on a stream ordered after the model's writes to the blocks (vLLM
  records one event per step) and returns once the copy is complete, because Mooncake reads the staging
  next; ``scatter`` is ordered after the get and completes before the blocks are handed back to the engine.
  Waiting for the device happens with the GIL released.
* **Mode choice**: ``"auto"`` stages only host memory today; with a device backend registered for device
  regions, ``register_kv_caches`` would pick the backend by the regions' memory kind (until then device
  regions use the multi-buffer calls, which Mooncake's CUDA build can read from device memory).
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Final, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr import _native

__all__ = [
    "SLOT_ALIGNMENT",
    "STREAMING_STORES",
    "CopyBackend",
    "HostCopyBackend",
    "MemoryRange",
    "SlotPlan",
    "StagingBuffer",
    "StagingLease",
    "StagingPool",
    "check_staging",
    "gather",
    "plan_batches",
    "plan_slots",
    "scatter",
]

Int64Array = npt.NDArray[np.int64]
#: A selection of keys: one flag per key (nonzero / True = copy the key).
KeySelection = npt.NDArray[np.bool_] | npt.NDArray[np.uint8]
#: A memory range as ``(address, nbytes)``.
MemoryRange = tuple[int, int]

#: Default alignment of every staging slot, in bytes (a cache line).
SLOT_ALIGNMENT: Final[int] = _native.STAGING_SLOT_ALIGNMENT
#: Whether this build copies with streaming stores (x86 SSE2); elsewhere the copy is plain ``memcpy``.
STREAMING_STORES: Final[bool] = _native.STAGING_STREAMING_STORES

_PAGE: Final = 4096


class SlotPlan(NamedTuple):
    """Where each key's object lives in a staging buffer.

    ``offsets[k]`` is the byte offset of key ``k``'s slot (aligned), ``object_sizes[k]`` the exact object size
    to give Mooncake (the sum of the key's region sizes), ``total_bytes`` the staging bytes the plan needs.
    """

    offsets: Int64Array
    object_sizes: Int64Array
    total_bytes: int


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


class StagingBuffer:
    """A pre-faulted, aligned host buffer that holds staging slots.

    Allocate it once at start-up and reuse it: the first write to fresh memory page-faults (a fresh 441 MiB
    Mooncake segment took 0.45-1.7 s instead of 0.12 s), so the buffer is touched page by page up front.
    Register ``range`` with Mooncake once, as one range. The memory lives as long as this object.
    """

    def __init__(self, nbytes: int, *, alignment: int = _PAGE, prefault: bool = True) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if alignment < SLOT_ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= {SLOT_ALIGNMENT}, got {alignment}")
        # Over-allocate and slice: numpy guarantees only 16-byte alignment.
        self._backing = np.empty(nbytes + alignment, dtype=np.uint8)
        skew = -self._backing.ctypes.data % alignment
        # Kept apart from the view: numpy may report another data pointer for an empty slice.
        self._ptr = int(self._backing.ctypes.data) + skew
        self._array = self._backing[skew : skew + nbytes]
        if prefault:
            self._array[::_PAGE] = 0  # one write per page maps it
        # Recorded from the allocation itself, never from an (overridable) property: the staging check trusts
        # only this record.
        _register_staging(self, self._ptr, nbytes)

    @property
    def ptr(self) -> int:
        """Address of the first byte."""
        return self._ptr

    @property
    def nbytes(self) -> int:
        """Length in bytes."""
        return int(self._array.nbytes)

    @property
    def range(self) -> MemoryRange:
        """``(ptr, nbytes)``: what to register with Mooncake and to pass as ``staging``."""
        return (self.ptr, self.nbytes)

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The whole buffer as a uint8 array (a view; no copy)."""
        return self._array

    def span(self, offset: int, nbytes: int) -> MemoryRange:
        """``(ptr, nbytes)`` of a sub-range, e.g. one request's share of a shared pool. Bounds-checked."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"span [{offset}, +{nbytes}) is outside the {self.nbytes}-byte staging buffer")
        return (self.ptr + offset, nbytes)

    def __repr__(self) -> str:
        return f"StagingBuffer(ptr={self.ptr:#x}, nbytes={self.nbytes})"


class BufferRegistrar(Protocol):
    """What a staging pool registers itself with: a Mooncake store (:class:`~mooncake_kvaddr.MooncakeStore`)."""

    def register_buffer(self, ptr: int, size: int) -> None: ...

    def unregister_buffer(self, ptr: int) -> None: ...


class StagingLease:
    """One request's contiguous share of a :class:`StagingPool`, held until :meth:`release` (or the ``with``
    block ends). Slot offsets of the request are relative to :attr:`ptr`; :attr:`range` is what
    :func:`gather`/:func:`scatter` take as ``staging``."""

    def __init__(self, pool: StagingPool, offset: int, nbytes: int) -> None:
        self._pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self._held = True

    @property
    def ptr(self) -> int:
        """Address of the lease's first byte (a multiple of :data:`SLOT_ALIGNMENT`)."""
        return self._pool.buffer.ptr + self.offset

    @property
    def range(self) -> MemoryRange:
        """``(ptr, nbytes)`` of the lease."""
        return (self.ptr, self.nbytes)

    @property
    def held(self) -> bool:
        """True until released."""
        return self._held

    def release(self) -> None:
        """Give the bytes back to the pool (idempotent; thread-safe, also against :meth:`shrink`)."""
        self._pool._give_back(self, None)

    def shrink(self, nbytes: int) -> None:
        """Keep only the first ``nbytes`` of the lease (rounded up to the slot alignment, at least one
        alignment unit) and give the rest back to the pool now. A staged call abandoned at its deadline keeps
        just the slots it may still write or read (docs/transfer-modes.md, "Deadlines").

        A lease already released stays released (another thread may release it meanwhile: the two never
        give the same bytes back twice)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._pool._give_back(self, max(SLOT_ALIGNMENT, _align_up(nbytes)))

    def __enter__(self) -> StagingLease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"StagingLease(offset={self.offset}, nbytes={self.nbytes}, held={self._held})"


def _align_up(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


class StagingPool:
    """A bounded, pre-faulted staging area that concurrent requests share without ever sharing a slot.

    Each request leases one contiguous span with :meth:`acquire` (as much as it can use, up to what is free,
    and at least the bytes of its largest key), moves its batches through it and releases it; a request that cannot
    get its minimum waits until another releases. A request holds one lease at a time, so waiting cannot
    deadlock. Register the buffer with each Mooncake store once, as one range (:meth:`register_with`;
    a second, overlapping registration would fail with -600).
    """

    def __init__(self, nbytes: int, *, prefault: bool = True) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.buffer = StagingBuffer(nbytes, prefault=prefault)
        self._capacity = nbytes // SLOT_ALIGNMENT * SLOT_ALIGNMENT
        self._cond = threading.Condition(threading.Lock())
        # Free spans as (offset, nbytes), sorted by offset, disjoint and never adjacent (merged on release).
        self._free: list[tuple[int, int]] = [(0, self._capacity)] if self._capacity else []
        self._registration_lock = threading.Lock()
        self._registrations: dict[int, tuple[BufferRegistrar, int]] = {}

    @property
    def capacity(self) -> int:
        """Bytes that leases can hold (the buffer, rounded down to the slot alignment)."""
        return self._capacity

    @property
    def free_bytes(self) -> int:
        """Bytes not leased right now."""
        with self._cond:
            return sum(size for _, size in self._free)

    @property
    def range(self) -> MemoryRange:
        """``(ptr, nbytes)`` of the whole buffer: the one range registered with Mooncake."""
        return self.buffer.range

    def acquire(self, min_bytes: int, max_bytes: int | None = None, *, timeout: float | None = None) -> StagingLease:
        """Lease one contiguous span of at least ``min_bytes`` and at most ``max_bytes`` (both rounded up to
        the slot alignment), the largest the free space allows; wait while no free span holds ``min_bytes``.

        Raises ``ValueError`` if ``min_bytes`` exceeds the pool's capacity (it could never be granted) and
        ``TimeoutError`` after ``timeout`` seconds of waiting (``None``: wait as long as it takes).
        """
        need = _align_up(max(min_bytes, 1))
        want = need if max_bytes is None else max(need, _align_up(max_bytes))
        if need > self._capacity:
            raise ValueError(
                f"a key needs {need} bytes of staging but the pool holds {self._capacity}: "
                "raise staging_buffer_size"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                best = max(range(len(self._free)), key=lambda i: self._free[i][1], default=None)
                if best is not None and self._free[best][1] >= need:
                    offset, size = self._free[best]
                    take = min(size, want)
                    if take == size:
                        del self._free[best]
                    else:
                        self._free[best] = (offset + take, size - take)
                    return StagingLease(self, offset, take)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"no {need}-byte staging span freed within {timeout} s "
                        f"({self.capacity}-byte pool, other requests hold it)"
                    )
                self._cond.wait(remaining)

    def _give_back(self, lease: StagingLease, keep: int | None) -> None:
        """Release ``lease`` whole (``keep=None``) or all but its first ``keep`` bytes, once, under the lock."""
        with self._cond:
            if not lease._held:
                return
            if keep is None:
                lease._held = False
                self._free_span(lease.offset, lease.nbytes)
            elif keep < lease.nbytes:
                tail = lease.nbytes - keep
                lease.nbytes = keep
                self._free_span(lease.offset + keep, tail)

    def _free_span(self, offset: int, nbytes: int) -> None:
        """Return a span to the free list (the lock is held)."""
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        start, end = offset, offset + nbytes
        if i < len(free) and free[i][0] == end:  # merge with the span after
            end += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # and the one before
            start = free[i - 1][0]
            i -= 1
            del free[i]
        free.insert(i, (start, end - start))
        self._cond.notify_all()

    def register_with(self, store: BufferRegistrar) -> None:
        """Register the whole buffer with ``store`` once; later calls for the same store only count."""
        with self._registration_lock:
            entry = self._registrations.get(id(store))
            if entry is None:
                store.register_buffer(self.buffer.ptr, self.buffer.nbytes)
                self._registrations[id(store)] = (store, 1)
            else:
                self._registrations[id(store)] = (store, entry[1] + 1)

    def unregister_from(self, store: BufferRegistrar) -> None:
        """Undo one :meth:`register_with`; the last one unregisters the buffer from ``store``."""
        with self._registration_lock:
            entry = self._registrations.get(id(store))
            if entry is None:
                return
            if entry[1] > 1:
                self._registrations[id(store)] = (store, entry[1] - 1)
                return
            del self._registrations[id(store)]
            store.unregister_buffer(self.buffer.ptr)

    def __repr__(self) -> str:
        return f"StagingPool(capacity={self.capacity}, free={self.free_bytes})"


# Live staging buffers by their first byte, with the length allocated: the only memory a gather may write and a
# scatter may read as staging, and the only memory a staged Mooncake call may be handed. The range is recorded
# by StagingBuffer.__init__ from its own allocation (a subclass's properties, or attributes edited later, change
# nothing here). The references carry no callback: a callback would run inside whatever allocation started a
# garbage collection, possibly while this thread holds the lock below (a deadlock). Dead entries are dropped at
# the next registration instead, and a dead reference is never a candidate.
_LIVE_STAGING: dict[int, tuple[weakref.ref[StagingBuffer], int]] = {}
_LIVE_STAGING_LOCK = threading.Lock()


def _register_staging(buffer: StagingBuffer, ptr: int, nbytes: int) -> None:
    with _LIVE_STAGING_LOCK:
        dead = [start for start, (ref, _) in _LIVE_STAGING.items() if ref() is None]
        for start in dead:
            del _LIVE_STAGING[start]
        _LIVE_STAGING[ptr] = (weakref.ref(buffer), nbytes)


StagingArg = StagingBuffer | StagingLease | MemoryRange


def _owner_of(ptr: int, nbytes: int) -> StagingBuffer:
    """The live staging buffer whose recorded allocation holds ``[ptr, ptr + nbytes)``; ``ValueError`` if none."""
    if nbytes >= 0:
        with _LIVE_STAGING_LOCK:
            candidates = [(start, ref(), length) for start, (ref, length) in _LIVE_STAGING.items()]
        for start, owner, length in candidates:
            if owner is not None and start <= ptr and ptr + nbytes <= start + length:
                return owner
    raise ValueError(
        f"staging range ({ptr:#x}, {nbytes}) is not inside a live staging buffer: staging must be memory this "
        "package allocated (StagingBuffer, StagingPool)"
    )


def _staging_range(staging: StagingArg) -> tuple[int, int, StagingBuffer | None]:
    """``(ptr, nbytes, owner)`` of a project-owned staging range; ``owner`` must be held during the copy.

    Whatever the form, the range is proven inside the recorded allocation of a live :class:`StagingBuffer`: a
    lease is an ordinary object (built or edited by anyone), so its word is not taken.
    """
    if isinstance(staging, StagingBuffer):
        with _LIVE_STAGING_LOCK:
            record = next(((start, length) for start, (ref, length) in _LIVE_STAGING.items() if ref() is staging),
                          None)  # fmt: skip
        if record is None:
            raise ValueError(f"{type(staging).__name__} is not a live staging buffer this package allocated")
        return record[0], record[1], staging
    if isinstance(staging, StagingLease):
        if not staging.held:
            raise ValueError(f"{staging!r} was released: its bytes may belong to another request now")
        ptr, nbytes = _int_pair(staging.ptr, staging.nbytes)
        if nbytes == 0 and ptr >= 0:
            return ptr, 0, None
        owner = _owner_of(ptr, nbytes)
        # Inside its own pool's buffer, not merely inside some live one (another pool's slots belong to other
        # requests).
        if owner is not staging._pool.buffer:
            raise ValueError(
                f"{staging!r}: range ({ptr:#x}, {nbytes}) is not inside its own pool's staging buffer"
            )
        return ptr, nbytes, owner
    elif isinstance(staging, (str, bytes)) or not isinstance(staging, Sequence) or len(staging) != 2:
        raise TypeError(
            f"staging must be a StagingBuffer, a StagingLease or a (ptr, nbytes) range, not {type(staging).__name__}"
        )
    else:
        ptr, nbytes = _int_pair(*staging)
    if nbytes == 0 and ptr >= 0:
        return ptr, 0, None  # nothing can be copied into or out of zero bytes
    return ptr, nbytes, _owner_of(ptr, nbytes)


def _int_pair(ptr: object, nbytes: object) -> tuple[int, int]:
    """Exact ints (``operator.index``: a float or a string is a ``TypeError``, not a truncated address)."""
    return operator.index(ptr), operator.index(nbytes)  # type: ignore[arg-type]


def check_staging(lease: StagingLease) -> StagingBuffer:
    """The live buffer that holds ``lease``'s whole range; ``ValueError`` unless the lease is held and inside
    project-owned staging. The staged path checks every lease so before it hands Mooncake pointers into it."""
    ptr, nbytes, owner = _staging_range(lease)
    if owner is None:
        owner = _owner_of(ptr, nbytes)
    return owner


def gather(
    addrs: Int64Array,
    sizes: Int64Array,
    staging: StagingArg,
    offsets: Int64Array,
    allowed_ranges: Sequence[MemoryRange],
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
    ptr, nbytes, owner = _staging_range(staging)
    try:
        return _native._staging_gather(
            addrs, sizes, ptr, nbytes, offsets, allowed_ranges, select=select, threads=threads, streaming=streaming
        )
    finally:
        del owner  # held until the native copy returned


def scatter(
    addrs: Int64Array,
    sizes: Int64Array,
    staging: StagingArg,
    offsets: Int64Array,
    allowed_ranges: Sequence[MemoryRange],
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
    ptr, nbytes, owner = _staging_range(staging)
    try:
        return _native._staging_scatter(
            addrs, sizes, ptr, nbytes, offsets, allowed_ranges, select=select, threads=threads, streaming=streaming
        )
    finally:
        del owner  # held until the native copy returned


@runtime_checkable
class CopyBackend(Protocol):
    """Moves region slices to and from staging slots for one kind of memory.

    The transfer driver stages a request as: :func:`plan_slots` → ``gather`` → Mooncake ``batch_put_from``
    (put), or Mooncake ``batch_get_into`` → ``scatter`` with the per-key results as ``select`` (get). A
    backend owns the knowledge of where the KV caches live (its allowed ranges) and how to copy there.
    ``gather``/``scatter`` must validate everything before copying (all or nothing), return the bytes
    moved, and return only once the destination is complete and visible to the caller's next step.
    """

    @property
    def memory_kind(self) -> Literal["host", "device"]:
        """Where the KV caches and the staging buffer this backend copies between live."""
        ...

    def gather(
        self,
        addrs: Int64Array,
        sizes: Int64Array,
        staging: StagingArg,
        offsets: Int64Array,
        *,
        select: KeySelection | None = None,
    ) -> int:
        """Copy each selected key's slices into its slot; return the bytes copied."""
        ...

    def scatter(
        self,
        addrs: Int64Array,
        sizes: Int64Array,
        staging: StagingArg,
        offsets: Int64Array,
        *,
        select: KeySelection | None = None,
    ) -> int:
        """Copy each selected key's slot back to its slices; return the bytes copied."""
        ...


class HostCopyBackend:
    """The host-memory :class:`CopyBackend`: native streaming-store copies with the GIL released.

    ``allowed_ranges`` are the registered KV-cache buffers as ``(ptr, nbytes)``; update them with
    :meth:`set_allowed_ranges` when the caches are re-registered. ``threads`` and ``streaming`` are passed to
    :func:`gather`/:func:`scatter`. Safe to share between threads (it holds no per-call state).

    A device (GPU) backend would implement the same protocol with ``memory_kind == "device"`` (see the module
    docstring for how it fits the driver) and needs:

    * staging in device memory (or pinned host memory), registered with Mooncake once, so that RDMA reads
      and writes it directly (GPUDirect); allowed ranges are the device KV-cache allocations;
    * one gather/scatter kernel launch per request (one thread block per key, slices walked in region
      order; the ``(keys, regions)`` address/size matrices and the ``select`` mask uploaded once per request
      into a small pinned/device buffer), or one copy-engine batch (``cudaMemcpyBatchAsync``-style) with
      one descriptor per slice, never one Python-level call per slice or per key;
    * the same all-or-nothing validation on the host before the launch (the kernel cannot raise);
    * stream ordering: ``gather`` returns after the copy is complete (event synchronise) because Mooncake
      reads the staging buffer next; ``scatter`` is ordered after the get completes and before the blocks
      are handed back to the inference engine (an event the caller can wait on, or a synchronise);
    * the GIL released while waiting for the device.
    """

    def __init__(self, allowed_ranges: Sequence[MemoryRange], *, threads: int = 0, streaming: bool = True) -> None:
        if threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = auto), got {threads}")
        self.threads = threads
        self.streaming = streaming
        self._allowed: tuple[MemoryRange, ...] = ()
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
        """Replace the memory ranges slices may touch (the registered KV-cache buffers)."""
        self._allowed = tuple((int(ptr), int(nbytes)) for ptr, nbytes in allowed_ranges)

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
        return gather(
            addrs,
            sizes,
            staging,
            offsets,
            self._allowed,
            select=select,
            threads=self.threads,
            streaming=self.streaming,
        )

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
        return scatter(
            addrs,
            sizes,
            staging,
            offsets,
            self._allowed,
            select=select,
            threads=self.threads,
            streaming=self.streaming,
        )

    def __repr__(self) -> str:
        return (
            f"HostCopyBackend({len(self._allowed)} allowed ranges, threads={self.threads}, streaming={self.streaming})"
        )
