"""Helpers shared by the command lines (``python -m mooncake_kvaddr demo|bench``), never by the library.

A command line owns its process, so it may do what the library must not: here, keep Mooncake's native log
lines (glog/ylt on file descriptor 2, including an ``E… Local segment descriptor not found`` line that every
successful setup prints) out of the terminal unless the user asks for them with ``--verbose`` or
``MOONCAKE_KVADDR_VERBOSE=1``. See ``docs/configuration.md``, "Logs".
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import IO, Final

from mooncake_kvaddr.core.flags import flag

__all__ = ["VERBOSE_ENV", "NativeLog", "native_log", "verbose_requested"]

#: Environment variable that turns on Mooncake's log lines in the command lines (``1``, ``true``, ``yes``).
VERBOSE_ENV: Final = "MOONCAKE_KVADDR_VERBOSE"


def verbose_requested(given: bool) -> bool:
    """True if ``--verbose`` was given or ``$MOONCAKE_KVADDR_VERBOSE`` is set to a true value."""
    return given or flag(os.environ.get(VERBOSE_ENV), False)


class NativeLog:
    """What native code wrote to file descriptor 2 while it was redirected (empty when not redirected)."""

    def __init__(self, file: IO[bytes] | None) -> None:
        self._file = file

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines captured, for an error report."""
        if self._file is None:
            return ""
        try:
            self._file.flush()
            self._file.seek(0)
            text = self._file.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        return "\n".join(text.splitlines()[-lines:])


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
