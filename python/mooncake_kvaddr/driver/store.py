"""The safe client over Mooncake's ``MooncakeDistributedStore`` (:class:`MooncakeStore`).

Mooncake's binding crashes on a call before ``setup()`` or after ``close()``, misreads short size rows and fails
large TCP batches; this wrapper makes each a Python exception or a non-event (docs/configuration.md, section 10).
Here: the state machine, set-up and close; the calls themselves (admission, sub-batches, deadlines) in
``store_calls``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import Sequence
from types import ModuleType, TracebackType
from typing import Any

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
)
from mooncake_kvaddr.driver.outcomes import _Op as _Op

# The helpers below lived in this module; the ones the tests import from it are re-exported.
from mooncake_kvaddr.driver.store_args import _check_rows as _check_rows
from mooncake_kvaddr.driver.store_args import _plan as _plan
from mooncake_kvaddr.driver.store_calls import HUNG_CALL_THRESHOLD_S as HUNG_CALL_THRESHOLD_S
from mooncake_kvaddr.driver.store_calls import RequestDeadline as RequestDeadline
from mooncake_kvaddr.driver.store_calls import StoreCalls
from mooncake_kvaddr.driver.store_setup import PROGRESS, connect, open_native
from mooncake_kvaddr.driver.store_setup import _client_ports as _client_ports
from mooncake_kvaddr.driver.store_setup import _has_port as _has_port

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


# ------------------------------------------------------------------------------------------- the store


class MooncakeStore(StoreCalls):
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

        No-op when already ready. Raises :class:`StoreSetupError` if an external master does not answer
        within ``config.connect_timeout_s`` or the client cannot connect after bounded retries,
        :class:`StoreClosedError` after :meth:`close`, ``ImportError`` without Mooncake.
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
                    logger.info("starting an embedded Mooncake master on 127.0.0.1: waiting up to %g s for it to be "
                                "ready (master_start_timeout_s)", config.master_start_timeout_s, extra={PROGRESS: True})
                    master = EmbeddedMaster(
                        extra_args=config.master_args, start_timeout_s=config.master_start_timeout_s
                    ).start()
                    address = master.rpc_address
                else:
                    assert config.master_server_address is not None
                    address = config.master_server_address
                client = connect(config, module, address, master)
            except BaseException:
                if master is not None:
                    master.close(kill=True)
                raise
            native = open_native(config, client)
            self._client = client
            self._native = native
            self._master = master
            self._gate.open()  # published last: an admitted call sees the fields above
        return self

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
                    # for its graceful shutdown (docs/configuration.md, "Close time").
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

    # ------------------------------------------------------------------ probes for benchmarks

    def time_argument_conversion(self, addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> float:
        """Seconds Mooncake's binding spends converting these rows (GIL held), without any transfer.

        Calls ``batch_get_into_multi_buffers([], addrs, sizes)``: the binding converts every argument,
        then returns ``[]`` at once because the key count does not match. For benchmarks.
        """
        _check_rows(len(addrs), addrs, sizes, check_values=True)
        out, elapsed = self._timed("batch_get_into_multi_buffers", [], addrs, sizes)
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
        out, elapsed = self._timed("batch_get_into", keys, ptrs[:-1], sizes[:-1])
        if any(code >= 0 for code in out):
            raise StoreError(f"conversion probe unexpectedly transferred: {list(out)[:4]}")
        return elapsed

    def _timed(self, name: str, *args: Any) -> tuple[Any, float]:
        """Mooncake's bound ``name(*args)`` once admitted, and the seconds the call took."""
        with self._gate.admitted():
            start = time.perf_counter()
            out = getattr(self._client, name)(*args)
            return out, time.perf_counter() - start

    def _replicate_default(self) -> Any:
        if self._default_replicate is None:
            assert self._module is not None
            self._default_replicate = self._module.ReplicateConfig()
        return self._default_replicate
