"""Multi-host faults over Mooncake's TCP transport, with three network namespaces (docs/multihost.md).

A master, a writer that holds the only segment, and a reader (a pure client: every byte it loads crosses the
bridge) run in their own namespaces. The reader loads in a loop while a fault is injected mid-load; every load
is checked chunk by chunk against the bytes it should hold (destination blocks pre-filled with a sentinel, two
data sets alternating so that a stale byte of the previous load is caught):

* nothing reported loaded that was not (``wrong == 0``), no stale bytes (``stale == 0``), every chunk either
  loaded or failed, and a staged load never writes a failed chunk's blocks (``partial == 0``);
* every load returns within its bound (``LOAD_BOUND_S``; see docs/multihost.md for where it comes from);
* once the fault is repaired, later loads succeed;
* no process or namespace outlives the test (the ``cluster`` fixture checks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mooncake_kvaddr.bench.netns import (
    NAME_PREFIX,
    NetnsCluster,
    Worker,
    WorkerTimeout,
    list_namespaces,
    sweep_stale,
    unavailable_reason,
)
from mooncake_kvaddr.driver.master import process_is_running

pytestmark = [pytest.mark.multihost, pytest.mark.mooncake]

# Mooncake knobs the tests shorten (docs/multihost.md): the master-RPC timeout (default 30 s) and the TCP
# transport's no-progress timeout (default 30 s). The master forgets a silent client after CLIENT_TTL_S.
RPC_TIMEOUT_S = 3.0
WORKER_ENV = {
    "MC_RPC_TIMEOUT_MS": str(int(RPC_TIMEOUT_S * 1000)),
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "3",
    "MC_TCP_STATUS_TIMEOUT_SEC": "3",
}
CLIENT_TTL_S = 5
# A failed master RPC costs the RPC timeout, then ~4.3 s per reconnect attempt (measured); the driver stops a
# request's remaining sub-batches after the first "master unreachable". So a load returns within about
# RPC_TIMEOUT_S + 2 x 4.3 s; LOAD_BOUND_S adds slack for a shared 2-core machine.
CONNECT_S = 4.3
LOAD_BOUND_S = RPC_TIMEOUT_S + 2 * CONNECT_S + 5.0
# After a repair: the first loads may still wait out a reconnect or a remount.
RECOVERY_BOUND_S = 30.0

# 12.5 MiB per load: 7 multi-buffer sub-batches of <= 1000 regions, or 25 staged batches.
REGIONS, CHUNKS, BLOCK_BYTES = 16, 400, 2048
SEGMENT = 128 << 20
STAGING = 512 << 10  # 16 keys of 32 KiB per staged batch
DATASETS = [["A", 1], ["B", 2]]
# The fault goes in while the reader holds back Mooncake call PAUSE_CALL of a load (see fault_during_loop).
PAUSE_CALL, PAUSE_S = 3, 0.5
MODES = ["staged", "multi_buffer"]


@pytest.fixture
def cluster() -> Iterator[NetnsCluster]:
    """A started cluster; afterwards every process it started is gone and so are its namespaces."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    running = NetnsCluster(worker_env=WORKER_ENV, master_args=[f"-client_ttl={CLIENT_TTL_S}"])
    try:
        running.start()
        yield running
    finally:
        running.close()
        leftovers = [name for name in list_namespaces() if name.startswith(running.run_id)]
        alive = [pid for pid in running.started_pids if process_is_running(pid)]
        assert not leftovers, f"namespaces left behind: {leftovers}"
        assert not alive, f"processes left behind: {alive}"


# ------------------------------------------------------------------------------------------- helpers


def setup_worker(cluster: NetnsCluster, role: str, mode: str, *, segment: int) -> Worker:
    worker = cluster.spawn_worker(role)
    worker.call("setup", 60, master=cluster.master_address, hostname=cluster.nodes[role].address, segment=segment)
    staging = STAGING if role == "reader" else None
    worker.call("cache", 60, cache="c", mode=mode, regions=REGIONS, blocks=CHUNKS + 1, block_bytes=BLOCK_BYTES,
                staging_bytes=staging)
    return worker


def store_datasets(writer: Worker) -> None:
    for tag, seed in DATASETS:
        writer.call("fill", 60, cache="c", seed=seed)
        report = writer.call("store", 60, cache="c", tag=tag, chunks=CHUNKS)
        assert report["stored_ok"], report


def start_pair(cluster: NetnsCluster, mode: str) -> tuple[Worker, Worker]:
    writer = setup_worker(cluster, "writer", mode, segment=SEGMENT)
    reader = setup_worker(cluster, "reader", mode, segment=0)
    store_datasets(writer)
    return writer, reader


def check_load(report: dict[str, Any], mode: str, bound: float = LOAD_BOUND_S) -> None:
    """The invariants every load must keep, fault or not."""
    where = {k: report.get(k) for k in ("index", "seconds", "outcomes", "error", "mode")}
    assert report["wrong"] == 0, f"chunks reported loaded with wrong bytes: {report}"
    assert report["stale"] == 0, f"stale bytes in the KV cache: {report}"
    assert report["unaccounted"] == 0 and report["overlap"] == 0, report
    assert report["verified"] == report["reported_loaded"], report
    assert report["verified"] + report["reported_failed"] == report["chunks"] == CHUNKS, report
    if mode == "staged":
        assert report["partial"] == 0, f"a staged load wrote a failed chunk's blocks: {report}"
    assert report["seconds"] <= bound, f"load took {report['seconds']:.1f} s > bound {bound:.1f} s: {where}"


def load_once(reader: Worker, mode: str, tag: str = "A", seed: int = 1) -> dict[str, Any]:
    report = reader.call("load", LOAD_BOUND_S + 10, cache="c", tag=tag, chunks=CHUNKS, seed=seed)
    check_load(report, mode)
    return report


def wait_recovered(
    reader: Worker, mode: str, bound: float = RECOVERY_BOUND_S, holder: Worker | None = None
) -> list[dict[str, Any]]:
    """Load until a load verifies every chunk (each attempt checked), within ``bound`` seconds. On failure
    the message carries the reader's exist answers and the Mooncake log of the reader (and of ``holder``)."""
    deadline = time.monotonic() + bound
    attempts: list[dict[str, Any]] = []
    while True:
        attempts.append(load_once(reader, mode, *DATASETS[len(attempts) % 2]))
        if attempts[-1]["verified"] == CHUNKS:
            return attempts
        if time.monotonic() >= deadline:
            present = {tag: reader.call("exist", 60, cache="c", tag=tag, chunks=CHUNKS) for tag, _ in DATASETS}
            raise AssertionError(
                f"no full load within {bound} s of the repair: {attempts[-3:]}; the reader's exist answers: "
                f"{present}; the reader's stderr (Mooncake's log) ends:\n{reader.stderr_tail()}"
                + ("" if holder is None else f"\nthe segment holder's stderr ends:\n{holder.stderr_tail()}")
            )
        time.sleep(0.2)


def wait_forgotten(reader: Worker, since_fault_s: float, bound: float = RECOVERY_BOUND_S) -> None:
    """Wait until the master lists none of the data sets' objects (their only holder died ``since_fault_s``
    ago): the client TTL, then the master's next check."""
    start = time.monotonic()
    while True:
        present = {tag: reader.call("exist", 60, cache="c", tag=tag, chunks=CHUNKS) for tag, _ in DATASETS}
        if all(p["present"] == 0 for p in present.values()):
            return
        waited = time.monotonic() - start
        assert waited < bound, (
            f"the master still lists the dead writer's objects {since_fault_s + waited:.0f} s after it died "
            f"(client TTL {CLIENT_TTL_S} s): {present}"
        )
        time.sleep(0.5)


def fault_during_loop(
    reader: Worker, mode: str, inject: Callable[[], None], repair: Callable[[], None], fault_s: float
) -> tuple[list[dict[str, Any]], float, float]:
    """Run a load loop; inject a fault in the middle of load 2 and repair it ``fault_s`` later.

    The reader announces Mooncake call ``PAUSE_CALL`` of load 2 and waits ``PAUSE_S`` before making it; the
    fault goes in during that wait, so calls before it ran healthy and the rest run into the fault. Returns
    the loop's per-load reports (each already checked) and the fault/repair wall-clock times.
    """
    # The loop runs 8 s past the repair's planned time (less what loads 1 and 2 took), so that on a loaded
    # machine, where loads against the dead master are slow, loads still start after the repair.
    reader.send(
        "load_loop", cache="c", datasets=DATASETS, chunks=CHUNKS, duration_s=fault_s + 8.0,
        pause={"iteration": 2, "call": PAUSE_CALL, "seconds": PAUSE_S},
    )  # fmt: skip
    reader.event("paused", 3 * LOAD_BOUND_S)
    t_fault = time.time()
    inject()
    time.sleep(fault_s)
    t_repair = time.time()
    repair()
    reply = reader.reply("load_loop", fault_s + 2 * LOAD_BOUND_S + 10)
    reports = reply["iterations"]
    if os.environ.get("MULTIHOST_DEBUG"):
        for r in reports:
            print(f"{r['index']:3d} {r['t_end'] - t_fault:+7.2f} {r['seconds']:6.2f}s calls={r['calls']} "
                  f"ok={r['verified']} failed={r['reported_failed']} partial={r['partial']} {r['outcomes']}")
    for report in reports:
        check_load(report, mode)
    assert all(r["verified"] == CHUNKS for r in reports[:2]), reports[:2]
    faulted = reports[2]
    assert faulted["calls"] >= PAUSE_CALL, f"the fault did not land inside load 2: {faulted}"
    return reports, t_fault, t_repair


# ------------------------------------------------------------------------------------------- the harness


def _host_state() -> tuple[str, str]:
    link = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    addr = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return link, addr


def test_harness_builds_private_network_and_tears_it_down() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    host_before = _host_state()
    with NetnsCluster() as cluster:
        assert set(cluster.namespaces) <= set(list_namespaces())
        assert len(cluster.namespaces) == 4
        # The host sees none of the cluster's interfaces or addresses ...
        assert _host_state() == host_before
        # ... and the hosts inside reach the master, while the caller's namespace cannot.
        assert cluster.reachable("reader", "master", 50051)
        assert cluster.reachable("writer", "master", 50051)
        master_pid = cluster.master_pid
        assert master_pid is not None and master_pid in cluster.pids()
        cluster.link_down("reader")
        assert not cluster.link_is_up("reader")
        assert not cluster.reachable("reader", "master", 50051, timeout=0.5)
        cluster.link_up("reader")
        assert cluster.reachable("reader", "master", 50051)
        names = cluster.namespaces
    assert not set(names) & set(list_namespaces())
    assert not process_is_running(master_pid)
    assert _host_state() == host_before


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_teardown_on_exception_kills_workers_and_namespaces(exc_type: type[BaseException]) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    seen: dict[str, Any] = {}
    with pytest.raises(exc_type):
        with NetnsCluster() as cluster:
            worker = cluster.spawn_worker("writer")
            worker.signal(signal.SIGSTOP)  # a stopped process must not survive teardown either
            seen.update(names=cluster.namespaces, pids=cluster.started_pids)
            raise exc_type("boom")
    assert not set(seen["names"]) & set(list_namespaces())
    assert not [pid for pid in seen["pids"] if process_is_running(pid)]


def test_sweep_removes_only_stale_namespaces_with_the_prefix() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{NAME_PREFIX}-{dead.pid}-abc123-w"  # creator gone
    live = f"{NAME_PREFIX}-{os.getpid()}-abc123-w"  # creator is this process
    other = f"{NAME_PREFIX}x-{dead.pid}-abc123-w"  # not our prefix
    created = []
    try:
        for name in (stale, live, other):
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
            created.append(name)
        sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
        removed = sweep_stale()
        assert stale in removed
        assert live not in removed and other not in removed
        names = set(list_namespaces()) | set(list_namespaces(NAME_PREFIX + "x"))
        assert stale not in names and live in names and other in names
        sleeper.wait(timeout=10)  # the process inside the stale namespace was killed
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_verify_catches_every_lie_a_load_could_tell() -> None:
    """The checker the fault tests rely on: wrong, stale, partial and unaccounted chunks are all seen."""
    import numpy as np

    from mooncake_kvaddr.bench.netns_client import dataset, verify
    from mooncake_kvaddr.driver.transfer import LoadResult

    expected = dataset(1, 2, 7, 64)
    other = dataset(2, 2, 7, 64)
    regions = [np.full((7, 64), 0xA5, dtype=np.uint8) for _ in range(2)]
    for region, want, old in zip(regions, expected, other, strict=True):
        region[1] = want[1]  # 1: loaded, right bytes
        region[2] = want[2]
        region[2, 5] ^= 1  # 2: "loaded", one byte wrong
        region[3] = old[3]  # 3: failed, holds another data set's bytes (stale)
        region[4, :10] = want[4, :10]  # 4: failed, partly written with the right bytes
        # 5: failed, untouched; 6: not reported at all
    result = LoadResult("r", loaded_block_ids={1, 2}, failed_block_ids={3, 4, 5})
    report = verify(regions, expected, [1, 2, 3, 4, 5, 6], result, 0xA5)
    assert report["verified"] == 1 and report["wrong"] == 1
    assert report["stale"] == 2  # block 3, and block 2's flipped byte
    assert report["partial"] == 2  # blocks 3 and 4 are not all sentinel
    assert report["unaccounted"] == 1 and report["overlap"] == 0


def test_unavailable_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe lives in netns_ip (netns re-exports it): patch _ip_binary where the probe looks it up.
    import mooncake_kvaddr.bench.netns_ip as netns_ip

    try:
        netns_ip.unavailable_reason.cache_clear()
        monkeypatch.setattr(netns_ip.os, "geteuid", lambda: 1000)
        assert (netns_ip.unavailable_reason() or "").startswith("not root")
        netns_ip.unavailable_reason.cache_clear()
        monkeypatch.setattr(netns_ip.os, "geteuid", lambda: 0)
        monkeypatch.setattr(netns_ip, "_ip_binary", lambda: None)
        assert "iproute2" in (netns_ip.unavailable_reason() or "")
        monkeypatch.setattr(netns_ip.sys, "platform", "darwin")
        netns_ip.unavailable_reason.cache_clear()
        assert "Linux" in (netns_ip.unavailable_reason() or "")
    finally:
        monkeypatch.undo()
        netns_ip.unavailable_reason.cache_clear()


def test_worker_waits_are_bounded(cluster: NetnsCluster) -> None:
    worker = cluster.spawn_worker("reader")
    worker.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout):
        worker.call("health", 1.0)
    assert time.monotonic() - t0 < 3.0
    worker.kill()


# ------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_across_namespaces(cluster: NetnsCluster, mode: str) -> None:
    _, reader = start_pair(cluster, mode)
    for tag, seed in DATASETS:
        report = load_once(reader, mode, tag, seed)
        assert report["verified"] == CHUNKS and report["mode"] == mode, report
    # The reader stores too (its puts cross TCP into the writer's segment) and reads it back.
    reader.call("fill", 60, cache="c", seed=3)
    stored = reader.call("store", 60, cache="c", tag="R", chunks=CHUNKS)
    assert stored["stored_ok"] and stored["stored"] == CHUNKS, stored
    assert load_once(reader, mode, "R", 3)["verified"] == CHUNKS


# ------------------------------------------------------------------------------------------- faults


@pytest.mark.parametrize("mode", MODES)
def test_reader_link_down_mid_load(cluster: NetnsCluster, mode: str) -> None:
    """Link down long enough that a load must give up on its own: loads fail within LOAD_BOUND_S, the
    link comes back, later loads succeed."""
    _, reader = start_pair(cluster, mode)
    down_s = RPC_TIMEOUT_S + CONNECT_S + 1.5  # longer than the in-flight load needs to give up on its own
    reports, t_fault, t_repair = fault_during_loop(
        reader, mode, lambda: cluster.link_down("reader"), lambda: cluster.link_up("reader"), down_s
    )
    during = [r for r in reports if t_fault < r["t_end"] < t_repair]
    assert during and all(r["reported_failed"] > 0 for r in during), "loads completed while the link was down"
    wait_recovered(reader, mode)


@pytest.mark.parametrize("mode", MODES)
def test_writer_sigstop_mid_load(cluster: NetnsCluster, mode: str) -> None:
    """A hung segment holder (SIGSTOP, shorter than the master's client TTL): the in-flight load waits for
    it (bounded by the stop, at most Mooncake's 60 s transfer timeout); after SIGCONT loads succeed again
    without re-storing anything."""
    writer, reader = start_pair(cluster, mode)
    stop_s = CLIENT_TTL_S - 2.0
    reports, _, _ = fault_during_loop(
        reader, mode, lambda: writer.signal(signal.SIGSTOP), lambda: writer.signal(signal.SIGCONT), stop_s
    )
    assert max(r["seconds"] for r in reports) >= stop_s - 0.5, "no load waited for the stopped writer"
    wait_recovered(reader, mode)


@pytest.mark.parametrize("mode", MODES)
def test_writer_sigkill_mid_load(cluster: NetnsCluster, mode: str) -> None:
    """The segment holder dies mid-load: loads fail fast (never report a chunk they could not read); a new
    writer in the same namespace stores again and loads succeed."""
    writer, reader = start_pair(cluster, mode)
    reports, t_fault, _ = fault_during_loop(reader, mode, writer.kill, lambda: None, CLIENT_TTL_S + 1.0)
    assert writer.returncode == -signal.SIGKILL
    after = [r for r in reports if r["t_start"] > t_fault]  # loads started after the kill
    assert after and all(r["verified"] == 0 for r in after), "chunks loaded from a dead writer"
    # Until the master drops the dead writer's segment (client TTL), it still lists the objects: a store then
    # finds them present and skips them, and loads of them keep failing. Re-store only once they are gone.
    wait_forgotten(reader, time.time() - t_fault)
    new_writer = setup_worker(cluster, "writer", mode, segment=SEGMENT)
    for tag, seed in DATASETS:
        new_writer.call("fill", 60, cache="c", seed=seed)
        report = new_writer.call("store", 60, cache="c", tag=tag, chunks=CHUNKS)
        assert report["stored_ok"] and report["stored"] == CHUNKS, f"the new writer did not store again: {report}"
    wait_recovered(reader, mode, holder=new_writer)


@pytest.mark.parametrize("mode", MODES)
def test_master_killed_and_restarted_mid_load(cluster: NetnsCluster, mode: str) -> None:
    """The master dies (SIGKILL) mid-load: loads fail "master unreachable" within the bound; after a restart
    at the same address the old objects are gone (not found, never loaded), the writer stores again and
    loads succeed."""
    writer, reader = start_pair(cluster, mode)
    reports, t_fault, t_repair = fault_during_loop(
        reader, mode, lambda: cluster.kill_master(signal.SIGKILL), cluster.start_master, 2.0
    )
    # Loads that started after the kill: master unreachable, then (restarted master) not found; never loaded.
    after = [r for r in reports if r["t_start"] > t_fault]
    assert after and all(r["verified"] == 0 for r in after), "chunks loaded while the master was dead or new"
    assert any(r["t_start"] > t_repair for r in after), "no load ran against the restarted master"
    # The restarted master knows no objects: a load now fails cleanly until the writer stores again.
    deadline = time.monotonic() + RECOVERY_BOUND_S
    while True:
        writer.call("fill", 60, cache="c", seed=1)
        stored = writer.call("store", 60, cache="c", tag="A", chunks=CHUNKS)
        if stored["stored_ok"]:
            break
        assert time.monotonic() < deadline, f"the writer could not store after the master restart: {stored}"
        time.sleep(0.5)
    writer.call("fill", 60, cache="c", seed=2)
    assert writer.call("store", 60, cache="c", tag="B", chunks=CHUNKS)["stored_ok"]
    wait_recovered(reader, mode)


# ------------------------------------------------------------------------------------------- hung peer

# When the peer holding the data hangs but the master still counts it alive (its heartbeat has not expired
# yet, or only its data path hangs), every call to it fails only after a timeout, and the driver used to make
# the request's next call anyway. Now a call that fails transfer_failed after >= 55 s (Mooncake's 60 s
# transfer timeout) ends the request, and so does the request deadline; a staged call still running at the
# deadline is abandoned there (docs/transfer-modes.md, "Deadlines"; docs/multihost.md, "Hung peer"). The
# reader here runs with a 20 s request deadline.
HUNG_REQUEST_TIMEOUT_S = 20.0
HUNG_PEER_BOUND_S = HUNG_REQUEST_TIMEOUT_S + 60.0 + 10.0  # the deadline + one call in flight + slack
# A staged load never waits for its call past the deadline: only slack on top (a loaded 2-core machine).
STAGED_HUNG_BOUND_S = HUNG_REQUEST_TIMEOUT_S + 5.0
SLOW = pytest.mark.skipif(
    not os.environ.get("MULTIHOST_SLOW"), reason="30-90 s per case; set MULTIHOST_SLOW=1 to run the hung-peer bounds"
)


def _against_hung_writer(
    mode: str, *, warm: bool, loads: int = 1, bound: float = HUNG_PEER_BOUND_S
) -> list[dict[str, Any]]:
    """Store both data sets from the writer, stop it (SIGSTOP), then make ``loads`` loads from the reader;
    each must return within ``bound`` and keep every load invariant. ``warm``: the reader loaded from the
    writer once before it was stopped (it has a connection to it)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host harness unavailable: {reason}")
    # The master never forgets the stopped writer during the test: the worst case for the reader.
    with NetnsCluster(worker_env=WORKER_ENV, master_args=["-client_ttl=600"]) as cluster:
        writer = setup_worker(cluster, "writer", mode, segment=SEGMENT)
        reader = cluster.spawn_worker("reader")
        reader.call("setup", 60, master=cluster.master_address, hostname=cluster.nodes["reader"].address, segment=0,
                    request_timeout_s=HUNG_REQUEST_TIMEOUT_S)  # fmt: skip
        reader.call("cache", 60, cache="c", mode=mode, regions=REGIONS, blocks=CHUNKS + 1, block_bytes=BLOCK_BYTES,
                    staging_bytes=STAGING)  # fmt: skip
        store_datasets(writer)
        if warm:  # the reader has talked to the writer before it hangs (the usual case mid-operation)
            check_load(reader.call("load", 60, cache="c", tag="B", chunks=CHUNKS, seed=2), mode)
        writer.signal(signal.SIGSTOP)
        reports = []
        for _ in range(loads):
            reader.send("load", cache="c", tag="A", chunks=CHUNKS, seed=1)
            try:
                report = reader.reply("load", bound + 5.0)
            except WorkerTimeout:
                pytest.fail(f"a load against a hung peer did not return within {bound + 5.0} s")
            if os.environ.get("MULTIHOST_DEBUG"):
                print(f"hung peer, {mode}, warm={warm}: {report['seconds']:.1f} s, calls={report['calls']}, "
                      f"stopped={report['stopped']!r}")  # fmt: skip
            check_load(report, mode, bound=bound)
            assert report["reported_failed"] == CHUNKS, report
            reports.append(report)
        return reports


def _load_against_hung_writer(mode: str, *, warm: bool) -> dict[str, Any]:
    return _against_hung_writer(mode, warm=warm)[0]


@SLOW
@pytest.mark.parametrize("mode", MODES)
def test_hung_peer_bounds_a_whole_load(mode: str) -> None:
    """A load against a stopped writer that the master still counts alive, every chunk failed, nothing written.

    Multi-buffer (7 sub-batches): the first call waits out Mooncake's 60 s transfer timeout and the hung-call
    rule ends the request there (measured 60.1 s, one call). Staged (25 batches): each batch call fails
    sooner (~15 s, the TCP progress timeout dropping the connection), below the hung-call threshold, so the
    request deadline ends it, abandoning the call in flight then: within the deadline plus slack (measured
    in docs/multihost.md, "Hung peer")."""
    if mode == "multi_buffer":
        report = _load_against_hung_writer(mode, warm=True)
        assert report["calls"] == 1, f"Mooncake was called again after the transfer timeout: {report}"
        assert report["seconds"] >= 50.0, f"returned before Mooncake's transfer timeout: {report}"
        assert "transfer timeout" in (report["stopped"] or ""), report
    else:
        (report,) = _against_hung_writer(mode, warm=True, bound=STAGED_HUNG_BOUND_S)
        assert report["seconds"] >= HUNG_REQUEST_TIMEOUT_S - 1.0, f"returned before its deadline: {report}"
        assert report["stopped"].startswith(f"the request deadline of {HUNG_REQUEST_TIMEOUT_S:g} s passed"), report


@SLOW
def test_a_never_contacted_hung_peer_costs_a_staged_load_only_its_deadline() -> None:
    """The reader never talked to the writer before it hung: Mooncake's first call would block ~61 s per key
    (16 keys a staged batch here: ~16 min). The staged load abandons it at the request deadline and returns;
    its slots stay leased by the abandoned call (here the whole 512 KiB pool), so the next load waits for
    staging space until its own deadline and fails without a Mooncake call. Both within the deadline + slack."""
    first, second = _against_hung_writer("staged", warm=False, loads=2, bound=STAGED_HUNG_BOUND_S)
    assert first["calls"] == 1, first
    assert first["stopped"].startswith(
        f"the request deadline of {HUNG_REQUEST_TIMEOUT_S:g} s passed during a staged Mooncake call"
    ), first
    assert "abandoned" in first["stopped"], first
    assert second["calls"] == 0, f"a call was made while the abandoned one held the staging pool: {second}"
    assert second["stopped"] == f"the request deadline of {HUNG_REQUEST_TIMEOUT_S:g} s passed", second


@SLOW
def test_a_never_contacted_hung_peer_costs_a_multi_buffer_load_only_its_deadline() -> None:
    """The same for a multi-buffer load, whose Mooncake call cannot be abandoned (it writes the KV cache
    itself): before the call, the reader asks the master where the keys live and probes the writer, a peer it
    never read from, with one small read into the probe's own buffer. The probe hangs (Mooncake's ~61 s
    segment handshake); it is abandoned at the deadline and the load fails without a multi-buffer call
    (driver/probe.py; before the probe: ~61 s per key of the first call). A second load does the same."""
    for report in _against_hung_writer("multi_buffer", warm=False, loads=2, bound=STAGED_HUNG_BOUND_S):
        assert report["calls"] == 1, f"only the probe reaches Mooncake: {report}"
        assert report["seconds"] >= HUNG_REQUEST_TIMEOUT_S - 1.0, f"returned before its deadline: {report}"
        assert report["stopped"].startswith(
            f"the request deadline of {HUNG_REQUEST_TIMEOUT_S:g} s passed while probing peer"
        ), report
