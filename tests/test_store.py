"""MooncakeStore against a real master on loopback: safety, round trips, splitting, failures, recovery.

Tests without the ``mooncake`` mark use a stand-in client and run without the Mooncake wheel.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from fake_mooncake import FakeClock, fake_store, install_fake_module
from kvaddr_testing import wait_until
from mooncake_kvaddr.driver import store as store_module
from mooncake_kvaddr.driver import store_calls, store_setup
from mooncake_kvaddr.driver.config import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, StoreConfig
from mooncake_kvaddr.driver.master import MOONCAKE_VARIANTS, EmbeddedMaster, free_ports, process_is_running
from mooncake_kvaddr.driver.store import (
    CODE_MASTER_UNREACHABLE,
    BatchResult,
    Health,
    MooncakeStore,
    Outcome,
    RequestDeadline,
    StoreClosedError,
    StoreError,
    StoreSetupError,
    _Op,
    _plan,
    load_mooncake,
)

mooncake = pytest.mark.mooncake
KiB = 1 << 10
MiB = 1 << 20


# ------------------------------------------------------------------------------------------- helpers


class Regions:
    """A host buffer cut into ``n_keys`` objects of ``per_key`` regions of ``region`` bytes each."""

    def __init__(self, n_keys: int, per_key: int, region: int, *, seed: int | None = None) -> None:
        self.n_keys, self.per_key, self.region = n_keys, per_key, region
        if seed is None:
            self.data = np.zeros((n_keys, per_key, region), dtype=np.uint8)
        else:
            self.data = np.random.default_rng(seed).integers(0, 256, (n_keys, per_key, region), dtype=np.uint8)
        base = self.data.ctypes.data
        self.addrs = [[base + (k * per_key + j) * region for j in range(per_key)] for k in range(n_keys)]
        self.sizes = [[region] * per_key for _ in range(n_keys)]

    @property
    def object_size(self) -> int:
        return self.per_key * self.region


class CallSpy:
    """Wraps the Mooncake client of a store and records (method, number of keys, regions) per call."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.calls: list[tuple[str, int, int]] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._client, name)
        if not callable(target):
            return target

        def recorded(*args: Any) -> Any:
            keys = args[0] if args else []
            regions = sum(len(row) for row in args[1]) if name.endswith("multi_buffers") else len(keys)
            self.calls.append((name, len(keys), regions))
            return target(*args)

        return recorded


@pytest.fixture
def spy(store: MooncakeStore, monkeypatch: pytest.MonkeyPatch) -> CallSpy:
    """Record what reaches Mooncake through the shared store during one test."""
    recorder = CallSpy(store._client)
    monkeypatch.setattr(store, "_client", recorder)
    if store._native is not None:  # batch transfers go to the native client when it is on: record those too
        native = CallSpy(store._native)
        native.calls = recorder.calls
        monkeypatch.setattr(store, "_native", native)
    return recorder


# ------------------------------------------------------------------------------------------- pure logic


def test_plan_splits_by_region_budget_in_order() -> None:
    assert _plan([], 10) == [(0, 0)]
    assert _plan([3, 3, 3], 10) == [(0, 3)]
    assert _plan([4, 4, 4], 10) == [(0, 2), (2, 3)]
    # A key over the budget goes alone; order and coverage are kept.
    assert _plan([2, 15, 2, 2], 10) == [(0, 1), (1, 2), (2, 4)]
    assert _plan([1] * 5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert _plan([10, 10], 10) == [(0, 1), (1, 2)]
    # Exactly at the budget is within it: one call, not two.
    assert _plan([5, 5], 10) == [(0, 2)]
    assert _plan([4, 6, 1], 10) == [(0, 2), (2, 3)]


def test_batch_result_maps_codes_per_operation() -> None:
    get = BatchResult._build(_Op.GET, [4096, -704, -200, -800, -600, -900, -706, -1])
    assert get.outcomes == (
        Outcome.OK,
        Outcome.NOT_FOUND,
        Outcome.NO_SPACE,
        Outcome.TRANSFER_FAILED,
        Outcome.INVALID_PARAMS,
        Outcome.MASTER_UNREACHABLE,
        Outcome.HAS_LEASE,
        Outcome.OTHER,
    )
    assert get.failed == [1, 2, 3, 4, 5, 6, 7] and not get.ok and get.back_pressure
    assert get.bytes_transferred == 4096 and get.count(Outcome.NOT_FOUND) == 1
    assert get.summary()["ok"] == 1 and len(get) == 8 and get[0] is Outcome.OK

    exist = BatchResult._build(_Op.EXIST, [1, 0, -900])
    assert exist.present == [True, False, False]
    assert list(exist) == [Outcome.OK, Outcome.NOT_FOUND, Outcome.MASTER_UNREACHABLE]

    put = BatchResult._build(_Op.PUT, [0, 0, 7])
    assert put.outcomes == (Outcome.OK, Outcome.OK, Outcome.OTHER) and not put.back_pressure
    assert BatchResult._build(_Op.PUT, []).ok


def test_missing_mooncake_names_the_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)  # find_spec -> None, import -> ImportError
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match="not installed") as info:
        MooncakeStore(master_server_address="127.0.0.1:1").setup()
    for variant in MOONCAKE_VARIANTS:
        assert variant in str(info.value)
    assert "mooncake-transfer-engine-non-cuda" in str(info.value) and "libibverbs1" in str(info.value)


def test_broken_mooncake_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> Any:
        raise ImportError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(store_module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(store_module.importlib, "import_module", broken)
    with pytest.raises(ImportError, match=r"failed to load mooncake\.store \(libcuda[\s\S]*non-cuda"):
        load_mooncake()


def test_a_store_needs_a_master_address_or_an_embedded_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ValueError, match=r"no master configured.*embedded_master=True"):
        MooncakeStore()
    with pytest.raises(ValueError, match="no master configured"):
        MooncakeStore(StoreConfig(global_segment_size=0))
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeStore(master_server_address="localhost")  # no port: rejected before anything connects
    assert MooncakeStore(embedded_master=True).master is None  # nothing starts before setup()


def test_keyword_overrides_apply_to_a_given_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    base = StoreConfig(global_segment_size=0)
    store = MooncakeStore(base, master_server_address="127.0.0.1:1", close_timeout_s=0.5)
    assert store.config.master_server_address == "127.0.0.1:1" and store.config.close_timeout_s == 0.5
    assert store.master_address == "127.0.0.1:1"
    assert base.master_server_address is None  # the given config is left as it was


class RecordingClient:
    """Stand-in for MooncakeDistributedStore: records setup() arguments, fails the first ``fail`` setups."""

    calls: list[tuple[Any, ...]] = []
    kwargs: list[dict[str, Any]] = []
    fail = 0
    closed = 0

    def setup(self, *args: Any, **kwargs: Any) -> int:
        RecordingClient.calls.append(args)
        RecordingClient.kwargs.append(kwargs)
        time.sleep(0.05)  # long enough for the watcher thread to look at the environment meanwhile
        return -1 if len(RecordingClient.calls) <= RecordingClient.fail else 0

    def close(self) -> int:
        RecordingClient.closed += 1
        return 0


def fake_mooncake(monkeypatch: pytest.MonkeyPatch, fail: int) -> type[RecordingClient]:
    RecordingClient.calls, RecordingClient.kwargs, RecordingClient.fail, RecordingClient.closed = [], [], fail, 0
    module = SimpleNamespace(MooncakeDistributedStore=RecordingClient)
    install_fake_module(monkeypatch, module)
    return RecordingClient


def test_setup_retries_are_this_calls_own_and_never_touch_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    client = fake_mooncake(monkeypatch, fail=2)
    seen: list[dict[str, str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(dict(os.environ))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    before = dict(os.environ)
    try:
        store = MooncakeStore(master_server_address="127.0.0.1:1", setup_retries=3, tenant_id="t9").setup()
    finally:
        stop.set()
        watcher.join()
    assert store.ready and len(client.calls) == 3 and client.closed == 2  # failed attempts were closed
    hosts = [call[0] for call in client.calls]
    # Each attempt pins its own port (Mooncake then makes exactly one attempt), all different.
    assert all(h.startswith("127.0.0.1:") for h in hosts) and len(set(hosts)) == 3
    assert client.calls[0][1:] == ("P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "", "127.0.0.1:1")
    assert client.kwargs[0] == {"tenant_id": "t9"}
    assert seen and all(env == before for env in seen) and dict(os.environ) == before


def test_setup_retries_exhausted_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    client = fake_mooncake(monkeypatch, fail=10)
    with pytest.raises(StoreSetupError, match=r"code -1 after 2 attempt\(s\) \(master 127\.0\.0\.1:1"):
        MooncakeStore(master_server_address="127.0.0.1:1", setup_retries=2).setup()
    assert len(client.calls) == 2 and client.closed == 2


def test_set_up_stops_retrying_once_the_embedded_master_died_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed attempt against an embedded master that is no longer alive is the last one (another could only
    fail the same way), and the error carries the master's state and its log tail."""
    client = fake_mooncake(monkeypatch, fail=10)
    module = SimpleNamespace(MooncakeDistributedStore=client)
    dead = SimpleNamespace(alive=False, stderr_tail=lambda: "F master: port in use")
    config = StoreConfig(master_server_address="127.0.0.1:1", setup_retries=3)
    with pytest.raises(StoreSetupError, match=r"after 1 attempt\(s\).*alive=False, log tail:\nF master: port in use"):
        store_setup.connect(config, module, "127.0.0.1:1", dead)  # type: ignore[arg-type]
    assert len(client.calls) == 1 and client.closed == 1
    quiet = SimpleNamespace(alive=True, stderr_tail=lambda: "")
    with pytest.raises(StoreSetupError, match=r"after 3 attempt\(s\).*alive=True, log tail:\n<empty>"):
        store_setup.connect(config, module, "127.0.0.1:1", quiet)  # type: ignore[arg-type]


def test_without_setup_retries_mooncake_runs_its_own_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    client = fake_mooncake(monkeypatch, fail=0)
    MooncakeStore(master_server_address="127.0.0.1:1", local_hostname="10.1.2.3").setup()
    assert [c[0] for c in client.calls] == ["10.1.2.3"] and client.kwargs == [{}]  # default tenant not passed
    client = fake_mooncake(monkeypatch, fail=5)
    with pytest.raises(StoreSetupError, match="after 1 attempt"):
        # A pinned local port is tried once: retrying cannot free it.
        MooncakeStore(master_server_address="127.0.0.1:1", local_hostname="10.1.2.3:4000", setup_retries=4).setup()
    assert [c[0] for c in client.calls] == ["10.1.2.3:4000"]


@pytest.mark.parametrize(("low", "high"), [("13000", "13010"), ("bad", "x"), ("60000", "100")])
def test_client_ports_follow_mooncakes_range(monkeypatch: pytest.MonkeyPatch, low: str, high: str) -> None:
    monkeypatch.setenv("MC_STORE_CLIENT_MIN_PORT", low)
    monkeypatch.setenv("MC_STORE_CLIENT_MAX_PORT", high)
    ports = store_module._client_ports(3)
    assert len(set(ports)) == 3
    if low == "13000":
        assert all(13000 <= p <= 13010 for p in ports)
    else:  # unreadable, or upside down: Mooncake's default range
        assert all(12300 <= p <= 14300 for p in ports)


def test_client_ports_past_an_exhausted_range_come_from_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-port range whose port is taken: the ports come from the kernel instead (distinct, free, never the
    taken one), so set-up still gets as many attempts as it asked for."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        monkeypatch.setenv("MC_STORE_CLIENT_MIN_PORT", str(port))
        monkeypatch.setenv("MC_STORE_CLIENT_MAX_PORT", str(port))
        ports = store_module._client_ports(3)
    assert len(set(ports)) == 3 and port not in ports and all(0 < p < 65536 for p in ports)


def test_a_one_port_client_range_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """MIN_PORT == MAX_PORT is a valid range of one port: it is tried first, the rest come from the kernel."""
    port = free_ports(1)[0]
    monkeypatch.setenv("MC_STORE_CLIENT_MIN_PORT", str(port))
    monkeypatch.setenv("MC_STORE_CLIENT_MAX_PORT", str(port))
    assert store_module._client_ports(1) == [port]
    ports = store_module._client_ports(2)
    assert ports[0] == port and len(set(ports)) == 2


class BlockingClient:
    """Stand-in for MooncakeDistributedStore whose batch_is_exist blocks until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.events: list[str] = []

    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self.entered.set()
        assert self.release.wait(timeout=30)
        self.events.append("call returned")
        return [1] * len(keys)

    def close(self) -> int:
        self.events.append("close")
        return 0


class ShortAnswerClient:
    """Stand-in for MooncakeDistributedStore that answers one code fewer than the keys it was asked about."""

    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [1] * (len(keys) - 1)

    def close(self) -> int:
        return 0


def test_short_answer_from_mooncake_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fewer codes than keys: which key each code belongs to is unknown, so nothing may count as present.
    fake = SimpleNamespace(MooncakeDistributedStore=ShortAnswerClient)
    install_fake_module(monkeypatch, fake)
    store = MooncakeStore(master_server_address="127.0.0.1:1").setup()
    try:
        with pytest.raises(StoreError, match="1 results for 2 keys"):
            store.batch_is_exist(["a", "b"])
    finally:
        store.close()


def test_close_waits_for_calls_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    client = BlockingClient()
    fake = SimpleNamespace(MooncakeDistributedStore=lambda: client)
    install_fake_module(monkeypatch, fake)
    store = MooncakeStore(master_server_address="127.0.0.1:1", close_timeout_s=0.3).setup()

    results: list[BatchResult] = []
    caller = threading.Thread(target=lambda: results.append(store.batch_is_exist(["a", "b"])))
    caller.start()
    assert client.entered.wait(timeout=10)

    started = time.monotonic()
    with pytest.raises(StoreError, match="1 call"):
        store.close()
    assert 0.25 < time.monotonic() - started < 5
    assert store.state == "closing" and client.events == []
    with pytest.raises(StoreClosedError, match="closing"):
        store.batch_is_exist(["c"])  # no new calls while closing

    client.release.set()
    caller.join(timeout=10)
    store.close()
    assert store.state == "closed"
    assert client.events == ["call returned", "close"]  # close never overlapped the call
    assert results[0].present == [True, True]
    store.close()  # idempotent


def test_setup_from_not_new_states_and_close_of_a_never_setup_store() -> None:
    store = MooncakeStore(master_server_address="127.0.0.1:1")
    assert store.health_check() is Health.NOT_READY and store.state == "new"
    store.close()
    assert store.state == "closed"
    with pytest.raises(StoreClosedError, match="closed"):
        store.setup()


# ------------------------------------------------------------------------------------------- deadlines

# A stand-in client with a fake clock (tests/fake_mooncake.py): a "hung" call takes 60 fake seconds, no real
# time. See docs/transfer-modes.md, "Deadlines".


def _call_store(store: MooncakeStore, method: str, n_keys: int, **kwargs: Any) -> BatchResult:
    """``method`` on ``n_keys`` keys of 2 x 64-byte regions (contiguous calls: one 128-byte buffer per key)."""
    buf = np.zeros((n_keys, 2, 64), dtype=np.uint8)
    base = buf.ctypes.data
    keys = [f"k{i}" for i in range(n_keys)]
    if method.endswith("multi_buffers"):
        addrs = [[base + (2 * i + j) * 64 for j in range(2)] for i in range(n_keys)]
        sizes = [[64, 64] for _ in range(n_keys)]
        return getattr(store, method)(keys, addrs, sizes, **kwargs)  # type: ignore[no-any-return]
    ptrs = [base + 128 * i for i in range(n_keys)]
    return getattr(store, method)(keys, ptrs, [128] * n_keys, **kwargs)  # type: ignore[no-any-return]


DATA_CALLS = ["batch_put_from_multi_buffers", "batch_get_into_multi_buffers", "batch_put_from", "batch_get_into"]


@pytest.mark.parametrize("method", DATA_CALLS)
def test_a_call_that_waited_out_the_transfer_timeout_stops_the_batch(
    monkeypatch: pytest.MonkeyPatch, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    with fake_store(monkeypatch, max_regions_per_batch=8) as (store, client):
        if "get" in method:
            _call_store(store, method.replace("get_into", "put_from"), 20)  # something to read
            client.calls.clear()
        client.hang_from = 2  # the peer hangs after the first sub-batch
        deadline = store.deadline()
        got = _call_store(store, method, 20, deadline=deadline)
    per_call = 4 if method.endswith("multi_buffers") else 8  # 2 regions per key vs 1 per contiguous key
    assert client.transfer_calls() == [per_call, per_call]  # no third call after the 60 s failure
    assert got.outcomes == (Outcome.OK,) * per_call + (Outcome.TRANSFER_FAILED,) * (20 - per_call)
    assert deadline.expired() and "transfer timeout" in (deadline.reason or "")
    assert f"{20 - 2 * per_call} of 20 key(s) not attempted" in caplog.text


def test_the_hung_call_rule_needs_both_the_failure_and_the_time(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch, max_regions_per_batch=8, request_timeout_s=None) as (store, client):
        client.fail_fast = True  # -800 in 1 s: a bad argument or a full queue, not a hung peer
        got = _call_store(store, "batch_put_from_multi_buffers", 20)
        assert client.transfer_calls() == [4] * 5 and got.count(Outcome.TRANSFER_FAILED) == 20
        client.calls.clear()
        client.fail_fast, client.call_seconds = False, store_module.HUNG_CALL_THRESHOLD_S + 10  # slow but fine
        got = _call_store(store, "batch_put_from_multi_buffers", 20)
        assert client.transfer_calls() == [4] * 5 and got.ok


def test_a_call_failing_after_exactly_the_hung_threshold_counts_as_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule is "transfer_failed after HUNG_CALL_THRESHOLD_S or more": a call that fails after exactly that
    long stops the request like one that waited out Mooncake's whole transfer timeout."""
    monkeypatch.setattr("fake_mooncake.HUNG_CALL_S", store_module.HUNG_CALL_THRESHOLD_S)  # tests/fake_mooncake.py
    with fake_store(monkeypatch, max_regions_per_batch=8, request_timeout_s=None) as (store, client):
        client.hang_from = 1  # every call fails -800 after exactly the threshold
        deadline = store.deadline()
        got = _call_store(store, "batch_put_from", 20, deadline=deadline)
    assert client.transfer_calls() == [8]  # no second call
    assert got.count(Outcome.TRANSFER_FAILED) == 20
    assert deadline.expired() and "transfer timeout" in (deadline.reason or "")


@pytest.mark.parametrize("method", DATA_CALLS)
def test_past_the_deadline_no_sub_batch_is_called(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    with fake_store(monkeypatch, max_regions_per_batch=8, request_timeout_s=25.0) as (store, client):
        client.call_seconds = 10.0  # calls start at 0, 10, 20 s; at 30 s the deadline (25 s) has passed
        got = _call_store(store, method, 20)
    per_call = 4 if method.endswith("multi_buffers") else 8
    calls = min(3, -(-20 // per_call))
    assert client.transfer_calls() == [per_call] * (calls - 1) + [min(per_call, 20 - per_call * (calls - 1))]
    tried = min(20, calls * per_call)
    assert got.codes[tried:] == (-800,) * (20 - tried)
    assert got.count(Outcome.TRANSFER_FAILED) == 20 - tried


def test_one_deadline_spans_the_calls_of_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch, request_timeout_s=15.0) as (store, client):
        client.call_seconds = 10.0
        deadline = store.deadline()
        assert _call_store(store, "batch_put_from", 3, deadline=deadline).ok  # 0 -> 10 s
        assert _call_store(store, "batch_get_into", 3, deadline=deadline).ok  # 10 -> 20 s
        got = _call_store(store, "batch_get_into", 3, deadline=deadline)  # 20 s > 15 s: not called
        assert got.codes == (-800,) * 3 and len(client.calls) == 2
        assert deadline.reason == "the request deadline of 15 s passed"
        # A call without a deadline of its own gets a fresh one from the configuration.
        assert _call_store(store, "batch_get_into", 3).ok and len(client.calls) == 3
        # A deadline stopped by hand ends the request too.
        stopped = RequestDeadline(None)
        stopped.stop("shutting down")
        assert _call_store(store, "batch_get_into", 3, deadline=stopped).codes == (-800,) * 3
        assert stopped.reason == "shutting down" and len(client.calls) == 3


def test_request_deadline_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(store_calls, "_now", clock)
    deadline = RequestDeadline(2.0)
    assert not deadline.expired() and deadline.remaining() == 2.0 and deadline.reason is None
    clock.advance(1.5)
    assert deadline.remaining() == 0.5
    clock.advance(0.5)
    assert deadline.expired() and deadline.remaining() == 0.0
    deadline.stop("later reason")
    assert deadline.reason == "the request deadline of 2 s passed"  # the first reason stays
    forever = RequestDeadline(None)
    clock.advance(1e9)
    assert not forever.expired() and forever.remaining() is None
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_s"):
            RequestDeadline(bad)


@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (-1, ValueError), (float("inf"), ValueError), ("10", TypeError),
                         (True, TypeError)]
)  # fmt: skip
def test_request_timeout_is_validated(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="request_timeout_s"):
        StoreConfig(request_timeout_s=value)  # type: ignore[arg-type]


def test_request_timeout_default_and_none() -> None:
    assert StoreConfig().request_timeout_s == DEFAULT_REQUEST_TIMEOUT_S == 120.0
    assert StoreConfig(request_timeout_s=None).request_timeout_s is None
    assert StoreConfig.from_dict({"request_timeout_s": 5}).request_timeout_s == 5.0


# ------------------------------------------------------------------------------------------- safety


def all_calls(store: MooncakeStore) -> dict[str, Callable[[], object]]:
    buf = Regions(1, 1, 64)
    return {
        "batch_is_exist": lambda: store.batch_is_exist(["k"]),
        "batch_put_from_multi_buffers": lambda: store.batch_put_from_multi_buffers(["k"], buf.addrs, buf.sizes),
        "batch_get_into_multi_buffers": lambda: store.batch_get_into_multi_buffers(["k"], buf.addrs, buf.sizes),
        "batch_put_from": lambda: store.batch_put_from(["k"], [buf.addrs[0][0]], [64]),
        "batch_get_into": lambda: store.batch_get_into(["k"], [buf.addrs[0][0]], [64]),
        "batch_remove": lambda: store.batch_remove(["k"]),
        "remove_all": lambda: store.remove_all(),
        "register_buffer": lambda: store.register_buffer(buf.addrs[0][0], 64),
        "unregister_buffer": lambda: store.unregister_buffer(buf.addrs[0][0]),
        "time_argument_conversion": lambda: store.time_argument_conversion(buf.addrs, buf.sizes),
    }


@mooncake
def test_use_before_setup_and_after_close_raises_instead_of_crashing(store_config: StoreConfig) -> None:
    # Before setup() and after close(), these calls SIGSEGV inside Mooncake's binding; here they raise.
    store = MooncakeStore(store_config)
    for name, call in all_calls(store).items():
        with pytest.raises(StoreClosedError, match="not set up"):
            call()
        assert store.state == "new", name
    assert store.health_check() is Health.NOT_READY

    with store:
        assert store.ready and store.health_check() is Health.OK
        assert store.setup() is store  # no second client
    assert store.state == "closed"
    for name, call in all_calls(store).items():
        with pytest.raises(StoreClosedError, match="closed"):
            call()
        assert store.state == "closed", name
    assert store.health_check() is Health.NOT_READY
    store.close()


# ------------------------------------------------------------------------------------------- data path


@mooncake
def test_mooncake_itself_takes_tuple_rows(store: MooncakeStore, key_prefix: str) -> None:
    # The immutable-rows output (docs/address-rows.md) hands vLLM's worker tuples, which it passes to
    # Mooncake's own batch calls unchanged: those calls must read tuples exactly as lists.
    client = store._client
    src, dst = Regions(6, 3, 1 * KiB, seed=4), Regions(6, 3, 1 * KiB)
    for region in (src, dst):
        assert client.register_buffer(region.data.ctypes.data, region.data.nbytes) == 0
    keys = [f"{key_prefix}/{i}" for i in range(6)]
    codes = client.batch_put_from_multi_buffers(keys, [tuple(r) for r in src.addrs], [tuple(r) for r in src.sizes])
    assert list(codes) == [0] * 6
    got = client.batch_get_into_multi_buffers(keys, [tuple(r) for r in dst.addrs], tuple(tuple(r) for r in dst.sizes))
    assert list(got) == [src.object_size] * 6
    np.testing.assert_array_equal(dst.data, src.data)
    for region in (src, dst):
        assert client.unregister_buffer(region.data.ctypes.data) == 0


@mooncake
def test_replica_locations_name_the_peer_holding_each_key(store: MooncakeStore, key_prefix: str) -> None:
    # The peer probe's question to the master (driver/probe.py): which peer holds each key, and its size.
    src = Regions(3, 2, 1 * KiB, seed=5)
    keys = [f"{key_prefix}/{i}" for i in range(3)]
    assert store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes).ok
    located = store.replica_locations([*keys, f"{key_prefix}/missing"])
    assert located is not None and located[-1] == ()
    endpoints = {endpoint for places in located[:-1] for endpoint, _ in places}
    assert len(endpoints) == 1  # this process holds the only segment
    (endpoint,) = endpoints
    host, port = endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert [places for places in located[:-1]] == [((endpoint, src.object_size),)] * 3
    assert store.replica_locations([]) == []


@mooncake
@pytest.mark.parametrize("call", ["batch_get_into_multi_buffers", "batch_get_into"])
def test_a_key_named_twice_in_one_get_fills_both_destinations(
    store: MooncakeStore, key_prefix: str, spy: CallSpy, call: str
) -> None:
    # Mooncake's own multi-buffer get writes only one destination of a repeated key and reports both read
    # (docs/transfer-modes.md, "Repeated keys"): the wrapper must never hand it a batch with a repeat.
    src = Regions(3, 2, 1 * KiB, seed=7)
    keys = [f"{key_prefix}/{i}" for i in range(3)]
    assert store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes).ok
    order = [0, 1, 0, 2, 1, 1]
    dst = Regions(len(order), 2, 1 * KiB)
    named = [keys[i] for i in order]
    spy.calls.clear()
    if call == "batch_get_into":
        rows = np.asarray(dst.addrs, dtype=np.int64)[:, 0].tolist()
        got = store.batch_get_into(named, rows, [2 * KiB] * len(order))
    else:
        got = store.batch_get_into_multi_buffers(named, dst.addrs, dst.sizes)
    assert got.ok and got.codes == (2 * KiB,) * len(order)
    for slot, i in enumerate(order):
        np.testing.assert_array_equal(dst.data[slot], src.data[i])
    assert [n for _, n, _ in spy.calls] == [2, 3, 1]  # split before each repeat, order kept


@mooncake
def test_put_exist_get_round_trip_bytes(store: MooncakeStore, key_prefix: str, spy: CallSpy) -> None:
    src = Regions(40, 5, 1 * KiB, seed=1)
    keys = [f"{key_prefix}/{i}" for i in range(40)]
    assert store.batch_is_exist(keys).present == [False] * 40

    put = store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes)
    assert put.ok and put.codes == (0,) * 40
    assert store.batch_is_exist(keys).ok

    dst = Regions(40, 5, 1 * KiB)
    got = store.batch_get_into_multi_buffers(keys, dst.addrs, dst.sizes)
    assert got.ok and got.codes == (src.object_size,) * 40
    assert got.bytes_transferred == src.data.nbytes
    np.testing.assert_array_equal(dst.data, src.data)

    # 200 regions with a budget of 64: every data call was split, none exceeded the budget.
    data_calls = [c for c in spy.calls if c[0].endswith("multi_buffers")]
    assert len(data_calls) == 2 * 4 and all(regions <= 64 for _, _, regions in data_calls)

    # numpy 2-D rows are accepted too, and the object can be read back with another region split.
    dst2 = Regions(40, 10, 512)
    addrs = np.asarray(dst2.addrs, dtype=np.uint64)
    sizes = np.asarray(dst2.sizes, dtype=np.uint64)
    assert store.batch_get_into_multi_buffers(keys, addrs, sizes).ok
    np.testing.assert_array_equal(dst2.data.reshape(40, -1), src.data.reshape(40, -1))


@mooncake
def test_contiguous_put_from_and_get_into(store: MooncakeStore, key_prefix: str) -> None:
    src = Regions(100, 1, 2 * KiB, seed=2)
    keys = [f"{key_prefix}/{i}" for i in range(100)]
    ptrs = [row[0] for row in src.addrs]
    assert store.batch_put_from(keys, ptrs, [2 * KiB] * 100).ok
    dst = Regions(100, 1, 2 * KiB)
    got = store.batch_get_into(
        [*keys, f"{key_prefix}/missing"], [*(row[0] for row in dst.addrs), ptrs[0]], [2 * KiB] * 101
    )
    assert got.codes[:100] == (2 * KiB,) * 100 and got[100] is Outcome.NOT_FOUND
    np.testing.assert_array_equal(dst.data, src.data)


@mooncake
def test_missing_keys_are_not_found_per_key(store: MooncakeStore, key_prefix: str) -> None:
    src = Regions(6, 3, 256, seed=3)
    keys = [f"{key_prefix}/{i}" for i in range(6)]
    present = [0, 2, 5]
    assert store.batch_put_from_multi_buffers(
        [keys[i] for i in present], [src.addrs[i] for i in present], [src.sizes[i] for i in present]
    ).ok

    exist = store.batch_is_exist(keys)
    assert exist.present == [i in present for i in range(6)]
    assert exist.failed == [1, 3, 4] and exist.count(Outcome.NOT_FOUND) == 3

    dst = Regions(6, 3, 256)
    got = store.batch_get_into_multi_buffers(keys, dst.addrs, dst.sizes)
    expected = [Outcome.OK if i in present else Outcome.NOT_FOUND for i in range(6)]
    assert list(got) == expected and got.codes[1] == -704
    for i in range(6):
        if i in present:
            np.testing.assert_array_equal(dst.data[i], src.data[i])
        else:
            assert not dst.data[i].any()  # a missing key leaves its destination untouched


@mooncake
def test_splitting_preserves_order_and_results(store: MooncakeStore, key_prefix: str, spy: CallSpy) -> None:
    # Region counts around the budget of 64, including keys that must go alone (> 64).
    counts = [1, 30, 40, 64, 70, 5, 5, 100, 2, 63, 1, 33]
    region = 128
    keys = [f"{key_prefix}/{i}" for i in range(len(counts))]
    rng = np.random.default_rng(4)
    src = [rng.integers(0, 256, c * region, dtype=np.uint8) for c in counts]
    addrs = [[a.ctypes.data + j * region for j in range(c)] for a, c in zip(src, counts, strict=True)]
    sizes = [[region] * c for c in counts]
    stored = [i for i in range(len(counts)) if i % 3 != 1]
    put = store.batch_put_from_multi_buffers(
        [keys[i] for i in stored], [addrs[i] for i in stored], [sizes[i] for i in stored]
    )
    assert put.ok

    spy.calls.clear()
    dst = [np.zeros(c * region, dtype=np.uint8) for c in counts]
    dst_addrs = [[a.ctypes.data + j * region for j in range(c)] for a, c in zip(dst, counts, strict=True)]
    got = store.batch_get_into_multi_buffers(keys, dst_addrs, sizes)
    assert got.codes == tuple(c * region if i in stored else -704 for i, c in enumerate(counts))
    for i in stored:
        np.testing.assert_array_equal(dst[i], src[i])

    # Calls covered the keys in order; each within budget unless it carried a single oversized key.
    assert sum(n for _, n, _ in spy.calls) == len(keys)
    assert all(regions <= 64 or n == 1 for _, n, regions in spy.calls)
    assert [n for _, n, _ in spy.calls] == [b - a for a, b in _plan(counts, 64)]


@mooncake
def test_threads_share_one_store(store: MooncakeStore, key_prefix: str) -> None:
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            src = Regions(10, 4, 512, seed=10 + t)
            keys = [f"{key_prefix}/{t}/{i}" for i in range(10)]
            for _ in range(3):
                assert store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes).ok
                dst = Regions(10, 4, 512)
                assert store.batch_get_into_multi_buffers(keys, dst.addrs, dst.sizes).ok
                np.testing.assert_array_equal(dst.data, src.data)
        except BaseException as exc:  # reported by the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors


@mooncake
def test_validation_errors_never_reach_mooncake(store: MooncakeStore, key_prefix: str, spy: CallSpy) -> None:
    buf = Regions(2, 2, 64)
    k = [f"{key_prefix}/a", f"{key_prefix}/b"]
    cases: list[tuple[Callable[[], object], type[Exception], str]] = [
        (
            lambda: store.batch_put_from_multi_buffers(k, buf.addrs[:1], buf.sizes),
            ValueError,
            "2 keys but 1 address",
        ),
        (lambda: store.batch_get_into_multi_buffers(k, buf.addrs, buf.sizes[:1]), ValueError, "1 size rows"),
        # The case Mooncake's get turns into an out-of-bounds read: more addresses than sizes.
        (
            lambda: store.batch_get_into_multi_buffers(k, buf.addrs, [buf.sizes[0], [64]]),
            ValueError,
            "key 1: 2 addresses but 1 sizes",
        ),
        (
            lambda: store.batch_put_from_multi_buffers(k, [buf.addrs[0], []], [buf.sizes[0], []]),
            ValueError,
            "key 1: no regions",
        ),
        (
            lambda: store.batch_put_from_multi_buffers(k, [buf.addrs[0], [-5, 1]], buf.sizes),
            ValueError,
            r"key 1: address \[0\] is negative",
        ),
        (
            lambda: store.batch_get_into_multi_buffers(k, buf.addrs, [[64, -1], [64, 64]]),
            ValueError,
            r"key 0: size \[1\] is negative",
        ),
        (lambda: store.batch_is_exist("one-key"), TypeError, "single str"),
        (lambda: store.batch_get_into(k, [1], [1, 2]), ValueError, "1 pointers"),
        (lambda: store.batch_put_from(k, [1, -1], [1, 2]), ValueError, "key 1: pointer is negative"),
        # The int64 maximum is a value in range: the error names the key after it.
        (lambda: store.batch_put_from(k, [(1 << 63) - 1, -1], [1, 2]), ValueError, "key 1: pointer is negative"),
        (lambda: store.batch_get_into(k, [1, 2], [(1 << 63) - 1, 1 << 63]), ValueError, r"key 1: size is 9223"),
        (
            lambda: store.batch_get_into_multi_buffers(k, [[(1 << 63) - 1, 1], [1, -2]], buf.sizes),
            ValueError,
            r"key 1: address \[1\] is negative",
        ),
        (  # 0 is in range too
            lambda: store.batch_get_into_multi_buffers(k, [[0, 1], [1, -2]], buf.sizes),
            ValueError,
            r"key 1: address \[1\] is negative",
        ),
        (lambda: store.batch_put_from(k, [0, -1], [1, 2]), ValueError, "key 1: pointer is negative"),
        (lambda: store.register_buffer(-1, 10), ValueError, "ptr"),
        (lambda: store.register_buffer(1.5, 10), TypeError, "ptr"),  # type: ignore[arg-type]
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    assert spy.calls == []

    # Elements only Mooncake's converter rejects come back as TypeError naming Mooncake.
    with pytest.raises(TypeError, match="Mooncake rejected"):
        store.batch_get_into_multi_buffers(k, [[1.5, 2.5], [1.5, 2.5]], buf.sizes)  # type: ignore[list-item]

    # Empty batches never call Mooncake.
    spy.calls.clear()
    assert len(store.batch_is_exist([])) == 0
    assert store.batch_get_into_multi_buffers([], [], []).ok
    assert spy.calls == []


def test_an_address_matrix_without_regions_is_refused_before_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``(n, 0)`` int64 matrix names keys without a region: refused like an empty row list ("key 0: no
    regions"), never handed to Mooncake."""
    empty = np.zeros((2, 0), np.int64)
    with fake_store(monkeypatch) as (store, client):
        for method in ("batch_put_from_multi_buffers", "batch_get_into_multi_buffers"):
            with pytest.raises(ValueError, match="key 0: no regions"):
                getattr(store, method)(["a", "b"], empty, empty.copy())
            with pytest.raises(ValueError, match="key 0: no regions"):
                getattr(store, method)(["a", "b"], empty, empty.copy(), check_values=False)
        assert client.calls == []


def test_puts_pass_the_callers_replicate_config_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """A put's ``replicate_config`` reaches Mooncake as given (the store's default only when it is None), for
    the contiguous and the multi-buffer put alike."""
    buf = np.arange(64, dtype=np.uint8)
    p = int(buf.ctypes.data)
    mine, default = SimpleNamespace(name="mine"), SimpleNamespace(name="default")
    seen: list[tuple[str, Any]] = []
    with fake_store(monkeypatch) as (store, client):
        monkeypatch.setattr(store, "_default_replicate", default)

        def recorder(name: str) -> Callable[..., Any]:
            original = getattr(client, name)

            def recording(*args: Any) -> Any:
                seen.append((name, args[-1]))
                return original(*args)

            return recording

        for name in ("batch_put_from", "batch_put_from_multi_buffers"):
            monkeypatch.setattr(client, name, recorder(name))
        assert store.batch_put_from(["a"], [p], [64], mine).ok
        assert store.batch_put_from_multi_buffers(["b"], [[p]], [[64]], mine).ok
        assert store.batch_put_from(["c"], [p], [64]).ok
        assert store.batch_put_from_multi_buffers(["d"], [[p]], [[64]]).ok
    assert seen == [
        ("batch_put_from", mine),
        ("batch_put_from_multi_buffers", mine),
        ("batch_put_from", default),
        ("batch_put_from_multi_buffers", default),
    ]


def test_register_buffer_codes_other_than_zero_are_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's register/unregister answer 0 on success; any other code, a positive one too, raises."""
    with fake_store(monkeypatch) as (store, client):
        for rc in (1, -600):
            monkeypatch.setattr(client, "register_buffer", lambda ptr, size, _rc=rc: _rc)
            monkeypatch.setattr(client, "unregister_buffer", lambda ptr, _rc=rc: _rc)
            with pytest.raises(StoreError, match="register_buffer") as info:
                store.register_buffer(4096, 4096)
            assert info.value.code == rc
            with pytest.raises(StoreError, match="unregister_buffer"):
                store.unregister_buffer(4096)


def test_an_existence_code_other_than_one_is_not_present() -> None:
    """batch_is_exist answers 1 (present) or 0 (absent); any other non-negative code is not read as present,
    on the all-ones fast path's edge too."""
    for codes in ([1, 2], [2, 1], [2, 2]):
        result = BatchResult._build(_Op.EXIST, codes)
        assert result.present == [c == 1 for c in codes], codes
        assert not result.ok
    assert BatchResult._build(_Op.EXIST, [1, 1]).ok


def test_the_int64_maximum_is_an_accepted_value_in_every_row_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values are checked to lie in [0, 2**63): 2**63 - 1 itself passes (arrays, rows and flat lists alike) and
    reaches Mooncake (here: a missing key, so no byte moves); 2**63 does not."""
    top = (1 << 63) - 1
    with fake_store(monkeypatch) as (store, client):
        forms = [
            (np.array([[top]], np.int64), np.array([[8]], np.int64)),
            (np.array([[4096]], np.int64), np.array([[top]], np.int64)),
            (np.array([[top]], np.uint64), np.array([[8]], np.uint64)),
            ([[top]], [[8]]),
            ([[4096]], [[top]]),
        ]
        for addrs, sizes in forms:
            assert list(store.batch_get_into_multi_buffers(["missing"], addrs, sizes)) == [Outcome.NOT_FOUND]
        for ptrs, flat_sizes in (([top], [8]), ([4096], [top]), (np.array([top], np.int64), np.array([8]))):
            assert list(store.batch_get_into(["missing"], ptrs, flat_sizes)) == [Outcome.NOT_FOUND]
        assert len(client.calls) == len(forms) + 3
        with pytest.raises(ValueError, match="not below 2"):
            too_big = np.array([[top + 1]], np.uint64)
            store.batch_get_into_multi_buffers(["missing"], too_big, np.array([[8]], np.uint64))


def test_buffer_registration_takes_zero_and_leaves_it_to_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer calls refuse only what no address or size can be (negative, not an int); 0 is Mooncake's to
    answer, and reaches it."""
    with fake_store(monkeypatch) as (store, client):
        seen: list[tuple[int, ...]] = []
        client.register_buffer = lambda ptr, size: seen.append((ptr, size)) or 0  # type: ignore[method-assign]
        client.unregister_buffer = lambda ptr: seen.append((ptr,)) or 0  # type: ignore[method-assign]
        store.register_buffer(0, 4096)
        store.register_buffer(4096, 0)
        store.unregister_buffer(0)
        assert seen == [(0, 4096), (4096, 0), (0,)]
        for call in (lambda: store.register_buffer(-1, 1), lambda: store.register_buffer(1, -1),
                     lambda: store.unregister_buffer(-1)):  # fmt: skip
            with pytest.raises(ValueError, match="must be >= 0"):
                call()
        with pytest.raises(TypeError, match="expected int, got bool"):
            store.register_buffer(True, 1)
        assert len(seen) == 3


def test_a_matrix_counts_its_columns_per_key_against_the_region_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``(n, R)`` int64 matrix is R regions per key: with a budget of 8, keys of 5 regions go one per call
    and keys of 4 two per call (a sub-batch exactly at the budget is not split). Missing keys: no byte moves."""
    with fake_store(monkeypatch, max_regions_per_batch=8) as (store, client):
        for shape, calls in (((3, 5), [1, 1, 1]), ((4, 4), [2, 2]), ((2, 8), [1, 1])):
            client.calls.clear()
            keys = [f"missing-{i}" for i in range(shape[0])]
            got = store.batch_get_into_multi_buffers(keys, np.full(shape, 4096, np.int64), np.ones(shape, np.int64))
            assert list(got) == [Outcome.NOT_FOUND] * shape[0]
            assert [n for _, n in client.calls] == calls, shape


def test_remove_all_returns_mooncakes_count_even_zero_and_raises_its_error_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with fake_store(monkeypatch) as (store, client):
        assert store.remove_all() == 0  # nothing stored: zero removed is no error
        client.objects.update({"a": b"x", "b": b"y"})
        assert store.remove_all(force=True) == 2
        client.remove_all = lambda force: -900  # type: ignore[method-assign]
        with pytest.raises(StoreError, match="remove_all failed with code -900") as info:
            store.remove_all()
        assert info.value.code == -900


def test_empty_flat_batches_and_replica_queries_never_reach_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch) as (store, client):
        client.batch_get_replica_desc = lambda keys: client.calls.append(("replicas", len(keys))) or {}  # type: ignore[attr-defined]
        assert store.batch_get_into([], [], []).ok and store.batch_put_from([], [], []).ok
        assert store.replica_locations([]) == []
        assert client.calls == []


@mooncake
def test_register_unregister_remove(store: MooncakeStore, key_prefix: str) -> None:
    buf = np.zeros(64 * KiB, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    with pytest.raises(StoreError, match="overlaps") as info:
        store.register_buffer(buf.ctypes.data, buf.nbytes)
    assert info.value.code == -600
    store.unregister_buffer(buf.ctypes.data)
    with pytest.raises(StoreError, match="not a registered"):
        store.unregister_buffer(buf.ctypes.data)

    src = Regions(3, 1, 256, seed=5)
    keys = [f"{key_prefix}/{i}" for i in range(3)]
    assert store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes).ok
    assert store.batch_remove(keys[:1]).ok
    assert store.batch_is_exist(keys[1:]).ok  # grants read leases
    removed = store.batch_remove(keys)
    assert list(removed) == [Outcome.NOT_FOUND, Outcome.HAS_LEASE, Outcome.HAS_LEASE]
    assert store.batch_remove(keys[1:], force=True).ok
    assert store.batch_is_exist(keys).present == [False] * 3


@mooncake
def test_conversion_probe_transfers_nothing(store: MooncakeStore) -> None:
    rows = Regions(50, 20, 64)
    seconds = store.time_argument_conversion(rows.addrs, rows.sizes)
    assert 0 <= seconds < 5


@mooncake
def test_contiguous_conversion_probe_transfers_nothing(store: MooncakeStore, key_prefix: str) -> None:
    src = Regions(10, 1, 512, seed=4)
    keys = [f"{key_prefix}/{i}" for i in range(10)]
    assert store.batch_put_from(keys, [row[0] for row in src.addrs], [512] * 10).ok
    dst = Regions(10, 1, 512)  # zeros
    seconds = store.time_contiguous_argument_conversion(keys, [row[0] for row in dst.addrs], [512] * 10)
    assert 0 <= seconds < 5
    assert not dst.data.any()  # the stored objects were not copied
    with pytest.raises(ValueError):
        store.time_contiguous_argument_conversion(keys, [], [])


# ------------------------------------------------------------------------------------------- failures


@mooncake
def test_embedded_master_only_when_asked_and_stopped_at_close() -> None:
    with MooncakeStore(embedded_master=True, global_segment_size="16MiB", local_buffer_size=0) as store:
        master = store.master
        assert master is not None and master.alive and store.master_address == master.rpc_address
        pid = master.pid
        assert pid is not None
        src = Regions(2, 2, 1 * KiB, seed=3)
        assert store.batch_put_from_multi_buffers(["emb/0", "emb/1"], src.addrs, src.sizes).ok
        started = time.monotonic()
    close_s = time.monotonic() - started
    assert not process_is_running(pid) and store.master is None
    # Mooncake's client shutdown takes ~2 s with a mounted segment; the master is killed, not waited for.
    assert close_s < 4, close_s


@mooncake
def test_setup_without_master_fails_fast_and_clearly() -> None:
    (port,) = free_ports(1)
    store = MooncakeStore(master_server_address=f"127.0.0.1:{port}", connect_timeout_s=1.5, global_segment_size=0)
    started = time.monotonic()
    with pytest.raises(StoreSetupError, match=f"127.0.0.1:{port}.*Connection refused.*connect_timeout_s") as info:
        store.setup()
    assert 1.2 < time.monotonic() - started < 5  # the bound, not Mooncake's ~90 s of retries
    assert info.value.code is not None and info.value.code != 0
    assert store.state == "new"
    with pytest.raises(StoreClosedError):
        store.batch_is_exist(["k"])
    store.close()


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """``127.0.0.1:port`` of a listener that accepts connections (the kernel's backlog) and never answers."""
    server = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


def test_waiting_for_a_silent_master_ends_at_the_bound_and_says_so(silent_listener: str) -> None:
    config = StoreConfig(master_server_address=silent_listener, connect_timeout_s=0.6)
    started = time.monotonic()
    with pytest.raises(StoreSetupError, match=f"{silent_listener} accepted a TCP connection but did not answer a "
                       r"request within 0\.6 s.*connect_timeout_s") as info:
        store_setup.wait_for_master(config, silent_listener)
    assert 0.5 < time.monotonic() - started < 3
    assert info.value.code == CODE_MASTER_UNREACHABLE


def test_waiting_for_a_master_where_nothing_listens_retries_until_the_bound() -> None:
    (port,) = free_ports(1)
    config = StoreConfig(master_server_address=f"127.0.0.1:{port}", connect_timeout_s=0.8)
    started = time.monotonic()
    with pytest.raises(StoreSetupError, match=rf"cannot reach the Mooncake master at 127\.0\.0\.1:{port}: (\d+) "
                       r"TCP connection attempt\(s\) in 0\.8 s, none accepted \(last: .*refused") as info:
        store_setup.wait_for_master(config, f"127.0.0.1:{port}")
    assert 0.6 < time.monotonic() - started < 3
    assert int(re.search(r": (\d+) TCP", str(info.value)).group(1)) >= 2  # type: ignore[union-attr]


def test_a_master_that_comes_up_within_the_bound_is_waited_for() -> None:
    (port,) = free_ports(1)
    config = StoreConfig(master_server_address=f"127.0.0.1:{port}", connect_timeout_s=10)
    answered = threading.Event()

    def late_master() -> None:
        time.sleep(0.6)
        with socket.create_server(("127.0.0.1", port)) as server:
            conn, _ = server.accept()
            with conn:
                conn.recv(20)
                conn.sendall(b"\x15")  # any answer
                answered.set()

    thread = threading.Thread(target=late_master)
    thread.start()
    try:
        store_setup.wait_for_master(config, f"127.0.0.1:{port}")
    finally:
        thread.join()
    assert answered.is_set()


def test_an_etcd_address_needs_one_endpoint_to_accept(silent_listener: str) -> None:
    (dead,) = free_ports(1)
    address = f"etcd://127.0.0.1:{dead};{silent_listener}"
    store_setup.wait_for_master(StoreConfig(master_server_address=address, connect_timeout_s=5), address)


@mooncake
def test_a_real_master_answers_the_wait_at_once(master: EmbeddedMaster, caplog: pytest.LogCaptureFixture) -> None:
    config = StoreConfig(master_server_address=master.rpc_address)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="mooncake_kvaddr.driver.store"):
        store_setup.wait_for_master(config, master.rpc_address)
    assert time.monotonic() - started < 1
    said = [r for r in caplog.records if getattr(r, store_setup.PROGRESS, False)]
    assert [r.getMessage() for r in said] == [
        f"connecting to the Mooncake master at {master.rpc_address}: waiting up to {DEFAULT_CONNECT_TIMEOUT_S:g} s "
        "for it to accept a connection and answer (connect_timeout_s)"
    ]


def test_our_own_setup_attempts_stop_at_the_connect_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    client = fake_mooncake(monkeypatch, fail=100)
    real_setup = client.setup

    def slow_setup(self: Any, *args: Any, **kwargs: Any) -> int:
        time.sleep(0.3)
        return real_setup(self, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(client, "setup", slow_setup)
    started = time.monotonic()
    with pytest.raises(StoreSetupError, match=r"after [1-4] attempt\(s\)"):
        MooncakeStore(master_server_address="127.0.0.1:1", setup_retries=50, connect_timeout_s=1).setup()
    assert time.monotonic() - started < 2.5
    assert len(client.calls) < 50


@pytest.fixture
def private_master() -> Iterator[EmbeddedMaster]:
    """A master of the test's own (for tests that fill the pool or kill the master)."""
    with EmbeddedMaster() as running:
        yield running


@mooncake
def test_pool_full_is_back_pressure_then_recovers(private_master: EmbeddedMaster) -> None:
    config = StoreConfig(
        master_server_address=private_master.rpc_address, global_segment_size="16MiB", local_buffer_size=0
    )
    with MooncakeStore(config) as store:
        src = Regions(24, 1, 1 * MiB, seed=6)
        keys = [f"full/{i}" for i in range(24)]
        put = store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes)
        assert put.back_pressure and put.count(Outcome.NO_SPACE) >= 8
        assert put.count(Outcome.OK) >= 8

        # The master evicts unleased objects in the background: a new put fits again soon.
        extra = Regions(1, 1, 1 * MiB, seed=7)
        assert wait_until(
            lambda: store.batch_put_from_multi_buffers(["full/extra"], extra.addrs, extra.sizes).ok,
            timeout=10,
        )

        # Removing everything makes room for a full batch at once.
        assert store.remove_all(force=True) > 0
        put = store.batch_put_from_multi_buffers(keys[:12], src.addrs[:12], src.sizes[:12])
        assert put.ok and not put.back_pressure
        dst = Regions(12, 1, 1 * MiB)
        assert store.batch_get_into_multi_buffers(keys[:12], dst.addrs, dst.sizes).ok
        np.testing.assert_array_equal(dst.data, src.data[:12])


@mooncake
def test_master_killed_then_restarted(private_master: EmbeddedMaster) -> None:
    config = StoreConfig(
        master_server_address=private_master.rpc_address,
        global_segment_size="32MiB",
        local_buffer_size=0,
        max_regions_per_batch=64,
    )
    with MooncakeStore(config) as store:
        src = Regions(20, 8, 1 * KiB, seed=8)
        keys = [f"kill/{i}" for i in range(20)]
        assert store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes).ok

        private_master.kill()
        started = time.monotonic()
        exist = store.batch_is_exist(keys)
        dst = Regions(20, 8, 1 * KiB)
        got = store.batch_get_into_multi_buffers(keys, dst.addrs, dst.sizes)  # 3 sub-batches
        put = store.batch_put_from_multi_buffers([f"kill/new/{i}" for i in range(20)], src.addrs, src.sizes)
        elapsed = time.monotonic() - started
        for result in (exist, got, put):
            assert result.failed == list(range(20)), result.summary()
            assert result.count(Outcome.MASTER_UNREACHABLE) == 20, result.summary()
        # ~4.3 s per call; the get stopped after its first failed sub-batch instead of paying it thrice.
        assert elapsed < 25
        assert wait_until(lambda: store.health_check() is Health.MASTER_UNREACHABLE, timeout=10)

        private_master.restart()
        assert wait_until(lambda: store.health_check() is Health.OK, timeout=20)
        # The new master knows nothing of the old objects; the client re-mounted its segment.
        assert wait_until(lambda: store.batch_is_exist(keys[:1]).count(Outcome.NOT_FOUND) == 1, timeout=10)
        assert store.batch_is_exist(keys).present == [False] * 20
        assert wait_until(lambda: store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes).ok, timeout=10)
        dst = Regions(20, 8, 1 * KiB)
        assert store.batch_get_into_multi_buffers(keys, dst.addrs, dst.sizes).ok
        np.testing.assert_array_equal(dst.data, src.data)


# ------------------------------------------------------------------------------------------- two processes

CHILD = """
import json, sys
import numpy as np
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.store import MooncakeStore

address, prefix, n, per_key, region, expected_path = sys.argv[1:7]
n, per_key, region = int(n), int(per_key), int(region)
expected = np.fromfile(expected_path, dtype=np.uint8).reshape(n, per_key, region)
# No segment of its own: every byte it reads or writes crosses TCP to the parent's segment.
config = StoreConfig(master_server_address=address, global_segment_size=0, local_buffer_size=0)
with MooncakeStore(config) as store:
    keys = [f"{prefix}/{i}" for i in range(n)]
    dst = np.zeros_like(expected)
    base = dst.ctypes.data
    addrs = [[base + (k * per_key + j) * region for j in range(per_key)] for k in range(n)]
    sizes = [[region] * per_key for _ in range(n)]
    got = store.batch_get_into_multi_buffers(keys, addrs, sizes)
    mine = (255 - expected).copy()
    base = mine.ctypes.data
    my_addrs = [[base + (k * per_key + j) * region for j in range(per_key)] for k in range(n)]
    put = store.batch_put_from_multi_buffers([f"{prefix}/child/{i}" for i in range(n)], my_addrs, sizes)
    print(json.dumps({"get": got.summary(), "equal": bool((dst == expected).all()), "put": put.summary()}))
"""


@mooncake
def test_second_process_reads_and_writes_over_tcp(
    store: MooncakeStore, master: EmbeddedMaster, key_prefix: str, tmp_path: Path
) -> None:
    src = Regions(16, 4, 2 * KiB, seed=9)
    keys = [f"{key_prefix}/{i}" for i in range(16)]
    assert store.batch_put_from_multi_buffers(keys, src.addrs, src.sizes).ok
    expected = tmp_path / "expected.bin"
    src.data.tofile(expected)

    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(CHILD),
            master.rpc_address,
            key_prefix,
            "16",
            "4",
            str(2 * KiB),
            str(expected),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report == {"get": {"ok": 16}, "equal": True, "put": {"ok": 16}}, child.stderr[-3000:]

    # What the child wrote (into this process's segment, over TCP) reads back here.
    dst = Regions(16, 4, 2 * KiB)
    assert store.batch_get_into_multi_buffers([f"{key_prefix}/child/{i}" for i in range(16)], dst.addrs, dst.sizes).ok
    np.testing.assert_array_equal(dst.data, 255 - src.data)


def test_a_pinned_port_is_read_after_an_ipv6_address() -> None:
    """``local_hostname`` pins a port as Mooncake reads it: ``host:port`` or ``[v6]:port``."""
    assert store_module._has_port("10.0.0.1:13000")
    assert store_module._has_port("[::1]:13000")
    assert store_module._has_port("[fe80::1%eth0]:13000")
    assert not store_module._has_port("10.0.0.1")
    assert not store_module._has_port("[::1]")
    assert not store_module._has_port("::1")


def _in_a_fork(calls: Callable[[], list[str]], timeout: float = 20.0) -> list[str] | None:
    """``calls()`` run in a forked child; what it returned (one line per call), or None when the child did not
    answer within ``timeout`` (it is killed). The child leaves with ``os._exit``: no atexit, no finalizer."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            lines = calls()
        except BaseException as exc:  # reported to the parent
            lines = [f"child raised {type(exc).__name__}: {exc}"]
        os.write(write, json.dumps(lines).encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                with os.fdopen(read, "rb") as pipe:
                    answer: list[str] = json.loads(pipe.read() or b"null")
                return answer
            time.sleep(0.05)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read)
        return None
    except BaseException:
        os.kill(pid, 9)
        raise


@pytest.mark.mooncake
def test_a_store_used_in_a_forked_child_is_refused_at_once(store: MooncakeStore, key_prefix: str) -> None:
    """Issue 39 item 5: Mooncake's client hangs in a fork of the process that set it up. The gate notes the pid
    at set-up: every call, and close(), in another process is refused at once with StoreClosedError naming the
    fork; health_check says NOT_READY; nothing reaches Mooncake, and the parent's store works on."""

    def calls() -> list[str]:
        lines = []
        for name, call in (
            ("batch_is_exist", lambda: store.batch_is_exist([f"{key_prefix}-a"])),
            ("batch_remove", lambda: store.batch_remove([f"{key_prefix}-a"])),
            ("close", store.close),
        ):
            try:
                call()
                lines.append(f"{name}: answered")
            except StoreClosedError as exc:
                lines.append(f"{name}: {exc}")
        lines.append(f"health_check: {store.health_check().name}")
        return lines

    started = time.monotonic()
    lines = _in_a_fork(calls)
    assert lines is not None, "the forked child hung"
    assert time.monotonic() - started < 10
    parent = os.getpid()
    for line in lines[:3]:
        assert f"MooncakeStore was opened in process {parent}; this is process" in line, lines
        assert "a fork of it" in line, lines
    assert lines[3] == "health_check: NOT_READY", lines
    assert store.ready and store.batch_is_exist([f"{key_prefix}-a"]).codes == (0,)
