"""The registered-range guard of the plugin's store wrappers (docs/vllm-plugin.md, "Registered-range guard").

Every raw-pointer slice a wrapper hands Mooncake must lie inside one buffer registered through it; a key with any
other slice gets Mooncake's invalid-params code and is never handed to Mooncake. The method tables live in
``guard_methods``, the range table and the slice checks in ``guard_ranges``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mooncake_kvaddr import _native
from mooncake_kvaddr.driver import per_key
from mooncake_kvaddr.integrations.vllm.guard_methods import (
    _RANGES_NAMES,
    CONFIG,
    FLAT_METHODS,
    INVALID_PARAMS,
    MULTI_METHODS,
    SINGLE_METHODS,
    _positional,
)
from mooncake_kvaddr.integrations.vllm.guard_methods import RANGES_METHOD as RANGES_METHOD
from mooncake_kvaddr.integrations.vllm.guard_methods import RANGES_METHODS as RANGES_METHODS
from mooncake_kvaddr.integrations.vllm.guard_methods import REGISTRATION_METHODS as REGISTRATION_METHODS
from mooncake_kvaddr.integrations.vllm.guard_methods import guarded_names as guarded_names
from mooncake_kvaddr.integrations.vllm.guard_methods import takes_pointers as takes_pointers
from mooncake_kvaddr.integrations.vllm.guard_ranges import BoolArray as BoolArray
from mooncake_kvaddr.integrations.vllm.guard_ranges import Int64Array, Ranges, RangeTable, _int, _slice_ok
from mooncake_kvaddr.integrations.vllm.guard_ranges import RowCheck as RowCheck

__all__ = [
    "FLAT_METHODS",
    "INVALID_PARAMS",
    "MULTI_METHODS",
    "SINGLE_METHODS",
    "GuardRefused",
    "RangeTable",
    "Ranges",
    "StoreGuard",
    "int64_matrices",
]

logger = logging.getLogger("vllm.mooncake_kvaddr")

#: Seconds between two refusal warnings of one wrapper (the refused-key count is summed in between).
WARN_INTERVAL_S = 10.0


class GuardRefused(TypeError):
    """A Mooncake method that takes raw pointers but that the guard does not know how to check."""


# --- the guard ---------------------------------------------------------------------------------------------------


def int64_matrices(addrs: Any, sizes: Any) -> bool:
    """Two int64 matrices of one shape (the form the array entries and the native checks take)."""
    return (
        isinstance(addrs, np.ndarray)
        and isinstance(sizes, np.ndarray)
        and addrs.dtype == np.int64
        and sizes.dtype == np.int64
        and addrs.ndim == 2
        and addrs.shape == sizes.shape
    )


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


def _call_rebound(
    func: Callable[..., Any], names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any], new: dict[str, Any]
) -> Any:
    """``func`` called with ``args``/``kwargs``, the parameters in ``new`` replaced where they were given."""
    new_args = list(args)
    new_kwargs = dict(kwargs)
    for i, name in enumerate(names):
        if name not in new:
            continue
        if i < len(new_args):
            new_args[i] = new[name]
        elif name in new_kwargs:
            new_kwargs[name] = new[name]
    return func(*new_args, **new_kwargs)


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
        return _verdict(ranges.cells_inside(addrs, sizes).all(axis=1), n, addrs, sizes)

    def check_multi(self, keys: Any, all_ptrs: Any, all_sizes: Any) -> RowCheck | None:
        """Rows of a multi-buffer call (lists of lists, arrays); None when ``keys`` has no length (Mooncake's
        binding refuses such a call itself)."""
        n = _paired(keys, all_ptrs, all_sizes)
        if not isinstance(n, int):
            return n
        if int64_matrices(all_ptrs, all_sizes) and all_ptrs.shape[0] == n:
            return self.check_matrices(all_ptrs, all_sizes)
        try:
            addrs, sizes = _native.multi_buffer_arrays(all_ptrs, all_sizes)
            widths = [len(row) for row in all_ptrs]
        except (TypeError, ValueError, OverflowError):
            return self._check_rows_one_by_one(all_ptrs, all_sizes, n)
        if n and widths.count(widths[0]) != n:
            # Ragged rows: padding cells (past a row's width) are not slices.
            ok = self.table.ranges.cells_inside(addrs, sizes)
            ok |= np.arange(addrs.shape[1])[None, :] >= np.asarray(widths)[:, None]
            return _verdict(ok.all(axis=1), n)
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
        n = _paired(keys, ptrs, sizes)
        if not isinstance(n, int):
            return n
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
        return _verdict(self.table.ranges.cells_inside(a, s), n, a, s)

    def call_arrays(
        self,
        keys: list[str],
        addrs: Int64Array,
        sizes: Int64Array,
        func: Callable[..., Any],
        name: str = "batch_get_into_multi_buffers_arrays",
        *,
        config: tuple[Any, ...] = (),
    ) -> Any:
        """The ``..._arrays`` entries (``name``): ``func(keys, addrs, sizes[, config])`` for the keys whose slices
        are all inside (matrices of the good rows, a put's ``config``, none or one, with its per-key fields cut
        to them: :func:`~mooncake_kvaddr.driver.per_key.config_for`), -600 for the others."""
        if not self.table.armed:
            return func(keys, addrs, sizes, *config)
        check = self.check_multi(keys, addrs, sizes) or RowCheck([], len(keys))  # int64 matrices: check_matrices
        if check.good is None:
            return func(keys, addrs, sizes, *config)
        good = check.good
        self.note_refused(check.refused, name)
        results: list[Any] = [INVALID_PARAMS] * check.count
        if good:
            part = per_key.configs_for(config, good, check.count)
            per_key.put_back(results, good, func([keys[i] for i in good], np.asarray(addrs)[good],
                                                 np.asarray(sizes)[good], *part))  # fmt: skip
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
                return _call_rebound(func, names, args, kwargs, {names[1]: check.addrs, names[2]: check.sizes})
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
        order = _positional(name, names, extras)  # Mooncake's parameter order (non-per-key ones between)
        for extra in extras:
            at = order.index(extra)
            value = args[at] if at < len(args) else kwargs.get(extra)
            if value is not None and _sized(value, check.count):
                values[extra] = _pick(value, good)
        if CONFIG in order:  # a put's ReplicateConfig: its per-key fields go with the kept keys
            at = order.index(CONFIG)
            value = args[at] if at < len(args) else kwargs.get(CONFIG)
            if value is not None:
                values[CONFIG] = per_key.config_for(value, good, check.count)
        per_key.put_back(results, good, _call_rebound(func, order, args, kwargs, values), f"Mooncake's {name}")
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
            answers = _call_rebound(func, names, args, kwargs, values)
            per_key.put_back(results, good, answers, f"Mooncake's {name}", unit="")  # one answer per buffer
        return results


def _paired(keys: Any, ptrs: Any, sizes: Any) -> int | RowCheck | None:
    """The key count when ``ptrs`` and ``sizes`` have one row (or value) per key; else the verdict: None when
    ``keys`` has no length (Mooncake's binding refuses such a call itself), every key refused when the rows
    cannot be paired with the keys (Mooncake: -600)."""
    try:
        n = len(keys)
    except TypeError:
        return None
    try:
        paired = len(ptrs) == n and len(sizes) == n
    except TypeError:
        paired = False
    return n if paired else RowCheck([], n)


def _verdict(ok: Any, n: int, *rows: Int64Array) -> RowCheck:
    """The verdict on ``n`` keys from each key's flag ``ok`` (all good: None), with the rows it was read from."""
    good = [int(i) for i in np.flatnonzero(ok)]
    return RowCheck(None if len(good) == n else good, n, *rows)


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
