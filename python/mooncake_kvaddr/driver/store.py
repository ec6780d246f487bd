"""The safe client over Mooncake's ``MooncakeDistributedStore`` (:class:`MooncakeStore`).

Mooncake's binding dereferences a null client when it is called before ``setup()`` or after ``close()``
and kills the process with SIGSEGV; it indexes past the end of a size row that is shorter than its
pointer row; and over TCP it fails batches of more than ~1000 regions. This wrapper makes all of that a
Python exception or a non-event:

* a lock-guarded state machine (new -> ready -> closing -> closed): a call reaches Mooncake only while the
  store is ready, and ``close()`` waits (bounded) until no call is in flight;
* arguments are validated before Mooncake sees them;
* batches are split by a region budget, results re-concatenated in key order; once the master is found
  unreachable the remaining sub-batches are not attempted (each would block ~4 s to learn the same);
* every batch call belongs to a request with a deadline (:class:`RequestDeadline`): past it, or once a
  sub-batch failed on Mooncake's fixed 60 s transfer timeout (a hung peer), the remaining keys fail
  ``TRANSFER_FAILED`` without another call (``docs/transfer-modes.md``, "Deadlines");
* per-key result codes become :class:`Outcome` values inside a :class:`BatchResult` (defined in
  :mod:`mooncake_kvaddr.driver.outcomes`, re-exported here).

The module is longer than most because each binding call Mooncake offers needs its own guarded wrapper
(admission, validation, splitting); setup and close are described in ``docs/configuration.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType, TracebackType
from typing import Any, Final

import numpy as np

from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.errors import StoreClosedError, StoreError, StoreSetupError
from mooncake_kvaddr.driver.gate import CallGate, GateState
from mooncake_kvaddr.driver.master import EmbeddedMaster, mooncake_install_hint
from mooncake_kvaddr.driver.native_client import NativeClient
from mooncake_kvaddr.driver.outcomes import (
    CODE_HAS_LEASE,
    CODE_INVALID_PARAMS,
    CODE_MASTER_UNREACHABLE,
    CODE_NO_SPACE,
    CODE_NOT_FOUND,
    CODE_TRANSFER_FAILED,
    BatchResult,
    Health,
    Outcome,
    _Op,
)

__all__ = [
    "CODE_HAS_LEASE",
    "CODE_INVALID_PARAMS",
    "CODE_MASTER_UNREACHABLE",
    "CODE_NOT_FOUND",
    "CODE_NO_SPACE",
    "CODE_TRANSFER_FAILED",
    "HUNG_CALL_THRESHOLD_S",
    "BatchResult",
    "Health",
    "MooncakeStore",
    "Outcome",
    "RequestDeadline",
    "StoreClosedError",
    "StoreError",
    "StoreSetupError",
    "load_mooncake",
]

logger = logging.getLogger(__name__)

# Setup attempts with the embedded master (known to be ready): a failure is a local port clash, and a few
# attempts suffice; Mooncake's default (20 x ~4.4 s) would hide a dead master for 90 s.
_EMBEDDED_SETUP_RETRIES: Final = 3
# Where Mooncake picks its client port when it picks one itself (read, never written, by this package).
_CLIENT_PORT_RANGE_ENV: Final = ("MC_STORE_CLIENT_MIN_PORT", "MC_STORE_CLIENT_MAX_PORT")
_CLIENT_PORT_RANGE: Final = (12300, 14300)
_PAUSE_BETWEEN_ATTEMPTS_S: Final = 0.1

#: Mooncake fails a transfer call only after a fixed 60 s when a peer holding the data hangs while the master
#: still counts it alive (docs/multihost.md). A sub-batch that fails ``TRANSFER_FAILED`` after at least this
#: many seconds is taken to have waited out that timeout: every further call of the request would wait it out
#: too, so none is made (docs/transfer-modes.md, "Deadlines"). Below 60 s to absorb timer slack; far above
#: any healthy call (the slowest measured, a whole headline request over TCP, takes ~12 s).
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


def load_mooncake() -> ModuleType:
    """Import ``mooncake.store`` (lazily: Mooncake is an optional, detected dependency).

    Nothing process-wide is changed: Mooncake's client logs follow the environment (``MC_LOG_LEVEL``) the
    application set, or Mooncake's defaults. Raises ``ImportError`` naming the Mooncake variants when no
    ``mooncake`` package is installed, or saying why an installed one failed to load.
    """
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as exc:
        if importlib.util.find_spec("mooncake") is None:
            raise ImportError(f"mooncake_kvaddr's store driver needs Mooncake, which is not installed: "
                              f"{mooncake_install_hint()}") from exc
        raise ImportError(
            f"the installed Mooncake package failed to load mooncake.store ({exc}). A CUDA build on a machine "
            f"without CUDA fails like this (use mooncake-transfer-engine-non-cuda there); otherwise "
            f"{mooncake_install_hint()}"
        ) from exc


# ------------------------------------------------------------------------------------------- validation


def _check_keys(keys: Sequence[str] | Sequence[bytes]) -> int:
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys: expected a sequence of keys, got a single " + type(keys).__name__)
    try:
        return len(keys)
    except TypeError:
        raise TypeError(f"keys: expected a sequence (list/tuple) of str, got {type(keys).__name__}") from None


_INT64_MAX = (1 << 63) - 1


def _first_out_of_range(rows: Any) -> tuple[int, int]:
    """(row, column) of the first value outside ``[0, 2**63)``; only called once we know one exists."""
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if not 0 <= value <= _INT64_MAX:
                return i, j
    raise AssertionError("no value out of range")


def _why_out_of_range(value: Any) -> str:
    if value < 0:
        return f"is negative ({value}); must be >= 0"
    return f"is {value}, not below 2**63 (no address or size is that large)"


def _out_of_range(values: Any, flat: bool) -> bool:
    """Some value is negative or >= 2**63 (a uint64 array passes a ``min() >= 0`` check with any value)."""
    if isinstance(values, np.ndarray):
        return bool(values.size) and (int(values.min()) < 0 or int(values.max()) > _INT64_MAX)
    if flat:
        return bool(min(values) < 0 or max(values) > _INT64_MAX)
    # The builtins over each row: ~14 ns per int, no Python loop.
    return bool(min(map(min, values)) < 0 or max(map(max, values)) > _INT64_MAX)


def _check_rows(n: int, addrs: Any, sizes: Any, check_values: bool) -> list[int]:
    """Validate the per-key region rows; returns the region count of each key."""
    if len(addrs) != n or len(sizes) != n:
        raise ValueError(
            f"{n} keys but {len(addrs)} address rows and {len(sizes)} size rows: need one row of each per key"
        )
    if isinstance(addrs, np.ndarray) and isinstance(sizes, np.ndarray) and addrs.ndim == sizes.ndim == 2:
        if n and addrs.shape[1] != sizes.shape[1]:
            raise ValueError(
                f"key 0: {addrs.shape[1]} addresses but {sizes.shape[1]} sizes; rows must be the same length"
            )
        if n and addrs.shape[1] == 0:
            raise ValueError("key 0: no regions; every key needs at least one (address, size) region")
        counts = [addrs.shape[1]] * n  # every row of a matrix has the same length: no per-row loop
        pairs: Any = ()
    else:
        counts = [len(a) for a in addrs]
        pairs = zip(counts, sizes, strict=True)
    for i, (count, row) in enumerate(pairs):
        if count != len(row):
            # Mooncake's get indexes sizes[j] past the end when a size row is the shorter one.
            raise ValueError(f"key {i}: {count} addresses but {len(row)} sizes; rows must be the same length")
        if count == 0:
            raise ValueError(f"key {i}: no regions; every key needs at least one (address, size) region")
    if check_values and n:
        for name, rows in (("address", addrs), ("size", sizes)):
            if _out_of_range(rows, flat=False):
                i, j = _first_out_of_range(rows)
                raise ValueError(f"key {i}: {name} [{j}] {_why_out_of_range(rows[i][j])}")
    return counts


def _check_flat(n: int, ptrs: Any, sizes: Any, check_values: bool) -> None:
    if len(ptrs) != n or len(sizes) != n:
        raise ValueError(f"{n} keys but {len(ptrs)} pointers and {len(sizes)} sizes: need one of each per key")
    if check_values and n:
        for name, values in (("pointer", ptrs), ("size", sizes)):
            if _out_of_range(values, flat=True):
                i = next(k for k, v in enumerate(values) if not 0 <= v <= _INT64_MAX)
                raise ValueError(f"key {i}: {name} {_why_out_of_range(values[i])}")


def _plan(counts: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Split keys into [start, end) spans whose region counts sum to <= budget (a bigger key goes alone)."""
    n = len(counts)
    if sum(counts) <= budget:
        return [(0, n)]
    spans: list[tuple[int, int]] = []
    start = 0
    total = 0
    for i, count in enumerate(counts):
        if i > start and total + count > budget:
            spans.append((start, i))
            start, total = i, 0
        total += count
    spans.append((start, n))
    return spans


def _unique_spans(keys: Sequence[Any], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` split further so that no span names one key twice (order kept).

    Mooncake's batch gets read a key named twice in one call into only one of its destinations while
    reporting both read: the other keeps stale bytes (docs/transfer-modes.md, "Repeated keys").
    """
    if len(set(keys)) == len(keys):
        return spans
    out: list[tuple[int, int]] = []
    for start, end in spans:
        seen: set[Any] = set()
        first = start
        for i in range(start, end):
            if keys[i] in seen:
                out.append((first, i))
                first, seen = i, set()
            seen.add(keys[i])
        out.append((first, end))
    return out


# ------------------------------------------------------------------------------------------- the store


class MooncakeStore:
    """A Mooncake store client that cannot crash the process through misuse.

    ``MooncakeStore(config)`` checks and records the configuration (it must say where the master is:
    ``master_server_address``, or ``embedded_master=True``); :meth:`setup` (or ``with``) starts the
    embedded master if asked for and connects. Every method raises
    :class:`StoreClosedError` instead of reaching Mooncake before setup or after close. Batch methods
    return a :class:`BatchResult` (per-key outcomes) and raise only for invalid arguments.

    Thread-safe: any number of threads may issue calls concurrently (Mooncake releases the GIL during a
    transfer); :meth:`close` waits until they are done.
    """

    def __init__(self, config: StoreConfig | None = None, **overrides: Any) -> None:
        """``config`` (default: :meth:`StoreConfig.load`, i.e. ``$MOONCAKE_CONFIG_PATH`` or defaults),
        with any field overridden by keyword."""
        if config is None:
            config = StoreConfig.load(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        if not config.has_master:
            raise ValueError(
                "MooncakeStore: no master configured: set master_server_address='host:port' (a running "
                "mooncake_master; in a config file, the same key vLLM reads), or embedded_master=True to start "
                "a private master on 127.0.0.1 for tests and demos (docs/configuration.md)"
            )
        self._config = config
        self._gate = CallGate(
            "MooncakeStore", ready=False, not_ready="MooncakeStore is not set up: call setup() (or use 'with') first"
        )
        self._lifecycle = threading.Lock()  # serialises setup() and close()
        self._client: Any = None
        self._master: EmbeddedMaster | None = None
        self._module: ModuleType | None = None
        self._default_replicate: Any = None
        self._native: NativeClient | None = None

    # ------------------------------------------------------------------ properties

    @property
    def config(self) -> StoreConfig:
        """The (validated) configuration."""
        return self._config

    @property
    def state(self) -> str:
        """``"new"``, ``"ready"``, ``"closing"`` or ``"closed"``."""
        return self._gate.state.value

    @property
    def ready(self) -> bool:
        """True between a successful :meth:`setup` and :meth:`close`."""
        return self._gate.state is GateState.READY

    @property
    def native_client_active(self) -> bool:
        """True while batch transfers go through the native client (docs/native-client.md, "In the driver")."""
        return self._native is not None

    @property
    def master(self) -> EmbeddedMaster | None:
        """The embedded master this store started, if any."""
        return self._master

    @property
    def master_address(self) -> str | None:
        """``host:port`` of the master in use (``None`` before setup with an embedded master)."""
        if self._config.master_server_address is not None:
            return self._config.master_server_address
        return self._master.rpc_address if self._master is not None else None

    # ------------------------------------------------------------------ lifecycle

    def setup(self) -> MooncakeStore:
        """Start the embedded master if configured, connect the client, and return ``self``.

        No-op when already ready. Raises :class:`StoreSetupError` (after bounded retries) if the client
        cannot connect, :class:`StoreClosedError` after :meth:`close`, ``ImportError`` without Mooncake.
        """
        config = self._config
        with self._lifecycle:
            if self._gate.state is GateState.READY:
                return self
            if self._gate.state is not GateState.NEW:
                raise StoreClosedError(f"MooncakeStore is {self._gate.state.value}; create a new one")
            module = self._module or load_mooncake()
            self._module = module
            master: EmbeddedMaster | None = None
            try:
                if config.embedded_master:
                    master = EmbeddedMaster(
                        extra_args=config.master_args, start_timeout_s=config.master_start_timeout_s
                    ).start()
                    address = master.rpc_address
                else:
                    assert config.master_server_address is not None
                    address = config.master_server_address
                client = self._connect(module, address, master)
            except BaseException:
                if master is not None:
                    master.close(kill=True)
                raise
            native = self._open_native(client)
            self._client = client
            self._native = native
            self._master = master
            self._gate.open()  # published last: an admitted call sees the fields above
        return self

    def _open_native(self, client: Any) -> NativeClient | None:
        """The native client for ``client``, or ``None`` (config off, or unavailable: the reason is logged once)."""
        if not self._config.native_client:
            return None
        try:
            native = NativeClient.from_store(client)
        except Exception as exc:  # never let the fast path break setup: the bound methods always work
            logger.warning("native Mooncake client off: probe failed: %s", exc)
            return None
        if native is not None:
            logger.info("native Mooncake client on (%s)", native.library)
        return native

    def _connect(self, module: ModuleType, address: str, master: EmbeddedMaster | None) -> Any:
        config = self._config
        retries = config.setup_retries
        if retries is None and master is not None:
            retries = _EMBEDDED_SETUP_RETRIES
        if retries is None:
            # Mooncake's own policy: it picks the client port and retries as its environment says.
            hosts = [config.local_hostname]
        elif _has_port(config.local_hostname):
            hosts = [config.local_hostname]  # a pinned port does not get free by retrying
        else:
            # Our own attempts, each on a port picked here, so the retry count is this call's alone (the
            # process environment, shared by every thread, is never written).
            hosts = [f"{config.local_hostname}:{port}" for port in _client_ports(retries)]
        rc = -1
        for attempt, host in enumerate(hosts):
            if attempt:
                time.sleep(_PAUSE_BETWEEN_ATTEMPTS_S)
            client = module.MooncakeDistributedStore()
            rc = self._setup_once(client, host, address)
            if rc == 0:
                return client
            # A failed setup may leave a half-built client behind; close() on it is safe and frees it.
            client.close()
            logger.debug("Mooncake setup attempt %d/%d as %s failed with code %s", attempt + 1, len(hosts), host, rc)
            if master is not None and not master.alive:
                break
        detail = ""
        if master is not None:
            detail = f"; embedded master alive={master.alive}, log tail:\n{master.stderr_tail() or '<empty>'}"
        raise StoreSetupError(
            f"Mooncake client setup failed with code {rc} after {len(hosts)} attempt(s) (master {address}, "
            f"protocol {config.protocol}, local_hostname {config.local_hostname!r}, metadata "
            f"{config.metadata_server!r}): is the master running and reachable? Mooncake's log has details{detail}",
            code=rc,
        )

    def _setup_once(self, client: Any, host: str, address: str) -> int:
        config = self._config
        extra: dict[str, str] = {}
        if config.tenant_id != "default":
            extra["tenant_id"] = config.tenant_id  # older wheels lack the keyword; pass it only when needed
        rc: int = client.setup(
            host,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            address,
            **extra,
        )
        return rc

    def close(self) -> None:
        """Wait (up to ``config.close_timeout_s``) for calls in flight, close the client, stop the master.

        Idempotent. If calls are still running at the deadline, raises :class:`StoreError` and stays in
        ``"closing"`` (no new calls are admitted); call ``close()`` again later.
        """
        timeout = self._config.close_timeout_s
        if not self._lifecycle.acquire(timeout=timeout):
            raise StoreError(f"close(): setup()/close() in another thread did not finish within {timeout} s")
        try:
            if not self._gate.begin_close():
                return  # never set up, or closed already
            if not self._gate.wait_idle(timeout):
                raise StoreError(
                    f"close(): {self._gate.in_flight} call(s) still in flight after {timeout} s; "
                    "the store stays closing (no new calls); call close() again"
                )
            client, self._client = self._client, None
            master, self._master = self._master, None
            native, self._native = self._native, None
            try:
                if native is not None:
                    native.close()  # no call in flight; before Mooncake's client goes away
                rc = client.close()
                if rc != 0:
                    logger.warning("Mooncake client close() returned %s", rc)
            finally:
                self._gate.release()
                if master is not None:
                    # The client is gone and the master keeps objects in memory only: no need to wait
                    # ~0.9 s for its graceful shutdown (docs/configuration.md, "Close time").
                    master.close(kill=True)
        finally:
            self._lifecycle.release()

    def __enter__(self) -> MooncakeStore:
        return self.setup()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"master={self.master_address}, protocol={self._config.protocol}"
        return f"MooncakeStore(state={self.state}, {where})"

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[Any]:
        """Hold an in-flight slot: the client cannot be closed until the block exits."""
        with self._admitted_pair() as (client, _native):
            yield client

    @contextlib.contextmanager
    def _admitted_batch(self) -> Iterator[Any]:
        """Like :meth:`_admitted`, yielding whichever client serves batch transfers: native or bound."""
        with self._admitted_pair() as (client, native):
            yield native if native is not None else client

    @contextlib.contextmanager
    def _admitted_pair(self) -> Iterator[tuple[Any, NativeClient | None]]:
        with self._gate.admitted():
            yield self._client, self._native

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
        skips the non-negativity scan (~3 ms per 225,800 regions) for rows known to be valid. ``deadline``:
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

    # ------------------------------------------------------------------ internals

    def deadline(self) -> RequestDeadline:
        """A new request deadline of ``config.request_timeout_s`` from now (see :class:`RequestDeadline`)."""
        return RequestDeadline(self._config.request_timeout_s)

    def _replicate_default(self) -> Any:
        if self._default_replicate is None:
            assert self._module is not None
            self._default_replicate = self._module.ReplicateConfig()
        return self._default_replicate

    def _split_call(
        self,
        call: Callable[[Any, Any, Any], Sequence[int]],
        keys: Any,
        addrs: Any,
        sizes: Any,
        counts: Sequence[int],
        deadline: RequestDeadline | None,
        *,
        unique_keys: bool = False,
    ) -> list[int]:
        """Call Mooncake once per sub-batch of the region budget; the codes of every key, in key order.

        ``unique_keys`` (gets): a sub-batch never names one key twice (see :func:`_unique_spans`).

        Before each sub-batch: past the request's deadline (or after a hung call of the same request), the
        remaining keys get ``TRANSFER_FAILED`` and Mooncake is not called again. After one: a
        ``MASTER_UNREACHABLE`` fails the rest the same way, and so does a ``TRANSFER_FAILED`` that took
        :data:`HUNG_CALL_THRESHOLD_S` or more (it waited out Mooncake's transfer timeout; the next call would
        too), which also stops the request's later calls.
        """
        n = len(counts)
        if deadline is None:
            deadline = self.deadline()
        spans = _plan(counts, self._config.region_budget)
        if unique_keys:
            spans = _unique_spans(keys, spans)
        codes: list[int] = []
        for start, end in spans:
            if deadline.expired():
                codes.extend([CODE_TRANSFER_FAILED] * (n - start))
                logger.warning("%d of %d key(s) not attempted: %s", n - start, n, deadline.reason)
                break
            t0 = _now()
            if len(spans) == 1:
                part = self._invoke(call, keys, addrs, sizes, 0, n)  # no slicing: the arguments as given
            else:
                part = self._invoke(call, keys[start:end], addrs[start:end], sizes[start:end], start, end)
            elapsed = _now() - t0
            codes.extend(part)
            if end < n and CODE_MASTER_UNREACHABLE in part:
                # Each further sub-batch would block ~4 s only to report the same; fail the rest now.
                codes.extend([CODE_MASTER_UNREACHABLE] * (n - end))
                break
            if elapsed >= HUNG_CALL_THRESHOLD_S and CODE_TRANSFER_FAILED in part:
                deadline.stop(
                    f"a Mooncake call failed transfer_failed after {elapsed:.0f} s, its transfer timeout: a peer "
                    "holding the data hangs (no further call would do better)"
                )
                if end < n:
                    codes.extend([CODE_TRANSFER_FAILED] * (n - end))
                    logger.warning("%d of %d key(s) not attempted: %s", n - end, n, deadline.reason)
                break
        return codes

    @staticmethod
    def _invoke(
        call: Callable[[Any, Any, Any], Sequence[int]],
        keys: Any,
        addrs: Any,
        sizes: Any,
        start: int,
        end: int,
    ) -> Sequence[int]:
        try:
            part = call(keys, addrs, sizes)
        except TypeError as exc:
            # pybind11 rejected an element (float, numpy float, > 2**64, ...) while converting.
            note = f" (keys {start}..{end - 1}; earlier keys were already processed)" if start else ""
            raise TypeError(f"Mooncake rejected the arguments{note}: {exc}") from exc
        if len(part) != end - start:
            raise StoreError(f"Mooncake returned {len(part)} results for {end - start} keys")
        return part

    @staticmethod
    def _result(op: _Op, codes: Sequence[int], n: int) -> BatchResult:
        if len(codes) != n:
            raise StoreError(f"Mooncake returned {len(codes)} results for {n} keys")
        return BatchResult._build(op, codes)


def _check_address(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")


def _has_port(hostname: str) -> bool:
    """Whether ``local_hostname`` pins a port (``host:port`` or ``[v6]:port``), as Mooncake reads it."""
    return hostname.rsplit("]", 1)[-1].count(":") == 1


def _client_ports(count: int) -> list[int]:
    """``count`` distinct ports, free a moment ago on every interface, from Mooncake's client port range.

    The range is Mooncake's own (``MC_STORE_CLIENT_MIN_PORT``/``MAX_PORT`` if set, read only), so firewall
    rules written for Mooncake keep working. Falls back to kernel-chosen ports if the range is exhausted.
    """
    low, high = _CLIENT_PORT_RANGE
    with contextlib.suppress(ValueError):
        low = int(os.environ.get(_CLIENT_PORT_RANGE_ENV[0], low))
        high = int(os.environ.get(_CLIENT_PORT_RANGE_ENV[1], high))
    if not 1 <= low <= high <= 65535:
        low, high = _CLIENT_PORT_RANGE
    candidates = random.sample(range(low, high + 1), min(high - low + 1, 8 * count))
    ports: list[int] = []
    for port in candidates:
        if len(ports) == count:
            break
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))  # the transfer engine listens on every interface
            except OSError:
                continue
        ports.append(port)
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("0.0.0.0", 0))
            port = sock.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports
