"""An embedded ``mooncake_master`` on loopback (:class:`EmbeddedMaster`).

Started on 127.0.0.1 with free ports in P2P-handshake mode, and always stopped again, even when the process that
started it dies; nothing here touches the process environment (docs/configuration.md, "The embedded master").
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from mooncake_kvaddr.driver.process import (
    LOOPBACK,
    STDERR_TAIL_BYTES,
    ChildOwner,
    ChildProcess,
    free_ports,
    health_ok,
    owns_listener,
    pdeathsig_preexec,
    process_is_running,
)

__all__ = [
    "HA_MASTER_FLAGS",
    "MOONCAKE_VARIANTS",
    "RESERVED_MASTER_FLAGS",
    "EmbeddedMaster",
    "MasterError",
    "check_master_args",
    "check_start_options",
    "find_master_binary",
    "free_ports",
    "mooncake_install_hint",
    "pdeathsig_preexec",
    "process_is_running",
]

#: The PyPI distributions that ship the ``mooncake`` package (one per hardware flavour; any one will do).
MOONCAKE_VARIANTS: Final = (
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine-rocm",
    "mooncake-transfer-engine-efa",
    "mooncake-transfer-engine-efa-non-cuda",
    "mooncake-transfer-engine-efa-cuda13",
    "mooncake-transfer-engine-musa",
    "mooncake-transfer-engine-npu",
)


def mooncake_install_hint() -> str:
    """How to install Mooncake: the variants, which one fits a CPU-only machine, the system libraries."""
    return (
        "install the Mooncake wheel that matches your hardware, one of: "
        + ", ".join(MOONCAKE_VARIANTS)
        + " (CPU-only machines and CI: mooncake-transfer-engine-non-cuda; CUDA 12: mooncake-transfer-engine; "
        "CUDA 13: mooncake-transfer-engine-cuda13). On Debian/Ubuntu it also needs: "
        "apt-get install libibverbs1 libnuma1 libcurl4"
    )


class MasterError(RuntimeError):
    """The embedded master could not be found, started, or did not become ready."""


def find_master_binary() -> Path:
    """Path of ``mooncake_master`` inside the installed Mooncake wheel.

    Located through the package's file location without importing ``mooncake.store`` (which would load
    the whole transfer engine just to find a file).
    """
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    if spec is None:
        raise MasterError(f"mooncake_master not found: Mooncake is not installed; {mooncake_install_hint()}")
    raise MasterError(
        f"mooncake_master not found in the installed Mooncake package ({', '.join(locations) or '?'}): "
        "this variant ships no master binary; start a master yourself and set master_server_address"
    )


class EmbeddedMaster(ChildOwner):
    """A ``mooncake_master`` child process listening on 127.0.0.1.

    Ports are picked free at :meth:`start` unless given (a start that loses a port race is retried with
    new ports). Use as a context manager, or call :meth:`start` and :meth:`close`::

        with EmbeddedMaster() as master:
            config = StoreConfig(master_server_address=master.rpc_address)

    The process is stopped by :meth:`close`, by garbage collection of this object, at interpreter exit,
    and when the parent process dies (``PR_SET_PDEATHSIG``).
    """

    def __init__(
        self,
        *,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = 15.0,
        binary: str | os.PathLike[str] | None = None,
        log_level: int = 1,
        port_attempts: int = 3,
    ) -> None:
        """Configure (nothing starts until :meth:`start` or ``with``); every argument is checked here.

        Args:
            rpc_port, metrics_port: fixed ports (1..65535, different from each other); ``None`` picks free
                ones on each start attempt.
            extra_args: extra ``-flag=value`` arguments for the master, placed before the loopback flags. A
                flag that decides where the master listens or loads flags from elsewhere is refused
                (:func:`check_master_args`).
            start_timeout_s: bound on the wait for readiness.
            binary: master executable (default: the one in the Mooncake wheel).
            log_level: glog ``-minloglevel`` (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL); the log goes to a private
                temporary file, kept for error messages, never to this process's output.
            port_attempts: how many times to retry with new ports when auto-picked ports were taken.
        """
        self._extra_args = check_master_args("extra_args", extra_args)
        _check_port("rpc_port", rpc_port)
        _check_port("metrics_port", metrics_port)
        if rpc_port is not None and rpc_port == metrics_port:
            raise ValueError(f"rpc_port and metrics_port must differ, both are {rpc_port}")
        self._start_timeout_s = check_start_options(start_timeout_s, log_level)
        if isinstance(port_attempts, bool) or not isinstance(port_attempts, int) or port_attempts < 1:
            raise ValueError(f"port_attempts: must be >= 1, got {port_attempts!r}")
        self._binary = Path(binary) if binary is not None else None
        self._auto_rpc_port = rpc_port is None
        self._auto_metrics_port = metrics_port is None
        self._ports_chosen = False
        self._rpc_port = rpc_port
        self._metrics_port = metrics_port
        self._log_level = log_level
        self._port_attempts = port_attempts
        self._proc = ChildProcess()
        self._own(self._proc.release)

    # ------------------------------------------------------------------ properties

    @property
    def rpc_port(self) -> int:
        """The RPC port (known once started)."""
        if self._rpc_port is None:
            raise MasterError("the master has not been started yet")
        return self._rpc_port

    @property
    def metrics_port(self) -> int:
        """The HTTP metrics/admin port serving ``/health`` (known once started)."""
        if self._metrics_port is None:
            raise MasterError("the master has not been started yet")
        return self._metrics_port

    @property
    def rpc_address(self) -> str:
        """``"127.0.0.1:<rpc_port>"``: the client's ``master_server_address``."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def health_url(self) -> str:
        """The readiness URL."""
        return f"http://{LOOPBACK}:{self.metrics_port}/health"

    @property
    def pid(self) -> int | None:
        """PID of the running master, ``None`` if not started or already stopped."""
        popen = self._proc.popen
        return popen.pid if popen is not None and popen.returncode is None else None

    @property
    def alive(self) -> bool:
        """True while the master process runs."""
        popen = self._proc.popen
        return popen is not None and popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit status of the last master process, ``None`` while it runs or if never started."""
        popen = self._proc.popen
        return None if popen is None else popen.poll()

    def stderr_tail(self, limit: int = STDERR_TAIL_BYTES) -> str:
        """The last ``limit`` bytes the master logged (WARNING and above by default)."""
        return self._proc.stderr_tail(limit)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> EmbeddedMaster:
        """Start the master and wait until it is ready; returns ``self``. No-op if already running.

        Ports not given to the constructor are picked on the first start and kept afterwards, so a
        stopped master comes back at the address its clients know. Thread-safe: concurrent calls start
        one process.
        """
        with self._lifecycle:
            self._check_open(MasterError)
            if self.alive:
                return self
            binary = self._binary or find_master_binary()
            pick_ports = not self._ports_chosen and (self._auto_rpc_port or self._auto_metrics_port)

            def command() -> list[str]:
                if pick_ports:  # each attempt: the usual early exit is a port taken since free_ports()
                    self._pick_ports()
                return self._command(binary)

            self._proc.start(
                "mooncake_master",
                command,
                # /health answers before the RPC server binds: a master that lost its RPC port to someone else
                # reports healthy and exits a moment later, and a /health answer may come from another process
                # holding the metrics port. Ready = healthy AND our child owns both listening ports.
                lambda pid: health_ok(self.metrics_port)
                and owns_listener(pid, self.rpc_port)
                and owns_listener(pid, self.metrics_port),
                timeout_s=self._start_timeout_s,
                attempts=self._port_attempts if pick_ports else 1,
                ports=lambda: f"rpc port {self._rpc_port}, metrics port {self._metrics_port}",
                waited_for="GET /health on the metrics port never returned 200 with both ports ours",
                error=MasterError,
            )
            self._ports_chosen = True
            return self

    def restart(self) -> EmbeddedMaster:
        """Stop the master (SIGTERM) and start a new one on the **same ports**; old objects are lost."""
        with self._lifecycle:
            self._proc.stop()
            return self._start_again(self.start, MasterError, self._start_timeout_s)

    def kill(self) -> None:
        """SIGKILL the master (simulates a crash; used by reliability tests). Safe if not running."""
        with self._lifecycle:
            self._proc.stop(kill=True)

    def stop(self) -> None:
        """SIGTERM the master, SIGKILL after a bounded grace period; it can be started again."""
        with self._lifecycle:
            self._proc.stop()

    def close(self, *, kill: bool = False) -> None:
        """Stop the master for good and release its log file. Idempotent; waits for a concurrent start().

        ``kill=True`` skips the graceful shutdown (docs/configuration.md, "Close time"): for owners that know
        nothing needs it any more, e.g. a store whose client is already closed. The master keeps its
        objects in memory only, so they are lost either way.
        """
        with self._lifecycle:
            if kill:
                self._proc.stop(kill=True)
            super().close()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.alive else "stopped"
        ports = f"rpc={self._rpc_port}, metrics={self._metrics_port}"
        return f"EmbeddedMaster({ports}, {state})"

    # ------------------------------------------------------------------ internals

    def _pick_ports(self) -> None:
        rpc, metrics = free_ports(2)
        if not self._auto_rpc_port:
            # One port fixed: the free one must not be it (the kernel may hand out a fixed port that is free).
            rpc = self.rpc_port
            metrics = metrics if metrics != rpc else next(p for p in free_ports(3) if p != rpc)
        elif not self._auto_metrics_port:
            metrics = self.metrics_port
            rpc = rpc if rpc != metrics else next(p for p in free_ports(3) if p != metrics)
        self._rpc_port, self._metrics_port = rpc, metrics

    def _command(self, binary: Path) -> list[str]:
        return [
            str(binary),
            # The default spawns one RPC thread per core; two suffice for a handful of local clients.
            "-rpc_thread_num=2",
            "-logtostderr=1",
            f"-minloglevel={self._log_level}",
            *self._extra_args,
            # Last (gflags: the last one wins), and refused in extra_args anyway: the master listens on loopback.
            f"-rpc_address={LOOPBACK}",
            f"-rpc_port={self.rpc_port}",
            f"-metrics_host={LOOPBACK}",
            f"-metrics_port={self.metrics_port}",
        ]


#: Master flags extra arguments may not set: where it listens (the embedded master is loopback only, on ports
#: this package picks) and the gflags flags that load other flags from a file or the environment.
RESERVED_MASTER_FLAGS: Final = frozenset(
    {
        "rpc_address",
        "rpc_interface",
        "rpc_port",
        "port",
        "metrics_host",
        "metrics_port",
        "enable_http_metadata_server",
        "http_metadata_server_host",
        "http_metadata_server_port",
        "kv_events_bind_endpoint",
        "flagfile",
        "fromenv",
        "tryfromenv",
    }
)


#: Master flags that put a master into an HA election and name where it is held: the embedded master is one
#: master on loopback, never elected; an ``EmbeddedCluster`` sets them itself (over its own etcd).
HA_MASTER_FLAGS: Final = frozenset({"enable_ha", "etcd_endpoints", "ha_backend_type", "ha_backend_connstring"})


def check_master_args(
    field: str,
    args: Sequence[str],
    ha_flags: frozenset[str] = HA_MASTER_FLAGS,
    ha_owner: str = "the embedded master does not take: it is one master on loopback, never part of an HA "
    "election (an HA deployment runs its own masters, docs/deployment.md)",
) -> tuple[str, ...]:
    """``args`` as a tuple if each is one ``-name=value`` (or ``--name=value``) flag the embedded master may take;
    else ``TypeError`` (not a sequence of strings) or ``ValueError`` naming ``field``. Refused: a bare ``-name``
    (gflags may take the next argument as its value), ``--`` or a positional argument (which end flag parsing),
    the :data:`RESERVED_MASTER_FLAGS`, then the ``ha_flags`` (``ha_owner`` says who sets them)."""
    if isinstance(args, str) or not isinstance(args, Sequence):
        raise TypeError(f"{field}: expected a sequence of strings, not one string")
    for arg in args:
        if not isinstance(arg, str):
            raise TypeError(f"{field}: expected strings, got {type(arg).__name__}")
    for arg in args:
        body = arg[2:] if arg.startswith("--") else arg[1:] if arg.startswith("-") else ""
        name, equals, _ = body.partition("=")
        if not name or not equals or name.startswith("-"):
            raise ValueError(f"{field}: {arg!r} is not one '-name=value' flag (write booleans as -name=true)")
        if name.replace("-", "_") in RESERVED_MASTER_FLAGS:
            raise ValueError(
                f"{field}: {arg!r} sets {name}, which the embedded master does not take: it listens on "
                f"{LOOPBACK} only, on ports it picks, and reads no flags from elsewhere (a deployment that needs "
                "another address runs its own mooncake_master)"
            )
    for arg in args:
        name = arg.lstrip("-").partition("=")[0].replace("-", "_")
        if name in ha_flags:
            raise ValueError(f"{field}: {arg!r} sets {name}, which {ha_owner}")
    return tuple(args)


def check_start_options(start_timeout_s: float, log_level: int) -> float:
    """``start_timeout_s`` as a float if it and the glog ``log_level`` are valid, else ``TypeError``/``ValueError``
    (the embedded master's and the HA cluster's checks)."""
    if isinstance(start_timeout_s, bool) or not isinstance(start_timeout_s, (int, float)):
        raise TypeError(f"start_timeout_s: expected seconds, got {type(start_timeout_s).__name__}")
    if not math.isfinite(start_timeout_s) or start_timeout_s <= 0:
        raise ValueError(f"start_timeout_s: must be > 0, got {start_timeout_s}")
    if isinstance(log_level, bool) or not isinstance(log_level, int) or not 0 <= log_level <= 3:
        raise ValueError(f"log_level: must be 0..3 (glog INFO..FATAL), got {log_level!r}")
    return float(start_timeout_s)


def _check_port(name: str, port: object) -> None:
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"{name}: expected an int port or None, got {type(port).__name__}")
    if not 1 <= port <= 65535:
        # 0 would mean "the master's default port" to mooncake_master, not "any free port".
        raise ValueError(f"{name}: must be 1..65535 (None picks a free one), got {port}")
