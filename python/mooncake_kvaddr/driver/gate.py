"""The one call gate: admits calls while open, and lets ``close`` release nothing under a call in flight.

``MooncakeStore``, ``KVTransfer`` and the vLLM plugin's store wrappers each hold one (docs/architecture.md).
It notes the process that opened it: Mooncake's client hangs in a forked child, so a call or a close from
another process is refused at once (docs/configuration.md, section 10).
"""

from __future__ import annotations

import enum
import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mooncake_kvaddr.driver.errors import StoreClosedError, StoreError

__all__ = ["CallGate", "GateState"]


class GateState(enum.Enum):
    NEW = "new"  # not opened yet: no call admitted
    READY = "ready"
    CLOSING = "closing"  # close began: only queued calls are admitted
    CLOSED = "closed"  # released: nothing is admitted


class CallGate:
    """Counts the calls in flight. ``name`` goes into the :class:`StoreClosedError` a refused call raises;
    ``not_ready`` is the message for a call before :meth:`open` (a gate made ``ready=True`` is open at once)."""

    def __init__(self, name: str, *, ready: bool = True, not_ready: str = "") -> None:
        self._name = name
        self._not_ready = not_ready or f"{name} is not ready"
        self._cond = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._state = GateState.READY if ready else GateState.NEW
        self._pid: int | None = os.getpid() if ready else None  # the process that opened the gate

    @property
    def state(self) -> GateState:
        return self._state

    @property
    def closed(self) -> bool:
        """True once :meth:`begin_close` ran: no new call is admitted."""
        return self._state in (GateState.CLOSING, GateState.CLOSED)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def open(self) -> None:
        """Admit calls from now on (a gate made with ``ready=False``)."""
        with self._cond:
            if self._state is GateState.NEW:
                self._state = GateState.READY
                self._pid = os.getpid()

    @property
    def pid(self) -> int | None:
        """The process that opened the gate (``None`` before :meth:`open`)."""
        return self._pid

    def _refuse_forked(self) -> None:
        # Held objects (Mooncake's client, its threads and sockets, a master) belong to the opening process: in
        # a forked child a call hangs and a close would tear down the parent's master.
        pid = os.getpid()
        if self._pid is not None and pid != self._pid:
            raise StoreClosedError(
                f"{self._name} was opened in process {self._pid}; this is process {pid}, a fork of it: "
                "Mooncake's client does not work after fork(), so nothing is called; set up a new one here"
            )

    @contextmanager
    def admitted(self, *, queued: bool = False) -> Iterator[None]:
        """Hold an in-flight slot for one call. ``StoreClosedError`` before :meth:`open` and once closing began;
        ``queued``: a job accepted before ``close`` began, which still runs until the gate is released. In a
        process other than the one that opened the gate (a fork), ``StoreClosedError`` at once."""
        with self._cond:
            state = self._state
            if state is not GateState.NEW and state is not GateState.CLOSED:
                self._refuse_forked()
            if state is not GateState.READY and not (queued and state is GateState.CLOSING):
                if state is GateState.NEW:
                    raise StoreClosedError(self._not_ready)
                raise StoreClosedError(f"{self._name} is {state.value}: no calls after close()")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                if not self._in_flight:
                    self._cond.notify_all()

    def begin_close(self) -> bool:
        """Admit no new call; False when the gate was already released (or never opened: then it is now).
        ``StoreClosedError`` in a forked child of the process that opened it (nothing of it is released)."""
        with self._cond:
            if self._state in (GateState.NEW, GateState.CLOSED):
                self._state = GateState.CLOSED  # never opened: released now (already released: unchanged)
                return False
            self._refuse_forked()
            self._state = GateState.CLOSING
            return True

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no call is in flight; False if some still are after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    def release(self) -> bool:
        """Mark the gate closed for good: True for the one caller that must now release the resources."""
        with self._cond:
            if self._state is GateState.CLOSED or self._in_flight:
                return False
            self._state = GateState.CLOSED
            return True

    def gated(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` called under :meth:`admitted`."""

        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.admitted():
                return func(*args, **kwargs)

        return call

    def close(self, timeout: float = 60.0) -> bool:
        """:meth:`begin_close`, :meth:`wait_idle` and :meth:`release` in one: True for the one caller that must
        now release the resources. ``StoreError`` if calls still run after ``timeout`` seconds (nothing may be
        released yet; call ``close`` again later)."""
        if not self.begin_close():
            return False
        if not self.wait_idle(timeout):
            raise StoreError(
                f"{self._name}.close(): {self._in_flight} call(s) still in flight after {timeout} s; "
                "no new calls are admitted; call close() again"
            )
        return self.release()
