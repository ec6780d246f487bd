"""A three-host Mooncake cluster made of Linux network namespaces (:class:`NetnsCluster`).

It lets the tests and the bench put a master, a segment holder and a pure client on separate network stacks of
one machine, so that faults (links down, stopped or killed processes) hit a real TCP path, without touching the
host's interfaces and without leaving a namespace or a process behind on any failure path. This module keeps the
cluster and its teardown state and re-exports its parts' public names. Layout, teardown, needs: docs/multihost.md.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final

from mooncake_kvaddr.bench.netns_ip import (
    _KILL_WAIT_S,
    NAME_PREFIX,
    NetnsError,
    _delete_netns,
    _ip,
    _netns_pids,
    _netns_preexec,
    _open_netns,
    list_namespaces,
    run_in_netns,
    sweep_stale,
    unavailable_reason,
)
from mooncake_kvaddr.bench.netns_worker import _LOG_TAIL_BYTES, Worker, WorkerError, WorkerTimeout, _tail
from mooncake_kvaddr.driver.master import find_master_binary

__all__ = [
    "NAME_PREFIX",
    "ROLES",
    "NetnsCluster",
    "NetnsError",
    "Node",
    "Worker",
    "WorkerError",
    "WorkerTimeout",
    "list_namespaces",
    "run_in_netns",
    "sweep_stale",
    "unavailable_reason",
]

#: The three hosts, in start order; ``"sw"`` is the switch namespace that holds the bridge.
ROLES: Final = ("master", "writer", "reader")
_SHORT: Final = {"master": "m", "writer": "w", "reader": "r", "switch": "sw"}
_HOST_NUMBER: Final = {"master": 1, "writer": 2, "reader": 3}

_TERM_GRACE_S: Final = 3.0

#: Ports of the master inside its namespace: fixed, because the namespace is fresh and private.
MASTER_RPC_PORT: Final = 50051
MASTER_METRICS_PORT: Final = 9003


# ------------------------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Node:
    """One "host": its role, namespace, address and the interface name on both sides of its link."""

    role: str
    netns: str
    address: str
    ifname: str = "eth0"

    @property
    def switch_port(self) -> str:
        """The veth end inside the switch namespace (attached to the bridge)."""
        return f"p-{self.role}"


class _State:
    """What teardown needs, apart from the cluster object (``weakref.finalize`` must not reference it)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.namespaces: list[str] = []
        self.popens: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []

    def stop_process(self, popen: subprocess.Popen[bytes], grace_s: float = _TERM_GRACE_S) -> None:
        if popen.poll() is not None:
            return
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(popen.pid, sig)
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=_KILL_WAIT_S)

    def release(self) -> None:
        with self.lock:
            for popen in self.popens:
                self.stop_process(popen)
                for stream in (popen.stdin, popen.stdout):
                    if stream is not None:
                        with contextlib.suppress(OSError, ValueError):
                            stream.close()
            errors: list[str] = []
            for name in reversed(self.namespaces):
                try:
                    _delete_netns(name)
                except NetnsError as exc:
                    errors.append(str(exc))
            self.namespaces.clear()
            self.popens.clear()
            for log in self.logs:
                with contextlib.suppress(OSError):
                    log.close()
            self.logs.clear()
        if errors:
            raise NetnsError("; ".join(errors))


class NetnsCluster:
    """Master, writer and reader "hosts" in their own network namespaces, joined by a bridge.

    ``start()`` (or ``with``) builds the namespaces and starts a ready ``mooncake_master`` in the master's
    namespace; workers are added with :meth:`spawn_worker`. Faults: :meth:`link_down`/:meth:`link_up`,
    :meth:`kill_master`/:meth:`start_master`, and :meth:`Worker.signal` on a worker. Every process and
    namespace is removed by :meth:`close` (idempotent; also run at garbage collection and at exit).

    Args:
        subnet: the first three octets of the private /24 (host numbers 1, 2, 3 are master, writer, reader).
        master_args: extra ``-flag=value`` arguments for the master (e.g. ``-client_ttl=5``).
        worker_env: environment added to every worker (e.g. ``MC_TCP_PROGRESS_TIMEOUT_SEC``).
        start_timeout_s: bound on the master's readiness (``GET /health`` and its RPC port answering from the
            writer's and the reader's namespaces).
    """

    def __init__(
        self,
        *,
        subnet: str = "10.77.0",
        master_args: Sequence[str] = (),
        worker_env: Mapping[str, str] | None = None,
        start_timeout_s: float = 15.0,
    ) -> None:
        if isinstance(master_args, str):
            raise TypeError("master_args: expected a sequence of strings, not one string")
        octets = subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(f"subnet: expected three octets like '10.77.0', got {subnet!r}")
        self.run_id = f"{NAME_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.subnet = subnet
        self.nodes = {
            role: Node(role, f"{self.run_id}-{_SHORT[role]}", f"{subnet}.{_HOST_NUMBER[role]}") for role in ROLES
        }
        self.switch = f"{self.run_id}-{_SHORT['switch']}"
        self._master_args = tuple(master_args)
        self._worker_env = dict(worker_env or {})
        self._start_timeout_s = float(start_timeout_s)
        self._state = _State()
        self._master: subprocess.Popen[bytes] | None = None
        self._master_log: IO[bytes] | None = None
        self.workers: list[Worker] = []
        #: PID of every process this cluster started (master restarts and dead workers included).
        self.started_pids: list[int] = []
        self._finalizer = weakref.finalize(self, self._state.release)

    # ------------------------------------------------------------------ addresses

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC server (the clients' ``master_server_address``)."""
        return f"{self.nodes['master'].address}:{MASTER_RPC_PORT}"

    @property
    def namespaces(self) -> list[str]:
        """The namespaces created so far (switch first)."""
        return list(self._state.namespaces)

    def pids(self) -> list[int]:
        """PIDs of every live process inside this cluster's namespaces (ours or not)."""
        return sorted({pid for name in self._state.namespaces for pid in _netns_pids(name)})

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> NetnsCluster:
        """Sweep stale namespaces, build the network, start the master and wait until it is ready."""
        if not self._finalizer.alive:
            raise NetnsError("this NetnsCluster was closed; create a new one")
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsError(reason)
        sweep_stale()
        try:
            self._build()
            self.start_master()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        state = self._state
        _ip("netns", "add", self.switch)
        state.namespaces.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes.values():
            _ip("netns", "add", node.netns)
            state.namespaces.append(node.netns)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            # Both ends are created inside their namespaces: nothing appears in the caller's namespace.
            _ip(
                "link", "add", node.ifname, "netns", node.netns,
                "type", "veth", "peer", "name", node.switch_port, "netns", self.switch,
            )  # fmt: skip
            _ip("-n", self.switch, "link", "set", node.switch_port, "master", "br0")
            _ip("-n", self.switch, "link", "set", node.switch_port, "up")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", node.ifname, "up")

    def close(self) -> None:
        """Stop every process and delete every namespace of this cluster. Idempotent."""
        for worker in self.workers:
            worker.signal(signal.SIGCONT)
        self._finalizer()
        self._master = None

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ processes

    def _spawn(
        self, role: str, argv: Sequence[str], env: Mapping[str, str], *, pipes: bool
    ) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
        """Start ``argv`` inside ``role``'s namespace; stderr (and stdout unless ``pipes``) go to a log file."""
        node = self.nodes[role]
        log = tempfile.TemporaryFile(prefix=f"{node.netns}-", suffix=".log")
        self._state.logs.append(log)
        fd = _open_netns(node.netns)
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else log,
                stderr=log,
                env=dict(env),
                close_fds=True,
                preexec_fn=_netns_preexec(fd),
            )
        finally:
            os.close(fd)
        with self._state.lock:
            self._state.popens.append(popen)
        self.started_pids.append(popen.pid)
        return popen, log

    @property
    def master_pid(self) -> int | None:
        """PID of the running master, ``None`` when it is not running."""
        master = self._master
        return master.pid if master is not None and master.poll() is None else None

    def master_log(self, limit: int = _LOG_TAIL_BYTES) -> str:
        """The tail of the current master's log."""
        return _tail(self._master_log, limit)

    def start_master(self) -> None:
        """Start ``mooncake_master`` in the master namespace (same address and ports every time) and wait
        until its ``/health`` answers and its RPC port accepts connections from the writer's and the
        reader's namespaces; retried while the old listener lingers, bounded by ``start_timeout_s``."""
        if self.master_pid is not None:
            return
        node = self.nodes["master"]
        argv = [
            str(find_master_binary()),
            f"-rpc_address={node.address}",
            f"-rpc_port={MASTER_RPC_PORT}",
            f"-metrics_host={node.address}",
            f"-metrics_port={MASTER_METRICS_PORT}",
            "-rpc_thread_num=2",
            "-logtostderr=1",
            "-minloglevel=1",
            *self._master_args,
        ]
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            popen, log = self._spawn("master", argv, os.environ, pipes=False)
            self._master, self._master_log = popen, log
            if self._wait_master(popen, deadline):
                return
            self._state.stop_process(popen, grace_s=0.5)
            if time.monotonic() >= deadline:
                raise NetnsError(
                    f"mooncake_master in {node.netns} not ready within {self._start_timeout_s} s "
                    f"(rc={popen.returncode}); log tail:\n{self.master_log() or '<empty>'}"
                )
            time.sleep(0.2)

    def _wait_master(self, popen: subprocess.Popen[bytes], deadline: float) -> bool:
        node = self.nodes["master"]
        delay = 0.01
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                return False
            healthy = run_in_netns(node.netns, lambda: _http_ok(node.address, MASTER_METRICS_PORT, "/health"))
            if healthy and all(
                run_in_netns(self.nodes[r].netns, lambda: _connects(node.address, MASTER_RPC_PORT))
                for r in ("writer", "reader")
            ):
                return True
            time.sleep(delay)
            delay = min(2 * delay, 0.1)
        return False

    def kill_master(self, sig: int = signal.SIGKILL, timeout: float = _KILL_WAIT_S) -> int | None:
        """Signal the master and wait (bounded) until it has exited; returns its exit status."""
        popen = self._master
        if popen is None or popen.poll() is not None:
            return None if popen is None else popen.returncode
        with contextlib.suppress(ProcessLookupError):
            os.kill(popen.pid, sig)
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=_KILL_WAIT_S)
        return popen.returncode

    def spawn_worker(self, role: str, *, env: Mapping[str, str] | None = None, ready_timeout: float = 60.0) -> Worker:
        """Start :mod:`mooncake_kvaddr.bench.netns_client` in ``role``'s namespace and wait for its hello.

        The worker imports this package from the same location as the caller; ``MC_LOG_LEVEL`` defaults to
        WARNING; the cluster's ``worker_env`` and then ``env`` are added. Call it from a thread that outlives
        the worker (the main thread, typically): ``PR_SET_PDEATHSIG`` fires when the *thread* that started a
        child exits.
        """
        if role not in ("writer", "reader"):
            raise ValueError(f"role: workers run as 'writer' or 'reader', got {role!r}")
        package_root = str(Path(__file__).resolve().parents[2])
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        full_env.setdefault("MC_LOG_LEVEL", "WARNING")
        full_env.update(self._worker_env)
        full_env.update(env or {})
        argv = [sys.executable, "-u", "-m", "mooncake_kvaddr.bench.netns_client"]
        popen, log = self._spawn(role, argv, full_env, pipes=True)
        worker = Worker(f"{role}[{popen.pid}]", popen, log)
        self.workers.append(worker)
        hello = worker.event("hello", ready_timeout)
        if hello.get("pid") != popen.pid:
            raise WorkerError(f"{worker.name}: unexpected hello {hello}")
        return worker

    # ------------------------------------------------------------------ links

    def link_down(self, role: str) -> None:
        """Take ``role``'s interface down (inside its namespace): the host drops off the network."""
        node = self.nodes[role]
        _ip("-n", node.netns, "link", "set", node.ifname, "down")

    def link_up(self, role: str) -> None:
        """Bring ``role``'s interface back up (its address and connected route return with it)."""
        node = self.nodes[role]
        _ip("-n", node.netns, "link", "set", node.ifname, "up")

    def link_is_up(self, role: str) -> bool:
        """Whether ``role``'s interface is administratively up."""
        node = self.nodes[role]
        out = _ip("-n", node.netns, "-o", "link", "show", node.ifname).stdout
        flags = out[out.find("<") + 1 : out.find(">")].split(",")
        return "UP" in flags

    def reachable(self, src: str, dst: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from ``src``'s namespace to ``dst``'s address and ``port`` succeeds."""
        address = self.nodes[dst].address
        return run_in_netns(self.nodes[src].netns, lambda: _connects(address, port, timeout), timeout + 5)


def _http_ok(host: str, port: int, path: str) -> bool:
    # http.client, not urllib: no proxy variables are consulted.
    conn = http.client.HTTPConnection(host, port, timeout=0.5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _connects(host: str, port: int, timeout: float = 0.5) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            return sock.connect_ex((host, port)) == 0
        except OSError:
            return False


@contextlib.contextmanager
def cluster(**kwargs: Any) -> Iterator[NetnsCluster]:
    """``with cluster(...) as c:`` - a started :class:`NetnsCluster`, always closed afterwards."""
    with NetnsCluster(**kwargs) as running:
        yield running
