"""The registered-range guard of the plugin's store wrappers (docs/vllm-plugin.md, "Registered-range guard").

Every wrapper the plugin installs (:class:`~mooncake_kvaddr.integrations.vllm.native_store.NativeMooncakeStore`,
:class:`~mooncake_kvaddr.integrations.vllm.staged_store.StagedMooncakeStore`, and the two stacked) records the
buffers registered through its ``register_buffer`` in a :class:`RangeTable`. Once the table is *armed* (the
first successful registration, or at construction for the wrappers the plugin installs) every ``(address,
size)`` slice of every Mooncake call that takes raw pointers must lie inside one registered buffer. A key with
any other slice (outside every buffer, straddling two, negative, wrapping past 2**63, a row whose address and
size counts differ, a value that is not an int) gets Mooncake's invalid-params code
(:data:`INVALID_PARAMS`, -600; ``None`` for the calls that answer tensors) in its result slot and is never
handed to Mooncake; the other keys go to Mooncake in one call, their results put back in order.

Nothing is ever dereferenced: ranges and slices are integers (device memory is checked the same way). The
check is vectorised (numpy, no Python loop per slice) for well-formed calls; only malformed rows take a
per-key path.
"""

from __future__ import annotations

import logging
import operator
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr import _native
from mooncake_kvaddr.driver.outcomes import CODE_INVALID_PARAMS

__all__ = [
    "FLAT_METHODS",
    "INVALID_PARAMS",
    "MULTI_METHODS",
    "SINGLE_METHODS",
    "GuardRefused",
    "RangeTable",
    "Ranges",
    "StoreGuard",
]

logger = logging.getLogger("vllm.mooncake_kvaddr")

#: Mooncake's INVALID_PARAMS result code (docs/configuration.md): the code a refused key gets.
INVALID_PARAMS = CODE_INVALID_PARAMS

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
_INT64_MAX = int(np.iinfo(np.int64).max)
#: Seconds between two refusal warnings of one wrapper (the refused-key count is summed in between).
WARN_INTERVAL_S = 10.0


class GuardRefused(TypeError):
    """A Mooncake method that takes raw pointers but that the guard does not know how to check."""


# --- the methods that take raw pointers (Mooncake 0.3.13's MooncakeDistributedStore) -------------------------
# name -> (parameter names of keys, pointers, sizes; per-key extra parameters (sub-set with the keys); the value
# a refused key gets).

#: ``(keys, rows of addresses, rows of sizes, ...)``.
MULTI_METHODS: dict[str, tuple[tuple[str, str, str], tuple[str, ...], Any]] = {
    "batch_get_into_multi_buffers": (("keys", "all_buffer_ptrs", "all_sizes"), (), INVALID_PARAMS),
    "batch_put_from_multi_buffers": (("keys", "all_buffer_ptrs", "all_sizes"), (), INVALID_PARAMS),
    "batch_get_into_multi_buffer_ranges": (
        ("keys", "all_buffer_ptrs", "all_sizes"), ("all_src_offsets",), INVALID_PARAMS,
    ),
    "batch_put_from_multi_buffer_ranges": (
        ("keys", "all_buffer_ptrs", "all_sizes"), ("all_dst_offsets",), INVALID_PARAMS,
    ),
}  # fmt: skip

_FLAT = ("keys", "buffer_ptrs", "sizes")
_FLAT_TP = ("base_keys", "buffer_ptrs", "sizes")
_PARALLEL_PUT = ("parallelisms", "writer_partitions")
#: ``(keys, one address per key, one size per key, ...)``.
FLAT_METHODS: dict[str, tuple[tuple[str, str, str], tuple[str, ...], Any]] = {
    "batch_get_into": (_FLAT, (), INVALID_PARAMS),
    "batch_put_from": (_FLAT, (), INVALID_PARAMS),
    "batch_upsert_from": (_FLAT, (), INVALID_PARAMS),
    "batch_get_tensor_into": (_FLAT, (), None),
    "batch_get_tensor_with_parallelism_into": (_FLAT, ("targets",), None),
    "batch_get_tensor_with_tp_into": (_FLAT_TP, (), None),
    "batch_put_tensor_from": (_FLAT, (), INVALID_PARAMS),
    "batch_upsert_tensor_from": (_FLAT, (), INVALID_PARAMS),
    "batch_put_tensor_with_parallelism_from": (_FLAT, _PARALLEL_PUT, INVALID_PARAMS),
    "batch_upsert_tensor_with_parallelism_from": (_FLAT, _PARALLEL_PUT, INVALID_PARAMS),
    "batch_put_tensor_with_tp_from": (_FLAT_TP, (), INVALID_PARAMS),
}

_SINGLE = ("key", "buffer_ptr", "size")
#: ``(key, address, size, ...)``: one slice; ``put_from_with_metadata`` has two (see :meth:`StoreGuard.call`).
SINGLE_METHODS: dict[str, tuple[tuple[str, ...], Any]] = {
    "get_into": (_SINGLE, INVALID_PARAMS),
    "put_from": (_SINGLE, INVALID_PARAMS),
    "upsert_from": (_SINGLE, INVALID_PARAMS),
    "get_tensor_into": (_SINGLE, None),
    "get_tensor_with_parallelism_into": (_SINGLE, None),
    "get_tensor_with_tp_into": (_SINGLE, None),
    "put_tensor_from": (_SINGLE, INVALID_PARAMS),
    "put_tensor_with_parallelism_from": (_SINGLE, INVALID_PARAMS),
    "put_tensor_with_tp_from": (_SINGLE, INVALID_PARAMS),
    "upsert_tensor_from": (_SINGLE, INVALID_PARAMS),
    "upsert_tensor_with_parallelism_from": (_SINGLE, INVALID_PARAMS),
    "put_from_with_metadata": (("key", "buffer_ptr", "metadata_buffer_ptr", "size", "metadata_size"), INVALID_PARAMS),
}
#: Raw-pointer methods with their own shape: ``get_into_ranges(buffer_ptrs, all_keys, all_dst_offsets,
#: all_src_offsets, all_sizes)``, and Mooncake 0.3.14's ``get_into_ranges_from_snapshot(snapshot, ...the
#: same...)``: name -> the parameters before ``buffer_ptrs``.
RANGES_METHODS: dict[str, tuple[str, ...]] = {
    "get_into_ranges": (),
    "get_into_ranges_from_snapshot": ("snapshot",),
}
RANGES_METHOD = "get_into_ranges"
_RANGES_NAMES = ("buffer_ptrs", "all_keys", "all_dst_offsets", "all_src_offsets", "all_sizes")
#: Methods whose pointer arguments are the registration itself (handled by the wrappers).
REGISTRATION_METHODS = frozenset({"register_buffer", "unregister_buffer"})


def guarded_names() -> frozenset[str]:
    """Every method name the guard checks (or handles) itself."""
    return frozenset(MULTI_METHODS) | frozenset(FLAT_METHODS) | frozenset(SINGLE_METHODS) | frozenset(RANGES_METHODS)


_POINTER_PARAM = re.compile(r"\w*(ptr|ptrs|pointer|pointers)\s*:")


def takes_pointers(value: Any) -> bool:
    """True when a method's (pybind11) signature names a pointer parameter (``..._ptr``, ``..._ptrs``)."""
    doc = getattr(value, "__doc__", None) or ""
    first = doc.strip().split("\n", 1)[0].lower()
    return _POINTER_PARAM.search(first) is not None


# --- the range table -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ranges:
    """One immutable snapshot of the registered ranges, sorted by start (``reach[i]``: the largest end among
    ranges ``0..i``). Slices are checked by the native module's one range set (``csrc/kvaddr/ranges.hpp``),
    exact for overlapping registrations."""

    starts: Int64Array
    ends: Int64Array
    reach: Int64Array
    items: tuple[tuple[int, int], ...]
    #: ``(n, 2)`` int64 ``[start, end)`` pairs: what the native client takes as its ``ranges`` argument.
    pairs: Int64Array

    @classmethod
    def of(cls, buffers: dict[int, int]) -> Ranges:
        items = tuple(sorted(buffers.items()))
        starts = np.array([p for p, _ in items], dtype=np.int64)
        ends = np.array([p + n for p, n in items], dtype=np.int64)
        reach = np.maximum.accumulate(ends) if ends.size else ends
        pairs = np.ascontiguousarray(np.stack([starts, ends], axis=1) if items else np.empty((0, 2), np.int64))
        return cls(starts, ends, reach, items, pairs)

    def cells_inside(self, addrs: Int64Array, sizes: Int64Array) -> BoolArray:
        """Per slice (a 1-D or 2-D int64 array): inside one registered range, size >= 0, no wrap - the one range
        set of the native module (``csrc/kvaddr/ranges.hpp``)."""
        inside: BoolArray = _native.slices_inside(
            np.ascontiguousarray(addrs, dtype=np.int64), np.ascontiguousarray(sizes, dtype=np.int64), self.items
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


# --- the guard ---------------------------------------------------------------------------------------------------


def _bind(names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """The values of ``names`` (by position, then keyword), or None when one is missing (Mooncake's binding
    then raises ``TypeError`` before doing anything)."""
    out = []
    for i, name in enumerate(names):
        if i < len(args):
            out.append(args[i])
        elif name in kwargs:
            out.append(kwargs[name])
        else:
            return None
    return out


def _rebind(
    names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any], values: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with the parameters in ``values`` replaced where they were given."""
    new_args = list(args)
    new_kwargs = dict(kwargs)
    for i, name in enumerate(names):
        if name not in values:
            continue
        if i < len(new_args):
            new_args[i] = values[name]
        elif name in new_kwargs:
            new_kwargs[name] = values[name]
    return tuple(new_args), new_kwargs


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


class StoreGuard:
    """The check and the split of one wrapper's calls (``name`` goes into the warning)."""

    def __init__(self, name: str, table: RangeTable) -> None:
        self.name = name
        self.table = table
        self._warn_lock = threading.Lock()
        self._pending = 0
        self._last_warning = -WARN_INTERVAL_S
        self.refused_keys = 0

    # -- warnings

    def note_refused(self, count: int, what: str) -> None:
        """Count ``count`` refused keys; log one warning per :data:`WARN_INTERVAL_S` naming the count."""
        if count <= 0:
            return
        with self._warn_lock:
            self.refused_keys += count
            self._pending += count
            now = time.monotonic()
            if now - self._last_warning < WARN_INTERVAL_S:
                return
            pending, self._pending, self._last_warning = self._pending, 0, now
        logger.warning(
            "mooncake_kvaddr: %s refused %d key(s) (latest in %s): a slice outside the buffers registered through "
            "it (result %d, not sent to Mooncake; docs/vllm-plugin.md)",
            self.name, pending, what, INVALID_PARAMS,
        )  # fmt: skip

    # -- checks

    def check_matrices(self, addrs: Int64Array, sizes: Int64Array) -> RowCheck:
        """Two (keys x regions) int64 matrices (the receive handler's form)."""
        n = int(addrs.shape[0])
        ranges = self.table.ranges
        if ranges.all_inside(addrs, sizes):
            return RowCheck(None, n, addrs, sizes)
        ok = ranges.cells_inside(addrs, sizes).all(axis=1)
        good = [int(i) for i in np.flatnonzero(ok)]
        return RowCheck(None if len(good) == n else good, n, addrs, sizes)

    def check_multi(self, keys: Any, all_ptrs: Any, all_sizes: Any) -> RowCheck | None:
        """Rows of a multi-buffer call (lists of lists, arrays); None when ``keys`` has no length (Mooncake's
        binding refuses such a call itself)."""
        try:
            n = len(keys)
        except TypeError:
            return None
        if isinstance(all_ptrs, np.ndarray) and isinstance(all_sizes, np.ndarray):
            if (
                all_ptrs.dtype == np.int64
                and all_sizes.dtype == np.int64
                and all_ptrs.ndim == 2
                and all_ptrs.shape == all_sizes.shape
                and all_ptrs.shape[0] == n
            ):
                return self.check_matrices(all_ptrs, all_sizes)
        try:
            if len(all_ptrs) != n or len(all_sizes) != n:
                return RowCheck([], n)  # rows cannot be paired with keys: every key refused (Mooncake: -600)
        except TypeError:
            return RowCheck([], n)
        try:
            addrs, sizes = _native.multi_buffer_arrays(all_ptrs, all_sizes)
            widths = [len(row) for row in all_ptrs]
        except (TypeError, ValueError, OverflowError):
            return self._check_rows_one_by_one(all_ptrs, all_sizes, n)
        if n and widths.count(widths[0]) != n:
            # Ragged rows: padding cells (past a row's width) are not slices.
            ok = self.table.ranges.cells_inside(addrs, sizes)
            ok |= np.arange(addrs.shape[1])[None, :] >= np.asarray(widths)[:, None]
            good = [int(i) for i in np.flatnonzero(ok.all(axis=1))]
            return RowCheck(None if len(good) == n else good, n)
        return self.check_matrices(addrs, sizes)

    def _check_rows_one_by_one(self, all_ptrs: Any, all_sizes: Any, n: int) -> RowCheck:
        """Rows the bulk conversion refused: each key on its own (a malformed row refuses only its key)."""
        ranges = self.table.ranges
        good = []
        for i in range(n):
            try:
                addrs, sizes = _native.multi_buffer_arrays([all_ptrs[i]], [all_sizes[i]])
            except (TypeError, ValueError, OverflowError, IndexError):
                continue
            if bool(ranges.cells_inside(addrs, sizes).all()):
                good.append(i)
        return RowCheck(None if len(good) == n else good, n)

    def check_flat(self, keys: Any, ptrs: Any, sizes: Any) -> RowCheck | None:
        """One address and one size per key."""
        try:
            n = len(keys)
        except TypeError:
            return None
        try:
            if len(ptrs) != n or len(sizes) != n:
                return RowCheck([], n)
        except TypeError:
            return RowCheck([], n)
        a = s = None
        if isinstance(ptrs, np.ndarray) and isinstance(sizes, np.ndarray):
            if ptrs.dtype == np.int64 and sizes.dtype == np.int64 and ptrs.shape == sizes.shape == (n,):
                a, s = ptrs, sizes
        elif isinstance(ptrs, list) and isinstance(sizes, list) and _all_plain_ints(ptrs, sizes):
            try:
                a, s = np.array(ptrs, dtype=np.int64), np.array(sizes, dtype=np.int64)
            except OverflowError:
                a = s = None
        if a is None or s is None:
            ranges = self.table.ranges
            try:
                good = [i for i in range(n) if _slice_ok(ranges, ptrs[i], sizes[i])]
            except (TypeError, IndexError, KeyError):
                good = []
            return RowCheck(None if len(good) == n else good, n)
        ok = self.table.ranges.cells_inside(a, s)
        good = [int(i) for i in np.flatnonzero(ok)]
        return RowCheck(None if len(good) == n else good, n, a, s)

    def call_arrays(
        self,
        keys: list[str],
        addrs: Int64Array,
        sizes: Int64Array,
        func: Callable[[Any, Any, Any], Any],
        name: str = "batch_get_into_multi_buffers_arrays",
    ) -> Any:
        """The ``..._arrays`` entries (``name``): ``func(keys, addrs, sizes)`` for the keys whose slices are all
        inside (matrices of the good rows), -600 for the others."""
        if not self.table.armed:
            return func(keys, addrs, sizes)
        if (
            not isinstance(addrs, np.ndarray)
            or not isinstance(sizes, np.ndarray)
            or addrs.dtype != np.int64
            or sizes.dtype != np.int64
            or addrs.ndim != 2
            or addrs.shape != sizes.shape
            or addrs.shape[0] != len(keys)
        ):
            check = self.check_multi(keys, addrs, sizes) or RowCheck([], len(keys))
        else:
            check = self.check_matrices(addrs, sizes)
        if check.good is None:
            return func(keys, addrs, sizes)
        good = check.good
        self.note_refused(check.refused, name)
        results: list[Any] = [INVALID_PARAMS] * check.count
        if good:
            answers = list(func([keys[i] for i in good], np.asarray(addrs)[good], np.asarray(sizes)[good]))
            if len(answers) != len(good):
                raise RuntimeError(f"Mooncake returned {len(answers)} results for {len(good)} keys")
            for i, value in zip(good, answers, strict=True):
                results[i] = value
        return results

    # -- calls

    def call(
        self,
        name: str,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        arrays_ok: bool = False,
    ) -> Any:
        """``func(*args, **kwargs)`` (the Mooncake method ``name``) with its refused keys held back; the guard is
        only active once the table is armed. ``arrays_ok``: ``func`` takes int64 matrices in place of rows
        (the native client): rows converted for the check are handed on as such (no second conversion)."""
        if not self.table.armed:
            return func(*args, **kwargs)
        if name in MULTI_METHODS or name in FLAT_METHODS:
            names, extras, refusal = MULTI_METHODS.get(name) or FLAT_METHODS[name]
            bound = _bind(names, args, kwargs)
            if bound is None:
                return func(*args, **kwargs)
            keys, ptrs, sizes = bound
            check = (self.check_multi if name in MULTI_METHODS else self.check_flat)(keys, ptrs, sizes)
            if check is None:
                return func(*args, **kwargs)
            if not (arrays_ok and check.addrs is not None and check.addrs.ndim == 2):
                check.addrs = check.sizes = None
            if check.good is None:
                if check.addrs is None:
                    return func(*args, **kwargs)
                new_args, new_kwargs = _rebind(names, args, kwargs, {names[1]: check.addrs, names[2]: check.sizes})
                return func(*new_args, **new_kwargs)
            return self.split(name, func, args, kwargs, names, extras, refusal, check)
        if name in SINGLE_METHODS:
            single_names, refusal = SINGLE_METHODS[name]
            bound = _bind(single_names, args, kwargs)
            if bound is None:
                return func(*args, **kwargs)
            ranges = self.table.ranges
            slices = (
                [(bound[1], bound[2])] if len(single_names) == 3 else [(bound[1], bound[3]), (bound[2], bound[4])]
            )
            if all(_slice_ok(ranges, a, s) for a, s in slices):
                return func(*args, **kwargs)
            self.note_refused(1, name)
            return refusal
        if name in RANGES_METHODS:
            return self._call_ranges(name, func, args, kwargs)
        return func(*args, **kwargs)

    def split(
        self,
        name: str,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        names: Sequence[str],
        extras: Sequence[str],
        refusal: Any,
        check: RowCheck,
    ) -> Any:
        """Send the good keys of ``check`` to ``func`` in one call; the refused ones get ``refusal``."""
        good = check.good or []
        self.note_refused(check.refused, name)
        results: list[Any] = [refusal] * check.count
        if not good:
            return results
        keys, ptrs, sizes = _bind(names, args, kwargs) or (None, None, None)
        values = {
            names[0]: _pick(keys, good),
            names[1]: _pick(ptrs if check.addrs is None else check.addrs, good),
            names[2]: _pick(sizes if check.sizes is None else check.sizes, good),
        }
        all_names = list(names) + list(extras)
        for extra in extras:
            bound = _bind(all_names, args, kwargs)
            value = bound[all_names.index(extra)] if bound is not None else None
            if value is not None and _sized(value, check.count):
                values[extra] = _pick(value, good)
        new_args, new_kwargs = _rebind(_positional(name, names, extras), args, kwargs, values)
        answered = func(*new_args, **new_kwargs)
        answers = list(answered)
        if len(answers) != len(good):
            raise RuntimeError(f"Mooncake's {name} returned {len(answers)} results for {len(good)} keys")
        for i, value in zip(good, answers, strict=True):
            results[i] = value
        return results

    def _call_ranges(
        self, name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``get_into_ranges`` (and its snapshot form): a buffer with any slice outside gets -600 for every range
        of it (not sent)."""
        lead = RANGES_METHODS[name]
        names = (*lead, *_RANGES_NAMES)
        bound_all = _bind(names, args, kwargs)
        if bound_all is None:
            return func(*args, **kwargs)
        bound = bound_all[len(lead) :]
        ptrs, all_keys, dsts, _srcs, all_sizes = bound
        ranges = self.table.ranges
        good: list[int] = []
        try:
            n = len(ptrs)
            for i in range(n):
                if all(
                    _slice_ok(ranges, _add(ptrs[i], d), s)
                    for dst_row, size_row in _zip_strict(dsts[i], all_sizes[i])
                    for d, s in _zip_strict(dst_row, size_row)
                ) and len(all_keys[i]) == len(dsts[i]):
                    good.append(i)
        except (TypeError, ValueError, IndexError):
            raise GuardRefused(f"{name}: arguments the guard cannot read are not sent to Mooncake") from None
        if len(good) == n:
            return func(*args, **kwargs)
        self.note_refused(n - len(good), name)

        def refused(i: int) -> list[list[int]]:
            return [[INVALID_PARAMS] * len(size_row) for size_row in all_sizes[i]]

        results: list[Any] = [refused(i) for i in range(n)]
        if good:
            values = {param: _pick(value, good) for param, value in zip(_RANGES_NAMES, bound, strict=True)}
            new_args, new_kwargs = _rebind(names, args, kwargs, values)
            answers = list(func(*new_args, **new_kwargs))
            if len(answers) != len(good):
                raise RuntimeError(f"Mooncake's {name} returned {len(answers)} results for {len(good)}")
            for i, value in zip(good, answers, strict=True):
                results[i] = value
        return results


def _positional(name: str, names: Sequence[str], extras: Sequence[str]) -> list[str]:
    """Parameter names in positional order (after self) for the methods with per-key extras."""
    if name in ("batch_get_into_multi_buffer_ranges", "batch_put_from_multi_buffer_ranges"):
        return [*names, *extras]
    if name == "batch_get_tensor_with_parallelism_into":
        return [*names, "targets"]
    if name in ("batch_put_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism_from"):
        return [*names, "parallelisms", "config", "writer_partitions"]
    return list(names)


def _sized(value: Any, n: int) -> bool:
    try:
        return not isinstance(value, (str, bytes)) and len(value) == n
    except TypeError:
        return False


def _pick(values: Any, good: list[int]) -> Any:
    if isinstance(values, np.ndarray):
        return values[good]
    return [values[i] for i in good]


def _add(base: Any, offset: Any) -> Any:
    a, d = _int(base), _int(offset)
    return None if a is None or d is None or d < 0 else a + d


def _zip_strict(a: Any, b: Any) -> Any:
    if len(a) != len(b):
        raise ValueError("rows of different lengths")
    return zip(a, b, strict=True)


def _all_plain_ints(ptrs: list[Any], sizes: Any) -> bool:
    return all(type(v) is int for v in ptrs) and all(type(v) is int for v in sizes)
