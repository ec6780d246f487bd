"""EmbeddedMaster: readiness, stop paths, restart on the same ports, and no leaked process ever."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
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

from kvaddr_testing import live_children, wait_until
from mooncake_kvaddr.driver import master as master_module
from mooncake_kvaddr.driver import process as process_module
from mooncake_kvaddr.driver.config import StoreConfig
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


def test_a_zombie_process_is_not_running() -> None:
    """A child that exited but was not reaped yet (a zombie) has stopped: it does not count as running."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            stat_text = Path(f"/proc/{child.pid}/stat").read_text()
            if stat_text[stat_text.rfind(")") + 2] == "Z":
                break
            time.sleep(0.01)
        else:
            pytest.fail("the child never became a zombie")
        assert not master_module.process_is_running(child.pid)
    finally:
        child.wait()
    assert master_module.process_is_running(os.getpid())


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


# ------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rpc_port": 0}, ValueError, "rpc_port: must be 1..65535"),
        ({"metrics_port": 70000}, ValueError, "metrics_port: must be 1..65535"),
        ({"rpc_port": -1}, ValueError, "rpc_port"),
        ({"rpc_port": True}, TypeError, "rpc_port"),
        ({"metrics_port": "9003"}, TypeError, "metrics_port"),
        ({"rpc_port": 50051, "metrics_port": 50051}, ValueError, "must differ"),
        ({"start_timeout_s": float("nan")}, ValueError, "start_timeout_s"),
        ({"start_timeout_s": "1"}, TypeError, "start_timeout_s"),
        ({"log_level": 7}, ValueError, "log_level"),
        ({"port_attempts": True}, ValueError, "port_attempts"),
        ({"extra_args": [1]}, TypeError, "extra_args"),
    ],
)
def test_bad_arguments_are_rejected_at_construction(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        EmbeddedMaster(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("level", [0, 3])
def test_both_end_log_levels_reach_the_master_command(level: int) -> None:
    """glog's levels run 0 (INFO) to 3 (FATAL): both ends are taken and passed on as ``-minloglevel``, one past
    either end is refused (fresh mutant M11-12: level 3 was refused)."""
    master = EmbeddedMaster(rpc_port=50051, metrics_port=50052, log_level=level)
    command = master._command(Path("mooncake_master"))
    assert [arg for arg in command if arg.startswith("-minloglevel=")] == [f"-minloglevel={level}"]
    with pytest.raises(ValueError, match="log_level"):
        EmbeddedMaster(log_level=level + 1 if level == 3 else level - 1)


def test_one_fixed_port_never_collides_with_the_picked_one() -> None:
    (fixed,) = free_ports(1)
    for _ in range(20):
        master = EmbeddedMaster(rpc_port=fixed)
        master._pick_ports()
        assert master.rpc_port == fixed and master.metrics_port != fixed
        master.close()


# ------------------------------------------------------------------------------------------- readiness

# A stand-in master: answers GET /health with 200 on its metrics port and never opens its RPC port.
HEALTH_ONLY = r"""#!{python}
import http.server, sys
args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:] if "=" in a)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{{"status":"ok"}}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(args["metrics_port"])), H).serve_forever()
"""


def test_readiness_is_not_fooled_by_someone_else_on_the_rpc_port(tmp_path: Path) -> None:
    script = tmp_path / "health_only_master"
    script.write_text(HEALTH_ONLY.format(python=sys.executable))
    script.chmod(0o755)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        (metrics,) = free_ports(1)
        # /health says 200 and the RPC port accepts connections, but neither proves the child serves RPC.
        master = EmbeddedMaster(
            binary=script, rpc_port=squatter.getsockname()[1], metrics_port=metrics, start_timeout_s=2
        )
        with pytest.raises(MasterError, match="not ready"):
            master.start()
        assert not master.alive
        master.close()


def test_readiness_requires_our_child_to_own_the_health_port(tmp_path: Path) -> None:
    # Someone else answers /health on the metrics port; the child (which opens nothing) must not be "ready".
    script = fake_binary(tmp_path, "exec sleep 60")
    helper = tmp_path / "health_server"
    helper.write_text(HEALTH_ONLY.format(python=sys.executable))
    helper.chmod(0o755)
    rpc, metrics = free_ports(2)
    server = subprocess.Popen([str(helper), f"-metrics_port={metrics}"])
    try:
        assert wait_until(lambda: port_accepts(metrics), timeout=10)
        with socket.socket() as rpc_listener:
            rpc_listener.bind(("127.0.0.1", rpc))
            rpc_listener.listen()
            master = EmbeddedMaster(binary=script, rpc_port=rpc, metrics_port=metrics, start_timeout_s=1.5)
            with pytest.raises(MasterError, match="not ready"):
                master.start()
            master.close()
    finally:
        server.kill()
        server.wait(timeout=10)


def test_health_ok_is_the_status_line_alone() -> None:
    """The embedded master's readiness probe asks for a 200 status only (as before 22a2c7a): a 200 answer whose
    body breaks off is healthy there, while the body readers (the cluster's etcd and HA masters) get nothing."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def answer() -> None:
            for _ in range(2):
                conn, _ = server.accept()
                with conn:
                    conn.recv(4096)
                    conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"status"')

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        assert process_module.health_ok(port)
        assert process_module.health(port) is None
        thread.join(timeout=10)


# ------------------------------------------------------------------------------------------- concurrency


def master_children() -> set[int]:
    """Live ``mooncake_master`` processes whose parent is this process."""
    return set(live_children("mooncake_master"))


def test_concurrent_starts_spawn_one_master_and_close_stops_it() -> None:
    before = master_children()
    master = EmbeddedMaster()
    barrier = threading.Barrier(4)
    pids: list[int | None] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            barrier.wait()
            pids.append(master.start().pid)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not errors and len(set(pids)) == 1 and None not in pids
        assert len(master_children() - before) == 1
    finally:
        master.close()
    assert master_children() - before == set()


def start_quietly(master: EmbeddedMaster) -> None:
    with contextlib.suppress(MasterError):  # "closed" when close() won the race
        master.start()


def test_close_racing_start_leaves_nothing_running() -> None:
    before = master_children()
    for _ in range(3):
        master = EmbeddedMaster()
        starter = threading.Thread(target=start_quietly, args=(master,))
        starter.start()
        time.sleep(0.01)
        master.close()
        starter.join(timeout=60)
        assert not master.alive
        with pytest.raises(MasterError, match="closed"):
            master.start()
    assert master_children() - before == set()


def test_threaded_start_stop_stress_leaves_no_master() -> None:
    """Random start/stop/restart/kill/close from several threads on shared masters: 0 masters afterwards."""
    before = master_children()
    masters = [EmbeddedMaster(start_timeout_s=20) for _ in range(2)]
    rng_seed = 1234
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        import random

        rng = random.Random(rng_seed + index)
        for _ in range(6):
            master = rng.choice(masters)
            action = rng.choice(["start", "start", "stop", "restart", "kill"])
            try:
                getattr(master, action)()
            except MasterError as exc:
                if "closed" not in str(exc):
                    errors.append(exc)
            except BaseException as exc:  # reported below
                errors.append(exc)
        if index == 0:
            masters[0].close()  # one master closed while the others still work on it

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    for master in masters:
        master.close()
    assert not errors, errors
    assert all(not m.alive for m in masters)
    assert master_children() - before == set()


@pytest.mark.parametrize(
    "arg",
    [
        "-rpc_address=0.0.0.0",
        "--rpc_address=0.0.0.0",
        "-rpc_interface=eth0",  # its IPv4 address would override rpc_address, wherever that flag stands
        "-rpc_port=50051",
        "--metrics_host=::",
        "-metrics-port=9003",
        "-http_metadata_server_host=0.0.0.0",
        "-flagfile=/tmp/flags",  # could set any of the above
        "--fromenv=rpc_address",
    ],
)
def test_extra_flags_that_move_the_master_off_loopback_are_refused(arg: str) -> None:
    """Issue 39 item 6: extra flags came after the loopback ones, so (gflags: the last one wins) an
    ``-rpc_address=`` there made the embedded master listen elsewhere. Now refused, naming the argument, in
    EmbeddedMaster and in StoreConfig.master_args alike."""
    with pytest.raises(ValueError, match=rf"extra_args: '{re.escape(arg)}' sets "):
        EmbeddedMaster(extra_args=[arg])
    with pytest.raises(ValueError, match=rf"master_args: '{re.escape(arg)}' sets "):
        StoreConfig(master_args=(arg,))


@pytest.mark.parametrize("arg", ["--", "-enable_ha", "positional", "-=1", "---rpc_address=0.0.0.0"])
def test_extra_arguments_must_each_be_one_name_value_flag(arg: str) -> None:
    """``--`` or a positional argument ends gflags' flag parsing (the loopback flags after it would be
    ignored), and a bare ``-name`` may take the next argument as its value."""
    with pytest.raises(ValueError, match=r"is not one '-name=value' flag"):
        EmbeddedMaster(extra_args=[arg])


def test_the_loopback_flags_come_last() -> None:
    master = EmbeddedMaster(rpc_port=50051, metrics_port=50052, extra_args=["-default_kv_lease_ttl=2000", "--a=b"])
    command = master._command(Path("mooncake_master"))
    assert command[-4:] == ["-rpc_address=127.0.0.1", "-rpc_port=50051", "-metrics_host=127.0.0.1",
                            "-metrics_port=50052"]  # fmt: skip
    assert command.index("--a=b") < len(command) - 4
    assert StoreConfig(master_args=["-client_ttl=5", "--eviction_ratio=0.1"]).master_args == (
        "-client_ttl=5",
        "--eviction_ratio=0.1",
    )
