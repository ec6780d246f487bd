"""A three-host Mooncake cluster made of Linux network namespaces (:class:`NetnsCluster`).

Layout (``docs/multihost.md``)::

    <run>-sw : bridge br0 ---- p-master ==veth== eth0  <run>-m   10.77.0.1  mooncake_master
                          ---- p-writer ==veth== eth0  <run>-w   10.77.0.2  writer (holds the segment)
                          ---- p-reader ==veth== eth0  <run>-r   10.77.0.3  reader (pure client)

Every interface and address exists only inside namespaces this module created (the veth ends are created
directly in their namespaces; the host's interfaces, addresses and routes are never touched), so traffic
between the three "hosts" never leaves them. Processes are started inside a namespace by ``setns`` in the
child before ``exec`` (so the PID is the real process and signals reach it), with ``PR_SET_PDEATHSIG`` so that
they die with the process that started them.

Teardown: :meth:`NetnsCluster.close` (also ``with``, garbage collection and interpreter exit through
``weakref.finalize``, so an exception or ``KeyboardInterrupt`` in a test tears the cluster down) continues
stopped processes, SIGTERMs then SIGKILLs every process it started, kills anything else still inside its
namespaces and deletes them. Namespace names carry the creating PID (``mkvmh-<pid>-<token>-<role>``): a
cluster left behind by a process that was SIGKILLed is removed by :func:`sweep_stale`, which every
:meth:`NetnsCluster.start` runs and which touches only names with this module's prefix whose creator is dead.

Root (CAP_SYS_ADMIN + CAP_NET_ADMIN), ``ip`` from iproute2 and the Mooncake wheel are needed;
:func:`unavailable_reason` says which one is missing (tests skip with it).

Size: namespaces, processes and teardown live together (~800 lines) because teardown must know every
resource the harness creates, on every failure path.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import http.client
import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, TypeVar

from mooncake_kvaddr.driver.master import MasterError, find_master_binary, process_is_running

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

_T = TypeVar("_T")

#: Every namespace this module creates is named ``mkvmh-<creator pid>-<token>-<role>``.
NAME_PREFIX: Final = "mkvmh"
_NAME_RE: Final = re.compile(rf"^{NAME_PREFIX}-(\d+)-([0-9a-f]+)-([a-z]+)$")
#: The three hosts, in start order; ``"sw"`` is the switch namespace that holds the bridge.
ROLES: Final = ("master", "writer", "reader")
_SHORT: Final = {"master": "m", "writer": "w", "reader": "r", "switch": "sw"}
_HOST_NUMBER: Final = {"master": 1, "writer": 2, "reader": 3}

_CLONE_NEWNET: Final = 0x40000000
_PR_SET_PDEATHSIG: Final = 1
_NETNS_DIR: Final = Path("/run/netns")
_IP_TIMEOUT_S: Final = 15.0
_TERM_GRACE_S: Final = 3.0
_KILL_WAIT_S: Final = 5.0
_LOG_TAIL_BYTES: Final = 4000

#: Ports of the master inside its namespace: fixed, because the namespace is fresh and private.
MASTER_RPC_PORT: Final = 50051
MASTER_METRICS_PORT: Final = 9003


class NetnsError(RuntimeError):
    """Creating, using or removing the namespaces failed (the message carries ``ip``'s stderr)."""


class WorkerError(RuntimeError):
    """A worker process died, refused a command, or broke the line protocol."""


class WorkerTimeout(WorkerError):
    """A worker did not answer within the bound given to :meth:`Worker.receive`."""


# ------------------------------------------------------------------------------------------- system calls


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.setns.restype = ctypes.c_int
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    return libc


def _setns(fd: int) -> None:
    if _libc().setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def _open_netns(name: str) -> int:
    try:
        return os.open(_NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(f"network namespace {name!r} cannot be opened: {exc}") from exc


def run_in_netns(netns: str, fn: Callable[[], _T], timeout: float = 30.0) -> _T:
    """Call ``fn()`` in a fresh thread that has joined network namespace ``netns``; return its result.

    Only that thread changes namespace (``setns`` with ``CLONE_NEWNET`` is per thread), so sockets ``fn``
    creates live in ``netns`` while the rest of the process stays where it was. Raises what ``fn`` raised,
    or :class:`TimeoutError` if it did not finish within ``timeout`` seconds.
    """
    fd = _open_netns(netns)
    box: list[Any] = []

    def target() -> None:
        try:
            _setns(fd)
            box.append((True, fn()))
        except BaseException as exc:  # handed back to the caller, which re-raises it
            box.append((False, exc))

    try:
        thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
        thread.start()
        thread.join(timeout)
    finally:
        os.close(fd)
    if not box:
        raise TimeoutError(f"run_in_netns({netns!r}): no result within {timeout} s")
    ok, value = box[0]
    if not ok:
        raise value
    result: _T = value
    return result


def _netns_preexec(fd: int) -> Callable[[], None]:
    """A ``preexec_fn`` that moves the child into the namespace behind ``fd`` and ties it to its parent."""
    libc = _libc()
    setns = libc.setns
    prctl = libc.prctl
    parent = os.getpid()

    def preexec() -> None:
        if setns(fd, _CLONE_NEWNET) != 0:
            os._exit(126)
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: the signal will never come
            os._exit(1)

    return preexec


# ------------------------------------------------------------------------------------------- ip(8)


@functools.cache
def _ip_binary() -> str | None:
    found = shutil.which("ip")
    if found:
        return found
    for candidate in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = _ip_binary()
    if binary is None:
        raise NetnsError("the `ip` command (iproute2) is not installed")
    try:
        done = subprocess.run(
            [binary, *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`ip {' '.join(args)}` did not finish within {_IP_TIMEOUT_S} s") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces(prefix: str = NAME_PREFIX) -> list[str]:
    """Names of the existing network namespaces that start with ``prefix + "-"``."""
    done = _ip("netns", "list", check=False)
    if done.returncode != 0:
        return []
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix + "-")]


def _netns_pids(name: str) -> list[int]:
    done = _ip("netns", "pids", name, check=False)
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()] if done.returncode == 0 else []


def _kill_netns_processes(name: str) -> None:
    """SIGKILL every process inside namespace ``name`` (continued first, so a stopped one dies too)."""
    for _ in range(3):
        pids = _netns_pids(name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        while time.monotonic() < deadline and any(process_is_running(p) for p in pids):
            time.sleep(0.02)


def _delete_netns(name: str) -> None:
    _kill_netns_processes(name)
    done = _ip("netns", "delete", name, check=False)
    if done.returncode != 0 and (_NETNS_DIR / name).exists():
        raise NetnsError(f"cannot delete network namespace {name!r}: {done.stderr.strip()}")


def sweep_stale(prefix: str = NAME_PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix>-<pid>-…`` whose creating process is gone; returns their names.

    Only names with this module's pattern are considered, and a namespace whose creator still runs is left
    alone (another cluster in use). Processes still inside a stale namespace are killed first.
    """
    removed: list[str] = []
    for name in list_namespaces(prefix):
        match = _NAME_RE.match(name)
        if match is None or not name.startswith(prefix + "-"):
            continue
        if process_is_running(int(match.group(1))):
            continue
        with contextlib.suppress(NetnsError):
            _delete_netns(name)
            removed.append(name)
    return removed


@functools.cache
def unavailable_reason() -> str | None:
    """Why a :class:`NetnsCluster` cannot run here (``None`` if it can); checked once per process.

    Checks: Linux, effective root, ``ip`` installed, the Mooncake wheel's master binary, and a trial
    namespace with a bridge and a veth pair (created and deleted again).
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    if _ip_binary() is None:
        return "the `ip` command (iproute2) is not installed"
    try:
        find_master_binary()
    except MasterError as exc:
        return str(exc)
    token = secrets.token_hex(3)
    a, b = f"{NAME_PREFIX}-{os.getpid()}-{token}-probea", f"{NAME_PREFIX}-{os.getpid()}-{token}-probeb"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("-n", a, "link", "add", "br0", "type", "bridge")
        _ip("link", "add", "eth0", "netns", a, "type", "veth", "peer", "name", "eth0", "netns", b)
        _ip("-n", b, "link", "set", "lo", "up")
    except NetnsError as exc:
        return f"cannot build network namespaces here: {exc}"
    finally:
        for name in (a, b):
            with contextlib.suppress(NetnsError):
                _delete_netns(name)
    return None


# ------------------------------------------------------------------------------------------- workers


class Worker:
    """A process inside one namespace that speaks JSON lines (commands on stdin, messages on stdout).

    Messages are ``{"event": …}`` (progress, e.g. ``"load_started"``) or ``{"reply": op, "ok": …}``. Every
    wait is bounded: :meth:`receive` raises :class:`WorkerTimeout`, and :class:`WorkerError` (with the
    tail of the worker's stderr) when the worker has died.
    """

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        self.name = name
        self._popen = popen
        self._log = log
        self._lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.events: list[dict[str, Any]] = []  # every event seen so far, in order
        self._reader = threading.Thread(target=self._read, name=f"worker-{name}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stream = self._popen.stdout
        assert stream is not None
        with contextlib.suppress(OSError, ValueError):
            for line in stream:
                self._lines.put(line)
        self._lines.put(None)

    @property
    def pid(self) -> int:
        """The worker's PID (the process itself, not a wrapper)."""
        return self._popen.pid

    @property
    def alive(self) -> bool:
        """True while the process has not exited (a stopped process is alive)."""
        return self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit status, ``None`` while running (negative: killed by that signal)."""
        return self._popen.poll()

    def stderr_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        """The last ``limit`` bytes the worker (and Mooncake inside it) wrote to stderr."""
        return _tail(self._log, limit)

    def send(self, op: str, **args: Any) -> None:
        """Send one command without waiting for its reply."""
        stdin = self._popen.stdin
        if stdin is None or not self.alive:
            raise WorkerError(f"{self.name}: worker is not running (rc={self.returncode}); {self._where()}")
        try:
            stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise WorkerError(f"{self.name}: cannot send {op!r}: {exc}; {self._where()}") from exc

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next message (event or reply), waiting at most ``timeout`` seconds."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise WorkerTimeout(f"{self.name}: no message within {timeout:.1f} s; {self._where()}") from None
        if line is None:
            self._lines.put(None)  # keep reporting EOF
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=2.0)
            raise WorkerError(f"{self.name}: worker exited (rc={self.returncode}); {self._where()}")
        try:
            message: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkerError(f"{self.name}: not a protocol line: {line[:200]!r}") from exc
        if "event" in message:
            self.events.append(message)
        return message

    def reply(self, op: str, timeout: float) -> dict[str, Any]:
        """Wait (at most ``timeout`` s overall) for the reply to ``op``; events seen meanwhile are kept."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.receive(max(0.0, deadline - time.monotonic()))
            if message.get("reply") != op:
                continue
            if not message.get("ok", False):
                raise WorkerError(f"{self.name}: {op} failed: {message.get('error')}; {self._where()}")
            return message

    def event(self, name: str, timeout: float) -> dict[str, Any]:
        """Wait (at most ``timeout`` s) for the next event called ``name``; a reply meanwhile is an error."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.receive(max(0.0, deadline - time.monotonic()))
            if message.get("event") == name:
                return message
            if "reply" in message:
                raise WorkerError(f"{self.name}: got reply {message} while waiting for event {name!r}")

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        """Send ``op`` and wait (at most ``timeout`` s) for its reply."""
        self.send(op, **args)
        return self.reply(op, timeout)

    def signal(self, sig: int) -> None:
        """Send signal ``sig`` to the worker (no-op once it has exited)."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> int | None:
        """SIGKILL and reap the worker; returns its exit status."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=_KILL_WAIT_S)
        return self.returncode

    def close(self, timeout: float = 30.0) -> int | None:
        """Ask the worker to exit cleanly (it closes its stores), SIGKILL it after ``timeout`` s."""
        if self.alive:
            with contextlib.suppress(WorkerError):
                self.send("exit")
            try:
                self._popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.returncode

    def _where(self) -> str:
        tail = self.stderr_tail(1500)
        return f"stderr tail:\n{tail}" if tail else "stderr empty"


def _tail(log: IO[bytes] | None, limit: int) -> str:
    if log is None:
        return ""
    try:
        log.flush()
        size = log.seek(0, os.SEEK_END)
        log.seek(max(0, size - limit))
        data = log.read()
    except (OSError, ValueError):
        return ""
    return data.decode("utf-8", "replace").strip()


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
