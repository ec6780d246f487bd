"""The native-client transport for vLLM's Mooncake store worker, the plugin's default (docs/vllm-plugin.md).

:class:`NativeMooncakeStore` wraps vLLM's ``MooncakeDistributedStore`` so that its multi-buffer, existence and
contiguous calls reach Mooncake's C++ client with the GIL released (our converters instead of Mooncake's
binding), behind the registered-range guard and a call gate that refuses calls after ``close()``; anything
the native client cannot take goes to the bound method. ``MOONCAKE_KVADDR_VLLM_NATIVE_CLIENT=0`` turns it off.
"""

from __future__ import annotations

import abc
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake_kvaddr.driver.gate import CallGate
from mooncake_kvaddr.driver.store_calls import Clients, bound_args
from mooncake_kvaddr.driver.store_calls import bound_rows as bound_rows
from mooncake_kvaddr.integrations.vllm.guard import (
    REGISTRATION_METHODS,
    RangeTable,
    StoreGuard,
    guarded_names,
    takes_pointers,
)
from mooncake_kvaddr.integrations.vllm.plans import ArrayStore
from mooncake_kvaddr.integrations.vllm.plans import ragged_calls as ragged_calls

__all__ = [
    "CLOSE_TIMEOUT_S",
    "CallGate",
    "NativeMooncakeStore",
    "NativeStats",
    "StoreWrapper",
    "guarded_method",
    "registration_ok",
    "warn_failed_registration",
]

#: How long a store wrapper's ``close()`` waits for the calls in flight before it raises ``StoreError``.
CLOSE_TIMEOUT_S = 60.0

logger = logging.getLogger("vllm.mooncake_kvaddr")


def registration_ok(result: Any) -> bool:
    """True when Mooncake's ``register_buffer`` answered 0 (success)."""
    return isinstance(result, (int, np.integer)) and not isinstance(result, bool) and int(result) == 0


def warn_failed_registration(logged: set[tuple[Any, Any]], buffer_ptr: Any, size: Any, result: Any) -> None:
    """One warning per buffer Mooncake refused to register: vLLM only logs the failure (on its non-grouped
    path) and carries on, and the registered-range guard then answers -600 for every key with a slice in that
    buffer (docs/vllm-plugin.md, "Registered-range guard"); the warning says why those keys fail."""
    key = (buffer_ptr, size)
    if key in logged:
        return
    logged.add(key)
    where = f"{buffer_ptr:#x}" if isinstance(buffer_ptr, int) else repr(buffer_ptr)
    logger.warning(
        "mooncake_kvaddr: Mooncake's register_buffer(%s, %s) answered %r: the registered-range guard refuses "
        "every key with a slice in that buffer (-600, not sent to Mooncake)",
        where,
        size,
        result,
    )


_UNSET = object()


@dataclass
class NativeStats:
    """Counters of a :class:`NativeMooncakeStore`: calls sent to the native client, calls passed through."""

    native_calls: int = 0
    fallback_calls: int = 0


class StoreWrapper(ArrayStore):
    """What both of our store wrappers are: the wrapped Mooncake store behind one call gate (nothing after
    ``close()``) and the registered-range guard (raw pointers checked against the buffers registered through
    the wrapper); an :class:`ArrayStore`, whose ragged entries make one array call per row width."""

    def __init__(self, store: Any, *, armed: bool) -> None:
        name = type(self).__name__
        self._store = store
        self._lock = threading.Lock()
        self.ranges = RangeTable(armed=armed)
        self.guard = StoreGuard(name, self.ranges)
        self._gate = CallGate(name)
        self._failed_registrations: set[tuple[Any, Any]] = set()

    @property
    def wrapped(self) -> Any:
        """The Mooncake store this wraps."""
        return self._store

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._store, name)
        if not callable(value):
            return value
        # Every method of the wrapped store is a Mooncake call too: admitted only before close(), and its raw
        # pointers checked against the registered buffers.
        return self._gate.gated(guarded_method(self.guard, name, value))

    def register_buffer(self, buffer_ptr: int, size: int) -> Any:
        """Mooncake's ``register_buffer``; a buffer it accepts (0) becomes a range the guard (and staging) lets
        through; one it refuses gets one warning (its keys will be refused with -600)."""
        with self._gate.admitted():
            result = self._store.register_buffer(buffer_ptr, size)
            if registration_ok(result):
                self.ranges.add(buffer_ptr, size)
            elif not isinstance(self._store, StoreWrapper):  # stacked: the inner wrapper warned already
                warn_failed_registration(self._failed_registrations, buffer_ptr, size, result)
            return int(result) if isinstance(result, np.integer) else result

    def unregister_buffer(self, buffer_ptr: int) -> Any:
        """Mooncake's ``unregister_buffer``; the range is dropped from the guard first, whatever Mooncake says."""
        with self._gate.admitted():
            self.ranges.remove(buffer_ptr)
            return self._store.unregister_buffer(buffer_ptr)

    def close(self, *args: Any, **kwargs: Any) -> Any:
        """Refuse new calls, wait for those in flight, release what the wrapper holds, then close the wrapped
        store (once: a later ``close`` returns 0 without calling Mooncake)."""
        if not self._gate.close(CLOSE_TIMEOUT_S):
            return 0
        self._release()
        return self._store.close(*args, **kwargs)

    def batch_get_into_multi_buffers(
        self, keys: Any, all_buffer_ptrs: Any, all_sizes: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Mooncake's ``batch_get_into_multi_buffers`` through the wrapper's transport (same results)."""
        return self._call("batch_get_into_multi_buffers", keys, all_buffer_ptrs, all_sizes, *args, **kwargs)

    def batch_put_from_multi_buffers(
        self, keys: Any, all_buffer_ptrs: Any, all_sizes: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Mooncake's ``batch_put_from_multi_buffers`` through the wrapper's transport (``ReplicateConfig`` passed
        through)."""
        return self._call("batch_put_from_multi_buffers", keys, all_buffer_ptrs, all_sizes, *args, **kwargs)

    @abc.abstractmethod
    def _call(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Mooncake's ``name(*args, **kwargs)`` through the wrapper's transport, behind the gate and the guard."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Release what the wrapper holds beside the store (called once, by :meth:`close`, when idle)."""

    @abc.abstractmethod
    def batch_put_from_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any, config: Any) -> Any:
        """Mooncake's multi-buffer put with (keys x regions) int64 matrices."""


class NativeMooncakeStore(StoreWrapper):
    """A Mooncake store whose batch calls go to the native client when it can (see the module docstring)."""

    def __init__(self, store: Any, *, armed: bool = False) -> None:
        super().__init__(store, armed=armed)
        self._client: Any = _UNSET  # _UNSET: not probed yet; None: unavailable
        self._logged: set[str] = set()
        self.stats = NativeStats()

    @property
    def native_client(self) -> Any:
        """The :class:`NativeClient` in use, or None when calls go to the bound methods."""
        return self._native()

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("mooncake_kvaddr: native-client transport: %s; using Mooncake's bound methods", reason)

    def _native(self) -> Any:
        client = self._client
        if client is _UNSET:
            with self._lock:
                if self._client is _UNSET:
                    from mooncake_kvaddr.driver.native_client import NativeClient

                    self._client = NativeClient.from_store(self._store)
                    if self._client is None:
                        self._log_once("no native client for this store (reason logged by native_client)")
                client = self._client
        return client

    def _send(
        self, name: str, args: tuple[Any, ...], what: str, *, guarded: bool = False, fallback: bool = True
    ) -> tuple[bool, Any]:
        """Mooncake's ``name(*args)`` through the one native-or-bound choice (:class:`Clients`), counted; a refused
        argument form is logged once per reason as ``what``. ``guarded``: the guard's ranges go with the call (the
        native client checks every slice itself, in C++, and answers -600 for the keys it refused). Without
        ``fallback``: ``(False, None)`` when there is no native client or it refuses the arguments."""
        client = self._native()
        done, result = Clients(self._store, client).send(
            name,
            args,
            ranges=self.ranges.ranges.pairs if guarded and client is not None else None,
            refused=lambda exc: self._log_once(f"{what} not accepted ({type(exc).__name__}: {exc})"),
            fallback=fallback,
        )
        if done:
            self.stats.native_calls += 1
            if guarded:
                self.guard.note_refused(client.last_refused(), name)
        elif fallback:
            self.stats.fallback_calls += 1
        return done, result

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self._gate.admitted():
            if name == "batch_is_exist":
                return self._call_admitted(name, *args, **kwargs)
            if self.ranges.armed and not kwargs and len(args) <= 4:
                # The native client checks the slices itself (C++, no second conversion of the rows).
                done, result = self._send(name, args, f"{name} arguments", guarded=True, fallback=False)
                if done:
                    return result
            return self.guard.call(
                name,
                lambda *a, **k: self._call_admitted(name, *a, **k),
                args,
                kwargs,
                arrays_ok=not kwargs and self._native() is not None,
            )

    def _call_admitted(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:
            return self._send(name, args, f"{name} arguments")[1]
        self._log_once(f"{name} called with keyword arguments {sorted(kwargs)}")
        self.stats.fallback_calls += 1
        # Rows the guard handed on as int64 matrices: Mooncake's binding takes lists.
        return getattr(self._store, name)(*bound_args(args), **kwargs)

    # --- the replaced calls ---------------------------------------------------------------------------------

    def batch_get_into_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any) -> Any:
        """``batch_get_into_multi_buffers`` with the rows as two (keys x regions) int64 matrices (the receive
        handler's entry, docs/vllm-plugin.md): the native client reads them without building a Python row;
        without a native client (or when it refuses them) Mooncake's bound method gets the rows as lists."""
        return self._arrays("batch_get_into_multi_buffers", "batch_get_into_multi_buffers_arrays", keys, addrs, sizes)

    def _arrays(self, name: str, refused_as: str, keys: list[str], addrs: Any, sizes: Any, *config: Any) -> Any:
        """Mooncake's ``name`` (a put's one ``config`` after the rows) with int64 matrices for rows; the guard counts
        the keys it refuses as ``refused_as``."""
        what = f"{name} arrays"
        with self._gate.admitted():
            if self.ranges.armed:
                # The native client checks the matrices itself, GIL released (docs/vllm-plugin.md).
                done, result = self._send(name, (keys, addrs, sizes, *config), what, guarded=True, fallback=False)
                if done:
                    return result
            return self.guard.call_arrays(
                keys, addrs, sizes, lambda *call: self._send(name, call, what)[1], refused_as, config=config
            )

    def batch_put_from_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any, config: Any) -> Any:
        """``batch_put_from_multi_buffers(keys, addrs, sizes, config)`` with the rows as two (keys x regions) int64
        matrices (the send handler's entry, docs/vllm-plugin.md); as :meth:`batch_get_into_multi_buffers_arrays`."""
        name = "batch_put_from_multi_buffers"
        return self._arrays(name, name, keys, addrs, sizes, config)

    def batch_get_into(self, *args: Any, **kwargs: Any) -> Any:
        """Mooncake's ``batch_get_into(keys, buffer_ptrs, sizes)`` through the native client."""
        return self._call("batch_get_into", *args, **kwargs)

    def batch_put_from(self, *args: Any, **kwargs: Any) -> Any:
        """Mooncake's ``batch_put_from(keys, buffer_ptrs, sizes[, config])`` (``ReplicateConfig`` passed
        through)."""
        return self._call("batch_put_from", *args, **kwargs)

    def batch_is_exist(self, keys: Any) -> Any:
        """Mooncake's ``batch_is_exist`` through the native client."""
        return self._call("batch_is_exist", keys)

    def _release(self) -> None:
        """Drop the native client (the wrapped store closes after it)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None and client is not _UNSET:
            client.close()

    def __repr__(self) -> str:
        return f"NativeMooncakeStore({self._store!r})"


_GUARDED = guarded_names()


#: Unknown raw-pointer methods already warned about (one warning per method name and process).
_WARNED_UNKNOWN: set[str] = set()


def guarded_method(guard: StoreGuard, name: str, value: Callable[..., Any]) -> Callable[..., Any]:
    """``value`` (the wrapped store's method ``name``) behind ``guard``: a raw-pointer method the guard checks
    goes through :meth:`StoreGuard.call`; one it does not know (a newer Mooncake's) passes through unchecked,
    as it does with vLLM alone, with one warning per method; every other method is returned as is."""
    if name in _GUARDED:

        @functools.wraps(value)
        def checked(*args: Any, **kwargs: Any) -> Any:
            return guard.call(name, value, args, kwargs)

        return checked
    if name not in REGISTRATION_METHODS and takes_pointers(value):

        @functools.wraps(value)
        def unknown(*args: Any, **kwargs: Any) -> Any:
            if guard.table.armed and name not in _WARNED_UNKNOWN:
                _WARNED_UNKNOWN.add(name)
                logger.warning(
                    "mooncake_kvaddr: Mooncake's %s takes raw pointers the registered-range guard does not know; "
                    "its calls pass unchecked, as without the plugin (docs/vllm-plugin.md, 'Registered-range "
                    "guard')", name,
                )  # fmt: skip
            return value(*args, **kwargs)

        return unknown
    return value
