"""The staging memory behind :mod:`~mooncake_kvaddr.driver.staging`: buffers, the shared pool and its leases.

With them, the record of live staging buffers that proves a staging range project-owned (SECURITY.md). Kept
apart from slot planning and the copies, which stay in ``driver.staging``; it re-exports every name here.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr import _native
from mooncake_kvaddr.driver.values import as_index

#: A memory range as ``(address, nbytes)``.
MemoryRange = tuple[int, int]

#: Default alignment of every staging slot, in bytes (a cache line).
SLOT_ALIGNMENT: Final[int] = _native.STAGING_SLOT_ALIGNMENT

_PAGE: Final = 4096


class StagingBuffer:
    """A pre-faulted, aligned host buffer that holds staging slots.

    Allocate it once at start-up and reuse it: the first write to fresh memory page-faults
    (docs/transfer-modes.md, "The three paths"), so the buffer is touched page by page up front.
    Register ``range`` with Mooncake once, as one range. The memory lives as long as this object.
    """

    def __init__(self, nbytes: int, *, alignment: int = _PAGE, prefault: bool = True) -> None:
        nbytes = as_index("nbytes", nbytes)
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
        # only this record. Dead entries are dropped here (see _LIVE_STAGING).
        with _LIVE_STAGING_LOCK:
            dead = [start for start, (ref, _) in _LIVE_STAGING.items() if ref() is None]
            for start in dead:
                del _LIVE_STAGING[start]
            _LIVE_STAGING[self._ptr] = (weakref.ref(self), nbytes)

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
        nbytes = as_index("nbytes", nbytes)
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
            registered = self._registrations.get(id(store), (store, 0))[1]
            if not registered:
                store.register_buffer(self.buffer.ptr, self.buffer.nbytes)
            self._registrations[id(store)] = (store, registered + 1)

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
    elif isinstance(staging, (str, bytes)) or not isinstance(staging, Sequence) or len(staging) != 2:
        raise TypeError(
            f"staging must be a StagingBuffer, a StagingLease or a (ptr, nbytes) range, not {type(staging).__name__}"
        )
    else:
        ptr, nbytes = _int_pair(*staging)
    if nbytes == 0 and ptr >= 0:
        return ptr, 0, None  # nothing can be copied into or out of zero bytes
    owner = _owner_of(ptr, nbytes)
    # A lease lies inside its own pool's buffer, not merely inside some live one (another pool's slots belong to
    # other requests).
    if isinstance(staging, StagingLease) and owner is not staging._pool.buffer:
        raise ValueError(
            f"{staging!r}: range ({ptr:#x}, {nbytes}) is not inside its own pool's staging buffer"
        )
    return ptr, nbytes, owner


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
