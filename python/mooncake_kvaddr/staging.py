"""Staged transfers: one contiguous staging slot per key, filled and drained natively with the GIL released.

Mooncake's multi-buffer calls convert every ``(address, size)`` pair with the GIL held and pay per slice on
TCP (PERF.md point 8, MOONCAKE.md section 2). Staging moves each key through one contiguous slot instead:
:func:`gather` copies a chunk's region slices, in region order, into its slot before a put, and
:func:`scatter` copies a slot back out to the slices after a get. A Mooncake object is the concatenation of
its regions, so staged objects are byte-identical to multi-buffer ones and the two modes interoperate.

The copy is C++ with streaming (non-temporal) stores, optionally on several native threads. Every slice is
checked against the allowed memory ranges (the registered KV-cache buffers) and every slot against the
staging buffer before any byte moves: a bad layout raises ``ValueError`` naming the key and region, and
nothing is copied.

Typical use (``addrs``/``sizes`` from ``ChunkedTokenDatabase.prepare_values_array``)::

    plan = plan_slots(sizes)
    staging = StagingBuffer(plan.total_bytes)
    backend = HostCopyBackend(kv_buffers)            # [(ptr, nbytes), ...] of the KV caches
    backend.gather(addrs, sizes, staging.range, plan.offsets)
    # store.batch_put_from(keys, staging.ptr + plan.offsets, plan.object_sizes)
"""

from __future__ import annotations

from collections.abc import Sequence
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
    "gather",
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


def _staging_range(staging: StagingBuffer | MemoryRange) -> MemoryRange:
    if isinstance(staging, StagingBuffer):
        return staging.range
    ptr, nbytes = staging
    return (ptr, nbytes)


def gather(
    addrs: Int64Array,
    sizes: Int64Array,
    staging: StagingBuffer | MemoryRange,
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
    ptr, nbytes = _staging_range(staging)
    return _native.staging_gather(
        addrs, sizes, ptr, nbytes, offsets, allowed_ranges, select=select, threads=threads, streaming=streaming
    )


def scatter(
    addrs: Int64Array,
    sizes: Int64Array,
    staging: StagingBuffer | MemoryRange,
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
    ptr, nbytes = _staging_range(staging)
    return _native.staging_scatter(
        addrs, sizes, ptr, nbytes, offsets, allowed_ranges, select=select, threads=threads, streaming=streaming
    )


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
        staging: StagingBuffer | MemoryRange,
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
        staging: StagingBuffer | MemoryRange,
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

    A device (GPU) backend would implement the same protocol with ``memory_kind == "device"`` and needs:

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
        staging: StagingBuffer | MemoryRange,
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
        staging: StagingBuffer | MemoryRange,
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
