"""The one plan record (docs/architecture.md, "The plan record"): a request's keys, each key's rows of
addresses and sizes, its block id and, for the staged transports, its staging slot. The databases' planners,
the driver's transfer paths and the vLLM handlers and store wrappers all pass this one type; rows are ``(n, R)``
int64 matrices, Python lists only where a vLLM-compatible signature must return lists.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["KeyPlan", "SlotPlan"]

Int64Array = npt.NDArray[np.int64]
_INT64_MAX = int(np.iinfo(np.int64).max)
_NO_INVALID: Mapping[int, str] = MappingProxyType({})


class SlotPlan(NamedTuple):
    """Where each key's object lives in a staging buffer.

    ``offsets[k]`` is the byte offset of key ``k``'s slot (aligned), ``object_sizes[k]`` the exact object size
    to give Mooncake (the sum of the key's region sizes), ``total_bytes`` the staging bytes the plan needs.
    """

    offsets: Int64Array
    object_sizes: Int64Array
    total_bytes: int


class _PlanFields(NamedTuple):
    """The fields of :class:`KeyPlan` (a named tuple cannot redefine its own ``_replace``)."""

    keys: list[str]
    addrs: Any
    sizes: Any
    block_ids: Any
    slots: SlotPlan | None = None
    widths: Any = None
    row_shift: int = 0
    bounded: bool = False
    invalid: Mapping[int, str] = _NO_INVALID
    dropped: int = 0


class KeyPlan(_PlanFields):
    """Keys in transfer order with their rows and block ids, index-aligned.

    ``addrs``/``sizes``: ``(n, R)`` int64 matrices (:attr:`arrays`), or lists of lists of ints where a
    vLLM-compatible signature needs them. ``block_ids``: an int64 array or a list (``None`` when the caller has
    none). ``slots``: the staging layout of every key, when planned with the rows. ``widths``: each row's
    region count when rows differ in width (vLLM's hybrid groups; the matrices padded with zero cells).
    ``row_shift``: 0, or the rows stay in walk order while keys, ids and slots are rotated: key ``i`` has row
    ``(i + row_shift) % n``. ``bounded``: the rows were bounded by construction when planned (else they are
    checked against the registered caches). ``invalid``/``dropped``: block ids refused while planning
    (id -> reason) and the chunks dropped for them.

    A named tuple (as the seed era's four-field record was: creating and freeing one costs what that did) that
    iterates, indexes, measures and compares as ``(keys, addrs, sizes, block_ids)``; the other fields are read
    by name.
    """

    __slots__ = ()

    def __iter__(self) -> Iterator[Any]:
        """``keys, addrs, sizes, block_ids``: a plan unpacks and indexes like the seed era's four-field record."""
        return iter((self.keys, self.addrs, self.sizes, self.block_ids))

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: Any) -> Any:
        return (self.keys, self.addrs, self.sizes, self.block_ids)[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyPlan):
            return NotImplemented
        return self._compared() == other._compared()

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  # holds lists and arrays

    def __getnewargs__(self) -> tuple[Any, ...]:
        return tuple(tuple.__iter__(self))

    def _asdict(self) -> dict[str, Any]:
        return dict(zip(self._fields, tuple.__iter__(self)))

    def _replace(self, **changes: Any) -> KeyPlan:
        """A copy with some fields changed (``offsets``, ``object_sizes`` and ``total_bytes`` change
        :attr:`slots`)."""
        slot_changes = {k: changes.pop(k) for k in SlotPlan._fields if k in changes}
        unknown = set(changes) - set(self._fields)
        if unknown:
            raise ValueError(f"KeyPlan has no field(s) {sorted(unknown)}")
        if slot_changes:
            changes["slots"] = self.slot_plan()._replace(**slot_changes)
        return KeyPlan(*[changes.get(name, value) for name, value in zip(self._fields, tuple.__iter__(self))])

    def _compared(self) -> tuple[Any, ...]:
        slots = None if self.slots is None else tuple(_plain(v) for v in self.slots)
        return (self.keys, _plain(self.addrs), _plain(self.sizes), _plain(self.block_ids), slots)

    @property
    def offsets(self) -> Int64Array:
        """Each key's staging slot offset (:attr:`slots`; ``AttributeError`` for a plan without slots)."""
        return self.slot_plan().offsets

    @property
    def object_sizes(self) -> Int64Array:
        """Each key's object size as laid out in :attr:`slots`."""
        return self.slot_plan().object_sizes

    @property
    def total_bytes(self) -> int:
        """The staging bytes :attr:`slots` needs (not the sum of the sizes: :meth:`num_bytes`)."""
        return self.slot_plan().total_bytes

    def slot_plan(self) -> SlotPlan:
        """:attr:`slots`, which this plan must have (``AttributeError`` otherwise)."""
        if self.slots is None:
            raise AttributeError("this plan has no staging slots")
        return self.slots

    @property
    def arrays(self) -> bool:
        """Whether the rows are int64 matrices (else lists of lists of ints)."""
        return isinstance(self.addrs, np.ndarray)

    def key_bytes(self) -> list[int]:
        """Each key's object size (the sum of its sizes), exact Python ints, in key order."""
        if self.slots is not None:
            return [int(x) for x in self.slots.object_sizes.tolist()]
        if not self.arrays:
            return [sum(row) for row in self.sizes]
        sizes = self.sizes
        if sizes.size and (int(sizes.min()) < 0 or int(sizes.max()) > _INT64_MAX // max(1, sizes.shape[1])):
            return [sum(row) for row in sizes.tolist()]
        result: list[int] = sizes.sum(axis=1).tolist() if len(self.keys) else []
        return result

    def num_bytes(self) -> int:
        """The sum of every size (vLLM's ``num_bytes`` of a load), exact."""
        if not self.arrays:
            return sum(map(sum, self.sizes))
        sizes = self.sizes
        if sizes.size == 0:
            return 0
        if int(sizes.min()) >= 0 and int(sizes.max()) <= _INT64_MAX // max(1, sizes.size):
            return int(sizes.sum())
        return sum(int(v) for v in sizes.ravel().tolist())

    def part(self, start: int, end: int) -> KeyPlan:
        """Keys ``start:end`` with their rows and block ids (views of the matrices, no copy)."""
        widths = None if self.widths is None else self.widths[start:end]
        rows = self.addrs[start:end], self.sizes[start:end]
        return KeyPlan(self.keys[start:end], *rows, self.block_ids[start:end], widths=widths)

    def take(self, indices: list[int]) -> KeyPlan:
        """The keys at ``indices`` (in that order) with their rows and block ids."""
        keys = [self.keys[i] for i in indices]
        if self.arrays:
            widths = None if self.widths is None else self.widths[indices]
            return KeyPlan(keys, self.addrs[indices], self.sizes[indices], self.block_ids[indices], widths=widths)
        addrs, sizes, ids = ([m[i] for i in indices] for m in (self.addrs, self.sizes, self.block_ids))
        return KeyPlan(keys, addrs, sizes, ids)

    def row_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """The rows as lists of lists of ints (padding dropped), as vLLM builds them."""
        addrs, sizes = self.addrs.tolist(), self.sizes.tolist()
        if self.widths is None:
            return addrs, sizes
        widths = self.widths.tolist()
        return [r[:w] for r, w in zip(addrs, widths)], [r[:w] for r, w in zip(sizes, widths)]

    def block_id_list(self, indices: list[int] | None = None) -> list[int]:
        """Block ids (all, or those at ``indices``) as a list of Python ints."""
        ids = self.block_ids
        if indices is None:
            return list(ids.tolist()) if self.arrays else list(ids)
        if self.arrays:
            return [int(ids[i]) for i in indices]
        return [ids[i] for i in indices]

    def __repr__(self) -> str:
        kind = "arrays" if self.arrays else "lists"
        return f"KeyPlan({len(self.keys)} keys, {kind}, slots={self.slots is not None})"


def _plain(value: Any) -> Any:
    """A comparable form of a plan field (matrices as nested lists)."""
    return value.tolist() if isinstance(value, np.ndarray) else value
