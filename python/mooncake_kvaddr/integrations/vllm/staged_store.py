"""Opt-in staged transport for host-memory KV caches (docs/vllm-plugin.md, "Staged transport").

:class:`StagedMooncakeStore` moves each key of vLLM's multi-buffer calls through one contiguous staging slot
(native gather/scatter, one ``batch_put_from``/``batch_get_into``), which pays when the bytes cross the
network; the objects are byte-identical to multi-buffer ones. Guarded and gated like the native transport.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
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
from mooncake_kvaddr.integrations.vllm.guard import int64_matrices
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

    def _call(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Mooncake's multi-buffer get or put ``name`` (the inherited entries), staged for host KV caches (same
        results)."""
        with self._gate.admitted():
            return self.guard.call(name, partial(self._multi, name == "batch_get_into_multi_buffers"), args, kwargs)

    def batch_get_into_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any) -> Any:
        """``batch_get_into_multi_buffers`` with the rows as two (keys x regions) int64 matrices (the receive
        handler's entry, docs/vllm-plugin.md): staged without building a Python row; a call staging does not
        take goes to the wrapped store's array entry when it is our native-client wrapper, else to its
        ``batch_get_into_multi_buffers`` with the rows as lists."""
        with self._gate.admitted():
            return self.guard.call_arrays(keys, addrs, sizes, partial(self._multi_arrays, True))

    def batch_put_from_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any, config: Any) -> Any:
        """``batch_put_from_multi_buffers(keys, addrs, sizes, config)`` with the rows as two (keys x regions) int64
        matrices (the send handler's entry, docs/vllm-plugin.md): staged without building a Python row; a call
        staging does not take goes on as :meth:`batch_get_into_multi_buffers_arrays` describes."""
        with self._gate.admitted():
            return self.guard.call_arrays(
                keys, addrs, sizes, partial(self._multi_arrays, False), "batch_put_from_multi_buffers", config=(config,)
            )

    def _count(self, get: bool, staged: bool) -> None:
        name = f"{'staged' if staged else 'passthrough'}_{'gets' if get else 'puts'}"
        setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _mooncake(self, get: bool) -> Any:
        """The wrapped store's own multi-buffer get or put."""
        return self._store.batch_get_into_multi_buffers if get else self._store.batch_put_from_multi_buffers

    def _multi(self, get: bool, keys: Any, all_buffer_ptrs: Any, all_sizes: Any, *args: Any, **kwargs: Any) -> Any:
        """A multi-buffer get (``get``) or put as vLLM calls it (row lists), staged when it can be."""
        config = _stageable_config(get, args, kwargs)
        staged = None if config is None else self._plan(keys, all_buffer_ptrs, all_sizes)
        if config is None or staged is None:
            self._count(get, False)
            return self._mooncake(get)(keys, all_buffer_ptrs, all_sizes, *args, **kwargs)
        return self._staged(get, keys, staged, config, _list_rows(all_buffer_ptrs, all_sizes))

    def _multi_arrays(self, get: bool, keys: list[str], addrs: Any, sizes: Any, *config: Any) -> Any:
        """An ``..._arrays`` get or put (a put's one ``config``), staged when it can be (int64 matrices, distinct
        keys, and a staging plan: :meth:`_plan_matrices`)."""
        staged = None
        if int64_matrices(addrs, sizes) and self._keys_stageable(keys):
            staged = self._plan_matrices(keys, np.ascontiguousarray(addrs), np.ascontiguousarray(sizes))
        if staged is None:
            self._count(get, False)
            store = self._store
            if isinstance(store, NativeMooncakeStore):  # our own type: never probe a foreign store
                own = store.batch_get_into_multi_buffers_arrays if get else store.batch_put_from_multi_buffers_arrays
                return own(keys, addrs, sizes, *config)
            return self._mooncake(get)(keys, *bound_rows(addrs, sizes), *config)
        return self._staged(get, keys, staged, config, _matrix_rows(staged))

    def _staged(self, get: bool, keys: list[str], staged: KeyPlan, config: tuple[Any, ...], rows_of: Any) -> list[int]:
        """Move ``keys`` through staging slots (:func:`run_staged`). A get scatters the keys read whole (a key whose
        object is shorter than its regions answers -800, as Mooncake's multi-buffer get does); a put gathers
        first, each round with ``config`` cut to its keys (:func:`~mooncake_kvaddr.driver.per_key.config_for`).
        ``rows_of(picks)`` gives the rows of the keys at ``picks`` for Mooncake's own call when no staging span
        came free in time."""
        lease = self._lease(staged)
        if lease is None:
            self._count(get, False)
            return list(self._mooncake(get)(keys, *rows_of(list(range(len(keys)))), *config))
        self._count(get, True)
        allowed = self.ranges.ranges.pairs  # the buffers registered now: the copy checks every slice again

        def call(start: int, end: int, ptrs: list[int], sizes: list[int]) -> Any:
            if get:
                return self._store.batch_get_into(keys[start:end], ptrs, sizes)
            part = per_key.configs_for(config, range(start, end), len(keys))
            return self._store.batch_put_from(keys[start:end], ptrs, sizes, *part)

        def copy(start: int, end: int, slots: Any, whole: Any) -> bool:
            rows = (staged.addrs[start:end], staged.sizes[start:end], lease.range, slots, allowed)
            if get:
                scatter(*rows, select=whole, threads=self._copy_threads)
            else:
                gather(*rows, threads=self._copy_threads)
            return True

        try:
            run = run_staged(get, staged.slot_plan(), lease, call, copy)
        finally:
            lease.release()
        if get:
            self.stats.short_reads += run.short
        return [int(c) for c in run.codes.tolist()]

    def __repr__(self) -> str:
        return f"StagedMooncakeStore({self._store!r}, staging={self._pool.capacity} bytes)"


def _list_rows(all_buffer_ptrs: Any, all_sizes: Any) -> Any:
    """``rows_of`` over vLLM's row lists: the rows of the keys at ``picks``."""
    return lambda picks: ([all_buffer_ptrs[i] for i in picks], [all_sizes[i] for i in picks])


def _matrix_rows(staged: KeyPlan) -> Any:
    """``rows_of`` over a staging plan's int64 matrices, as lists for Mooncake's own call."""
    return lambda picks: bound_rows(staged.addrs[picks], staged.sizes[picks])


def _stageable_config(get: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The arguments after the rows that staging hands on (none for a get; a put's one ``config``, positional or
    by keyword), or None: the call goes to Mooncake unchanged."""
    if get:
        return None if args or kwargs else ()
    if kwargs:
        return (kwargs["config"],) if set(kwargs) == {"config"} and not args else None
    return args if len(args) <= 1 else None
