"""The shared transfer rules (docs/transfer-modes.md): rotation, lcm flooring, group runs, the disk-offload
staging-budget split (checked against vLLM's own function when vLLM is installed), and the metrics callback
on a real store."""

from __future__ import annotations

import functools
import itertools
import warnings
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr_testing import Cache, Calls, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.rules import (
    choose_auto_mode,
    copies_in_memory,
    estimate_staging_bytes,
    floor_to,
    group_runs,
    rotate,
    split_by_staging_budget,
)
from mooncake_kvaddr.driver.store import MooncakeStore, StoreError
from mooncake_kvaddr.driver.transfer import TransferRequest

mooncake = pytest.mark.mooncake


@functools.cache
def _vllm_module(name: str) -> ModuleType | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return __import__(name, fromlist=["_"])
        except Exception:  # not installed, or it fails to import on this machine
            return None


def vllm_store_module(leaf: str) -> ModuleType:
    """vLLM 0.33's Mooncake store module ``leaf`` (worker, metrics), or skip."""
    module = _vllm_module(f"vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.{leaf}")
    if module is None:
        pytest.skip("vLLM's Mooncake store connector is not importable")
    return module


# ------------------------------------------------------------------------------------------- small rules


def test_rotate_lists_and_arrays_alike() -> None:
    assert rotate([1, 2, 3, 4], 1) == [2, 3, 4, 1]
    assert rotate([1, 2, 3, 4], 6) == [3, 4, 1, 2]
    assert rotate([], 3) == []
    same = [1, 2]
    assert rotate(same, 4) is same
    np.testing.assert_array_equal(rotate(np.arange(10).reshape(5, 2), 2), [[4, 5], [6, 7], [8, 9], [0, 1], [2, 3]])


def test_floor_to_and_group_runs() -> None:
    assert [floor_to(x, 48) for x in (0, 47, 48, 95, 96)] == [0, 0, 48, 48, 96]
    assert group_runs([0, 0, 1, 1, 1, 0, 2]) == [(0, 0, 2), (1, 2, 5), (0, 5, 6), (2, 6, 7)]
    assert group_runs([]) == []


# ------------------------------------------------------------------------------------------- staging budget


def test_staging_estimate_and_split_edges() -> None:
    assert estimate_staging_bytes(1) == 4096 + 8192 and estimate_staging_bytes(4096) == 4096 + 8192
    assert estimate_staging_bytes(4097) == 8192 + 8192
    one = estimate_staging_bytes(2048)  # 12 KiB per key
    assert split_by_staging_budget([2048] * 4, 4 * one, 4 * one) == [(0, 4)]
    assert split_by_staging_budget([2048] * 4, 2 * one, 4 * one) == [(0, 2), (2, 4)]
    # A key above the usable share but within the budget goes alone; one above the budget fails everything.
    assert split_by_staging_budget([2048, 20000, 2048], 2 * one, 40000) == [(0, 1), (1, 2), (2, 3)]
    assert split_by_staging_budget([2048, 40000, 2048], 2 * one, 40000) == 1
    assert split_by_staging_budget([], 1, 1) == []
    # Exactly at the budget is within it (vLLM fails only a key whose estimate is above it).
    assert split_by_staging_budget([2048], one, one) == [(0, 1)]
    assert split_by_staging_budget([2048, 2048], one, one) == [(0, 1), (1, 2)]


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1 << 20), max_size=40),
    budget=st.integers(1, 1 << 23),
    ratio=st.sampled_from([0.5, 0.9, 1.0]),
)
def test_split_equals_vllm(sizes: list[int], budget: int, ratio: float) -> None:
    worker = vllm_store_module("worker")
    usable = max(1, int(budget * ratio))
    keys = [f"k{i}" for i in range(len(sizes))]
    rows = [[n] for n in sizes]
    assert [estimate_staging_bytes(n) for n in sizes] == [worker._estimate_disk_offload_staging_bytes(r) for r in rows]
    ours = split_by_staging_budget(sizes, usable, budget)
    total = sum(worker._estimate_disk_offload_staging_bytes(r) for r in rows)
    if total <= usable:  # vLLM splits only when the whole request does not fit
        assert ours == ([(0, len(sizes))] if sizes else [])
        return
    batches, oversized = worker._split_disk_offload_load_batches(keys, rows, rows, usable, budget)
    if oversized is not None:
        assert ours == keys.index(oversized)
        return
    bounds, start = [], 0
    for batch_keys, _, _ in batches:
        bounds.append((start, start + len(batch_keys)))
        start += len(batch_keys)
    assert ours == bounds


def test_one_split_serves_the_driver_and_the_plugin() -> None:
    """The one staging split, in both callers' forms: the driver's (its constants, the raw budget checked first,
    no batch for no key) and the plugin's (vLLM's constants, ``fits_first``: a load that fits is one batch before
    any raw check, ``(0, 0)`` for no key)."""
    one = estimate_staging_bytes(2048)
    assert split_by_staging_budget([], 1, 1) == [] and split_by_staging_budget([], 1, 1, fits_first=True) == [(0, 0)]
    for fits_first in (False, True):  # a key over usable goes alone; one over raw fails a load that must split
        assert split_by_staging_budget([2048, 20000, 2048], 2 * one, 40000, fits_first=fits_first) == [
            (0, 1), (1, 2), (2, 3)
        ]
        assert split_by_staging_budget([2048, 40000, 2048], 2 * one, 40000, fits_first=fits_first) == 1
    # A key over raw in a load that fits usable (vLLM's usable may exceed raw): only the driver refuses it.
    assert split_by_staging_budget([40000], 60000, 40000) == 0
    assert split_by_staging_budget([40000], 60000, 40000, fits_first=True) == [(0, 1)]
    # Alignment and padding are parameters (vLLM's worker module's constants in the plugin).
    assert estimate_staging_bytes(1, 512, 0) == 512 and estimate_staging_bytes(513, 512, 100) == 1124
    assert split_by_staging_budget([512] * 4, 1024, 1024, alignment=512, padding=0) == [(0, 2), (2, 4)]
    assert split_by_staging_budget([512] * 4, 1024, 1 << 20) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 4095, 4096, 4097, 8192, 20_000, 1 << 20]), max_size=12),
    usable=st.integers(-1, 1 << 21),
    raw=st.integers(0, 1 << 21),
)
def test_the_driver_and_the_plugin_split_alike_unless_the_load_fits(sizes: list[int], usable: int, raw: int) -> None:
    """On generated loads (the empty one, keys over usable, keys over raw) the two forms agree except where the
    whole load fits ``usable`` (the plugin then takes one batch); both equal vLLM's rules where it is installed."""
    driver = split_by_staging_budget(sizes, usable, raw)
    plugin = split_by_staging_budget(sizes, usable, raw, fits_first=True)
    fits = sum(estimate_staging_bytes(n) for n in sizes) <= usable
    assert plugin == ([(0, len(sizes))] if fits else driver)
    if not sizes:  # the empty load: no batch for the driver, one empty batch for the plugin (usable >= 0)
        assert driver == [] and plugin == ([(0, 0)] if usable >= 0 else [])
    worker = _vllm_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker")
    if worker is None or not sizes or fits:
        return
    keys, rows = [f"k{i}" for i in range(len(sizes))], [[n] for n in sizes]
    batches, oversized = worker._split_disk_offload_load_batches(keys, rows, rows, usable, raw)
    if oversized is not None:
        assert plugin == keys.index(oversized)
        return
    starts = np.cumsum([0] + [len(batch[0]) for batch in batches]).tolist()
    assert plugin == list(itertools.pairwise(starts))


@mooncake
@pytest.mark.parametrize("mode", ["multi_buffer", "staged"])
def test_load_splits_by_the_disk_offload_budget(
    store: MooncakeStore, model: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs, chunks = 16, 10
    src, dst = Cache(2, chunks + 1, 1024, seed=1), Cache(2, chunks + 1, 1024)  # 2 KiB objects: 12 KiB staged
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    with transfer(store, model, src, bs, transfer_mode=mode) as writer:
        assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).ok
    calls = Calls(store, monkeypatch)
    budget = 4 * estimate_staging_bytes(2048)  # usable 90 %: three keys per sub-batch
    with transfer(store, model, dst, bs, transfer_mode=mode, disk_offload_buffer_budget_bytes=budget) as reader:
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids]))
    assert loaded.ok and loaded.bytes == chunks * 2048
    assert_blocks_equal(src, ids, dst, ids)
    name = "batch_get_into_multi_buffers" if mode == "multi_buffer" else "batch_get_into"
    assert calls.named(name) == [3, 3, 3, 1]


@mooncake
def test_a_usable_ratio_of_one_uses_the_whole_budget(store: MooncakeStore, model: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The ratio's range is (0, 1]: 1 is accepted and a sub-batch then fills the whole budget (three keys
    exactly); 0 and anything above 1 are refused."""
    bs, chunks = 16, 7
    src, dst = Cache(2, chunks + 1, 1024, seed=3), Cache(2, chunks + 1, 1024)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    with transfer(store, model, src, bs) as writer:
        assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).ok
    for ratio in (0, 1.0001):
        with pytest.raises(ValueError, match="disk_offload_usable_ratio"):
            transfer(store, model, dst, bs, disk_offload_usable_ratio=ratio)
    calls = Calls(store, monkeypatch)
    budget = 3 * estimate_staging_bytes(2048)
    with transfer(store, model, dst, bs, transfer_mode="multi_buffer", disk_offload_buffer_budget_bytes=budget,
                  disk_offload_usable_ratio=1) as reader:
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids]))
    assert loaded.ok and loaded.bytes == chunks * 2048
    assert_blocks_equal(src, ids, dst, ids)
    assert calls.named("batch_get_into_multi_buffers") == [3, 3, 1]


@mooncake
@pytest.mark.parametrize("mode", ["multi_buffer", "staged"])
def test_one_key_over_the_budget_fails_the_whole_request_untouched(
    store: MooncakeStore, model: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs, chunks = 16, 4
    src, dst = Cache(2, chunks + 1, 4096, seed=2), Cache(2, chunks + 1, 4096, fill=7)
    h = hashes(model, chunks)
    ids = [1, 2, 3, 4]
    with transfer(store, model, src, bs, transfer_mode=mode) as writer:
        assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).ok
    calls = Calls(store, monkeypatch)
    budget = estimate_staging_bytes(8192) - 1  # not even one 8 KiB object fits
    with transfer(store, model, dst, bs, transfer_mode=mode, disk_offload_buffer_budget_bytes=budget) as reader:
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids]))
    assert loaded.failed_block_ids == set(ids) and not loaded.loaded_block_ids and loaded.bytes == 0
    assert loaded.error is not None and "staging budget" in loaded.error
    assert loaded.outcomes == {"staging_budget_exceeded": chunks}
    assert calls.calls == [] and all((region == 7).all() for region in dst.regions)


# ------------------------------------------------------------------------------------------- metrics


class Recorder:
    """A ``record_operation`` callback that keeps every call's keywords."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, operation: str, duration_seconds: float, num_keys: int, *, num_bytes: int = 0,
                 status: str = "ok", num_failed_keys: int = 0) -> None:
        assert 0.0 <= duration_seconds < 60.0  # the call's own duration, not a clock reading
        self.records.append({"operation": operation, "num_keys": num_keys, "num_bytes": num_bytes,
                             "status": status, "num_failed_keys": num_failed_keys})


@mooncake
@pytest.mark.parametrize(("mode", "regions"), [("multi_buffer", 2), ("staged", 2), ("direct", 1)])
def test_every_mooncake_call_is_recorded(store: MooncakeStore, model: str, mode: str, regions: int) -> None:
    bs, chunks = 16, 6
    src, dst = Cache(regions, chunks + 1, 512, seed=3), Cache(regions, chunks + 1, 512)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    requested = "auto" if mode == "direct" else mode
    key_bytes = regions * 512
    writes, reads = Recorder(), Recorder()
    with transfer(store, model, src, bs, transfer_mode=requested, record_operation=writes) as writer:
        assert writer.mode == mode
        assert writer.store(TransferRequest("r", 4 * bs, h, [ids])).ok  # chunks 0..3
        assert writer.store(TransferRequest("r", 4 * bs, h, [ids])).ok  # all present: no put
    assert writes.records == [
        {"operation": "save_exists", "num_keys": 4, "num_bytes": 0, "status": "ok", "num_failed_keys": 0},
        {"operation": "save_put", "num_keys": 4, "num_bytes": 4 * key_bytes, "status": "ok", "num_failed_keys": 0},
        {"operation": "save_exists", "num_keys": 4, "num_bytes": 0, "status": "ok", "num_failed_keys": 0},
    ]
    with transfer(store, model, dst, bs, transfer_mode=requested, record_operation=reads) as reader:
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids]))
    assert loaded.failed_block_ids == {5, 6}
    assert reads.records == [{"operation": "load_get", "num_keys": chunks, "num_bytes": chunks * key_bytes,
                              "status": "partial_failure", "num_failed_keys": 2}]


@mooncake
def test_a_raising_call_is_recorded_as_an_error_and_a_raising_callback_is_ignored(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = Cache(2, 4, 256, seed=4)
    h = hashes(model, 3)
    records = Recorder()
    with transfer(store, model, cache, 16, transfer_mode="multi_buffer", record_operation=records) as xfer:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise StoreError("master gone", -900)

        monkeypatch.setattr(store, "batch_get_into_multi_buffers", broken)
        loaded = xfer.load(TransferRequest("r", 48, h, [[1, 2, 3]]))
        assert loaded.error is not None and "master gone" in loaded.error
    assert records.records == [{"operation": "load_get", "num_keys": 3, "num_bytes": 3 * 512,
                                "status": "error", "num_failed_keys": 3}]

    def raising(**kwargs: Any) -> None:
        raise RuntimeError("metrics bug")

    with transfer(store, f"{model}/b", cache, 16, record_operation=raising) as xfer:
        assert xfer.store(TransferRequest("r", 48, h, [[1, 2, 3]])).ok
    assert "record_operation callback failed" in caplog.text


@mooncake
def test_vllm_connector_stats_accept_our_records(store: MooncakeStore, model: str) -> None:
    stats = vllm_store_module("metrics").MooncakeStoreConnectorStats()
    cache = Cache(2, 4, 256, seed=5)
    h = hashes(model, 3)
    with transfer(store, model, cache, 16, record_operation=stats.record_operation) as xfer:
        assert xfer.store(TransferRequest("r", 48, h, [[1, 2, 3]])).ok
        assert xfer.load(TransferRequest("r", 48, h, [[1, 2, 3]])).ok
    assert sorted(stats.data) == ["load_get", "save_exists", "save_put"]
    assert stats.data["load_get"][0]["num_keys"] == 3 and stats.data["load_get"][0]["num_bytes"] == 3 * 512
    reduced = stats.reduce()
    assert any(key.startswith("load_get") for key in reduced)


# ------------------------------------------------------------------------------------------- auto


def test_auto_rule_follows_the_measured_crossover() -> None:
    # Over the network: stage below 32 KiB regions whatever the region count, and objects up to 512 KiB.
    for regions in (17, 100, 15616):
        assert choose_auto_mode(regions, 2 << 10) == "staged"
        assert choose_auto_mode(regions, (32 << 10) - 1) == "staged"
        assert choose_auto_mode(regions, 32 << 10) == "multi_buffer"
    assert choose_auto_mode(16, 32 << 10) == "staged"  # exactly 512 KiB
    assert choose_auto_mode(4, 128 << 10) == "staged"
    assert choose_auto_mode(16, 64 << 10) == "multi_buffer"
    # In memory: stage only loads of keys with at most 8 regions under 4 KiB (the measured shapes where the
    # staged get won); never stores (staging adds a copy of every byte and saves no network cost).
    for regions, region_bytes in ((2, 64), (4, 2 << 10), (8, 2 << 10), (8, (4 << 10) - 1)):
        assert choose_auto_mode(regions, region_bytes, local_copy=True) == "staged"
        assert choose_auto_mode(regions, region_bytes, local_copy=True, direction="store") == "multi_buffer"
    for regions, region_bytes in ((9, 2 << 10), (16, 2 << 10), (100, 2 << 10), (4, 4 << 10), (4, 8 << 10),
                                  (16, 32 << 10)):
        for direction in ("load", "store"):
            assert choose_auto_mode(regions, region_bytes, local_copy=True, direction=direction) == "multi_buffer"
    # Over the network both directions follow the same rule.
    assert choose_auto_mode(100, 2 << 10, direction="store") == "staged"
    assert choose_auto_mode(16, 64 << 10, direction="store") == "multi_buffer"
    with pytest.raises(ValueError, match="direction"):
        choose_auto_mode(4, 2 << 10, direction="put")
    # One region per key never stages; no region at all has nothing to move.
    assert choose_auto_mode(1, 2 << 10) == choose_auto_mode(1, 1 << 20, local_copy=True) == "direct"
    assert choose_auto_mode(0, 0) == "multi_buffer"


def test_in_memory_copies_are_inferred_from_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_STORE_MEMCPY", raising=False)
    assert copies_in_memory(StoreConfig(global_segment_size="64MiB", embedded_master=True))  # own master + segment
    assert not copies_in_memory(StoreConfig(global_segment_size="64MiB"))  # no master named: not known
    assert not copies_in_memory(StoreConfig(global_segment_size="64MiB", master_server_address="10.0.0.1:50051"))
    assert not copies_in_memory(StoreConfig(global_segment_size=0))  # a pure client: every byte crosses
    assert not copies_in_memory(StoreConfig(global_segment_size="64MiB", protocol="rdma"))
    monkeypatch.setenv("MC_STORE_MEMCPY", "0")
    assert not copies_in_memory(StoreConfig(global_segment_size="64MiB"))


@mooncake
@pytest.mark.parametrize(
    ("regions", "block_bytes", "local_copy", "expected", "expected_store"),
    [
        (3, 512, None, "staged", "staged"),  # the test store's master is external: network rule
        (3, 8 << 10, None, "staged", "staged"),
        (3, 32 << 10, None, "staged", "staged"),  # 96 KiB objects
        (20, 32 << 10, None, "multi_buffer", "multi_buffer"),  # 640 KiB objects of 32 KiB regions
        (3, 512, True, "staged", "multi_buffer"),  # in memory, few small regions: loads staged
        (20, 512, True, "multi_buffer", "multi_buffer"),  # in memory, many regions
        (1, 32 << 10, True, "direct", "direct"),
    ],
)
def test_auto_resolves_by_the_rule_and_round_trips(
    store: MooncakeStore,
    model: str,
    regions: int,
    block_bytes: int,
    local_copy: bool | None,
    expected: str,
    expected_store: str,
) -> None:
    src, dst = Cache(regions, 4, block_bytes, seed=6), Cache(regions, 4, block_bytes)
    h = hashes(model, 3)
    kw: dict[str, Any] = {"transfer_mode": "auto", "local_copy": local_copy, "start_threads": False}
    with transfer(store, model, src, 16, **kw) as writer, transfer(store, model, dst, 16, **kw) as reader:
        assert writer.mode == reader.mode == expected
        assert writer.store_mode == reader.store_mode == expected_store
        stored = writer.store(TransferRequest("r", 48, h, [[1, 2, 3]]))
        assert stored.ok and stored.mode == expected_store
        loaded = reader.load(TransferRequest("r", 48, h, [[3, 2, 1]]))
        assert loaded.ok and loaded.mode == expected
    assert_blocks_equal(src, [1, 2, 3], dst, [3, 2, 1])


def test_each_in_memory_condition_alone_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """From a configuration that copies in memory (own master, a segment, TCP), each condition alone makes it
    network: ``MC_STORE_MEMCPY=0``, another protocol, no segment."""
    own = {"global_segment_size": "64MiB", "embedded_master": True}
    monkeypatch.setenv("MC_STORE_MEMCPY", "1")
    assert copies_in_memory(StoreConfig(**own))
    assert not copies_in_memory(StoreConfig(**{**own, "protocol": "rdma"}))
    assert not copies_in_memory(StoreConfig(**{**own, "global_segment_size": 0}))
    monkeypatch.setenv("MC_STORE_MEMCPY", "0")
    assert not copies_in_memory(StoreConfig(**own))


@mooncake
def test_a_raising_existence_check_of_a_store_is_recorded_as_an_error_of_no_bytes(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose ``batch_is_exist`` raises: the error reaches the caller after one ``save_exists`` record,
    status error, every key failed, 0 bytes (an existence check moves none); nothing is put."""
    cache = Cache(2, 4, 256, seed=6)
    records = Recorder()
    with transfer(store, model, cache, 16, transfer_mode="multi_buffer", record_operation=records) as xfer:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise StoreError("master gone", -900)

        monkeypatch.setattr(store, "batch_is_exist", broken)
        with pytest.raises(StoreError, match="master gone"):
            xfer.store(TransferRequest("r", 48, hashes(model, 3), [[1, 2, 3]]))
    assert records.records == [{"operation": "save_exists", "num_keys": 3, "num_bytes": 0,
                                "status": "error", "num_failed_keys": 3}]
