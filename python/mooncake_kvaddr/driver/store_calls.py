"""The calls of :class:`~mooncake_kvaddr.driver.store.MooncakeStore` that reach Mooncake (:class:`StoreCalls`).

The driver's call layer in one module: admission to the client, argument checks, the native-or-bound choice,
sub-batches of the region budget and request deadlines. ``MooncakeStore`` adds set-up and close.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numpy as np

from mooncake_kvaddr.driver import per_key
from mooncake_kvaddr.driver.errors import StoreClosedError, StoreError
from mooncake_kvaddr.driver.outcomes import (
    CODE_MASTER_UNREACHABLE,
    CODE_TRANSFER_FAILED,
    BatchResult,
    Health,
    Outcome,
    _Op,
)
from mooncake_kvaddr.driver.store_args import (
    _check_address,
    _check_flat,
    _check_keys,
    _check_rows,
    _plan,
    _unique_spans,
)

if TYPE_CHECKING:
    from mooncake_kvaddr.driver.config import StoreConfig
    from mooncake_kvaddr.driver.gate import CallGate
    from mooncake_kvaddr.driver.native_client import NativeClient

logger = logging.getLogger("mooncake_kvaddr.driver.store")  # the store's own logger: its records kept their name

#: Mooncake fails a transfer call only after a fixed 60 s when a peer holding the data hangs while the master
#: still counts it alive (docs/multihost.md). A sub-batch that fails ``TRANSFER_FAILED`` after at least this
#: many seconds is taken to have waited out that timeout: every further call of the request would wait it out
#: too, so none is made (docs/transfer-modes.md, "Deadlines"). Below 60 s to absorb timer slack; far above
#: any healthy call (a whole headline request over TCP; docs/transfer-modes.md, "Deadlines").
HUNG_CALL_THRESHOLD_S: Final = 55.0


def _now() -> float:
    """The clock of deadlines and call durations (``time.monotonic``; a seam for tests)."""
    return time.monotonic()


class RequestDeadline:
    """The time limit of one request, shared by every Mooncake call the request makes.

    A request (one store batch call, or one ``KVTransfer`` load or store with all its sub-batches and
    staged batches) creates one with :meth:`MooncakeStore.deadline` and passes it to each call. It is
    :meth:`expired` once ``timeout_s`` has passed since it was created, or once :meth:`stop` was called
    (the store does so when a sub-batch failed on Mooncake's transfer timeout, see
    :data:`HUNG_CALL_THRESHOLD_S`); then the request's remaining keys fail ``TRANSFER_FAILED`` without
    reaching Mooncake, and :attr:`reason` says why. A call already in flight is never interrupted.

    One request runs in one thread: the object is not locked.
    """

    def __init__(self, timeout_s: float | None) -> None:
        """``timeout_s`` seconds from now (``None``: no time limit; :meth:`stop` still ends the request)."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 or None, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.expires_at = None if timeout_s is None else _now() + timeout_s
        #: Why the request must not make another call (``None`` while it may).
        self.reason: str | None = None

    def expired(self) -> bool:
        """Whether the request must stop: its time is up, or :meth:`stop` was called."""
        if self.reason is None and self.expires_at is not None and _now() >= self.expires_at:
            self.reason = f"the request deadline of {self.timeout_s:g} s passed"
        return self.reason is not None

    def remaining(self) -> float | None:
        """Seconds left (0 once expired; ``None`` without a time limit)."""
        if self.expired():
            return 0.0
        return None if self.expires_at is None else max(0.0, self.expires_at - _now())

    def stop(self, reason: str) -> None:
        """End the request now: later checks report it expired with ``reason`` (the first reason stays)."""
        if self.reason is None:
            self.reason = reason

    def __repr__(self) -> str:
        return f"RequestDeadline(timeout_s={self.timeout_s}, reason={self.reason!r})"


#: What the native client raises when it refuses an argument form, before Mooncake is called.
REFUSED: Final = (TypeError, ValueError, OverflowError)


class Clients(NamedTuple):
    """Mooncake's own store object (``bound``) and our native client for it (``native``; ``None``: none): the
    one place a Mooncake call chooses between the two, for the driver's store and the vLLM store wrappers."""

    bound: Any
    native: NativeClient | None

    def call(self, name: str, *args: Any) -> Any:
        """``name(*args)``: through the native client when there is one (a refused argument form is raised:
        the driver's arguments were checked before), else through the bound method."""
        return self.send(name, args)[1]

    def send(
        self,
        name: str,
        args: tuple[Any, ...],
        *,
        ranges: Any = None,
        refused: Callable[[Exception], None] | None = None,
        fallback: bool = True,
    ) -> tuple[bool, Any]:
        """``(True, result)`` of the native client's ``name(*args)``, else ``(False, result)`` of the bound
        method, which gets int64 matrices as rows (:func:`bound_args`; ``(False, None)`` without ``fallback``).
        ``ranges``: the registered buffers the native client checks every slice against (a key with a slice
        outside is answered -600, not sent). When the native client refuses the arguments, ``refused(exc)`` is
        told and the bound method is tried; without ``refused`` the refusal is raised."""
        native = self.native
        if native is not None:
            method = getattr(native, name)
            try:
                return True, (method(*args) if ranges is None else method(*args, ranges=ranges))
            except REFUSED as exc:
                if refused is None:
                    raise
                refused(exc)
        if not fallback:
            return False, None
        return False, getattr(self.bound, name)(*bound_args(args))


def bound_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` as Mooncake's binding takes them: a call's (keys x regions) matrices as rows
    (:func:`bound_rows`), any other array as a list."""
    if len(args) >= 3 and isinstance(args[1], np.ndarray) and isinstance(args[2], np.ndarray) and args[1].ndim == 2:
        addrs, sizes = bound_rows(args[1], args[2])
        return (args[0], addrs, sizes, *bound_args(args[3:]))
    return tuple(a.tolist() if isinstance(a, np.ndarray) else a for a in args)


def bound_rows(addrs: Any, sizes: Any) -> tuple[list[Any], list[Any]]:
    """(keys x regions) matrices as the lists of rows Mooncake's bound method takes, built with the least GIL
    time (docs/vllm-plugin.md, "Native-client transport"): one new int per address cell (``tolist``), but when
    every size row is the same row (one block length per region: every rank-local layout) a single list of
    sizes stands for every row. Mooncake's binding only reads the rows (it copies them into its own vectors),
    and the lists never leave the call."""
    a, s = np.asarray(addrs), np.asarray(sizes)
    if s.ndim == 2 and s.dtype == np.int64 and s.shape[0] > 0 and bool((s == s[0]).all()):
        row: list[Any] = s[0].tolist()
        return a.tolist(), [row] * s.shape[0]
    return a.tolist(), s.tolist()


class StoreCalls:
    """The batch, buffer and health calls of :class:`~mooncake_kvaddr.driver.store.MooncakeStore`.

    Not used alone: :class:`~mooncake_kvaddr.driver.store.MooncakeStore` provides the attributes declared
    below (its configuration, call gate and clients, set by its ``setup()`` and ``close()``).
    """

    _config: StoreConfig
    _gate: CallGate
    _client: Any
    _native: NativeClient | None
    _replicate_default: Callable[[], Any]

    def _bound(self, name: str, *args: Any) -> Any:
        """Mooncake's bound ``name(*args)`` in an in-flight slot: the client cannot be closed until it returns."""
        with self._gate.admitted():
            return getattr(self._client, name)(*args)

    # ------------------------------------------------------------------ internals

    def deadline(self) -> RequestDeadline:
        """A new request deadline of ``config.request_timeout_s`` from now (see :class:`RequestDeadline`)."""
        return RequestDeadline(self._config.request_timeout_s)

    # ------------------------------------------------------------------ batch calls

    def batch_is_exist(self, keys: Sequence[str] | Sequence[bytes]) -> BatchResult:
        """Which keys exist (``present``); absent keys are ``NOT_FOUND``. Grants each object a read lease."""
        return self._batch(_Op.EXIST, _check_keys(keys), lambda clients: clients.call("batch_is_exist", keys))

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
        return self._transfer("batch_put_from_multi_buffers", keys, addrs, sizes, counts, deadline, (replicate_config,))

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
        return self._transfer("batch_get_into_multi_buffers", keys, addrs, sizes, counts, deadline)

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
        return self._transfer("batch_put_from", keys, ptrs, sizes, [1] * n, deadline, (replicate_config,))

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
        return self._transfer("batch_get_into", keys, ptrs, sizes, [1] * n, deadline)

    def _transfer(
        self,
        name: str,
        keys: Sequence[str] | Sequence[bytes],
        addrs: Any,
        sizes: Any,
        counts: Sequence[int],
        deadline: RequestDeadline | None,
        put: tuple[Any] | None = None,
    ) -> BatchResult:
        """The batch call ``name`` of checked arguments (``counts``: the regions of each key): Mooncake is called
        once per sub-batch of the region budget; the codes of every key, in key order.

        ``put``: a put's ``(replicate_config,)``, ``None`` (the store's default) replaced once admitted; each
        sub-batch gets it, after the rows, with its per-key fields cut to the sub-batch's keys
        (:func:`~mooncake_kvaddr.driver.per_key.config_for`). Without ``put`` a get, whose sub-batches never name
        one key twice (see :func:`_unique_spans`).

        Before each sub-batch: past the request's deadline (or after a hung call of the same request), the
        remaining keys get ``TRANSFER_FAILED`` and Mooncake is not called again. After one: a
        ``MASTER_UNREACHABLE`` fails the rest the same way, and so does a ``TRANSFER_FAILED`` that took
        :data:`HUNG_CALL_THRESHOLD_S` or more (it waited out Mooncake's transfer timeout; the next call would
        too), which also stops the request's later calls.
        """

        def call(clients: Clients) -> list[int]:
            config = () if put is None else (put[0] if put[0] is not None else self._replicate_default(),)
            send = partial(clients.call, name)
            n = len(counts)
            request = self.deadline() if deadline is None else deadline
            spans = _plan(counts, self._config.region_budget)
            if put is None:
                spans = _unique_spans(keys, spans)
            codes: list[int] = []
            for start, end in spans:
                if request.expired():
                    codes.extend([CODE_TRANSFER_FAILED] * (n - start))
                    logger.warning("%d of %d key(s) not attempted: %s", n - start, n, request.reason)
                    break
                t0 = _now()
                if len(spans) == 1:
                    args = (keys, addrs, sizes, *config)  # no slicing: the arguments as given (the span is (0, n))
                else:
                    own = per_key.configs_for(config, range(start, end), n)
                    args = (keys[start:end], addrs[start:end], sizes[start:end], *own)
                try:
                    part = send(*args)
                except TypeError as exc:
                    # pybind11 rejected an element (float, numpy float, > 2**64, ...) while converting.
                    note = f" (keys {start}..{end - 1}; earlier keys were already processed)" if start else ""
                    raise TypeError(f"Mooncake rejected the arguments{note}: {exc}") from exc
                per_key.check_count(part, end - start, error=StoreError)
                elapsed = _now() - t0
                codes.extend(part)
                if end < n and CODE_MASTER_UNREACHABLE in part:
                    # Each further sub-batch would block only to report the same; fail the rest now.
                    codes.extend([CODE_MASTER_UNREACHABLE] * (n - end))
                    break
                if elapsed >= HUNG_CALL_THRESHOLD_S and CODE_TRANSFER_FAILED in part:
                    request.stop(
                        f"a Mooncake call failed transfer_failed after {elapsed:.0f} s, its transfer timeout: a "
                        "peer holding the data hangs (no further call would do better)"
                    )  # the next sub-batch, if any, finds the request stopped: the rest fail unattempted
            return codes

        return self._batch(_Op.GET if put is None else _Op.PUT, len(counts), call)

    def _batch(self, op: _Op, n: int, call: Callable[[Clients], Sequence[int]]) -> BatchResult:
        """``call(clients)`` once admitted, for a batch of ``n`` checked keys (none: no call, an empty result),
        its codes read as ``op``'s (one per key, else :class:`StoreError`)."""
        if n == 0:
            return BatchResult((), ())
        with self._gate.admitted():  # both clients: batch calls go native when they can
            codes = call(Clients(self._client, self._native))
        per_key.check_count(codes, n, error=StoreError)
        return BatchResult._build(op, codes)

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
        with self._gate.admitted():
            query = getattr(self._client, "batch_get_replica_desc", None)
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
        return self._batch(_Op.REMOVE, _check_keys(keys), lambda clients: clients.bound.batch_remove(keys, force))

    def remove_all(self, force: bool = False) -> int:
        """Remove every object; returns how many. Leased objects are skipped unless ``force``."""
        removed: int = self._bound("remove_all", force)
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
        rc: int = self._bound("register_buffer", ptr, size)
        if rc != 0:
            raise StoreError(
                f"register_buffer(0x{ptr:x}, {size}) failed with code {rc}: overlaps an already registered range?",
                rc,
            )

    def unregister_buffer(self, ptr: int) -> None:
        """Unregister a buffer by its start address; :class:`StoreError` if it was not registered."""
        _check_address("ptr", ptr)
        rc: int = self._bound("unregister_buffer", ptr)
        if rc != 0:
            raise StoreError(f"unregister_buffer(0x{ptr:x}) failed with code {rc}: not a registered start address", rc)

    def health_check(self) -> Health:
        """``OK``, ``NOT_READY`` (not set up / closed; Mooncake is not called) or ``MASTER_UNREACHABLE``."""
        try:
            return Health(self._bound("health_check"))
        except StoreClosedError:
            return Health.NOT_READY
