"""Child-process plumbing for the embedded master and the HA cluster: free ports, one start-up routine (spawn
with a parent-death signal, log to a private file, wait for readiness, retry a lost port race), stopping, and
proving which process owns a listening port.

Kept apart from :mod:`mooncake_kvaddr.driver.master` and :mod:`mooncake_kvaddr.driver.cluster` (which decide
*when* to start and stop); the benchmark reuses the spawning helpers for its ``mooncake_client``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import http.client
import os
import queue
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Final, TypeVar

__all__ = [
    "LOOPBACK",
    "STDERR_TAIL_BYTES",
    "ChildOwner",
    "ChildProcess",
    "Spawner",
    "children",
    "free_ports",
    "health",
    "health_ok",
    "owns_listener",
    "pdeathsig_preexec",
    "process_is_running",
    "read_tail",
]

LOOPBACK: Final = "127.0.0.1"
_PR_SET_PDEATHSIG: Final = 1
# Mooncake shuts down within about a second on SIGTERM (docs/configuration.md, "Close time"); beyond this
# we stop asking politely.
_TERM_GRACE_S: Final = 10.0
_KILL_WAIT_S: Final = 5.0
STDERR_TAIL_BYTES: Final = 4000


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct TCP ports that were free on ``host`` a moment ago (callers must tolerate a race).

    All sockets stay bound until every port is read, so the kernel cannot hand out one port twice.
    """
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def children() -> list[tuple[int, str]]:
    """``(pid, command name)`` of every direct child of this process, read from ``/proc`` (none without it).

    Zombies are included: a caller that must ignore them asks :func:`process_is_running`."""
    me = str(os.getpid())
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = entry.joinpath("stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces; after it: state, ppid, ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1] == me:
            found.append((int(entry.name), stat[stat.find("(") + 1 : stat.rfind(")")]))
    return found


def process_is_running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie.

    A master orphaned by its parent's death is re-parented to PID 1, which in a container may never reap
    it; a zombie has exited all the same, so ``/proc/<pid>/stat`` is consulted, not just ``kill(pid, 0)``.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        # No procfs (not Linux): fall back to the signal probe.
        try:
            with contextlib.suppress(PermissionError):  # it exists, owned by another user
                os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    # Field 3 follows the parenthesised command name, which may itself contain spaces or parentheses.
    state = stat[stat.rfind(")") + 2 :].split(" ", 1)[0]
    return state not in ("Z", "X")


# --------------------------------------------------------------------------------------------- spawning


def pdeathsig_preexec() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies.

    Everything is looked up here, in the parent, so the forked child only makes two system calls.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        # If the parent died between fork and prctl the signal will never come: leave now.
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class Spawner:
    """Forks children from one thread that lives as long as the process.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process. A master
    started from a short-lived worker thread would be killed when that thread ends, so children are forked
    either from the main thread or from this daemon thread, both of which end only with the process.
    """

    _lock = threading.Lock()
    _requests: queue.SimpleQueue[tuple[Callable[[], subprocess.Popen[bytes]], queue.SimpleQueue[object]]] = (
        queue.SimpleQueue()
    )
    _thread: threading.Thread | None = None

    @classmethod
    def spawn(cls, make: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        if threading.current_thread() is threading.main_thread():
            return make()
        with cls._lock:
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._serve, name="mooncake-master-spawner", daemon=True)
                cls._thread.start()
        reply: queue.SimpleQueue[object] = queue.SimpleQueue()
        cls._requests.put((make, reply))
        # Popen itself returns within milliseconds; a generous bound only guards against a dead spawner.
        result = reply.get(timeout=60.0)
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, subprocess.Popen)
        return result

    @classmethod
    def _serve(cls) -> None:
        while True:
            make, reply = cls._requests.get()
            try:
                reply.put(make())
            except BaseException as exc:  # handed back to the requesting thread, which re-raises it
                reply.put(exc)


# --------------------------------------------------------------------------------------------- process


class ChildProcess:
    """One child server (the embedded master, the cluster's etcd or one of its masters): started by
    :meth:`start`, stopped by :meth:`stop` and :meth:`release`, its output kept in a private log file.

    Kept apart from its owner: ``weakref.finalize`` must not reference the owner, so everything needed to
    stop the child lives here.
    """

    def __init__(self) -> None:
        self.popen: subprocess.Popen[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self.lock = threading.RLock()

    def start(
        self,
        name: str,
        command: Callable[[], Sequence[str]],
        ready: Callable[[int], bool],
        *,
        timeout_s: float,
        attempts: int,
        ports: Callable[[], str],
        waited_for: str,
        error: type[Exception],
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Run ``command()`` as ``name`` and wait until ``ready(pid)``; ``error`` with the log tail if it fails.

        A child that exits before it is ready (typically a port taken between :func:`free_ports` and its bind)
        is run again with a fresh ``command()``, ``attempts`` times in all. One not ready after ``timeout_s``
        is killed; on any other failure (Ctrl-C) it is stopped. ``ports()`` and ``waited_for`` describe the
        attempt in the errors; ``env`` adds variables to the child's environment only.
        """
        for attempt in range(1, attempts + 1):
            self._spawn(name, command(), env)
            deadline = time.monotonic() + timeout_s
            delay = 0.01
            try:
                while True:
                    popen = self.popen
                    assert popen is not None
                    if popen.poll() is not None:
                        early_exit = (
                            f"{name} exited with code {popen.returncode} during startup ({ports()}); "
                            f"log tail:\n{self.stderr_tail() or '<empty>'}"
                        )
                        break
                    if ready(popen.pid):
                        return
                    if time.monotonic() >= deadline:
                        self.stop(kill=True)
                        raise error(
                            f"{name} (pid {popen.pid}) not ready after {timeout_s:.1f} s ({ports()}): {waited_for}; "
                            f"log tail:\n{self.stderr_tail() or '<empty>'}"
                        )
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
            except BaseException:
                self.stop()
                raise
            self.stop()  # reaps the child that exited early
            if attempt == attempts:
                raise error(early_exit) from None
        raise AssertionError("unreachable")

    def _spawn(self, name: str, command: Sequence[str], env: Mapping[str, str] | None) -> None:
        preexec = pdeathsig_preexec()
        child_env = None if not env else {**os.environ, **env}
        argv = list(command)
        with self.lock:
            if self.stderr is None:
                # A file, not a pipe: nobody drains a pipe while the child runs, and a full pipe would block
                # the child's logging thread.
                self.stderr = tempfile.TemporaryFile(prefix=f"{name}_", suffix=".log")
            else:
                self.stderr.seek(0)
                self.stderr.truncate()
            log = self.stderr

            def make() -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True, preexec_fn=preexec,
                    env=child_env,
                )  # fmt: skip

            self.popen = Spawner.spawn(make)

    def stderr_tail(self, limit: int = STDERR_TAIL_BYTES) -> str:
        with self.lock:
            return read_tail(self.stderr, limit).strip()

    def stop(self, *, kill: bool = False, grace_s: float = _TERM_GRACE_S) -> int | None:
        """Terminate (or kill) the child and reap it; returns its exit code (None if there was none)."""
        with self.lock:
            popen = self.popen
            if popen is None:
                return None
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if kill:
                        popen.kill()
                    else:
                        popen.terminate()
                try:
                    popen.wait(timeout=_KILL_WAIT_S if kill else grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        popen.kill()
                    popen.wait(timeout=_KILL_WAIT_S)
            return popen.returncode

    def release(self) -> None:
        """Stop the child and close its log file; safe to call any number of times."""
        with self.lock:
            self.stop()
            self.popen = None
            if self.stderr is not None:
                self.stderr.close()
                self.stderr = None


_Owner = TypeVar("_Owner", bound="ChildOwner")
_T = TypeVar("_T")


class ChildOwner:
    """The lifecycle the embedded master and the HA cluster share: one lock for every step, a finalizer that
    releases the children (at :meth:`close`, garbage collection and interpreter exit), ``with`` = start and
    close, and a start again on the same ports."""

    def _own(self, release: Callable[..., None], *args: object) -> None:
        # One lifecycle operation at a time: two threads starting one owner must not spawn twice, and a close()
        # that races a start() waits for it and then stops what it started.
        self._lifecycle = threading.RLock()
        self._closed = False
        # Runs at garbage collection and (atexit=True by default) at interpreter exit; holds no `self`.
        self._finalizer = weakref.finalize(self, release, *args)

    def _check_open(self, error: type[Exception]) -> None:
        if self._closed or not self._finalizer.alive:
            raise error(f"this {type(self).__name__} was closed; create a new one")

    def _start_again(self, start: Callable[[], _T], error: type[Exception], timeout_s: float) -> _T:
        """``start()`` until it succeeds or ``timeout_s`` passes: the old process's sockets may linger."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return start()
            except error:
                if self._closed or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def start(self: _Owner) -> _Owner:
        raise NotImplementedError

    def close(self) -> None:
        """Stop every child for good and release what it holds. Idempotent; waits for a concurrent start()."""
        with self._lifecycle:
            self._closed = True
            self._finalizer()

    def __enter__(self: _Owner) -> _Owner:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_tail(file: IO[bytes] | None, limit: int | None = None) -> str:
    """The last ``limit`` bytes (``None``: all) of a log ``file``, decoded; ``""`` without a file or when it
    cannot be read."""
    if file is None:
        return ""
    try:
        file.flush()
        size = file.seek(0, os.SEEK_END)
        file.seek(0 if limit is None else max(0, size - limit))
        return file.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""


def health(port: int, *, body: bool = True) -> bytes | None:
    """The body of a status-200 answer to ``GET /health`` on loopback ``port``; ``None`` for any other answer
    or none (the readiness probe of the embedded master, the cluster's etcd and its masters). ``body=False``:
    the status alone (``b""`` for a 200; the body is never read)."""
    # http.client, not urllib: urllib honours http_proxy variables, which must never see loopback probes.
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=0.5)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        if response.status != 200:
            return None
        return response.read() if body else b""
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def health_ok(port: int) -> bool:
    """Whether ``GET /health`` on loopback ``port`` answers status 200 (the embedded master's readiness; its body
    is not read)."""
    return health(port, body=False) is not None


def owns_listener(pid: int, port: int) -> bool:
    """True if process ``pid`` holds a listening TCP socket on ``port`` (a connect() cannot tell: the
    port may belong to another process). Without procfs, falls back to a connect() probe."""
    try:
        # The ``socket:[inode]`` names of the LISTEN sockets on ``port`` in ``pid``'s network namespace.
        inodes: set[str] = set()
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except FileNotFoundError:
                continue
            for line in lines:
                fields = line.split()
                # fields: sl, local "ADDR:PORT" (hex), remote, state (0A = LISTEN), ..., inode at index 9
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
        if not inodes:
            return False
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return True
        return False
    except OSError:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            return sock.connect_ex((LOOPBACK, port)) == 0
