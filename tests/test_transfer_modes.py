"""Staged transfers (issue 6): the staging pool and batch planning, then KVTransfer's modes on a real store.

Every transfer test compares bytes: interop between the staged and multi-buffer modes in both directions (an
object is the concatenation of its regions either way), odd sizes and alignments, partial failures that must
leave regions untouched, concurrent requests sharing one pool, and a second process over real TCP.
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvaddr_testing import Cache, Calls, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, StoreConfig
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT, StagingPool, plan_batches, plan_slots
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

mooncake = pytest.mark.mooncake


# ------------------------------------------------------------------------------------------- batch planning


def test_plan_batches_whole_request_when_it_fits() -> None:
    plan = plan_slots(np.full((10, 3), 100, dtype=np.int64))  # 300-byte objects, 320-byte slots
    assert plan_batches(plan, plan.total_bytes) == [(0, 10)]
    assert plan_batches(plan, 1 << 30) == [(0, 10)]
    assert plan_batches(plan_slots(np.zeros((0, 3), dtype=np.int64)), 64) == []


def test_plan_batches_fill_the_span_and_keep_slots_aligned() -> None:
    sizes = np.array([[100, 1], [64, 0], [500, 0], [1, 1], [63, 0]], dtype=np.int64)
    plan = plan_slots(sizes)
    for span in (500, 512, 640, 700, 1000):
        batches = plan_batches(plan, span)
        assert batches[0][0] == 0 and batches[-1][1] == 5
        assert all(a[1] == b[0] for a, b in itertools.pairwise(batches))
        for start, end in batches:
            slots = plan.offsets[start:end] - plan.offsets[start]
            assert (slots % SLOT_ALIGNMENT == 0).all()
            assert int(slots[-1] + plan.object_sizes[end - 1]) <= span  # the batch fits
            if end < 5:  # and is as large as the span allows: one more key would not fit
                assert int(plan.offsets[end] - plan.offsets[start] + plan.object_sizes[end]) > span
    assert plan_batches(plan, 1 << 20, max_keys=2) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="key 2: its 500-byte object does not fit in a 499-byte"):
        plan_batches(plan, 499)
    with pytest.raises(ValueError, match="max_keys"):
        plan_batches(plan, 100, max_keys=0)


def test_a_path_records_the_keys_that_failed() -> None:
    """The metrics of one Mooncake call count its failed keys (not the keys that succeeded)."""
    from mooncake_kvaddr.driver.paths import PathContext, TransferPath
    from mooncake_kvaddr.driver.results import Clock
    from mooncake_kvaddr.driver.rules import OperationRecorder
    from mooncake_kvaddr.driver.store import BatchResult, Outcome

    records: list[dict[str, Any]] = []
    ctx = PathContext(None, [], None, None, OperationRecorder(lambda **kw: records.append(kw)))  # type: ignore[arg-type]
    path = TransferPath(ctx)
    outcomes: dict[str, int] = {}
    got = BatchResult((0, 0, -704), (Outcome.OK, Outcome.OK, Outcome.NOT_FOUND))
    path._call_inline("load_get", 3, 300, lambda: got, Clock(), "get", outcomes)
    every_ok = BatchResult((0, 0), (Outcome.OK, Outcome.OK))
    path._call_inline("save_put", 2, 200, lambda: every_ok, Clock(), "put", outcomes)
    assert [(r["operation"], r["status"], r["num_failed_keys"]) for r in records] == [
        ("load_get", "partial_failure", 1),
        ("save_put", "ok", 0),
    ]
    assert outcomes == {"ok": 4, "not_found": 1}


# ------------------------------------------------------------------------------------------- the pool


def test_pool_leases_are_disjoint_aligned_and_merge_back() -> None:
    pool = StagingPool(1000, prefault=False)
    assert pool.capacity == 960 and pool.free_bytes == 960
    assert pool.buffer.ptr % 4096 == 0
    a = pool.acquire(100, 200)  # rounded up to 256
    b = pool.acquire(1, 1)
    c = pool.acquire(10, 10_000)  # everything left
    assert (a.offset, a.nbytes) == (0, 256) and (b.offset, b.nbytes) == (256, 64)
    assert (c.offset, c.nbytes) == (320, 640) and pool.free_bytes == 0
    assert a.ptr % SLOT_ALIGNMENT == 0 and c.range == (pool.buffer.ptr + 320, 640)
    b.release()
    b.release()  # idempotent
    a.release()
    assert pool.free_bytes == 320
    with c:
        pass
    assert pool.free_bytes == 960 and not c.held
    whole = pool.acquire(960)  # merged back into one span
    assert whole.nbytes == 960
    whole.release()
    with pytest.raises(ValueError, match="pool holds 960"):
        pool.acquire(961)
    with pytest.raises(ValueError, match="nbytes"):
        StagingPool(0)


def test_pool_waits_for_room_and_times_out() -> None:
    pool = StagingPool(4096, prefault=False)
    held = pool.acquire(4096)
    with pytest.raises(TimeoutError, match=r"no 64-byte staging span freed within 0\.05 s"):
        pool.acquire(64, timeout=0.05)
    got: list[int] = []

    def waiter() -> None:
        with pool.acquire(2048, 4096, timeout=10) as lease:
            got.append(lease.nbytes)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    assert not got  # still waiting
    held.release()
    thread.join(10)
    assert got == [4096] and pool.free_bytes == 4096


def test_pool_never_gives_two_holders_the_same_bytes() -> None:
    pool = StagingPool(64 * 50, prefault=False)
    owners = np.full(pool.capacity, -1, dtype=np.int64)
    errors: list[str] = []
    lock = threading.Lock()

    def worker(me: int) -> None:
        rng = np.random.default_rng(me)
        for _ in range(200):
            lo = int(rng.integers(1, 64 * 20))
            with pool.acquire(lo, lo + int(rng.integers(0, 64 * 20)), timeout=30) as lease:
                span = slice(lease.offset, lease.offset + lease.nbytes)
                with lock:
                    if (owners[span] != -1).any():
                        errors.append(f"worker {me} got bytes held by {set(owners[span].tolist())}")
                    owners[span] = me
                time.sleep(0)
                with lock:
                    owners[span] = -1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and pool.free_bytes == pool.capacity


class Registrar:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def register_buffer(self, ptr: int, size: int) -> None:
        self.calls.append(("register", size))

    def unregister_buffer(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr))


def test_pool_registers_once_per_store() -> None:
    pool = StagingPool(4096, prefault=False)
    first, second = Registrar(), Registrar()
    pool.register_with(first)
    pool.register_with(first)
    pool.register_with(second)
    assert first.calls == [("register", 4096)] and second.calls == [("register", 4096)]
    pool.unregister_from(first)
    assert first.calls == [("register", 4096)]
    pool.unregister_from(first)
    pool.unregister_from(first)  # no longer registered: nothing to do
    assert first.calls == [("register", 4096), ("unregister", pool.buffer.ptr)]


# ------------------------------------------------------------------------------------------- configuration


def test_config_transfer_mode_and_staging_size() -> None:
    assert StoreConfig().transfer_mode == "auto" and StoreConfig().staging_buffer_size == 512 << 20
    config = StoreConfig(transfer_mode="Multi-Buffer", staging_buffer_size="64MiB")
    assert config.transfer_mode == "multi_buffer" and config.staging_buffer_size == 64 << 20
    with pytest.raises(ValueError, match="transfer_mode"):
        StoreConfig(transfer_mode="scatter")
    with pytest.raises(ValueError, match="staging_buffer_size"):
        StoreConfig(staging_buffer_size=0)
    store = MooncakeStore(master_server_address="127.0.0.1:1")
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
    with pytest.raises(ValueError, match="transfer_mode"):
        KVTransfer(store, [db], transfer_mode="fast", start_threads=False)
    xfer = KVTransfer(store, [db], transfer_mode="staged", start_threads=False)
    assert xfer.transfer_mode == "staged" and xfer.mode == "multi_buffer"  # nothing registered yet
    xfer.close()


def test_the_store_configs_transfer_mode_is_the_default() -> None:
    store = MooncakeStore(master_server_address="127.0.0.1:1", transfer_mode="staged")
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
    xfer = KVTransfer(store, [db], start_threads=False)
    assert xfer.transfer_mode == "staged"
    xfer.close()
    xfer = KVTransfer(store, [db], transfer_mode="multi_buffer", start_threads=False)  # the argument wins
    assert xfer.transfer_mode == "multi_buffer"
    xfer.close()


def test_walk_load_equals_plan_load() -> None:
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16, 4)
    db.set_kv_caches_base_addr([1 << 20, 2 << 20, 3 << 20])
    db.set_block_len([64, 128])
    h = [bytes([i]) * 8 for i in range(40)]
    ids = list(range(1, 20))
    for token_len, mask_num, mask in ((152, 20, None), (152, 0, [True, False, True] * 5), (160, 48, []), (0, 0, None)):
        plan = db.plan_load(token_len, h, ids, mask_num, mask)
        walk = db.walk_load(token_len, h, mask_num, mask)
        assert walk.keys == plan.keys and walk.chunks.shape == (len(plan.keys), 2)
        if plan.keys:
            addrs, sizes, block_ids = db.prepare_values_array(walk.chunks, ids)
            assert addrs.tolist() == plan.addrs and sizes.tolist() == plan.sizes
            assert block_ids.tolist() == plan.block_ids


# ------------------------------------------------------------------------------------------- modes on a store


@mooncake
@pytest.mark.parametrize(("put_mode", "get_mode"), [("multi_buffer", "staged"), ("staged", "multi_buffer")])
@pytest.mark.parametrize("tp_rank", [0, 5])
def test_interop_between_modes(store: MooncakeStore, model: str, put_mode: str, get_mode: str, tp_rank: int) -> None:
    bs, chunks, regions = 16, 12, 5
    src, dst = Cache(regions, chunks + 1, 768, seed=1), Cache(regions, chunks + 1, 768, fill=0xAB)
    h = hashes(model, chunks)
    ids_src = list(range(1, chunks + 1))
    ids_dst = [7, 3, 11, 1, 12, 5, 9, 2, 10, 4, 8, 6]
    with (
        transfer(store, model, src, bs, transfer_mode=put_mode) as writer,
        transfer(store, model, dst, bs, transfer_mode=get_mode, tp_rank=tp_rank) as reader,
    ):
        assert (writer.mode, reader.mode) == (put_mode, get_mode)
        stored = writer.store(TransferRequest("r", chunks * bs, h, [ids_src]))
        assert stored.ok and stored.stored == chunks and stored.mode == put_mode
        assert stored.bytes == chunks * regions * 768
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids_dst]))
        assert loaded.ok and loaded.mode == get_mode and loaded.loaded_block_ids == set(ids_dst)
        assert loaded.bytes == chunks * regions * 768
        assert_blocks_equal(src, ids_src, dst, ids_dst)
        assert (dst.regions[0][0] == 0xAB).all()  # the null block was never written

        # The stored object is the concatenation of the chunk's regions, whichever mode put it.
        keys = [writer.databases[0].key_for(x) for x in h]
        flat = np.zeros((chunks, regions * 768), dtype=np.uint8)
        got = store.batch_get_into(keys, [flat[i].ctypes.data for i in range(chunks)], [flat.shape[1]] * chunks)
        assert got.ok
        for i, block in enumerate(ids_src):
            assert flat[i].tobytes() == src.object_bytes(block)


@mooncake
@pytest.mark.parametrize("block_bytes", [1, 77, 1000, 4099])
def test_odd_sizes_pad_slots_but_give_mooncake_exact_object_sizes(
    store: MooncakeStore, model: str, block_bytes: int
) -> None:
    bs, chunks, regions = 16, 9, 3
    src, dst = Cache(regions, chunks + 1, block_bytes, seed=2), Cache(regions, chunks + 1, block_bytes)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    # A pool of an odd size that holds ~3 padded slots: objects are not multiples of 64, so slots are padded.
    pool = StagingPool(3 * (-(-regions * block_bytes // 64) * 64) + 17)
    with (
        transfer(store, model, src, bs, transfer_mode="staged", staging_pool=pool) as writer,
        transfer(store, model, dst, bs, transfer_mode="staged", staging_pool=pool) as reader,
    ):
        assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).ok
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids[::-1]]))
        assert loaded.ok
        assert_blocks_equal(src, ids, dst, ids[::-1])
    assert pool.free_bytes == pool.capacity


@mooncake
def test_pool_smaller_than_the_request_moves_it_in_few_large_batches(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs, chunks, regions, block_bytes = 16, 40, 4, 256
    src, dst = Cache(regions, chunks + 1, block_bytes, seed=3), Cache(regions, chunks + 1, block_bytes)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    pool = StagingPool(16 * regions * block_bytes)  # 16 keys per batch
    calls = Calls(store, monkeypatch)
    with (
        transfer(store, model, src, bs, staging_pool=pool) as writer,
        transfer(store, model, dst, bs, staging_pool=pool, tp_rank=7) as reader,
    ):
        assert writer.mode == "staged" and writer.staging_pool is pool
        assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).ok
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids]))
        assert loaded.ok
        assert_blocks_equal(src, ids, dst, ids)
    assert calls.named("batch_put_from") == [16, 16, 8]
    assert calls.named("batch_get_into") == [16, 16, 8]
    assert not calls.named("batch_put_from_multi_buffers") and not calls.named("batch_get_into_multi_buffers")


@mooncake
def test_whole_request_is_one_call_per_direction(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs, chunks = 16, 30
    src, dst = Cache(8, chunks + 1, 512, seed=4), Cache(8, chunks + 1, 512)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    calls = Calls(store, monkeypatch)
    with transfer(store, model, src, bs) as writer, transfer(store, model, dst, bs) as reader:
        assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).ok
        assert reader.load(TransferRequest("r", chunks * bs, h, [ids])).ok
        assert_blocks_equal(src, ids, dst, ids)
    # The store below splits by its region budget (64 in these tests); a staged key is one region.
    assert calls.named("batch_put_from") == [30] and calls.named("batch_get_into") == [30]


@mooncake
@pytest.mark.parametrize("other_mode", ["multi_buffer", "staged"])
def test_one_region_layouts_use_the_contiguous_calls_without_staging(
    store: MooncakeStore, model: str, other_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs, chunks = 16, 10
    src, dst = Cache(1, chunks + 1, 3000, seed=5), Cache(1, chunks + 1, 3000, fill=7)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    calls = Calls(store, monkeypatch)
    with (
        transfer(store, model, src, bs) as writer,
        transfer(store, model, dst, bs, transfer_mode=other_mode) as reader,
    ):
        assert writer.mode == "direct" and writer.staging_pool is None
        assert writer.store(TransferRequest("r", 5 * bs, h, [ids])).ok  # chunks 0..4 only
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids[::-1]]))
        assert loaded.failed_block_ids == set(ids[::-1][5:]) and loaded.loaded_block_ids == set(ids[::-1][:5])
        assert_blocks_equal(src, ids[:5], dst, ids[::-1][:5])
        assert (dst.regions[0][ids[::-1][5:]] == 7).all()
    assert calls.named("batch_put_from") == [5]
    if other_mode == "multi_buffer":
        assert calls.named("batch_get_into_multi_buffers") == [10]
    else:
        # The peer probe (this store's master is not embedded: network rules) reads one key first.
        assert calls.named("batch_get_into") == ([1] if reader.probes_peers else []) + [10]


@mooncake
@pytest.mark.parametrize("tp_rank", [0, 4, 7, 13])
def test_two_groups_with_rotation_load_the_same_as_multi_buffer(store: MooncakeStore, model: str, tp_rank: int) -> None:
    bs, chunks = 16, 6
    src = Cache(3, 2 * chunks + 1, 320, seed=14)
    ids = [[1, 2, 3, 4, 5, 6], [12, 11, 10, 9, 8, 7]]  # the groups share the regions, not the blocks
    h = hashes(model, chunks)

    def two_groups(cache: Cache, mode: str) -> KVTransfer:
        dbs = [ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0, group_id=g), bs) for g in range(2)]
        xfer = KVTransfer(store, dbs, transfer_mode=mode, tp_rank=tp_rank)
        xfer.register_kv_caches(cache.regions, cache.num_blocks)
        return xfer

    with two_groups(src, "staged") as writer:
        assert writer.store(TransferRequest("r", chunks * bs, h, ids)).stored == 2 * chunks
        gone = [writer.databases[0].key_for(h[4]), writer.databases[1].key_for(h[1])]
        assert store.batch_remove(gone, force=True).ok
    results = {}
    for mode in ("staged", "multi_buffer"):
        dst = Cache(3, 2 * chunks + 1, 320, fill=9)
        with two_groups(dst, mode) as reader:
            loaded = reader.load(TransferRequest("r", chunks * bs, h, ids))
        assert loaded.mode == mode and loaded.failed_block_ids == {5, 11}
        good = [b for b in range(1, 2 * chunks + 1) if b not in (5, 11)]
        assert_blocks_equal(src, good, dst, good)
        assert all((region[[0, 5, 11]] == 9).all() for region in dst.regions)
        results[mode] = (loaded.loaded_block_ids, loaded.bytes, loaded.outcomes)
    assert results["staged"] == results["multi_buffer"]


# ------------------------------------------------------------------------------------------- failures


@mooncake
@pytest.mark.parametrize("tp_rank", [0, 3])
@pytest.mark.parametrize("pool_slots", [1, 10])
def test_missing_keys_leave_their_regions_untouched_despite_stale_staging(
    store: MooncakeStore, model: str, tp_rank: int, pool_slots: int
) -> None:
    bs, chunks, regions = 16, 10, 3
    src = Cache(regions, chunks + 1, 512, seed=6)
    dst = Cache(regions, chunks + 1, 512, fill=0xEE)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    # The writer's gather leaves every key's bytes in the shared pool: a slot of a key that is missing at
    # load time holds some other chunk's data. One slot: one key per batch; ten: the whole request at once.
    pool = StagingPool(pool_slots * regions * 512)
    with (
        transfer(store, model, src, bs, staging_pool=pool) as writer,
        transfer(store, model, dst, bs, staging_pool=pool, tp_rank=tp_rank) as reader,
    ):
        stored = writer.store(TransferRequest("r", chunks * bs, h, [ids]))
        assert stored.ok
        present = [0, 1, 3, 4, 6, 9]
        gone = [2, 5, 7, 8]
        keys = [writer.databases[0].key_for(h[i]) for i in gone]
        assert store.batch_remove(keys, force=True).ok
        # Staging now holds the bytes of the last key gathered; loading must never copy them anywhere else.
        dst_ids = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [dst_ids]))
        assert loaded.failed_block_ids == {dst_ids[i] for i in gone}
        assert loaded.loaded_block_ids == {dst_ids[i] for i in present}
        assert loaded.outcomes == {"ok": 6, "not_found": 4} and not loaded.ok and loaded.error is None
        assert loaded.bytes == 6 * regions * 512
        assert_blocks_equal(src, [ids[i] for i in present], dst, [dst_ids[i] for i in present])
        for region in dst.regions:
            assert (region[[dst_ids[i] for i in gone]] == 0xEE).all()
            assert (region[0] == 0xEE).all()


@mooncake
def test_a_failed_gather_is_never_put_and_never_reported_stored(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs, chunks = 16, 6
    src = Cache(2, chunks + 1, 256, seed=7)
    h = hashes(model, chunks)
    pool = StagingPool(2 * 256)  # one key per batch: the bad key's batch fails alone
    with transfer(store, model, src, bs, staging_pool=pool) as writer:
        backend = writer.copy_backend
        assert backend is not None
        gather = backend.gather
        calls = []

        def failing_third(*args: Any, **kwargs: Any) -> int:
            calls.append(1)
            if len(calls) == 3:  # the copy refuses the third key's batch
                raise ValueError("slice not inside any allowed memory range")
            return gather(*args, **kwargs)

        monkeypatch.setattr(backend, "gather", failing_third)
        stored = writer.store(TransferRequest("r", chunks * bs, h, [[1, 2, 3, 4, 5, 6]]))
        bad_key = writer.databases[0].key_for(h[2])
        assert stored.failed_keys == [bad_key] and stored.stored == 5 and not stored.ok
        assert stored.outcomes == {"ok": 5, "gather_failed": 1} and stored.saved_tokens == 0
        assert stored.bytes == 5 * 2 * 256
        present = store.batch_is_exist([writer.databases[0].key_for(x) for x in h]).present
        assert present == [True, True, False, True, True, True]


@mooncake
def test_a_failed_scatter_writes_nothing_and_fails_its_blocks(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs, chunks = 16, 4
    src, dst = Cache(2, chunks + 1, 256, seed=8), Cache(2, chunks + 1, 256, fill=3)
    h = hashes(model, chunks)
    with transfer(store, model, src, bs) as writer, transfer(store, model, dst, bs) as reader:
        assert writer.store(TransferRequest("r", chunks * bs, h, [[1, 2, 3, 4]])).ok
        backend = reader.copy_backend
        assert backend is not None

        def refuse(*args: Any, **kwargs: Any) -> int:
            raise ValueError("slice not inside any allowed memory range")

        monkeypatch.setattr(backend, "scatter", refuse)
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [[1, 2, 3, 4]]))
        assert loaded.error is not None and "not inside any allowed memory range" in loaded.error
        assert loaded.failed_block_ids == {1, 2, 3, 4} and not loaded.loaded_block_ids and loaded.bytes == 0
        assert all((region == 3).all() for region in dst.regions)  # not one byte written


@mooncake
def test_a_key_larger_than_the_pool_fails_the_load_cleanly(store: MooncakeStore, model: str) -> None:
    bs, chunks = 16, 3
    src, dst = Cache(4, chunks + 1, 1024, seed=9), Cache(4, chunks + 1, 1024)
    h = hashes(model, chunks)
    with transfer(store, model, src, bs) as writer:
        assert writer.store(TransferRequest("r", chunks * bs, h, [[1, 2, 3]])).ok
    with transfer(store, model, dst, bs, staging_pool=StagingPool(1024)) as reader:
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [[1, 2, 3]]))
        assert loaded.error is not None and "raise staging_buffer_size" in loaded.error
        assert loaded.failed_block_ids == {1, 2, 3}
        assert not any(region.any() for region in dst.regions)


# ------------------------------------------------------------------------------------------- sharing


@mooncake
def test_concurrent_requests_share_one_small_pool(store: MooncakeStore, model: str) -> None:
    bs, chunks, requests, regions = 16, 12, 8, 4
    src = Cache(regions, requests * chunks + 1, 512, seed=10)
    dst = Cache(regions, requests * chunks + 1, 512)
    pool = StagingPool(int(1.5 * chunks) * regions * 512)  # one request and a half at a time
    reqs = []
    for r in range(requests):
        ids = list(range(1 + r * chunks, 1 + (r + 1) * chunks))
        reqs.append((hashes(f"{model}/{r}", chunks), ids))
    with (
        transfer(store, model, src, bs, staging_pool=pool) as writer,
        transfer(store, model, dst, bs, staging_pool=pool, num_recv_threads=4) as reader,
    ):
        stores = [
            writer.submit_store(TransferRequest(f"r{r}", chunks * bs, h, [ids])) for r, (h, ids) in enumerate(reqs)
        ]
        assert all(f.result(timeout=60).ok for f in stores)
        loads = [
            reader.submit_load(TransferRequest(f"r{r}", chunks * bs, h, [ids[::-1]])) for r, (h, ids) in enumerate(reqs)
        ]
        results = [f.result(timeout=60) for f in loads]
        assert all(res.ok and res.mode == "staged" for res in results)
        for _h, ids in reqs:
            assert_blocks_equal(src, ids, dst, ids[::-1])
    assert pool.free_bytes == pool.capacity


@mooncake
def test_shared_pool_is_registered_once_and_released_by_the_last_user(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered: list[tuple[int, int]] = []
    unregistered: list[int] = []
    register, unregister = store.register_buffer, store.unregister_buffer

    def spy_register(ptr: int, size: int) -> None:
        registered.append((ptr, size))
        register(ptr, size)

    def spy_unregister(ptr: int) -> None:
        unregistered.append(ptr)
        unregister(ptr)

    monkeypatch.setattr(store, "register_buffer", spy_register)
    monkeypatch.setattr(store, "unregister_buffer", spy_unregister)
    cache_a, cache_b = Cache(3, 5, 128, seed=11), Cache(3, 5, 128)
    pool = StagingPool(1 << 16)
    first = transfer(store, model, cache_a, 16, staging_pool=pool)
    second = transfer(store, model, cache_b, 16, staging_pool=pool)
    # Staged mode registers the pool (one range), not the KV caches.
    assert registered == [pool.range]
    first.close()
    assert unregistered == []
    second.close()
    assert unregistered == [pool.buffer.ptr]


@mooncake
def test_mode_choice_is_logged_once(store: MooncakeStore, model: str, caplog: pytest.LogCaptureFixture) -> None:
    cache = Cache(2, 3, 64, seed=12)
    with caplog.at_level(logging.INFO, logger="mooncake_kvaddr.driver.transfer"):
        with transfer(store, model, cache, 16) as xfer:
            h = hashes(model, 2)
            xfer.store(TransferRequest("r", 32, h, [[1, 2]]))
            xfer.load(TransferRequest("r", 32, h, [[1, 2]]))
    lines = [r.getMessage() for r in caplog.records if "transfer mode" in r.getMessage()]
    assert len(lines) == 1 and "auto -> staged (2 regions per key, host memory, staging pool" in lines[0]


@mooncake
@pytest.mark.parametrize(
    ("regions", "block_bytes", "local", "modes"),
    [
        (4, 2048, True, ("staged", "multi_buffer")),
        (8, 3072, True, ("staged", "multi_buffer")),
        (9, 512, True, ("multi_buffer", "multi_buffer")),
        (2, 4096, True, ("multi_buffer", "multi_buffer")),
        (32, 16 << 10, False, ("staged", "staged")),
        (2, 32 << 10, False, ("staged", "staged")),
        (32, 32 << 10, False, ("multi_buffer", "multi_buffer")),
    ],
)
def test_auto_decides_on_the_mean_region_size(
    store: MooncakeStore, model: str, regions: int, block_bytes: int, local: bool, modes: tuple[str, str]
) -> None:
    """``auto`` reads the MEAN region size, however large the whole object: in memory it stages loads of at
    most 8 regions per key under 4 KiB each (4 x 2 KiB = 8 KiB, 8 x 3 KiB = 24 KiB), over the network every
    layout of regions under 32 KiB (32 x 16 KiB = 512 KiB) or of objects up to 512 KiB (fresh mutant M18-11:
    the object's total bytes taken for the region size)."""
    with transfer(store, model, Cache(regions, 3, block_bytes), 16, local_copy=local) as xfer:
        assert (xfer.mode, xfer.store_mode) == modes


# ------------------------------------------------------------------------------------------- across processes

CHILD = """
import json, sys
import numpy as np
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, StoreConfig
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

address, model, get_mode, put_mode = sys.argv[1:5]
chunks, regions, block_bytes = (int(x) for x in sys.argv[5:8])
bs = 16
rng = np.random.default_rng(13)
src = [rng.integers(0, 256, (chunks + 1, block_bytes), dtype=np.uint8) for _ in range(regions)]
dst = [np.zeros_like(r) for r in src]
h = [f"{model}:{i}".encode() for i in range(chunks)]
ids = list(range(1, chunks + 1))
# No segment of its own: every byte it reads or writes crosses TCP to the parent's segment.
config = StoreConfig(master_server_address=address, global_segment_size=0, local_buffer_size=0)
with MooncakeStore(config) as store:
    def xfer(regions_, name, mode):
        t = KVTransfer(store, [ChunkedTokenDatabase(KeyMetadata(name, 0, 0, 0, 0), bs)], transfer_mode=mode)
        t.register_kv_caches(regions_, chunks + 1)
        return t
    with xfer(dst, model, get_mode) as reader:
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids[::-1]]))
    equal = all(np.array_equal(a[ids], b[ids[::-1]]) for a, b in zip(src, dst))
    mine = [255 - r for r in src]
    with xfer(mine, model + "/child", put_mode) as writer:
        stored = writer.store(TransferRequest("r", chunks * bs, h, [ids]))
    print(json.dumps({"loaded": loaded.ok, "get_mode": loaded.mode, "equal": equal, "stored": stored.ok,
                      "put_mode": stored.mode, "error": loaded.error}))
"""


@mooncake
@pytest.mark.parametrize(("here", "there"), [("multi_buffer", "staged"), ("staged", "multi_buffer")])
def test_second_process_interoperates_over_tcp(
    store: MooncakeStore, master: EmbeddedMaster, model: str, here: str, there: str
) -> None:
    chunks, regions, block_bytes, bs = 16, 4, 2048, 16
    src = Cache(regions, chunks + 1, block_bytes, seed=13)  # the child builds the same bytes from the same seed
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    with transfer(store, model, src, bs, transfer_mode=here) as writer:
        assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).ok
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), master.rpc_address, model, there, there,
         str(chunks), str(regions), str(block_bytes)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report == {
        "loaded": True, "get_mode": there, "equal": True, "stored": True, "put_mode": there, "error": None
    }, child.stderr[-3000:]

    # What the child put (over TCP, into this process's segment) loads back here in the other mode.
    dst = Cache(regions, chunks + 1, block_bytes)
    with transfer(store, f"{model}/child", dst, bs, transfer_mode=here) as reader:
        assert reader.load(TransferRequest("r", chunks * bs, h, [ids])).ok
    for a, b in zip(src.regions, dst.regions, strict=True):
        np.testing.assert_array_equal(b[ids], 255 - a[ids])


# ------------------------------------------------------------------------------------------- pool leak guard


@pytest.fixture(autouse=True)
def _no_lingering_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in before and t.name.startswith("KVCacheStore")]
        if not extra:
            return
        time.sleep(0.05)
    raise AssertionError(f"transfer threads left running: {[t.name for t in extra]}")


@pytest.mark.parametrize(("mode", "regions"), [("multi_buffer", 2), ("auto", 1), ("staged", 3)])
def test_a_full_pool_is_back_pressure_in_every_path(monkeypatch: pytest.MonkeyPatch, mode: str, regions: int) -> None:
    """Mooncake answering ``no_space`` (-200) for one key of a store is back pressure in every path: the
    result says so and the transfer keeps it until a store succeeds."""
    from fake_mooncake import fake_store

    with fake_store(monkeypatch) as (store, fake):
        src = Cache(regions, 6, 256, seed=4)
        h = hashes("full", 3)
        with transfer(store, "full", src, 16, transfer_mode=mode, start_threads=False) as writer:
            full_key = writer.databases[0].key_for(h[2])
            put = fake._put
            fake._put = lambda key, data: -200 if key == full_key else put(key, data)  # type: ignore[method-assign]
            stored = writer.store(TransferRequest("r", 48, h, [[1, 2, 3]]))
            assert stored.back_pressure and writer.back_pressure, stored
            assert stored.stored == 2 and stored.failed_keys == [full_key]
            fake._put = put  # type: ignore[method-assign]
            again = writer.store(TransferRequest("r", 48, h, [[1, 2, 3]]))
            assert again.ok and not again.back_pressure and not writer.back_pressure


def test_a_staged_load_makes_no_further_call_once_the_master_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten keys through a 4-slot pool: Mooncake answers the first call's keys -900 (master unreachable); every
    further call would block only to say the same, so none is made and the other keys count unreachable too."""
    from fake_mooncake import fake_store

    with fake_store(monkeypatch) as (store, fake):
        src, h, ids = Cache(2, 11, 256, seed=6), hashes("gone", 10), list(range(1, 11))
        pool = StagingPool(4 * (-(-2 * 256 // SLOT_ALIGNMENT) * SLOT_ALIGNMENT))
        with transfer(store, "gone", src, 16, transfer_mode="staged", staging_pool=pool, start_threads=False) as x:
            assert x.store(TransferRequest("r", 160, h, [ids])).ok
            calls: list[int] = []
            fake.batch_get_into = lambda keys, ptrs, sizes: calls.append(len(keys)) or [-900] * len(keys)  # type: ignore[method-assign]
            loaded = x.load(TransferRequest("r", 160, h, [ids]))
    assert calls == [4]
    assert loaded.outcomes == {"master_unreachable": 10} and not loaded.loaded_block_ids


@pytest.mark.parametrize(("mode", "regions"), [("auto", 1), ("staged", 3)])
def test_a_get_answering_zero_bytes_loads_nothing(monkeypatch: pytest.MonkeyPatch, mode: str, regions: int) -> None:
    """A key Mooncake answers with 0 bytes read is not loaded: its block fails and is never written."""
    from fake_mooncake import fake_store

    with fake_store(monkeypatch) as (store, fake):
        src, dst = Cache(regions, 6, 256, seed=5), Cache(regions, 6, 256, fill=0x5A)
        h = hashes("zero", 3)
        with transfer(store, "zero", src, 16, transfer_mode=mode, start_threads=False) as writer:
            assert writer.store(TransferRequest("r", 48, h, [[1, 2, 3]])).ok
            empty = writer.databases[0].key_for(h[1])
        get = fake._get
        fake._get = lambda key, regions: 0 if key == empty else get(key, regions)  # type: ignore[method-assign]
        with transfer(store, "zero", dst, 16, transfer_mode=mode, start_threads=False) as reader:
            loaded = reader.load(TransferRequest("r", 48, h, [[1, 2, 3]]))
    # The outcomes count Mooncake's answers (it answered bytes read): the block is failed, never written.
    assert loaded.loaded_block_ids == {1, 3} and loaded.failed_block_ids == {2}
    assert loaded.bytes == 2 * regions * 256
    assert all((region[2] == 0x5A).all() for region in dst.regions)


@pytest.mark.parametrize(("mode", "regions"), [("auto", 1), ("staged", 3)])
def test_a_short_read_is_a_failed_chunk_in_the_contiguous_paths(
    monkeypatch: pytest.MonkeyPatch, mode: str, regions: int
) -> None:
    """Direct and staged loads read whole objects with batch_get_into: one byte less than the object is a
    failure (the staged slot is then never scattered), not a loaded chunk."""
    from fake_mooncake import fake_store

    with fake_store(monkeypatch) as (store, fake):
        src, dst = Cache(regions, 6, 256, seed=3), Cache(regions, 6, 256, fill=0x5A)
        h = hashes("short", 3)
        with transfer(store, "short", src, 16, transfer_mode=mode, start_threads=False) as writer:
            assert writer.store(TransferRequest("r", 48, h, [[1, 2, 3]])).ok
            fake.short_reads.add(writer.databases[0].key_for(h[1]))
        with transfer(store, "short", dst, 16, transfer_mode=mode, start_threads=False) as reader:
            assert reader.mode == ("direct" if mode == "auto" else "staged")
            before = dst.snapshot()
            loaded = reader.load(TransferRequest("r", 48, h, [[1, 4, 3]]))
    assert loaded.loaded_block_ids == {1, 3} and loaded.failed_block_ids == {4}
    assert loaded.bytes == 2 * regions * 256  # the bytes of the keys read whole only
    assert_blocks_equal(src, [1, 3], dst, [1, 3])
    if mode == "staged":  # nothing scattered into the block of the short key
        for region, old in zip(dst.regions, before, strict=True):
            assert region[4].tobytes() == old[4].tobytes()
