"""The registered ranges of one store wrapper and the slice checks on them: the table the guard of
:mod:`mooncake_kvaddr.integrations.vllm.guard` consults, and the verdict it reaches on a call's rows. Apart
from the guard's policy (which keys go to Mooncake, the warning) so that each reads on its own; ``guard``
re-exports every name.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr import _native

__all__ = ["BoolArray", "Int64Array", "RangeTable", "Ranges", "RowCheck"]

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass(frozen=True)
class Ranges:
    """One immutable snapshot of the registered ranges, sorted by start. Slices are checked by the native
    module's one range set (``csrc/kvaddr/ranges.hpp``), exact for overlapping registrations, converted once
    per snapshot (per registration change), never per call."""

    items: tuple[tuple[int, int], ...]
    #: The ranges as one native range set: what ``slices_inside`` and the native client's ``ranges`` take.
    pairs: _native.MemoryRanges

    @classmethod
    def of(cls, buffers: dict[int, int]) -> Ranges:
        items = tuple(sorted(buffers.items()))
        return cls(items, _native.memory_ranges(items))

    def cells_inside(self, addrs: Int64Array, sizes: Int64Array) -> BoolArray:
        """Per slice (a 1-D or 2-D int64 array): inside one registered range, size >= 0, no wrap - the one range
        set of the native module (``csrc/kvaddr/ranges.hpp``)."""
        inside: BoolArray = _native.slices_inside(
            np.ascontiguousarray(addrs, dtype=np.int64), np.ascontiguousarray(sizes, dtype=np.int64), self.pairs
        )
        return inside

    def all_inside(self, addrs: Int64Array, sizes: Int64Array) -> bool:
        """True when every slice of the (keys x regions) matrices is inside."""
        return addrs.size == 0 or bool(self.cells_inside(addrs, sizes).all())


class RangeTable:
    """The ranges registered through one store wrapper (thread-safe; snapshots are immutable).

    ``armed``: the guard is on (every slice must be inside a registered range); set by the first successful
    registration, or at construction (``armed=True``: the plugin's wrappers, docs/vllm-plugin.md).
    """

    def __init__(self, *, armed: bool = False) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[int, int] = {}
        self._armed = armed
        self._ranges = Ranges.of({})

    @property
    def armed(self) -> bool:
        """True once slices are checked."""
        return self._armed

    @property
    def ranges(self) -> Ranges:
        """The current snapshot (replaced as a whole on every change)."""
        return self._ranges

    @staticmethod
    def as_range(buffer_ptr: Any, size: Any) -> tuple[int, int] | None:
        """``(ptr, size)`` as ints when they describe a non-empty range inside ``[1, 2**63)``, else None."""
        try:
            ptr, nbytes = operator.index(buffer_ptr), operator.index(size)
        except TypeError:
            return None
        if ptr <= 0 or nbytes <= 0 or ptr + nbytes > _INT64_MAX:
            return None
        return ptr, nbytes

    def add(self, buffer_ptr: Any, size: Any) -> bool:
        """Record a buffer Mooncake accepted (arms the table); False when it cannot be a range (then nothing
        inside it is allowed)."""
        span = self.as_range(buffer_ptr, size)
        with self._lock:
            self._armed = True
            if span is None:
                return False
            self._buffers[span[0]] = span[1]
            self._ranges = Ranges.of(self._buffers)
        return True

    def remove(self, buffer_ptr: Any) -> None:
        """Forget the buffer starting at ``buffer_ptr`` (whatever Mooncake answers to its unregistration)."""
        try:
            ptr = operator.index(buffer_ptr)
        except TypeError:
            return
        with self._lock:
            if self._buffers.pop(ptr, None) is not None:
                self._ranges = Ranges.of(self._buffers)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _slice_ok(ranges: Ranges, address: Any, size: Any) -> bool:
    """One slice (Python ints or anything else) inside one registered range."""
    a, s = _int(address), _int(size)
    if a is None or s is None or not (0 < a <= _INT64_MAX and 0 <= s <= _INT64_MAX):
        return False  # not an int64 slice at all (the native check takes int64 values)
    return bool(ranges.cells_inside(np.array([a], np.int64), np.array([s], np.int64))[0])


@dataclass
class RowCheck:
    """The verdict on a multi-buffer or flat call: ``good`` (indices of the keys that may go to Mooncake) or
    None when all may; the rows as int64 matrices (or vectors) when they are rectangular and converted."""

    good: list[int] | None
    count: int
    addrs: Int64Array | None = None
    sizes: Int64Array | None = None

    @property
    def refused(self) -> int:
        return 0 if self.good is None else self.count - len(self.good)
