"""Helpers shared by the command lines (``python -m mooncake_kvaddr demo|bench``), never by the library.

A command line owns its process, so it may do what the library must not: keep Mooncake's native log lines
(file descriptor 2) out of the terminal unless ``--verbose`` or ``MOONCAKE_KVADDR_VERBOSE=1`` asks for them
(``docs/configuration.md``, "Logs"), and end the process on Ctrl-C (or SIGTERM) at once, wherever the main thread
is: one line, exit status 130 (143), no child process left (``docs/configuration.md``, "Ctrl-C").
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from types import FrameType
from typing import IO, Final

from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.driver.process import children, read_tail

__all__ = [
    "INTERRUPTED_EXIT",
    "INTERRUPTED_LINE",
    "VERBOSE_ENV",
    "NativeLog",
    "exit_on_interrupt",
    "native_log",
    "verbose_requested",
]

#: Environment variable that turns on Mooncake's log lines in the command lines (``1``, ``true``, ``yes``).
VERBOSE_ENV: Final = "MOONCAKE_KVADDR_VERBOSE"
#: Exit status of a command line ended by Ctrl-C (128 + SIGINT, what a shell reports for it).
INTERRUPTED_EXIT: Final = 128 + int(signal.SIGINT)
#: The one line it prints on standard error.
INTERRUPTED_LINE: Final = "interrupted"
#: The line and exit status (128 + SIGTERM) of one ended by SIGTERM (kill, timeout(1), a cancelled CI job).
_TERMINATED: Final = ("terminated", 128 + int(signal.SIGTERM))


def verbose_requested(given: bool) -> bool:
    """True if ``--verbose`` was given or ``$MOONCAKE_KVADDR_VERBOSE`` is set to a true value."""
    return given or flag(os.environ.get(VERBOSE_ENV), False, VERBOSE_ENV)


class NativeLog:
    """What native code wrote to file descriptor 2 while it was redirected (empty when not redirected)."""

    def __init__(self, file: IO[bytes] | None) -> None:
        self._file = file

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines captured, for an error report."""
        return "\n".join(read_tail(self._file).splitlines()[-lines:])


@contextlib.contextmanager
def native_log(verbose: bool) -> Iterator[NativeLog]:
    """Redirect file descriptor 2 to a temporary file for the block, unless ``verbose``.

    Python's own ``sys.stderr`` keeps writing to the terminal: when it is the real descriptor 2, it is
    swapped for a stream on a duplicate of the original descriptor for the duration.
    """
    if verbose:
        yield NativeLog(None)
        return
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(tempfile.TemporaryFile(prefix="mooncake_kvaddr_native_", suffix=".log"))
        with contextlib.suppress(AttributeError, ValueError, OSError):
            sys.stderr.flush()
        saved = os.dup(2)
        python_stream = sys.stderr
        swapped: IO[str] | None = None
        try:
            if _is_fd2(python_stream):
                swapped = open(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
                sys.stderr = swapped
            os.dup2(log.fileno(), 2)
            yield NativeLog(log)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if swapped is not None:
                sys.stderr = python_stream
                swapped.close()


def _is_fd2(stream: object) -> bool:
    try:
        return stream.fileno() == 2  # type: ignore[attr-defined, no-any-return]
    except (AttributeError, ValueError, OSError):
        return False


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[None]:
    """For the block, SIGINT ends the process within moments: every child process is killed (an embedded
    master, a ``mooncake_client``, a bench worker), :data:`INTERRUPTED_LINE` goes to the terminal's standard
    error and the process exits with :data:`INTERRUPTED_EXIT`, skipping every clean-up that could wait (the
    interpreter's exit handlers run, bounded: temporary directories go). SIGTERM alike: "terminated", 143.

    The main thread takes the signal between two bytecodes; while it sits in a call that released the GIL (a
    Mooncake transfer, a join), a watcher thread woken through :func:`signal.set_wakeup_fd` takes it instead.
    A call that holds the GIL delays both until it returns (``docs/configuration.md``, "Ctrl-C"). Outside the
    main thread, or nested, the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is _ending:
        yield
        return
    terminal = os.dup(2)  # before any redirection of file descriptor 2 (native_log)
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    previous_handlers = [signal.signal(signum, _ending) for signum in (signal.SIGINT, signal.SIGTERM)]
    previous_fd = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    _ENDING.terminal = terminal

    def watch() -> None:
        while True:
            try:
                data = wake_read.recv(64)
            except OSError:
                return
            if not data:
                return  # the block is over: its end closed the other side
            for signum in (signal.SIGINT, signal.SIGTERM):
                if int(signum) in data:
                    _end(signum)

    watcher = threading.Thread(target=watch, name="mooncake-kvaddr-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handlers[0])
        signal.signal(signal.SIGTERM, previous_handlers[1])
        wake_write.close()
        watcher.join()
        wake_read.close()
        _ENDING.terminal = None
        os.close(terminal)


class _Ending:
    """Where the interrupt line goes, and which thread took the signal first (it alone ends the process)."""

    def __init__(self) -> None:
        self.terminal: int | None = None
        self.owner: int | None = None
        self.guard = threading.RLock()  # re-entrant: a signal handler may run inside the guarded block


_ENDING: Final = _Ending()
# How long the interpreter's exit handlers (``weakref.finalize`` clean-ups: a network namespace of the bench)
# may run before the process ends regardless.
_EXIT_HANDLERS_S: Final = 2.0


def _ending(signum: int, frame: FrameType | None) -> None:
    _end(signum)


def _end(signum: int) -> None:
    with _ENDING.guard:
        owner = _ENDING.owner
        if owner is None:
            _ENDING.owner = threading.get_ident()
    if owner is not None:
        if owner != threading.get_ident():
            threading.Event().wait()  # the other taker ends the process; this thread must not run on meanwhile
        return  # a second Ctrl-C inside the first one's clean-up
    for pid, _name in children():  # SIGKILL every direct child of this process (found through /proc)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    line, status = _TERMINATED if signum == signal.SIGTERM else (INTERRUPTED_LINE, INTERRUPTED_EXIT)
    terminal = _ENDING.terminal
    with contextlib.suppress(OSError, TypeError):
        os.write(terminal if terminal is not None else 2, f"{line}\n".encode())
    # Clean-ups registered for interpreter exit, bounded and silent (the line above is the only one).
    sys.stderr = open(os.devnull, "w")
    runner = threading.Thread(target=atexit._run_exitfuncs, name="mooncake-kvaddr-exit", daemon=True)
    runner.start()
    runner.join(_EXIT_HANDLERS_S)
    os._exit(status)
