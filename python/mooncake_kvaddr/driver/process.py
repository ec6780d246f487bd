"""Child-process plumbing for the embedded master: free ports, spawning with a parent-death signal, stopping,
and proving which process owns a listening port.

Kept apart from :mod:`mooncake_kvaddr.driver.master` (which decides *when* to start and stop) so that each
reads on its own; the benchmark reuses the spawning helpers for its ``mooncake_client``. See
``docs/configuration.md``, "The embedded master".
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
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Final

__all__ = [
    "LOOPBACK",
    "STDERR_TAIL_BYTES",
    "ChildProcess",
    "Spawner",
    "free_ports",
    "health_ok",
    "owns_listener",
    "pdeathsig_preexec",
    "process_is_running",
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
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
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
    """The state a finalizer needs to stop the master, kept apart from ``EmbeddedMaster``.

    ``weakref.finalize`` must not reference the owner, so everything needed to stop the child lives here.
    """

    def __init__(self) -> None:
        self.popen: subprocess.Popen[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self.lock = threading.RLock()

    def stderr_tail(self, limit: int = STDERR_TAIL_BYTES) -> str:
        with self.lock:
            if self.stderr is None:
                return ""
            try:
                self.stderr.flush()
                size = self.stderr.seek(0, os.SEEK_END)
                self.stderr.seek(max(0, size - limit))
                data = self.stderr.read()
            except (OSError, ValueError):
                return ""
        return data.decode("utf-8", "replace").strip()

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


def health_ok(port: int) -> bool:
    # http.client, not urllib: urllib honours http_proxy variables, which must never see loopback probes.
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=0.5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def owns_listener(pid: int, port: int) -> bool:
    """True if process ``pid`` holds a listening TCP socket on ``port`` (a connect() cannot tell: the
    port may belong to another process). Without procfs, falls back to a connect() probe."""
    try:
        inodes = _listening_inodes(pid, port)
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


def _listening_inodes(pid: int, port: int) -> set[str]:
    """``socket:[inode]`` names of the LISTEN sockets on ``port`` in ``pid``'s network namespace."""
    found: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            # fields: sl, local "ADDR:PORT" (hex), remote, state (0A = LISTEN), ..., inode at index 9
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{fields[9]}]")
    return found
