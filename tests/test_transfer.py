"""KVTransfer on a real store: store -> lookup -> load with byte checks, threads, failures (docs/transfer-modes.md)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from fake_mooncake import fake_store
from kvaddr_testing import Cache, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.store import MooncakeStore, StoreClosedError
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

mooncake = pytest.mark.mooncake


# ------------------------------------------------------------------------------------------- round trip


@mooncake
@pytest.mark.parametrize(
    ("mode", "resolved", "store_phases", "load_phases"),
    [
        ("multi_buffer", "multi_buffer", {"keys", "exist", "prepare", "put"}, {"plan", "probe", "get"}),
        ("auto", "staged", {"keys", "exist", "prepare", "staging_wait", "gather", "put"},
         {"plan", "staging_wait", "get", "scatter"}),
    ],
)
def test_store_lookup_load_round_trip(
    store: MooncakeStore, model: str, mode: str, resolved: str, store_phases: set[str], load_phases: set[str]
) -> None:
    bs, chunks = 16, 12
    src, dst = Cache(6, chunks + 1, 512, seed=1), Cache(6, chunks + 1, 512)
    h = hashes(model, chunks)
    ids_src = list(range(1, chunks + 1))
    ids_dst = list(reversed(ids_src))
    with (
        transfer(store, model, src, bs, transfer_mode=mode) as writer,
        transfer(store, model, dst, bs, tp_rank=3, transfer_mode=mode) as reader,
    ):
        assert writer.mode == reader.mode == resolved
        assert reader.lookup(chunks * bs + 1, h) == 0

        stored = writer.submit_store(TransferRequest("r1", chunks * bs, h, [ids_src])).result(timeout=60)
        assert stored.ok and stored.chunks == chunks and stored.stored == chunks and stored.mode == resolved
        assert stored.saved_tokens == chunks * bs and stored.bytes == chunks * 6 * 512
        assert set(stored.timings) == store_phases

        # Storing again puts nothing: every chunk is already present.
        again = writer.store(TransferRequest("r1", chunks * bs, h, [ids_src]))
        assert again.ok and again.already_present == chunks and again.stored == 0

        assert reader.lookup(chunks * bs + 1, h) == chunks * bs
        assert reader.lookup(chunks * bs, h) == (chunks - 1) * bs  # full hit: recompute the last block

        loaded = reader.submit_load(TransferRequest("r1", chunks * bs, h, [ids_dst])).result(timeout=60)
        assert loaded.ok and loaded.chunks == chunks and loaded.bytes == chunks * 6 * 512
        assert loaded.mode == resolved and set(loaded.timings) == load_phases
        assert loaded.loaded_block_ids == set(ids_dst) and not loaded.failed_block_ids
        for a, b in zip(src.blocks(ids_src), dst.blocks(ids_dst), strict=True):
            np.testing.assert_array_equal(a, b)
        assert not dst.regions[0][0].any()  # the null block was never written


@mooncake
def test_skip_tokens_and_null_blocks_are_not_transferred(store: MooncakeStore, model: str) -> None:
    bs, chunks = 16, 6
    src, dst = Cache(2, chunks + 1, 256, seed=2), Cache(2, chunks + 1, 256)
    h = hashes(model, chunks)
    ids = [1, 2, 0, 4, 5, 6]  # chunk 2 maps to the null block: never stored
    with transfer(store, model, src, bs) as writer, transfer(store, model, dst, bs) as reader:
        stored = writer.store(TransferRequest("r", chunks * bs, h, [ids], skip_tokens=2 * bs))
        assert stored.chunks == 3 and stored.stored == 3  # chunks 0, 1 skipped; chunk 2 is null
        present = reader.mooncake_store.batch_is_exist([reader.databases[0].key_for(x) for x in h]).present
        assert present == [False, False, False, True, True, True]
        assert reader.lookup(chunks * bs + 1, h) == 0  # the prefix is missing

        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids], skip_tokens=3 * bs))
        assert loaded.ok and loaded.loaded_block_ids == {4, 5, 6}
        for a, b in zip(src.blocks([4, 5, 6]), dst.blocks([4, 5, 6]), strict=True):
            np.testing.assert_array_equal(a, b)
        assert not any(region[[1, 2]].any() for region in dst.regions)


@mooncake
def test_lookup_rules_pinned_by_spec(store: MooncakeStore, model: str) -> None:
    bs = 16
    cache = Cache(1, 4, 64, seed=3)
    with transfer(store, model, cache, bs) as xfer:
        a = [b"a0", b"a1", b"a2"]
        model_hashes = [model.encode() + x for x in a]
        xfer.store(TransferRequest("r", 32, model_hashes, [[1, 2, 3]]))  # a0, a1 present; a2 not
        assert xfer.lookup(48, model_hashes) == 32
        assert xfer.lookup(33, model_hashes[:2]) == 32
        assert xfer.lookup(32, model_hashes[:2]) == 16  # full hit re-derivation
        assert xfer.lookup(15, model_hashes) == 0  # less than one block
        assert xfer.lookup(48, []) == 0
        assert xfer.lookup(1000, model_hashes) == 32  # hashes cover only 48 tokens


@mooncake
def test_two_groups_hit_only_where_both_have_the_chunk(store: MooncakeStore, model: str) -> None:
    bs, chunks = 16, 4
    src, dst = Cache(2, 2 * chunks + 1, 128, seed=4), Cache(2, 2 * chunks + 1, 128)
    h = hashes(model, chunks)
    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]  # the groups share the regions but use different blocks
    with transfer(store, model, src, bs, groups=2) as writer, transfer(store, model, dst, bs, groups=2) as reader:
        assert writer.store(TransferRequest("r", chunks * bs, h, ids)).stored == 2 * chunks
        assert reader.lookup(chunks * bs + 1, h) == chunks * bs
        # Drop group 1's third chunk: both groups are needed, so the hit stops before it.
        key = writer.databases[1].key_for(h[2])
        assert writer.mooncake_store.batch_remove([key], force=True).ok
        assert reader.lookup(chunks * bs + 1, h) == 2 * bs

        loaded = reader.load(TransferRequest("r", chunks * bs, h, ids))
        assert loaded.failed_block_ids == {7}
        assert loaded.loaded_block_ids == {1, 2, 3, 4, 5, 6, 8}
        good = [1, 2, 3, 4, 5, 6, 8]
        for a, b in zip(src.blocks(good), dst.blocks(good), strict=True):
            np.testing.assert_array_equal(a, b)


@mooncake
@pytest.mark.parametrize("tp_rank", [1, 3])
@pytest.mark.parametrize("mode", ["multi_buffer", "staged"])
def test_two_groups_load_into_their_own_blocks_at_any_tp_rank(
    store: MooncakeStore, model: str, tp_rank: int, mode: str
) -> None:
    """A reader at another TP rank loads its chunks in a rotated order: each chunk still comes from its own
    group's keys into its own group's block ids, and an invalid id drops only its own group's chunk."""
    bs, chunks = 16, 4
    src, dst = Cache(2, 2 * chunks + 1, 128, seed=8), Cache(2, 2 * chunks + 1, 128)
    h = hashes(f"{model}/{tp_rank}/{mode}", chunks)
    with (
        transfer(store, model, src, bs, groups=2, transfer_mode=mode) as writer,
        transfer(store, model, dst, bs, groups=2, tp_rank=tp_rank, transfer_mode=mode) as reader,
    ):
        assert writer.store(TransferRequest("w", chunks * bs, h, [[1, 2, 3, 4], [5, 6, 7, 8]])).stored == 2 * chunks
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [[8, 7, 6, 5], [4, 3, 2, 1]]))
        assert loaded.ok and loaded.loaded_block_ids == set(range(1, 9))
        assert_blocks_equal(src, [1, 2, 3, 4, 5, 6, 7, 8], dst, [8, 7, 6, 5, 4, 3, 2, 1])
        dst.regions[0][:] = 0
        dst.regions[1][:] = 0
        partial = reader.load(TransferRequest("r2", chunks * bs, h, [[8, 7, 6, 5], [4, 99, 2, 1]]))
        assert set(partial.invalid_block_ids) == {99} and partial.failed_block_ids == {99}
        assert partial.loaded_block_ids == {1, 2, 4, 5, 6, 7, 8}
        assert_blocks_equal(src, [1, 2, 3, 4, 5, 7, 8], dst, [8, 7, 6, 5, 4, 2, 1])


# ------------------------------------------------------------------------------------------- failures


@mooncake
@pytest.mark.parametrize("tp_rank", [0, 1, 5])
@pytest.mark.parametrize("mode", ["auto", "multi_buffer", "staged"])
def test_missing_keys_report_failed_block_ids(store: MooncakeStore, model: str, tp_rank: int, mode: str) -> None:
    """Every mode rotates the block ids with the keys (fresh mutant M8-13: the list plan's ids left unrotated)."""
    bs, chunks = 16, 8
    src, dst = Cache(3, chunks + 1, 256, seed=5), Cache(3, chunks + 1, 256)
    h = hashes(f"{model}/{tp_rank}/{mode}", chunks)
    ids_src = list(range(1, chunks + 1))
    ids_dst = [8, 1, 7, 2, 6, 3, 5, 4]
    with (
        transfer(store, model, src, bs) as writer,
        transfer(store, model, dst, bs, tp_rank=tp_rank, transfer_mode=mode) as reader,
    ):
        writer.store(TransferRequest("r", 5 * bs, h, [ids_src]))  # chunks 0..4 only
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids_dst]))
        assert loaded.failed_block_ids == set(ids_dst[5:])
        assert loaded.loaded_block_ids == set(ids_dst[:5])
        assert loaded.outcomes == {"ok": 5, "not_found": 3} and not loaded.ok
        for a, b in zip(src.blocks(ids_src[:5]), dst.blocks(ids_dst[:5]), strict=True):
            np.testing.assert_array_equal(a, b)
        # Nothing claimed loaded was skipped: the failed blocks are still zero.
        assert not any(region[ids_dst[5:]].any() for region in dst.regions)


@pytest.mark.parametrize("tp_rank", [1, 5])
def test_the_list_plan_rotates_block_ids_with_the_keys(monkeypatch: pytest.MonkeyPatch, tp_rank: int) -> None:
    """Without a native client the multi-buffer load plans Python lists (one fused plan per group, then rotated
    for the rank): a missing key reports its own block id (fresh mutant M8-13: the ids left unrotated)."""
    bs, chunks = 16, 8
    src, dst = Cache(3, chunks + 1, 256, seed=5), Cache(3, chunks + 1, 256)
    h = hashes("list-plan", chunks)
    ids_dst = [8, 1, 7, 2, 6, 3, 5, 4]
    with fake_store(monkeypatch) as (store, _fake):
        assert not store.native_client_active
        with (
            transfer(store, "l", src, bs, transfer_mode="multi_buffer", start_threads=False) as writer,
            transfer(store, "l", dst, bs, tp_rank=tp_rank, transfer_mode="multi_buffer", start_threads=False) as reader,
        ):
            stored = writer.store(TransferRequest("r", 5 * bs, h, [list(range(1, chunks + 1))]))  # chunks 0..4
            loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids_dst]))
    # Every region of every key counted (fresh mutant M20-11: the list rows' first region only).
    assert stored.stored == 5 and stored.bytes == 5 * 3 * 256
    assert loaded.failed_block_ids == set(ids_dst[5:]) and loaded.loaded_block_ids == set(ids_dst[:5])
    assert not any(region[ids_dst[5:]].any() for region in dst.regions)


@pytest.mark.parametrize("block_ids", [None, [5], [None], 7])
def test_a_load_that_fails_before_naming_a_block_is_not_ok(monkeypatch: pytest.MonkeyPatch, block_ids: Any) -> None:
    """Block ids that do not read as ids: the load reports the error with no failed block id to name, and is not
    ``ok`` all the same (fresh mutant M11-07: ``ok`` looked only at the failed block ids)."""
    with fake_store(monkeypatch) as (store, _fake):
        cache = Cache(2, 5, 256)
        with transfer(store, "m", cache, 16, transfer_mode="multi_buffer", start_threads=False) as xfer:
            loaded = xfer.load(TransferRequest("r", 48, hashes("m", 3), block_ids))
    assert loaded.error is not None and "TypeError" in loaded.error
    assert loaded.failed_block_ids == set() and loaded.loaded_block_ids == set()
    assert loaded.ok is False


@mooncake
def test_concurrent_loads_on_several_receive_threads(store: MooncakeStore, model: str) -> None:
    bs, chunks, requests = 16, 10, 6
    src = Cache(4, requests * chunks + 1, 512, seed=6)
    dst = Cache(4, requests * chunks + 1, 512)
    reqs = []
    for r in range(requests):
        ids = list(range(1 + r * chunks, 1 + (r + 1) * chunks))
        reqs.append((hashes(f"{model}/{r}", chunks), ids))
    with transfer(store, model, src, bs) as writer, transfer(store, model, dst, bs, num_recv_threads=3) as reader:
        stores = [
            writer.submit_store(TransferRequest(f"r{r}", chunks * bs, h, [ids])) for r, (h, ids) in enumerate(reqs)
        ]
        assert all(f.result(timeout=60).ok for f in stores)
        # Each load writes other blocks than it reads from: reversed block order per request.
        loads = [
            reader.submit_load(TransferRequest(f"r{r}", chunks * bs, h, [ids[::-1]])) for r, (h, ids) in enumerate(reqs)
        ]
        results = [f.result(timeout=60) for f in loads]
        assert all(res.ok for res in results)
        for _h, ids in reqs:
            for a, b in zip(src.blocks(ids), dst.blocks(ids[::-1]), strict=True):
                np.testing.assert_array_equal(a, b)
        served_by = {t.name for t in reader.threads if t.name.startswith("KVCacheStoreRecvingThread")}
        assert len(served_by) == 3


def test_nothing_moves_before_register_kv_caches() -> None:
    store = MooncakeStore(master_server_address="127.0.0.1:1")  # never set up: any Mooncake call would raise
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
    db.set_kv_caches_base_addr([Cache(1, 4, 64).regions[0].ctypes.data])  # rows set by hand are not enough
    db.set_block_len([64])
    with KVTransfer(store, [db], num_recv_threads=2) as xfer:
        h = hashes("unregistered", 3)
        loaded = xfer.submit_load(TransferRequest("r", 48, h, [[1, 2, 3]])).result(timeout=10)
        assert loaded.failed_block_ids == {1, 2, 3} and not loaded.loaded_block_ids
        assert loaded.error is not None and "register_kv_caches" in loaded.error
        with pytest.raises(RuntimeError, match="register_kv_caches"):
            xfer.submit_store(TransferRequest("r", 48, h, [[1, 2, 3]])).result(timeout=10)


@mooncake
def test_a_store_closed_underneath_is_a_miss_and_load_reports_every_block(store_config: StoreConfig) -> None:
    cache = Cache(2, 4, 64)
    own = MooncakeStore(store_config).setup()
    xfer = transfer(own, "closed-underneath", cache, 16, num_recv_threads=2)
    own.close()
    try:
        h = hashes("closed", 3)
        assert xfer.lookup(48, h) == 0
        loaded = xfer.submit_load(TransferRequest("r", 48, h, [[1, 2, 3]])).result(timeout=10)
        assert loaded.failed_block_ids == {1, 2, 3} and not loaded.loaded_block_ids
        assert loaded.error is not None and "StoreClosedError" in loaded.error
        with pytest.raises(StoreClosedError):
            xfer.submit_store(TransferRequest("r", 48, h, [[1, 2, 3]])).result(timeout=10)
    finally:
        xfer.close()
    assert not any(t.is_alive() for t in xfer.threads)


def test_argument_checks() -> None:
    store = MooncakeStore(master_server_address="127.0.0.1:1")
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
    with pytest.raises(ValueError, match="databases"):
        KVTransfer(store, [])
    with pytest.raises(ValueError, match="num_recv_threads"):
        KVTransfer(store, [db], num_recv_threads=0)
    xfer = KVTransfer(store, [db], start_threads=False)
    with pytest.raises(RuntimeError, match="not started"):
        xfer.submit_load(TransferRequest("r", 16, [b"x"], [[1]]))
    with pytest.raises(ValueError, match="multiple of 3 blocks"):
        xfer.register_kv_caches([np.zeros(10, dtype=np.uint8)], 3)
    with pytest.raises(TypeError, match="C-contiguous"):
        xfer.register_kv_caches([np.zeros((4, 4), dtype=np.uint8)[:, ::2]], 2)
    xfer.close()


# ------------------------------------------------------------------------------------------- back-pressure


@pytest.fixture
def small_pool() -> Iterator[MooncakeStore]:
    """A store whose pool (its own master, one 16 MiB segment, Mooncake's minimum) fills quickly."""
    with EmbeddedMaster() as master:
        config = StoreConfig(master_server_address=master.rpc_address, global_segment_size="16MiB", local_buffer_size=0)
        with MooncakeStore(config) as client:
            yield client


@mooncake
def test_full_pool_sets_back_pressure_until_a_store_succeeds(small_pool: MooncakeStore) -> None:
    bs, chunks = 16, 24
    cache = Cache(2, chunks + 1, 512 << 10, seed=7)  # 1 MiB per chunk: 24 MiB into a 16 MiB pool
    with transfer(small_pool, "pressure", cache, bs) as xfer:
        full = xfer.store(TransferRequest("big", chunks * bs, hashes("big", chunks), [list(range(1, chunks + 1))]))
        assert full.back_pressure and xfer.back_pressure
        assert full.failed_keys and full.saved_tokens == 0 and full.stored < chunks

        assert small_pool.remove_all(force=True) > 0
        small = xfer.store(TransferRequest("small", 2 * bs, hashes("small", 2), [[1, 2]]))
        assert small.ok and not small.back_pressure and not xfer.back_pressure


def test_a_staged_transfer_sizes_its_own_pool_for_every_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool a staged transfer makes holds every block of every group plus one slot's padding per key of
    every group (a request never stages more)."""
    from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT

    cache = Cache(2, 5, 100)
    with fake_store(monkeypatch) as (store, _fake), transfer(store, "pool", cache, 16, groups=2,
                                                            transfer_mode="staged") as xfer:
        assert xfer.mode == "staged"
        needed = 2 * 5 * 100 + SLOT_ALIGNMENT * 5 * 2
        assert xfer.staging_pool.capacity == needed // SLOT_ALIGNMENT * SLOT_ALIGNMENT


def test_tp_rank_and_offload_budget_bounds() -> None:
    """``tp_rank`` is >= 0 and a disk-offload budget > 0 bytes: -1 and 0 are refused, 0 and 1 accepted."""
    store = MooncakeStore(master_server_address="127.0.0.1:1")
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
    with pytest.raises(ValueError, match="tp_rank"):
        KVTransfer(store, [db], tp_rank=-1, start_threads=False)
    with pytest.raises(ValueError, match="disk_offload_buffer_budget_bytes"):
        KVTransfer(store, [db], disk_offload_buffer_budget_bytes=0, start_threads=False)
    ok = KVTransfer(store, [db], tp_rank=0, disk_offload_buffer_budget_bytes=1, start_threads=False)
    assert ok.tp_rank == 0 and ok.disk_offload_buffer_budget_bytes == 1
    ok.close()


@pytest.mark.parametrize(("mode", "regions"), [("multi_buffer", 2), ("auto", 1), ("staged", 2)])
def test_the_replicate_config_reaches_every_put(monkeypatch: pytest.MonkeyPatch, mode: str, regions: int) -> None:
    """``KVTransfer(replicate_config=...)`` is handed to every put Mooncake sees, whatever the mode (auto with
    one region per key: the direct path)."""
    mine = object()
    seen: list[Any] = []
    with fake_store(monkeypatch) as (store, client):
        for name in ("batch_put_from", "batch_put_from_multi_buffers"):

            def recording(*args: Any, _original: Any = getattr(client, name)) -> Any:  # noqa: B008
                seen.append(args[-1])
                return _original(*args)

            monkeypatch.setattr(client, name, recording)
        cache = Cache(regions, 5, 256, seed=2)
        h = hashes(f"replicate-{mode}", 4)
        with transfer(store, "m", cache, 16, transfer_mode=mode, replicate_config=mine) as xfer:
            stored = xfer.store(TransferRequest("r", 64, h, [[1, 2, 3, 4]]))
        assert stored.ok and stored.stored == 4
    assert seen and all(config is mine for config in seen)


def test_a_call_runner_of_zero_abandoned_calls_is_allowed_and_never_saturated() -> None:
    """``max_abandoned`` 0 means no limit (calls run inline, never abandoned): accepted, never saturated;
    only a negative count is refused."""
    from mooncake_kvaddr.driver.workers import CallRunner

    runner = CallRunner(0)
    assert runner.max_abandoned == 0 and not runner.saturated
    assert runner.submit(lambda: 7, 1.0, lambda exc: None).wait(1.0) == 7
    with pytest.raises(ValueError, match="max_abandoned"):
        CallRunner(-1)


def test_the_failure_report_of_a_load_reads_only_plain_integer_ids() -> None:
    """A load that fails before its screen reports as failed every id that reads as an integer without user
    code (ints, numpy integers, 1-D integer arrays), skipping floats, bools, strings and float arrays, and
    never raises."""
    from mooncake_kvaddr.driver.transfer_requests import _plain_ids

    groups = [[1, 2.5, True, "x", np.int64(4)], np.array([5, 6], np.uint32), np.array([1.5]), "not a group"]
    assert _plain_ids(groups) == [1, 4, 5, 6]
    assert _plain_ids((np.array([[1, 2]]), [7])) == [7]  # a 2-D array is not a group of ids
    assert _plain_ids(object()) == []


def test_groups_of_different_block_sizes_store_and_skip_whole_scheduler_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of block sizes 16 and 32 (hashes per 16 tokens) work in scheduler blocks of their lcm, 32: a
    48-token request stores the first 32 tokens only, and a skip of 48 tokens skips those 32 (fresh mutant
    M17-10: the gcd, 16, stored chunks past token 32 and reported 48 tokens saved)."""
    cache = Cache(2, 8, 256, seed=3)
    h = hashes("lcm", 3)
    with fake_store(monkeypatch) as (store, _fake):
        dbs = [ChunkedTokenDatabase(KeyMetadata("lcm", 0, 0, 0, 0, group_id=g), bs, 16)
               for g, bs in enumerate((16, 32))]
        with KVTransfer(store, dbs, transfer_mode="multi_buffer", start_threads=False) as xfer:
            xfer.register_kv_caches(cache.regions, cache.num_blocks)
            assert xfer.lcm_block_size == 32
            stored = xfer.store(TransferRequest("r", 48, h, [[1, 2, 3], [4, 5]]))
            assert stored.ok and stored.chunks == stored.stored == 3 and stored.saved_tokens == 32
            assert xfer.lookup(49, h) == 32
            # The skip floors to 32 as well: the chunks from token 32 on are still asked for (and missing).
            skipped = xfer.load(TransferRequest("r", 48, h, [[1, 2, 3], [4, 5]], skip_tokens=48))
            assert skipped.loaded_block_ids == set() and skipped.failed_block_ids == {3, 5}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64])
def test_regions_of_wider_dtypes_move_whole_blocks(monkeypatch: pytest.MonkeyPatch, dtype: Any) -> None:
    """A block's length is its bytes, not its elements: a store and a load of regions of 2-, 4- and 8-byte
    items move every byte of each block and none of the next (fresh mutant M18-07: elements taken for bytes)."""
    rng = np.random.default_rng(9)
    src = [rng.integers(0, 100, (6, 64)).astype(dtype) for _ in range(2)]
    dst = [np.zeros_like(region) for region in src]
    h = hashes("wide", 3)
    with fake_store(monkeypatch) as (store, _fake):
        writer = KVTransfer(store, [ChunkedTokenDatabase(KeyMetadata("wide", 0, 0, 0, 0), 16)], start_threads=False)
        reader = KVTransfer(store, [ChunkedTokenDatabase(KeyMetadata("wide", 0, 0, 0, 0), 16)], start_threads=False)
        with writer, reader:
            writer.register_kv_caches(src, 6)
            reader.register_kv_caches(dst, 6)
            assert writer.store(TransferRequest("w", 48, h, [[1, 2, 3]])).bytes == 3 * 2 * src[0][0].nbytes
            assert reader.load(TransferRequest("r", 48, h, [[5, 4, 2]])).loaded_block_ids == {5, 4, 2}
    for a, b in zip(src, dst, strict=True):
        np.testing.assert_array_equal(b[[5, 4, 2]], a[[1, 2, 3]])
        assert not b[[0, 1, 3]].any()
