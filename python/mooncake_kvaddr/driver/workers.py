"""The transfer threads, and the threads that run a staged Mooncake call a request may stop waiting for.

:class:`TransferThreads`: one send thread and ``num_recv_threads`` receive threads, a ``Future`` per request.
:class:`CallRunner`: one blocking call on a reusable daemon thread, abandoned at the request's deadline; only calls
whose memory the driver owns may be (docs/transfer-modes.md, "Requests and threads", "Deadlines").
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from mooncake_kvaddr.driver.values import as_index

__all__ = ["CallAbandoned", "CallRunner", "PendingCall", "TransferThreads"]

logger = logging.getLogger(__name__)

_Req = TypeVar("_Req")
_S = TypeVar("_S")
_L = TypeVar("_L")
_T = TypeVar("_T")

_Jobs = queue.Queue  # of (request, future) pairs, or None to stop one thread


class TransferThreads(Generic[_Req, _S, _L]):
    """Runs ``store(request)`` on the send thread and ``load(request)`` on the first free receive thread."""

    def __init__(self, store: Callable[[_Req], _S], load: Callable[[_Req], _L], num_recv_threads: int) -> None:
        num_recv_threads = as_index("num_recv_threads", num_recv_threads)
        if num_recv_threads < 1:
            raise ValueError(f"num_recv_threads: must be >= 1, got {num_recv_threads}")
        self._store, self._load = store, load
        self._num_recv_threads = num_recv_threads
        self._send: _Jobs[tuple[_Req, Future[_S]] | None] = queue.Queue()
        self._recv: _Jobs[tuple[_Req, Future[_L]] | None] = queue.Queue()
        self.threads: list[threading.Thread] = []
        self._stopping = False

    @property
    def started(self) -> bool:
        """True once :meth:`start` ran."""
        return bool(self.threads)

    def start(self) -> None:
        """Start the threads (idempotent)."""
        if self.threads:
            return
        receivers = [f"KVCacheStoreRecvingThread-{i}" for i in range(self._num_recv_threads)]
        for i, name in enumerate(["KVCacheStoreSendingThread", *receivers]):
            args = (self._send, self._store) if i == 0 else (self._recv, self._load)
            self.threads.append(threading.Thread(target=_serve, args=args, name=name, daemon=True))
        for thread in self.threads:
            thread.start()

    def submit_store(self, request: _Req) -> Future[_S]:
        """Queue a store on the send thread."""
        return self._submit(self._send, request)

    def submit_load(self, request: _Req) -> Future[_L]:
        """Queue a load; the first free receive thread takes it."""
        return self._submit(self._recv, request)

    def _submit(self, jobs: _Jobs[tuple[_Req, Future[_T]] | None], request: _Req) -> Future[_T]:
        if not self.threads:
            raise RuntimeError("KVTransfer threads are not started (start_threads=False): call start()")
        future: Future[_T] = Future()
        jobs.put((request, future))
        return future

    def stop(self, deadline: float) -> list[str]:
        """Let queued work finish, then stop every thread; names of threads still running at ``deadline``
        (``time.monotonic()``)."""
        if not self._stopping:
            self._stopping = True
            self._send.put(None)
            for _ in range(self._num_recv_threads):
                self._recv.put(None)
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]


def _serve(jobs: _Jobs[tuple[_Req, Future[_T]] | None], work: Callable[[_Req], _T]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        request, future = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(work(request))
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)


# ------------------------------------------------------------------------------------------ abandonable calls


class CallAbandoned(Exception):
    """The caller stopped waiting for a call at its timeout; the call goes on running on its own thread."""


class PendingCall(Generic[_T]):
    """One call handed to a :class:`CallRunner` (or already made inline): wait for it, or abandon it.

    ``on_late_return`` runs on the call's thread once an abandoned call returns (with the call's exception, or
    ``None``): it releases what the call used (a staging lease). It never runs for a call that was not abandoned:
    then the caller owns everything again as soon as :meth:`wait` returns or raises the call's exception.
    """

    def __init__(self, runner: CallRunner | None, fn: Callable[[], _T], on_late_return: Callable[[BaseException | None],
                 None]) -> None:  # fmt: skip
        self._runner = runner
        self._fn = fn
        self._on_late_return = on_late_return
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._finished = False  # guarded by the runner's lock
        self._abandoned = False  # guarded by the runner's lock; never reset
        self.started = time.monotonic()

    @property
    def abandoned(self) -> bool:
        """True once the caller stopped waiting while the call still ran (then it owns what it uses)."""
        return self._abandoned

    def wait(self, timeout: float | None) -> _T:
        """The call's result (or its exception), waiting at most ``timeout`` seconds (``None``: as long as it
        takes). Raises :class:`CallAbandoned` if it is still running then; so does any exception raised while
        waiting (``KeyboardInterrupt``) propagate only after the call was abandoned the same way."""
        try:
            finished = self._done.wait(timeout)
        except BaseException:
            self._abandon()
            raise
        if not finished and self._abandon():
            raise CallAbandoned(f"the call did not return within {timeout:.3g} s; it still runs, abandoned")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[no-any-return]

    def _abandon(self) -> bool:
        """Abandon the call unless it finished already; whether it is (now) abandoned."""
        runner = self._runner
        if runner is None:
            return False  # made inline: finished before the caller could wait
        with runner._cond:
            if self._finished:
                return False
            if not self._abandoned:
                self._abandoned = True
                runner._abandoned += 1
            return True

    def _execute(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # handed to the caller, or to on_late_return
            self._error = exc
        runner = self._runner
        with runner._cond if runner is not None else contextlib.nullcontext():  # inline: no other thread looks
            self._finished = True
            abandoned = self._abandoned
            self._done.set()
        if abandoned and runner is not None:
            runner._late_return(self)

    def _release(self) -> None:
        seconds = time.monotonic() - self.started
        if self._error is not None:
            logger.warning("an abandoned call returned after %.1f s by raising %r", seconds, self._error)
        else:
            logger.info("an abandoned call returned after %.1f s", seconds)
        try:
            self._on_late_return(self._error)
        except Exception:  # the release callback must not kill the thread before the count drops
            logger.exception("releasing what an abandoned call used failed")


class _Worker:
    """A daemon thread that runs the calls handed to it, one at a time, and waits idle between them."""

    def __init__(self, runner: CallRunner, name: str) -> None:
        self.jobs: queue.SimpleQueue[PendingCall[Any] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, args=(runner,), name=name, daemon=True)

    def _serve(self, runner: CallRunner) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job._execute()
            del job
            if not runner._park(self):
                return


class CallRunner:
    """Runs blocking calls on reusable daemon threads so that the caller can stop waiting at its deadline.

    :meth:`submit` hands a call to an idle thread (or starts one) and returns a :class:`PendingCall` to wait
    on. A call the caller abandons keeps its thread until it returns; :attr:`abandoned` counts them and
    :attr:`saturated` is true once ``max_abandoned`` are in flight, when the caller should make no new call
    (they would pile up threads behind a hung peer). ``max_abandoned=0`` never abandons anything: every call
    runs inline in the caller's thread, as does every call submitted without a timeout (``timeout=None``).

    At most ``max_idle`` threads wait idle for the next call; the others end after their call. Threads are
    daemons: an abandoned call stuck in Mooncake never blocks the interpreter's exit. After :meth:`close`
    every idle thread ends and every later thread ends after its call.
    """

    def __init__(self, max_abandoned: int, *, name: str = "KVTransferCall", max_idle: int = 2) -> None:
        if max_abandoned < 0:
            raise ValueError(f"max_abandoned: must be >= 0, got {max_abandoned}")
        self.max_abandoned = max_abandoned
        self.name = name
        self._max_idle = max_idle
        self._cond = threading.Condition(threading.Lock())
        self._idle: list[_Worker] = []
        self._abandoned = 0
        self._started = 0
        self._closed = False
        self._settled: list[Callable[[], None]] = []

    @property
    def abandoned(self) -> int:
        """Abandoned calls that have not returned yet."""
        with self._cond:
            return self._abandoned

    @property
    def saturated(self) -> bool:
        """True while ``max_abandoned`` (or more) abandoned calls are still in flight (never when it is 0)."""
        with self._cond:
            return 0 < self.max_abandoned <= self._abandoned

    def refuse(self, stop: Callable[[str], None], calls: str, blocked: str) -> bool:
        """Whether the caller must make no new call: while :attr:`saturated`, ``stop`` (a request deadline's
        ``stop``) is told why, naming the abandoned ``calls`` and what is ``blocked``."""
        if not self.saturated:
            return False
        stop(
            f"{self.abandoned} {calls} abandoned at their deadline are still in flight "
            f"(max_abandoned_calls={self.max_abandoned}): a peer hangs; no new {blocked} until one returns"
        )
        return True

    def submit(
        self, fn: Callable[[], _T], timeout: float | None, on_late_return: Callable[[BaseException | None], None]
    ) -> PendingCall[_T]:
        """Start ``fn()``: on a thread when the caller will wait at most ``timeout`` seconds for it (and
        abandoning is enabled), else inline, finished when this returns. ``on_late_return``: see
        :class:`PendingCall`."""
        if timeout is None or self.max_abandoned == 0:
            inline = PendingCall(None, fn, on_late_return)
            inline._execute()
            return inline
        call = PendingCall(self, fn, on_late_return)
        with self._cond:
            new = not self._idle
            if new:
                self._started += 1
                worker = _Worker(self, f"{self.name}-{self._started}")
            else:
                worker = self._idle.pop()
        worker.jobs.put(call)
        if new:
            worker.thread.start()
        return call

    def _park(self, worker: _Worker) -> bool:
        """After a call: keep ``worker`` idle for the next one (True) or let it end (False)."""
        with self._cond:
            if self._closed or len(self._idle) >= self._max_idle:
                return False
            self._idle.append(worker)
            return True

    def _late_return(self, call: PendingCall[Any]) -> None:
        call._release()
        with self._cond:
            self._abandoned -= 1
            settled = self._settled if self._abandoned == 0 else []
            if settled:
                self._settled = []
            self._cond.notify_all()
        for callback in settled:
            _run_callback(callback)

    def wait_settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no abandoned call is in flight; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._abandoned == 0, max(0.0, timeout))

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once no abandoned call is in flight: now (in this thread) if none is, else on the
        thread of the last one to return, after its ``on_late_return``."""
        with self._cond:
            if self._abandoned:
                self._settled.append(callback)
                return
        _run_callback(callback)

    def close(self) -> None:
        """End the idle threads; threads still running a call end after it (abandoned ones included)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.jobs.put(None)

    def __repr__(self) -> str:
        return f"CallRunner({self.name!r}, abandoned={self.abandoned}, max_abandoned={self.max_abandoned})"


def _run_callback(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        logger.exception("a callback run once the abandoned calls returned failed")
