"""Opt-in staged transport for host-memory KV caches (docs/vllm-plugin.md, "Staged transport").

:class:`StagedMooncakeStore` moves each key of vLLM's multi-buffer calls through one contiguous staging slot
(native gather/scatter, one ``batch_put_from``/``batch_get_into``), which pays when the bytes cross the
network; the objects are byte-identical to multi-buffer ones. Guarded and gated like the native transport.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver import per_key
from mooncake_kvaddr.driver.staging import (
    StagingLease,
    StagingPool,
    gather,
    plan_slots,
    run_staged,
    scatter,
)
from mooncake_kvaddr.driver.store_calls import bound_rows
from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore, StoreWrapper

__all__ = ["StagedMooncakeStore", "StagedStats"]

logger = logging.getLogger("vllm.mooncake_kvaddr")

Int64Array = npt.NDArray[np.int64]


@dataclass
class StagedStats:
    """Counters of a :class:`StagedMooncakeStore` (calls staged, calls passed through, staged gets that read
    fewer bytes than the object (answered -800), calls passed through because no staging span came free in
    time)."""

    staged_gets: int = 0
    staged_puts: int = 0
    passthrough_gets: int = 0
    passthrough_puts: int = 0
    short_reads: int = 0
    lease_timeouts: int = 0

    @property
    def refetched_keys(self) -> int:
        """Deprecated name of :attr:`short_reads` (short keys are no longer fetched a second time)."""
        return self.short_reads


class StagedMooncakeStore(StoreWrapper):
    """A Mooncake store whose multi-buffer calls stage host-memory KV caches (see the module docstring).

    ``store`` is the wrapped ``MooncakeDistributedStore`` (or anything with its methods); ``staging_bytes`` the
    staging buffer, shared by the threads using this store (each call leases one span, waiting at most
    ``staging_wait_s`` seconds while none is free, then passing the call through to Mooncake's own
    multi-buffer method: never an endless wait); ``copy_threads`` native copy threads per gather/scatter
    (0: by job size).
    """

    def __init__(
        self,
        store: Any,
        *,
        staging_bytes: int = 256 << 20,
        copy_threads: int = 0,
        armed: bool = False,
        staging_wait_s: float = 10.0,
    ) -> None:
        if copy_threads < 0:
            raise ValueError(f"copy_threads must be >= 0, got {copy_threads}")
        if not staging_wait_s >= 0:  # also refuses NaN
            raise ValueError(f"staging_wait_s must be >= 0, got {staging_wait_s}")
        super().__init__(store, armed=armed)
        self._staging_wait_s = float(staging_wait_s)
        self._pool = StagingPool(staging_bytes)
        self._copy_threads = copy_threads
        self._pool_registered: bool | None = None  # None: not tried yet; False: Mooncake refused it
        self.stats = StagedStats()

    def _release(self) -> None:
        """Unregister the staging buffer when it was registered (the wrapped store closes after it)."""
        with self._lock:
            registered, self._pool_registered = self._pool_registered, False
        if registered:
            try:
                self._store.unregister_buffer(self._pool.range[0])
            except Exception as exc:  # closing must go on
                logger.debug("mooncake_kvaddr: staging buffer unregister failed: %s", exc)

    # --- staging ------------------------------------------------------------------------------------------

    def _ensure_pool_registered(self) -> bool:
        with self._lock:
            if self._pool_registered is None:
                ptr, nbytes = self._pool.range
                result = self._store.register_buffer(ptr, nbytes)
                self._pool_registered = result == 0
                if result != 0:
                    logger.warning(
                        "mooncake_kvaddr: Mooncake refused the staging buffer (%s): staged transport off", result
                    )
            return bool(self._pool_registered)

    @staticmethod
    def _keys_stageable(keys: Any) -> bool:
        """A non-empty list of distinct strings (anything else goes to Mooncake unchanged)."""
        if not isinstance(keys, list) or not keys or not all(type(k) is str for k in keys):
            return False
        return len(set(keys)) == len(keys)

    def _plan(self, keys: Any, all_buffer_ptrs: Any, all_sizes: Any) -> KeyPlan | None:
        """The staging plan of a call, or None when the call must go to Mooncake unchanged."""
        if not self._keys_stageable(keys):
            return None
        try:
            addrs, sizes = _native.multi_buffer_arrays(all_buffer_ptrs, all_sizes)
        except (TypeError, ValueError, OverflowError):
            return None  # Mooncake raises (or answers) for these itself
        return self._plan_matrices(keys, addrs, sizes)

    def _plan_matrices(self, keys: list[str], addrs: Int64Array, sizes: Int64Array) -> KeyPlan | None:
        """The staging plan of a call whose rows are already int64 matrices (see :meth:`_plan`)."""
        if addrs.shape[0] != len(keys):
            return None
        ranges = self.ranges.ranges
        try:
            staged = KeyPlan(keys, addrs, sizes, None, slots=plan_slots(sizes))
        except (ValueError, OverflowError):
            return None
        object_sizes = staged.object_sizes
        if bool(np.any(object_sizes <= 0)) or int(object_sizes.max()) > self._pool.capacity:
            return None
        if not ranges.all_inside(addrs, sizes):
            return None
        if not self._ensure_pool_registered():
            return None
        return staged

    def _lease(self, staged: KeyPlan) -> StagingLease | None:
        """A staging span for the call, or None when none came free within ``staging_wait_s``."""
        largest = int(staged.object_sizes.max())
        try:
            return self._pool.acquire(largest, staged.total_bytes, timeout=self._staging_wait_s)
        except TimeoutError:
            self.stats.lease_timeouts += 1
            return None

    def batch_get_into_multi_buffers(
        self, keys: Any, all_buffer_ptrs: Any, all_sizes: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Mooncake's ``batch_get_into_multi_buffers``, staged for host KV caches (same results)."""
        with self._gate.admitted():
            return self.guard.call(
                "batch_get_into_multi_buffers", self._get_multi, (keys, all_buffer_ptrs, all_sizes, *args), kwargs
            )

    def _get_multi(self, keys: Any, all_buffer_ptrs: Any, all_sizes: Any, *args: Any, **kwargs: Any) -> Any:
        staged = None if (args or kwargs) else self._plan(keys, all_buffer_ptrs, all_sizes)
        if staged is None:
            self.stats.passthrough_gets += 1
            return self._store.batch_get_into_multi_buffers(keys, all_buffer_ptrs, all_sizes, *args, **kwargs)
        return self._staged_get(keys, staged, _list_rows(all_buffer_ptrs, all_sizes))

    def batch_get_into_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any) -> Any:
        """``batch_get_into_multi_buffers`` with the rows as two (keys x regions) int64 matrices (the receive
        handler's entry, docs/vllm-plugin.md): staged without building a Python row; a call staging does not
        take goes to the wrapped store's array entry when it is our native-client wrapper, else to its
        ``batch_get_into_multi_buffers`` with the rows as lists."""
        with self._gate.admitted():
            return self.guard.call_arrays(keys, addrs, sizes, self._get_multi_arrays)

    def _plan_arrays(self, keys: list[str], addrs: Any, sizes: Any) -> KeyPlan | None:
        """The staging plan of an ``..._arrays`` call (int64 matrices, distinct keys), or None."""
        if (
            isinstance(addrs, np.ndarray)
            and isinstance(sizes, np.ndarray)
            and addrs.dtype == np.int64
            and sizes.dtype == np.int64
            and addrs.ndim == 2
            and addrs.shape == sizes.shape
            and self._keys_stageable(keys)
        ):
            return self._plan_matrices(keys, np.ascontiguousarray(addrs), np.ascontiguousarray(sizes))
        return None

    def _get_multi_arrays(self, keys: list[str], addrs: Any, sizes: Any) -> Any:
        staged = self._plan_arrays(keys, addrs, sizes)
        if staged is None:
            self.stats.passthrough_gets += 1
            if isinstance(self._store, NativeMooncakeStore):  # our own type: never probe a foreign store
                return self._store.batch_get_into_multi_buffers_arrays(keys, addrs, sizes)
            rows = bound_rows(addrs, sizes)
            return self._store.batch_get_into_multi_buffers(keys, *rows)
        return self._staged_get(keys, staged, _matrix_rows(staged))

    def _staged_get(self, keys: list[str], staged: KeyPlan, rows_of: Any) -> list[int]:
        """Fetch ``keys`` through staging slots and scatter the ones read whole (:func:`run_staged`: a key whose
        object is shorter than its regions answers -800, as Mooncake's multi-buffer get does); ``rows_of(picks)``
        gives the rows of the keys at ``picks`` for Mooncake's own call when no staging span came free in time."""
        lease = self._lease(staged)
        if lease is None:
            self.stats.passthrough_gets += 1
            return list(self._store.batch_get_into_multi_buffers(keys, *rows_of(list(range(len(keys))))))
        self.stats.staged_gets += 1
        allowed = self.ranges.ranges.pairs  # the buffers registered now: the copy checks every slice again

        def get(start: int, end: int, ptrs: list[int], sizes: list[int]) -> Any:
            return self._store.batch_get_into(keys[start:end], ptrs, sizes)

        def put_back(start: int, end: int, slots: Any, whole: Any) -> bool:
            scatter(staged.addrs[start:end], staged.sizes[start:end], lease.range, slots, allowed,
                    select=whole, threads=self._copy_threads)  # fmt: skip
            return True

        try:
            run = run_staged(True, staged.slot_plan(), lease, get, put_back)
        finally:
            lease.release()
        self.stats.short_reads += run.short
        return [int(c) for c in run.codes.tolist()]

    def batch_put_from_multi_buffers(
        self, keys: Any, all_buffer_ptrs: Any, all_sizes: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Mooncake's ``batch_put_from_multi_buffers``, staged for host KV caches (same results)."""
        with self._gate.admitted():
            return self.guard.call(
                "batch_put_from_multi_buffers", self._put_multi, (keys, all_buffer_ptrs, all_sizes, *args), kwargs
            )

    def _put_multi(self, keys: Any, all_buffer_ptrs: Any, all_sizes: Any, *args: Any, **kwargs: Any) -> Any:
        config: tuple[Any, ...] = args
        if kwargs:
            if set(kwargs) != {"config"} or args:
                self.stats.passthrough_puts += 1
                return self._store.batch_put_from_multi_buffers(keys, all_buffer_ptrs, all_sizes, *args, **kwargs)
            config = (kwargs["config"],)
        staged = None if len(config) > 1 else self._plan(keys, all_buffer_ptrs, all_sizes)
        if staged is None:
            self.stats.passthrough_puts += 1
            return self._store.batch_put_from_multi_buffers(keys, all_buffer_ptrs, all_sizes, *args, **kwargs)
        return self._staged_put(keys, staged, config, _list_rows(all_buffer_ptrs, all_sizes))

    def batch_put_from_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any, config: Any) -> Any:
        """``batch_put_from_multi_buffers(keys, addrs, sizes, config)`` with the rows as two (keys x regions) int64
        matrices (the send handler's entry, docs/vllm-plugin.md): staged without building a Python row; a call
        staging does not take goes on as :meth:`batch_get_into_multi_buffers_arrays` describes."""
        with self._gate.admitted():
            return self.guard.call_arrays(
                keys, addrs, sizes, self._put_multi_arrays, "batch_put_from_multi_buffers", config=(config,)
            )

    def _put_multi_arrays(self, keys: list[str], addrs: Any, sizes: Any, config: Any) -> Any:
        staged = self._plan_arrays(keys, addrs, sizes)
        if staged is None:
            self.stats.passthrough_puts += 1
            if isinstance(self._store, NativeMooncakeStore):  # our own type: never probe a foreign store
                return self._store.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, config)
            rows = bound_rows(addrs, sizes)
            return self._store.batch_put_from_multi_buffers(keys, *rows, config)
        return self._staged_put(keys, staged, (config,), _matrix_rows(staged))

    def _staged_put(self, keys: list[str], staged: KeyPlan, config: tuple[Any, ...], rows_of: Any) -> list[int]:
        """Gather ``keys`` into staging slots and put them (:func:`run_staged`), each round with ``config`` cut
        to its keys (:func:`~mooncake_kvaddr.driver.per_key.config_for`); ``rows_of`` as for
        :meth:`_staged_get` (used when no staging span came free in time)."""
        lease = self._lease(staged)
        if lease is None:
            self.stats.passthrough_puts += 1
            rows = rows_of(list(range(len(keys))))
            return list(self._store.batch_put_from_multi_buffers(keys, *rows, *config))
        self.stats.staged_puts += 1
        allowed = self.ranges.ranges.pairs

        def fill(start: int, end: int, slots: Any, _select: Any) -> bool:
            gather(staged.addrs[start:end], staged.sizes[start:end], lease.range, slots, allowed,
                   threads=self._copy_threads)  # fmt: skip
            return True

        def put(start: int, end: int, ptrs: list[int], sizes: list[int]) -> Any:
            part = per_key.configs_for(config, range(start, end), len(keys))
            return self._store.batch_put_from(keys[start:end], ptrs, sizes, *part)

        try:
            run = run_staged(False, staged.slot_plan(), lease, put, fill)
        finally:
            lease.release()
        return [int(c) for c in run.codes.tolist()]

    def __repr__(self) -> str:
        return f"StagedMooncakeStore({self._store!r}, staging={self._pool.capacity} bytes)"


def _list_rows(all_buffer_ptrs: Any, all_sizes: Any) -> Any:
    """``rows_of`` over vLLM's row lists: the rows of the keys at ``picks``."""
    return lambda picks: ([all_buffer_ptrs[i] for i in picks], [all_sizes[i] for i in picks])


def _matrix_rows(staged: KeyPlan) -> Any:
    """``rows_of`` over a staging plan's int64 matrices, as lists for Mooncake's own call."""
    return lambda picks: bound_rows(staged.addrs[picks], staged.sizes[picks])
