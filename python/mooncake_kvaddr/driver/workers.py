"""The transfer threads: one send thread and ``num_recv_threads`` receive threads sharing one load queue.

vLLM's Mooncake connector runs stores and loads on such threads (the same names), relying on Mooncake to
release the GIL while bytes move. Each submitted request gets a ``Future`` with its result (or exception).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

__all__ = ["TransferThreads"]

_Req = TypeVar("_Req")
_S = TypeVar("_S")
_L = TypeVar("_L")
_T = TypeVar("_T")

_Jobs = queue.Queue  # of (request, future) pairs, or None to stop one thread


class TransferThreads(Generic[_Req, _S, _L]):
    """Runs ``store(request)`` on the send thread and ``load(request)`` on the first free receive thread."""

    def __init__(self, store: Callable[[_Req], _S], load: Callable[[_Req], _L], num_recv_threads: int) -> None:
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
        self.threads.append(
            threading.Thread(target=_serve, args=(self._send, self._store), name="KVCacheStoreSendingThread",
                             daemon=True)
        )
        for i in range(self._num_recv_threads):
            self.threads.append(
                threading.Thread(target=_serve, args=(self._recv, self._load), name=f"KVCacheStoreRecvingThread-{i}",
                                 daemon=True)
            )
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
