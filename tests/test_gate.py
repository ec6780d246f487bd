"""The one call gate (driver/gate.py) on its own: what it admits in each state, and that close waits for and
releases nothing under a call in flight."""

from __future__ import annotations

import os
import threading

import pytest

from mooncake_kvaddr.driver.gate import CallGate, GateState
from mooncake_kvaddr.driver.store import StoreClosedError


def test_a_gate_made_not_ready_admits_nothing_until_opened() -> None:
    gate = CallGate("Thing", ready=False, not_ready="Thing is not set up")
    with pytest.raises(StoreClosedError, match="not set up"), gate.admitted():
        pass
    gate.open()
    with gate.admitted():
        assert gate.in_flight == 1
    assert gate.in_flight == 0 and gate.state is GateState.READY


def test_closing_admits_only_queued_calls_and_closed_admits_none() -> None:
    gate = CallGate("Thing")
    assert gate.begin_close() and gate.closed and gate.state is GateState.CLOSING
    with pytest.raises(StoreClosedError, match="Thing is closing"), gate.admitted():
        pass
    with gate.admitted(queued=True):  # accepted before close began: still runs
        pass
    assert gate.release() and gate.state is GateState.CLOSED
    for queued in (False, True):
        with pytest.raises(StoreClosedError, match="Thing is closed"), gate.admitted(queued=queued):
            pass
    assert not gate.release() and not gate.begin_close()  # released once


def test_release_waits_for_no_call_and_never_happens_under_one() -> None:
    gate = CallGate("Thing")
    inside, leave = threading.Event(), threading.Event()

    def call() -> None:
        with gate.admitted():
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=call)
    worker.start()
    assert inside.wait(10)
    assert gate.begin_close()
    assert not gate.wait_idle(0.05)  # the call is still in flight
    assert not gate.release()  # nothing is released under it
    assert gate.state is GateState.CLOSING
    leave.set()
    worker.join(10)
    assert gate.wait_idle(1) and gate.release()


def test_a_never_opened_gate_closes_at_once() -> None:
    gate = CallGate("Thing", ready=False)
    assert not gate.begin_close() and gate.state is GateState.CLOSED
    gate.open()  # too late: stays closed
    with pytest.raises(StoreClosedError), gate.admitted():
        pass


def test_close_in_one_call_is_true_once_and_false_for_every_later_caller() -> None:
    """``close()`` (begin, wait idle, release) answers True to the one caller that must release the resources;
    a second ``close()``, once closing has begun or ended, answers False (nothing is released twice)."""
    gate = CallGate("test")
    assert gate.close(timeout=1.0) is True and gate.state is GateState.CLOSED
    assert gate.close(timeout=1.0) is False


def test_a_forked_child_is_refused_at_once_and_releases_nothing() -> None:
    """Issue 39 item 5: the gate notes the process that opened it; in a fork, a call and a close raise
    StoreClosedError naming both processes (Mooncake's client would hang there, and a close would tear down
    what the parent still uses). A gate never opened, or already closed, has nothing to refuse."""
    opened, later, closed = CallGate("Thing"), CallGate("Later", ready=False), CallGate("Gone")
    closed.close()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without any cleanup
        lines = []
        for what in (lambda: opened.admitted().__enter__(), opened.begin_close, closed.begin_close):
            try:
                lines.append(f"ok {what()}")
            except StoreClosedError as exc:
                lines.append(str(exc))
        later.open()
        with later.admitted():
            lines.append(f"later {later.pid == os.getpid()}")
        os.write(write, "\n".join(lines).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        lines = pipe.read().split("\n")
    parent = os.getpid()
    refusal = f"Thing was opened in process {parent}; this is process {pid}, a fork of it"
    assert lines[0].startswith(refusal) and lines[1].startswith(refusal), lines
    assert lines[2:] == ["ok False", "later True"], lines
    assert opened.state is GateState.READY and opened.pid == parent
    with opened.admitted():
        assert opened.in_flight == 1
