"""The calls of :class:`~mooncake_kvaddr.driver.store.MooncakeStore` that reach Mooncake (:class:`StoreCalls`).

Each binding call needs its own guarded wrapper (admission, validation, splitting); they live here, apart from
the store's set-up and close, as a base class of ``MooncakeStore`` that relies on the store for admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from mooncake_kvaddr.driver.errors import StoreClosedError, StoreError
from mooncake_kvaddr.driver.outcomes import BatchResult, Health, Outcome, _Op
from mooncake_kvaddr.driver.store_args import _check_address, _check_flat, _check_keys, _check_rows

if TYPE_CHECKING:
    from mooncake_kvaddr.driver.store import RequestDeadline


class StoreCalls:
    """The batch, buffer and health calls of :class:`~mooncake_kvaddr.driver.store.MooncakeStore`, and its
    argument-conversion probes for benchmarks.

    Not used alone: :class:`~mooncake_kvaddr.driver.store.MooncakeStore` provides the attributes declared
    below (admission to its client, and the sub-batch loop, which shares the clock of request deadlines).
    """

    _admitted: Callable[[], AbstractContextManager[Any]]
    _admitted_batch: Callable[[], AbstractContextManager[Any]]
    _replicate_default: Callable[[], Any]
    _split_call: Callable[..., list[int]]

    # ------------------------------------------------------------------ batch calls

    def batch_is_exist(self, keys: Sequence[str] | Sequence[bytes]) -> BatchResult:
        """Which keys exist (``present``); absent keys are ``NOT_FOUND``. Grants each object a read lease."""
        n = _check_keys(keys)
        if n == 0:
            return BatchResult((), ())
        with self._admitted_batch() as client:
            codes = client.batch_is_exist(keys)
        return self._result(_Op.EXIST, codes, n)

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str] | Sequence[bytes],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        replicate_config: Any = None,
        *,
        check_values: bool = True,
        deadline: RequestDeadline | None = None,
    ) -> BatchResult:
        """Store each key as the concatenation of its regions ``(addrs[i][j], sizes[i][j])``.

        An existing key is left unchanged (first write wins) and reported ``OK``. ``check_values=False``
        skips the non-negativity scan (docs/configuration.md, section 10) for rows known to be valid. ``deadline``:
        the request this call belongs to (default: a new one of ``config.request_timeout_s``); every batch
        call takes it.
        """
        n = _check_keys(keys)
        counts = _check_rows(n, addrs, sizes, check_values)
        if n == 0:
            return BatchResult((), ())
        with self._admitted_batch() as client:
            config = replicate_config if replicate_config is not None else self._replicate_default()
            codes = self._split_call(
                lambda k, a, s: client.batch_put_from_multi_buffers(k, a, s, config),
                keys,
                addrs,
                sizes,
                counts,
                deadline,
            )
        return self._result(_Op.PUT, codes, n)

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str] | Sequence[bytes],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        check_values: bool = True,
        deadline: RequestDeadline | None = None,
    ) -> BatchResult:
        """Read each key's object, scattered over its regions in order; codes are bytes read.

        The sizes of a key must add up exactly to the object's size (smaller: ``INVALID_PARAMS``, larger:
        ``TRANSFER_FAILED``). Missing keys are ``NOT_FOUND``.
        """
        n = _check_keys(keys)
        counts = _check_rows(n, addrs, sizes, check_values)
        if n == 0:
            return BatchResult((), ())
        with self._admitted_batch() as client:
            codes = self._split_call(
                client.batch_get_into_multi_buffers, keys, addrs, sizes, counts, deadline, unique_keys=True
            )
        return self._result(_Op.GET, codes, n)

    def batch_put_from(
        self,
        keys: Sequence[str] | Sequence[bytes],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        replicate_config: Any = None,
        *,
        check_values: bool = True,
        deadline: RequestDeadline | None = None,
    ) -> BatchResult:
        """Store each key from one contiguous buffer ``(ptrs[i], sizes[i])``."""
        n = _check_keys(keys)
        _check_flat(n, ptrs, sizes, check_values)
        if n == 0:
            return BatchResult((), ())
        with self._admitted_batch() as client:
            config = replicate_config if replicate_config is not None else self._replicate_default()
            codes = self._split_call(
                lambda k, p, s: client.batch_put_from(k, p, s, config), keys, ptrs, sizes, [1] * n, deadline
            )
        return self._result(_Op.PUT, codes, n)

    def batch_get_into(
        self,
        keys: Sequence[str] | Sequence[bytes],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        *,
        check_values: bool = True,
        deadline: RequestDeadline | None = None,
    ) -> BatchResult:
        """Read each key into one contiguous buffer ``(ptrs[i], sizes[i])``; codes are bytes read."""
        n = _check_keys(keys)
        _check_flat(n, ptrs, sizes, check_values)
        if n == 0:
            return BatchResult((), ())
        with self._admitted_batch() as client:
            codes = self._split_call(client.batch_get_into, keys, ptrs, sizes, [1] * n, deadline, unique_keys=True)
        return self._result(_Op.GET, codes, n)

    def replica_locations(self, keys: Sequence[str]) -> list[tuple[tuple[str, int], ...]] | None:
        """Where each key's memory replicas live: per key, ``(transport endpoint, object bytes)`` of each.

        A key that does not exist (or has no memory replica) gets ``()``. ``None`` when the Mooncake client
        has no replica query (``batch_get_replica_desc``). Asks the master only, never a peer, and moves no
        bytes; like a get, it grants each object a read lease. Used to prove a peer responsive before a load
        that Mooncake writes into the KV cache itself (docs/multihost.md, "Hung peer").
        """
        n = _check_keys(keys)
        if n == 0:
            return []
        with self._admitted() as client:
            query = getattr(client, "batch_get_replica_desc", None)
            if query is None:
                return None
            found = query(list(keys))
        out: list[tuple[tuple[str, int], ...]] = []
        for key in keys:
            places: list[tuple[str, int]] = []
            for replica in found.get(key, ()) if isinstance(found, dict) else ():
                if not replica.is_memory_replica():
                    continue
                where = replica.get_memory_descriptor().buffer_descriptor
                places.append((str(where.transport_endpoint), int(where.size)))
            out.append(tuple(places))
        return out

    def batch_remove(self, keys: Sequence[str] | Sequence[bytes], force: bool = False) -> BatchResult:
        """Remove keys: ``OK``, ``NOT_FOUND``, or ``HAS_LEASE`` (read recently) unless ``force``."""
        n = _check_keys(keys)
        if n == 0:
            return BatchResult((), ())
        with self._admitted() as client:
            codes = client.batch_remove(keys, force)
        return self._result(_Op.REMOVE, codes, n)

    def remove_all(self, force: bool = False) -> int:
        """Remove every object; returns how many. Leased objects are skipped unless ``force``."""
        with self._admitted() as client:
            removed: int = client.remove_all(force)
        if removed < 0:
            raise StoreError(f"remove_all failed with code {removed} ({Outcome.from_error(removed).value})", removed)
        return removed

    # ------------------------------------------------------------------ buffers and health

    def register_buffer(self, ptr: int, size: int) -> None:
        """Register ``[ptr, ptr+size)`` for zero-copy transfers (needed on RDMA; harmless on TCP).

        Raises :class:`StoreError` if Mooncake refuses (e.g. the range overlaps a registered one).
        """
        _check_address("ptr", ptr)
        _check_address("size", size)
        with self._admitted() as client:
            rc: int = client.register_buffer(ptr, size)
        if rc != 0:
            raise StoreError(
                f"register_buffer(0x{ptr:x}, {size}) failed with code {rc}: overlaps an already registered range?",
                rc,
            )

    def unregister_buffer(self, ptr: int) -> None:
        """Unregister a buffer by its start address; :class:`StoreError` if it was not registered."""
        _check_address("ptr", ptr)
        with self._admitted() as client:
            rc: int = client.unregister_buffer(ptr)
        if rc != 0:
            raise StoreError(f"unregister_buffer(0x{ptr:x}) failed with code {rc}: not a registered start address", rc)

    def health_check(self) -> Health:
        """``OK``, ``NOT_READY`` (not set up / closed; Mooncake is not called) or ``MASTER_UNREACHABLE``."""
        try:
            with self._admitted() as client:
                return Health(client.health_check())
        except StoreClosedError:
            return Health.NOT_READY

    def time_argument_conversion(self, addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> float:
        """Seconds Mooncake's binding spends converting these rows (GIL held), without any transfer.

        Calls ``batch_get_into_multi_buffers([], addrs, sizes)``: the binding converts every argument,
        then returns ``[]`` at once because the key count does not match. For benchmarks.
        """
        _check_rows(len(addrs), addrs, sizes, check_values=True)
        with self._admitted() as client:
            start = time.perf_counter()
            out = client.batch_get_into_multi_buffers([], addrs, sizes)
            elapsed = time.perf_counter() - start
        if list(out):
            raise StoreError(f"conversion probe unexpectedly returned {list(out)[:4]}")
        return elapsed

    def time_contiguous_argument_conversion(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> float:
        """Seconds Mooncake's binding spends on a ``batch_get_into`` call's arguments (GIL held), no transfer.

        Passes one pointer and size fewer than keys: the binding converts everything, then rejects every key
        (-600) without moving a byte. An upper bound: it includes that length check and the result list.
        For benchmarks.
        """
        if not (len(keys) == len(ptrs) == len(sizes)) or not keys:
            raise ValueError("keys, ptrs and sizes must be non-empty and of equal length")
        with self._admitted() as client:
            start = time.perf_counter()
            out = client.batch_get_into(keys, ptrs[:-1], sizes[:-1])
            elapsed = time.perf_counter() - start
        if any(code >= 0 for code in out):
            raise StoreError(f"conversion probe unexpectedly transferred: {list(out)[:4]}")
        return elapsed

    @staticmethod
    def _result(op: _Op, codes: Sequence[int], n: int) -> BatchResult:
        if len(codes) != n:
            raise StoreError(f"Mooncake returned {len(codes)} results for {n} keys")
        return BatchResult._build(op, codes)
