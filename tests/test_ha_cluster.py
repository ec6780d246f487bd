"""An HA Mooncake cluster (etcd + HA masters on loopback) that loses its leader: the harness, and what the
driver's store, lookup and load do through a failover (docs/deployment.md, "When the leader dies").

Mooncake's client keeps one etcd connection per process for the life of the process, so every test here that
sets up a client uses the one module cluster; other clusters run without a client, or in a child process
(``demo --cluster``, bench/ha_failover.py). ``HA_FAILOVER_SLOW=1`` adds the 20-kill workload of
docs/deployment.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ha_workload import BLOCK_SIZE, CHUNKS, Pair, Workload, etcd_missing, kill_and_measure, store_config, summary
from kvaddr_testing import live_children
from mooncake_kvaddr.driver.cluster import (
    ClusterError,
    EmbeddedCluster,
    etcd_install_hint,
    find_etcd_binary,
)
from mooncake_kvaddr.driver.master import process_is_running
from mooncake_kvaddr.driver.store import MooncakeStore

pytestmark = pytest.mark.mooncake

ROOT = Path(__file__).resolve().parent.parent
REQUEST_TIMEOUT_S = 10.0
# The docs' target is 15 s with Mooncake's defaults (measured ~10-12 s); a loaded CI machine gets slack.
SERVICE_BOUND_S = 30.0


needs_etcd = pytest.mark.skipif(etcd_missing() is not None, reason=etcd_missing() or "")


@pytest.fixture(scope="module", autouse=True)
def no_leaked_etcd() -> Iterator[None]:
    """The session fixture of conftest.py checks masters; this checks etcd."""
    before = set(live_children("etcd"))
    yield
    assert set(live_children("etcd")) - before == set(), "etcd processes leaked"


# ---------------------------------------------------------------------------------------------- the harness


def test_a_missing_etcd_names_the_debian_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ClusterError, match="apt-get install etcd-server"):
        find_etcd_binary()
    cluster = EmbeddedCluster()
    with pytest.raises(ClusterError, match="etcd-server"):
        cluster.start()
    assert cluster.masters == [] and live_children("etcd") == []
    cluster.close()
    assert "/usr/bin/etcd" in etcd_install_hint()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"masters": 1}, ValueError),
        ({"masters": True}, ValueError),
        ({"master_args": "-enable_oplog=true"}, TypeError),
        ({"master_args": [1]}, TypeError),
        ({"master_args": ["-rpc_address=0.0.0.0"]}, ValueError),
        ({"master_args": ["-metrics_host=0.0.0.0"]}, ValueError),
        ({"master_args": ["-etcd_endpoints=10.0.0.1:2379"]}, ValueError),
        ({"master_args": ["--enable-ha=false"]}, ValueError),
        ({"master_args": ["-enable_oplog"]}, ValueError),
        ({"master_env": {"A=B": "1"}}, TypeError),
        ({"master_env": {"A": 1}}, TypeError),
        ({"start_timeout_s": 0}, ValueError),
        ({"log_level": 4}, ValueError),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        EmbeddedCluster(**kwargs)


@needs_etcd
def test_the_cluster_knows_its_leader_and_stops_everything() -> None:
    cluster = EmbeddedCluster(masters=3)
    with cluster:
        leader = cluster.leader()
        assert leader is not None and leader.serving()
        statuses = cluster.statuses()
        assert sorted(s.role for s in statuses if s is not None) == ["leader", "standby", "standby"]
        # Every master names the same leader: the one whose RPC port clients are sent to.
        assert {s.leader_address for s in statuses if s is not None} == {leader.rpc_address}
        assert cluster.master_server_address == f"etcd://{cluster.etcd_endpoint}"
        assert cluster.etcd_endpoint.startswith("127.0.0.1:")
        pids = [m.pid for m in cluster.masters] + [cluster.etcd.pid]
        data_dir = cluster._data_dir
        assert all(pid is not None and process_is_running(pid) for pid in pids)
    assert not any(process_is_running(pid) for pid in pids if pid is not None)
    assert not data_dir.exists()
    cluster.close()  # idempotent
    with pytest.raises(ClusterError, match="closed"):
        cluster.start()


# ---------------------------------------------------------------------------------------------- failover


@pytest.fixture(scope="module")
def ha_cluster() -> Iterator[EmbeddedCluster]:
    if etcd_missing() is not None:
        pytest.skip(etcd_missing() or "")
    with EmbeddedCluster(masters=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def ha_store(ha_cluster: EmbeddedCluster) -> Iterator[MooncakeStore]:
    with MooncakeStore(store_config(ha_cluster, REQUEST_TIMEOUT_S)) as store:
        yield store


def _revive_all(cluster: EmbeddedCluster) -> None:
    for master in cluster.masters:
        cluster.revive(master)
    cluster.wait_for_leader()


def test_calls_made_as_the_leader_dies_end_by_their_deadline_and_fail_per_block(
    ha_cluster: EmbeddedCluster, ha_store: MooncakeStore
) -> None:
    """Store, lookup and load in both transfer modes, issued the moment the leader is SIGKILLed: each returns
    within its deadline without raising, a failed load names its blocks and writes no wrong byte, service
    comes back by itself, the keys the cluster lost are reported failed per block (lookup: not a hit), and
    stores after the failover load back byte for byte."""
    _revive_all(ha_cluster)
    pairs = {mode: Pair(ha_store, mode, f"edge-{mode}") for mode in ("multi_buffer", "staged")}
    try:
        for pair in pairs.values():
            assert pair.store(1).ok and pair.lookup(1) == CHUNKS * BLOCK_SIZE
        outcomes: dict[str, Any] = {}
        errors: list[BaseException] = []

        def call(name: str, fn: Any) -> None:
            start = time.monotonic()
            try:
                value = fn()
            except BaseException as exc:  # reported below: the public API must not raise for store trouble
                errors.append(exc)
                return
            outcomes[name] = (value, time.monotonic() - start)

        threads = []
        for mode, pair in pairs.items():
            threads += [
                threading.Thread(target=call, args=(f"store-{mode}", lambda p=pair: p.store(2))),
                threading.Thread(target=call, args=(f"lookup-{mode}", lambda p=pair: p.lookup(1))),
                threading.Thread(target=call, args=(f"load-{mode}", lambda p=pair: p.load(1))),
            ]
        killed = ha_cluster.kill_leader()
        killed_at = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S + 30)
        assert not errors, errors
        assert len(outcomes) == len(threads)
        for name, (value, seconds) in outcomes.items():
            assert seconds <= REQUEST_TIMEOUT_S, f"{name} took {seconds:.2f} s"
            if name.startswith("load"):
                result, right, wrong = value
                assert wrong == 0
                assert right + len(result.failed_block_ids) == CHUNKS, name
        ha_cluster.wait_for_leader(SERVICE_BOUND_S, exclude=killed)
        for mode, pair in pairs.items():
            deadline = killed_at + SERVICE_BOUND_S
            while not pair.store(3).ok:
                assert time.monotonic() < deadline, f"{mode}: no store succeeded {SERVICE_BOUND_S} s after the kill"
                time.sleep(0.2)
            result, right, wrong = pair.load(3)
            assert result.ok and right == CHUNKS and wrong == 0, mode
            # Without replication the new leader never heard of request 1: every block fails, none is a hit.
            assert pair.lookup(1) == 0
            lost, right, wrong = pair.load(1)
            assert right == 0 and wrong == 0
            assert lost.failed_block_ids == set(pair.ids) and not lost.loaded_block_ids
            assert lost.outcomes.get("not_found", 0) == CHUNKS, lost.outcomes
    finally:
        for pair in pairs.values():
            pair.close()
        _revive_all(ha_cluster)


def test_a_workload_rides_through_a_failover(ha_cluster: EmbeddedCluster, ha_store: MooncakeStore) -> None:
    """A store / lookup / load loop while the leader is killed: no wrong byte, no call past its deadline, no
    lookup hit that cannot be loaded, service back by itself."""
    _revive_all(ha_cluster)
    pair = Pair(ha_store, "auto", "workload")
    probe = Pair(ha_store, "auto", "probe")
    workload = Workload(pair, [])
    workload.start()
    try:
        result = kill_and_measure(ha_cluster, probe, workload, 7, service_timeout_s=SERVICE_BOUND_S)
        time.sleep(0.5)
    finally:
        workload.stop()
        pair.close()
        probe.close()
    report = summary([result], workload.stats, REQUEST_TIMEOUT_S)
    assert report["errors"] == [] and report["unloadable"] == [], report
    assert report["wrong_blocks"] == 0 and report["calls_past_deadline"] == 0 and report["unloadable_hits"] == 0
    assert 0 < result.service_s <= SERVICE_BOUND_S
    # The workload really ran on both sides of the kill, and stores failed while no leader served.
    killed_at = workload.kills[0]
    calls = workload.stats.calls
    assert any(c.kind == "load" and c.ok and c.end < killed_at for c in calls)
    assert any(c.kind == "load" and c.ok and c.start > killed_at for c in calls)
    assert any(c.kind == "store" and not c.ok and c.start >= killed_at - 0.1 for c in calls)
    # Without replication nothing stored before the kill survives, and the lookup says so.
    assert (result.settled_survived, result.fresh_survived, result.settled_hit) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------- replication


def _bench(*args: str) -> dict[str, Any]:
    script = ROOT / "bench" / "ha_failover.py"
    if not script.exists():
        pytest.skip("bench/ha_failover.py is not in this tree (tests copied without the checkout)")
    if etcd_missing() is not None:
        pytest.skip(etcd_missing() or "")
    import mooncake_kvaddr

    package_root = Path(mooncake_kvaddr.__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")])
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ha_failover_{os.getpid()}_{time.monotonic_ns()}.json"
    try:
        done = subprocess.run(
            [sys.executable, str(script), *args, "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=3000,
            env=env,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        settings: dict[str, Any] = {s["setting"]: s for s in json.loads(out.read_text())["settings"]}
        return settings
    finally:
        out.unlink(missing_ok=True)


def _check_targets(report: dict[str, Any], service_bound_s: float) -> None:
    assert report["wrong_blocks"] == 0 and report["calls_past_deadline"] == 0, report
    assert report["unloadable_hits"] == 0 and report["errors"] == [], report
    assert report["service_s"]["worst"] <= service_bound_s, report


def test_the_cluster_demo_shows_the_oplog_keeping_a_settled_request() -> None:
    """``demo --cluster`` (masters with ``-enable_oplog=true``): a request stored a second before the kill is
    served byte for byte by the new leader, and one stored after it too. A child process: this one's client
    is bound to the module cluster's etcd."""
    if etcd_missing() is not None:
        pytest.skip(etcd_missing() or "")
    import mooncake_kvaddr

    env = dict(os.environ)
    package_root = Path(mooncake_kvaddr.__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "mooncake_kvaddr", "demo", "--cluster"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "request 'before': lookup hit 256 of 256 tokens; 16/16 chunks loaded byte for byte" in out, out
    assert "request 'after': lookup hit 256 of 256 tokens; 16/16 chunks loaded byte for byte" in out, out
    service = float(out.split("time to service: ", 1)[1].split(" s", 1)[0])
    assert 0 < service <= SERVICE_BOUND_S, out
    assert "Local segment descriptor" not in done.stderr  # Mooncake's log stays hidden without --verbose


def test_the_cluster_demo_says_in_one_line_that_etcd_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mooncake_kvaddr.__main__ import main

    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["demo", "--cluster"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "etcd-server" in lines[0] and lines[0].startswith("demo --cluster needs etcd"), lines


@pytest.mark.skipif(
    not os.environ.get("HA_FAILOVER_SLOW"), reason="about 10 minutes; set HA_FAILOVER_SLOW=1 to run 20 kills twice"
)
def test_twenty_kills_meet_the_targets() -> None:
    """docs/deployment.md's figures (bench/ha_failover.py): 20 kills without and with the oplog, each with the
    workload running; time to service <= 15 s."""
    settings = _bench("--kills", "20", "--replication", "none,oplog")
    for report in settings.values():
        _check_targets(report, 15.0)
    assert sum(settings["none"]["settled_survived"]) == 0
    assert settings["oplog"]["settled_survived"] == [CHUNKS] * 20


def test_the_clusters_own_flags_come_last() -> None:
    """gflags takes a flag's last occurrence: the loopback and HA flags follow every extra flag."""
    from pathlib import Path

    from mooncake_kvaddr.driver.cluster import EmbeddedCluster

    cluster = EmbeddedCluster(master_args=["-enable_oplog=true"])
    cluster._etcd = type("Etcd", (), {"endpoint": "127.0.0.1:2379"})()
    argv = cluster._master_command(Path("mooncake_master"))(50051, 9003)
    assert argv.index("-enable_oplog=true") < min(i for i, a in enumerate(argv) if a.startswith("-rpc_address="))
    assert argv[-1].startswith("-minloglevel=") and "-rpc_address=127.0.0.1" in argv

