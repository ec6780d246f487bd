"""The parent's side of a namespace worker: :class:`Worker` drives one ``netns_client`` process over JSON lines.

Split out of :mod:`~mooncake_kvaddr.bench.netns` (which re-exports these names): the line protocol, its
bounded waits and the worker's signals are one concern, independent of how the namespaces are built.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from typing import IO, Any, Final

from mooncake_kvaddr.bench.netns_ip import _KILL_WAIT_S

__all__ = ["Worker", "WorkerError", "WorkerTimeout"]

_LOG_TAIL_BYTES: Final = 4000


class WorkerError(RuntimeError):
    """A worker process died, refused a command, or broke the line protocol."""


class WorkerTimeout(WorkerError):
    """A worker did not answer within the bound given to :meth:`Worker.receive`."""


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
