"""EmbeddedMaster: readiness, stop paths, restart on the same ports, and no leaked process ever."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvaddr_testing import wait_until
from mooncake_kvaddr.driver import master as master_module
from mooncake_kvaddr.driver.master import (
    EmbeddedMaster,
    MasterError,
    find_master_binary,
    free_ports,
    process_is_running,
)

pytestmark = pytest.mark.mooncake


def health_status(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def port_accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run_child(code: str, timeout: float = 30) -> subprocess.Popen[str]:
    """A python child running ``code`` that prints the master pid on its first stdout line."""
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_find_master_binary_is_executable() -> None:
    binary = find_master_binary()
    assert binary.name == "mooncake_master" and os.access(binary, os.X_OK)


def test_start_is_ready_then_close_leaves_no_process() -> None:
    master = EmbeddedMaster()
    assert master.pid is None and not master.alive
    with pytest.raises(MasterError, match="not been started"):
        _ = master.rpc_address
    started = time.monotonic()
    master.start()
    try:
        assert time.monotonic() - started < 5
        pid = master.pid
        assert pid is not None and process_is_running(pid) and master.alive
        assert master.rpc_address == f"127.0.0.1:{master.rpc_port}"
        assert master.rpc_port != master.metrics_port
        # Ready means both the admin endpoint and the RPC port answer.
        assert health_status(master.metrics_port) == 200
        assert port_accepts(master.rpc_port)
        assert master.start() is master  # already running: no second process
        assert master.pid == pid
    finally:
        master.close()
    assert not master.alive and master.pid is None
    assert not process_is_running(pid)
    master.close()  # idempotent
    with pytest.raises(MasterError, match="closed"):
        master.start()


def test_context_manager_restart_and_kill() -> None:
    with EmbeddedMaster() as master:
        first_pid, address = master.pid, master.rpc_address
        assert first_pid is not None
        master.restart()
        assert master.rpc_address == address and master.pid != first_pid
        assert not process_is_running(first_pid)
        assert health_status(master.metrics_port) == 200

        second_pid = master.pid
        assert second_pid is not None
        master.kill()
        assert not master.alive and master.returncode == -signal.SIGKILL
        assert not process_is_running(second_pid)

        master.start()  # same ports again after a crash
        assert master.alive and master.rpc_address == address
        last_pid = master.pid
    assert last_pid is not None and not process_is_running(last_pid)


def test_fixed_port_in_use_fails_fast_with_log_tail() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        (free,) = free_ports(1)
        master = EmbeddedMaster(rpc_port=free, metrics_port=taken.getsockname()[1])
        started = time.monotonic()
        expected = r"exited with code 1 during startup[\s\S]*Address already in use"
        with pytest.raises(MasterError, match=expected):
            master.start()
        assert time.monotonic() - started < 10
        assert not master.alive
        master.close()


def test_auto_ports_retry_after_a_lost_race(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        calls: list[list[int]] = []
        real = master_module.free_ports

        def racy_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
            # The first pick hands out a port someone else already holds, as a lost race would.
            ports = [busy, *real(count - 1)] if not calls else real(count, host)
            calls.append(ports)
            return ports

        monkeypatch.setattr(master_module, "free_ports", racy_free_ports)
        with EmbeddedMaster() as master:
            assert len(calls) == 2
            assert master.rpc_port != busy and master.alive


def fake_binary(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake_master"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_start_timeout_kills_a_master_that_never_gets_ready(tmp_path: Path) -> None:
    binary = fake_binary(tmp_path, "echo booting >&2; exec sleep 60")
    master = EmbeddedMaster(binary=binary, start_timeout_s=0.5)
    with pytest.raises(MasterError, match=r"not ready after 0\.5 s[\s\S]*booting"):
        master.start()
    assert not master.alive
    master.close()


def test_master_dying_at_startup_reports_its_log(tmp_path: Path) -> None:
    master = EmbeddedMaster(binary=fake_binary(tmp_path, "echo 'bad flag -x' >&2; exit 3"), port_attempts=2)
    with pytest.raises(MasterError, match=r"code 3[\s\S]*bad flag -x"):
        master.start()
    master.close()


def test_invalid_arguments() -> None:
    with pytest.raises(TypeError, match="extra_args"):
        EmbeddedMaster(extra_args="-v=1")
    with pytest.raises(ValueError, match="start_timeout_s"):
        EmbeddedMaster(start_timeout_s=0)
    with pytest.raises(ValueError, match="port_attempts"):
        EmbeddedMaster(port_attempts=0)


def test_master_started_from_a_short_lived_thread_survives_the_thread() -> None:
    # PR_SET_PDEATHSIG fires when the forking *thread* exits; the spawner thread must absorb that.
    started: list[EmbeddedMaster] = []
    worker = threading.Thread(target=lambda: started.append(EmbeddedMaster().start()))
    worker.start()
    worker.join(timeout=30)
    (master,) = started
    try:
        time.sleep(1.2)  # SIGTERM would have stopped it in ~0.9 s
        assert master.alive
    finally:
        master.close()


def test_garbage_collection_stops_the_master() -> None:
    master = EmbeddedMaster().start()
    pid = master.pid
    assert pid is not None
    del master
    assert wait_until(lambda: not process_is_running(pid), timeout=15)


def test_parent_sigkill_leaves_no_master_behind() -> None:
    child = run_child(
        """
        import sys, time
        from mooncake_kvaddr.driver.master import EmbeddedMaster
        m = EmbeddedMaster().start()
        print(m.pid, flush=True)
        time.sleep(120)
        """
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip(), f"child did not start a master: {child.stderr.read() if child.stderr else ''}"
        pid = int(line)
        assert process_is_running(pid)
        child.kill()  # SIGKILL: no atexit, no finalizer; only the parent-death signal is left
        child.wait(timeout=10)
        gone = wait_until(lambda: not process_is_running(pid), timeout=15)
        assert gone, f"master {pid} outlived its parent"
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)
        child.communicate(timeout=10)


def test_interpreter_exit_without_close_stops_the_master() -> None:
    child = run_child(
        """
        from mooncake_kvaddr.driver.master import EmbeddedMaster
        m = EmbeddedMaster().start()
        print(m.pid, flush=True)
        """
    )
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, (child.returncode, err)
    pid = int(out.split()[0])
    # atexit ran the finalizer (SIGTERM + wait) before the interpreter exited.
    assert not process_is_running(pid)
