"""What a demanding user hits on the first-hour command lines (``python -m mooncake_kvaddr demo``, ``demo --cluster``):
every failure is one clear message and a conventional exit status (2: the run could not be made; 1 is kept for
"ran, NOT VERIFIED"), never a traceback; ``--json PATH`` never leaves a report that says the opposite of the run;
and ``demo --cluster``'s options do not quietly break what the demo sets out to show (docs/deployment.md).

A test marked ``xfail(strict=True)`` fails on the current code, its reason says what and where: an open bug
(remove the mark with the fix) or, for Ctrl-C in ``demo --cluster``'s client close, a documented limitation.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest

import mooncake_kvaddr.demo as demo_module
import mooncake_kvaddr.demo_cluster as demo_cluster
from ha_workload import etcd_missing
from kvaddr_testing import live_children
from mooncake_kvaddr.__main__ import main as top_main
from mooncake_kvaddr._cli import VERBOSE_ENV
from mooncake_kvaddr.demo import main as demo_main
from mooncake_kvaddr.driver.cluster import ClusterError
from mooncake_kvaddr.driver.master import MasterError, process_is_running
from mooncake_kvaddr.driver.store import StoreError

SMALL = ["--tokens", "512", "--regions", "4", "--block-size", "64", "--block-bytes", "512"]


def _exit_status(call: Any) -> int:
    """The exit status a command line's ``main`` ends with: its return value, or argparse's ``SystemExit``."""
    try:
        return int(call())
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Any:
    """Nothing these tests start (an embedded master, etcd, HA masters) outlives its test."""
    before = {name: set(live_children(name)) for name in ("mooncake_master", "etcd")}
    yield
    for name, pids in before.items():
        assert set(live_children(name)) - pids == set(), f"{name} processes leaked"


# ------------------------------------------------------------------------------------- the embedded master


@pytest.mark.mooncake
def test_demo_reports_a_master_that_cannot_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master_args": ["-no_such_flag=1"]}))
    assert demo_main([*SMALL, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "demo failed: MasterError: mooncake_master exited" in err and "no_such_flag" in err, err


def test_demo_cluster_reports_a_missing_master_binary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import mooncake_kvaddr.driver.cluster as cluster_module

    if etcd_missing() is not None:
        pytest.skip(etcd_missing() or "")

    def no_master() -> NoReturn:  # what find_master_binary raises without Mooncake
        raise MasterError("mooncake_master not found: Mooncake is not installed")

    monkeypatch.setattr(cluster_module, "find_master_binary", no_master)
    assert top_main(["demo", "--cluster"]) == 2
    err = capsys.readouterr().err
    assert "demo --cluster failed: MasterError: mooncake_master not found" in err, err


# ------------------------------------------------------------------------------------- arguments, environment


@pytest.mark.mooncake
def test_demo_refuses_a_seed_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_status(lambda: demo_main([*SMALL, "--seed", str(2**64)])) == 2
    assert "--seed" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "demo --cluster"])
def test_a_bad_verbose_variable_is_one_line_not_a_traceback(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(VERBOSE_ENV, "maybe")

    def stop(*args: object, **kwargs: object) -> NoReturn:  # the run itself is not what this test is about
        raise ClusterError("stopped by the test") if "cluster" in command else ValueError("stopped by the test")

    monkeypatch.setattr(demo_module, "run", stop)
    monkeypatch.setattr(demo_cluster, "run_cluster_demo", stop)
    monkeypatch.setattr(demo_cluster, "find_etcd_binary", lambda: Path("/usr/bin/etcd"))
    argv = ["demo", *SMALL] if command == "demo" else ["demo", "--cluster"]
    assert _exit_status(lambda: top_main(argv)) == 2
    err = capsys.readouterr().err
    assert VERBOSE_ENV in err and "Traceback" not in err, err


def test_demo_help_names_the_cluster_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_status(lambda: top_main(["demo", "--help"])) == 0
    assert "--cluster" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- --json PATH


@pytest.mark.mooncake
def test_demo_json_path_that_cannot_be_written_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "no-such-directory" / "demo.json"
    assert _exit_status(lambda: demo_main([*SMALL, "--json", str(target)])) == 2
    assert str(target) in capsys.readouterr().err


def test_a_failed_demo_leaves_no_stale_verified_json(tmp_path: Path) -> None:
    report = tmp_path / "demo.json"
    report.write_text(json.dumps({"verified": True}) + "\n")  # an earlier, successful run's report
    # A run that fails before any store is set up (the configuration refuses the batch size).
    assert demo_main([*SMALL, "--max-regions-per-batch", "0", "--json", str(report)]) == 2
    if report.exists():
        assert json.loads(report.read_text()).get("verified") is False


# ------------------------------------------------------------------------------------- demo --cluster --chunks


@pytest.mark.mooncake
def test_demo_cluster_sizes_its_segment_for_the_chunks_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Either ``--chunks`` is bounded by what the segment holds (a usage error, before anything starts), or the
    client's segment is sized for both requests. (No Mooncake client is made here: one would tie this test
    process to the cluster's etcd for good, docs/deployment.md.)"""
    if etcd_missing() is not None:
        pytest.skip(etcd_missing() or "")
    chunks = 5000
    seen: list[int] = []

    class Recorder:
        def __init__(self, config: Any) -> None:
            seen.append(config.global_segment_size)
            raise StoreError("stopped by the test before the client is set up")

    monkeypatch.setattr(demo_cluster, "MooncakeStore", Recorder)
    status = _exit_status(lambda: demo_cluster.main(["--chunks", str(chunks)]))
    if seen:
        per_request = chunks * demo_cluster._REGIONS * demo_cluster._BLOCK_BYTES
        assert seen[0] >= 2 * per_request, (seen, 2 * per_request)
    else:
        assert status == 2  # refused as a usage error


# ------------------------------------------------------------------------------------- top-level usage


def test_usage_error_goes_to_standard_error() -> None:
    """``python -m mooncake_kvaddr`` with no command is a usage error: exit status 2, the usage on stderr."""
    done = subprocess.run([sys.executable, "-m", "mooncake_kvaddr"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage:" in done.stderr and done.stdout == "", (done.stdout, done.stderr)


# ------------------------------------------------------------------------------------- demo --cluster, a real run


class _ClusterDemo:
    """``python -m mooncake_kvaddr demo --cluster`` in a child process with a private ``TMPDIR``; its standard
    output is read line by line, each line with the time it came."""

    def __init__(self, tmp_path: Path) -> None:
        import mooncake_kvaddr

        package_root = str(Path(mooncake_kvaddr.__file__).resolve().parent.parent)
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.tmpdir))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_kvaddr", "demo", "--cluster"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.seen: list[str] = []
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.put((time.monotonic(), line))
        self.lines.put((time.monotonic(), ""))

    def next_line(self, timeout: float) -> tuple[float, str]:
        """The next line and when it came; ``(now, "")`` at the end of the output or after ``timeout``."""
        try:
            at, line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return time.monotonic(), ""
        self.seen.append(line)
        return at, line

    def wait_for(self, marker: str, timeout: float = 120.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            at, line = self.next_line(max(0.01, deadline - time.monotonic()))
            if marker in line:
                return at
            if not line:
                break
        self.end()
        pytest.fail(f"no {marker!r} line; output so far: {self.seen}")

    def ended(self, timeout: float) -> tuple[int | None, str, float]:
        """(exit status or None if still running after ``timeout``, standard error, seconds waited)."""
        started = time.monotonic()
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, "", time.monotonic() - started
        return self.proc.returncode, err, time.monotonic() - started

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()
        self._reader.join(timeout=5)

    def leftovers(self) -> list[str]:
        return sorted(path.name for path in self.tmpdir.iterdir())


needs_etcd = pytest.mark.skipif(etcd_missing() is not None, reason=etcd_missing() or "")


@pytest.mark.mooncake
@needs_etcd
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="a known limitation, documented (docs/configuration.md, 'Ctrl-C'): demo --cluster now says it closes "
    "(a line that names the 30 s), but Mooncake's HA client close() (MooncakeStore.__exit__, ~30 s) holds the GIL, "
    "so neither the SIGINT handler nor exit_on_interrupt's watcher thread can run until it returns (measured "
    "27 s, then 'interrupted', status 130); ending sooner needs Mooncake to release the GIL in close()",
)
def test_demo_cluster_says_it_closes_and_ctrl_c_ends_the_close_at_once(tmp_path: Path) -> None:
    demo = _ClusterDemo(tmp_path)
    try:
        last_result = demo.wait_for("request 'after': lookup hit")
        at, line = demo.next_line(timeout=5.0)
        said = "clos" in line and at - last_result < 2.0  # a line that says what the wait is for
        time.sleep(2.0)  # inside Mooncake's client close
        demo.proc.send_signal(signal.SIGINT)
        status, err, took = demo.ended(timeout=60.0)
    finally:
        demo.end()
    assert status == 130 and err == "interrupted\n", (status, err)
    assert said and took < 5.0, (line, at - last_result, took)


@pytest.mark.mooncake
@needs_etcd
def test_demo_cluster_ended_by_sigterm_leaves_no_etcd_data_directory(tmp_path: Path) -> None:
    demo = _ClusterDemo(tmp_path)
    try:
        demo.wait_for("stored request 'before'")
        demo.proc.send_signal(signal.SIGTERM)
        status, _, _ = demo.ended(timeout=30.0)
    finally:
        demo.end()
    assert status is not None
    deadline = time.monotonic() + 5.0
    while demo.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = demo.leftovers()
    shutil.rmtree(demo.tmpdir, ignore_errors=True)  # not 62 MB per run in pytest's directory
    assert leftovers == [], leftovers


# ------------------------------------------------------------------------------------- bench, ended by SIGTERM


def test_bench_ended_by_sigterm_leaves_no_child_running() -> None:
    import mooncake_kvaddr

    package_root = str(Path(mooncake_kvaddr.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "mooncake_kvaddr", "bench", "--no-mooncake", "--reps", "3"]  # ~20 s
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    orphans: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "bench on" in line:
                break
        kids = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert kids  # python -m mooncake_kvaddr.bench
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 2.0  # a parent-death signal acts at once; the bench alone runs far longer
        while time.monotonic() < deadline:
            orphans = [pid for pid in kids if process_is_running(pid)]
            if not orphans:
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        for pid in orphans:  # the test's own clean-up: never leave the orphan running
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert orphans == [], f"bench child {orphans} still running after its parent was ended by SIGTERM"


# ------------------------------------------------------------------------------------- more arguments, the report


def test_demo_refuses_a_zero_hash_block_size() -> None:
    def parse() -> int:
        demo_module._parse([*SMALL, "--hash-block-size", "0"])
        return 0  # accepted

    assert _exit_status(parse) == 2


def test_demo_report_rates_no_transfer_that_moved_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    # The report of a run whose embedded master was SIGKILLed at 'storing ...' (measured: figures as printed).
    report = {
        "verified": False,
        "mode": {"requested": "auto", "store": "multi_buffer", "load": "multi_buffer"},
        "copy_ms": {},
        "transfer_ms": {"put": 3.46, "get": 0.0},
        "staging_pool_bytes": 0,
        "chunks": 512,
        "regions": 64,
        "bytes": 64 << 20,
        "tokens": 65536,
        "block_size": 128,
        "block_bytes": 2048,
        "lookup_hit_tokens": 0,
        "stored_chunks": 0,
        "loaded_bytes": 0,
        "failed_block_ids": [],
        "master": "embedded",
        "region_budget": 1000,
        "timings_ms": {"setup": 175.55, "store_put": 3.46, "lookup": 0.95, "verify": 0.01, "close": 11950.46},
        "remeasured_ms": {},
    }
    demo_module._print_report(report)
    out = capsys.readouterr().out
    put_line = next(line for line in out.splitlines() if line.strip().startswith("store_put"))
    assert "MiB/s" not in put_line, put_line


@pytest.mark.mooncake
def test_demo_cluster_says_at_once_what_it_waits_for(tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "etcd"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 600\n")  # an etcd that never answers /health
    fake.chmod(0o755)
    import mooncake_kvaddr

    package_root = str(Path(mooncake_kvaddr.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_kvaddr", "demo", "--cluster"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        time.sleep(4.0)  # imports (~1 s), then the wait for etcd
        children = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    gone_by = time.monotonic() + 2.0
    while any(process_is_running(pid) for pid in children) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not [pid for pid in children if process_is_running(pid)], children  # the fake etcd was killed
    assert proc.returncode == 130 and err == "interrupted\n", (proc.returncode, err)
    assert "etcd" in out, f"nothing said in 4 s: {out!r}"


# ------------------------------------------------------------------------------------- EmbeddedCluster's flags


@pytest.mark.parametrize("arg", ["-ha_backend_connstring=10.0.0.1:2379", "--ha-backend-type=redis", "-cluster_id=mine"])
def test_cluster_refuses_flags_that_move_its_election_off_its_etcd(arg: str) -> None:
    """Mooncake's ``-ha_backend_connstring``/``-ha_backend_type`` override ``-etcd_endpoints`` (the masters would
    elect through another backend, not the cluster's loopback etcd), and ``-cluster_id`` publishes the leader
    where the cluster's ``etcd://`` clients do not look: the cluster refuses them as it refuses ``enable_ha``."""
    from mooncake_kvaddr.driver.cluster import EmbeddedCluster

    with pytest.raises(ValueError, match="master_args"):
        EmbeddedCluster(master_args=[arg]).close()


@pytest.mark.parametrize(
    "args",
    [
        ["-enable_ha=true", "-etcd_endpoints=10.0.0.5:2379"],
        ["-enable_ha=true", "-ha_backend_connstring=10.0.0.5:2379"],
    ],
)
def test_embedded_master_refuses_to_join_an_ha_election(args: list[str]) -> None:
    """The embedded master is one master on loopback: given HA flags it would join that etcd's election and publish
    ``127.0.0.1:<port>`` as the cluster's leader (measured), so both faces refuse them."""
    from mooncake_kvaddr.driver.config import StoreConfig
    from mooncake_kvaddr.driver.master import EmbeddedMaster

    with pytest.raises(ValueError, match="master_args"):
        StoreConfig(embedded_master=True, master_args=args)
    with pytest.raises(ValueError, match="extra_args"):
        EmbeddedMaster(extra_args=args).close()


@pytest.mark.parametrize("state", ["never started", "closed"])
def test_wait_for_leader_on_a_cluster_without_masters_says_so_at_once(state: str) -> None:
    """With no master to wait for (never started, or closed) ``wait_for_leader`` raises at once rather than poll
    for its whole timeout."""
    from mooncake_kvaddr.driver.cluster import EmbeddedCluster

    cluster = EmbeddedCluster(start_timeout_s=3.0)
    if state == "closed":
        cluster.close()
    started = time.monotonic()
    try:
        with pytest.raises(ClusterError):
            cluster.wait_for_leader()
    finally:
        cluster.close()
    assert time.monotonic() - started < 1.0
