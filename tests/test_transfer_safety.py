"""KVTransfer never hands Mooncake an address outside the registered KV caches, in any mode, and refuses every
call after close (issue 9, classes 1 and 2; docs/transfer-modes.md, "Safety").

Bad block ids must come back as failed blocks (load) or unstored chunks (store) with a reason, never as a
wild address: on a load that is a SIGSEGV or a write into unrelated memory, on a store it puts process memory
into the shared pool.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import uuid
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr_testing import Cache, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.store import MooncakeStore, StoreClosedError
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

mooncake = pytest.mark.mooncake

#: Every mode with the region count that resolves to it.
MODES = [("multi_buffer", 3), ("direct", 1), ("staged", 3)]
REQUESTED = {"multi_buffer": "multi_buffer", "direct": "auto", "staged": "staged"}
BAD_IDS = [-1, -(2**40), 9, 10**5, 2**62, 2**63 - 1]


def open_transfer(store: MooncakeStore, model: str, cache: Cache, mode: str, **kwargs: Any) -> KVTransfer:
    xfer = transfer(store, model, cache, 16, transfer_mode=REQUESTED[mode], start_threads=False, **kwargs)
    assert xfer.mode == mode
    return xfer


# ------------------------------------------------------------------------------------------- the reproducer

REPRODUCER = """
import json, sys
import numpy as np
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

address = sys.argv[1]
store = MooncakeStore(StoreConfig(master_server_address=address, global_segment_size="64MiB",
                                  local_buffer_size=0)).setup()
report = {}
for mode, regions in (("multi_buffer", 1), ("auto", 1), ("staged", 2)):
    kv = [np.zeros((9, 512), np.uint8) for _ in range(regions)]
    md = KeyMetadata("m-" + mode, 0, 0, 0, 0)
    x = KVTransfer(store, [ChunkedTokenDatabase(md, 16)], start_threads=False, transfer_mode=mode)
    x.register_kv_caches(kv, 9)
    x.store(TransferRequest("r", 16, [b"h0"], [[1]]))
    loaded = x.load(TransferRequest("r", 16, [b"h0"], [[10**5]]))
    stored = x.store(TransferRequest("r", 16, [b"h1"], [[-3]]))
    report[x.mode] = [sorted(loaded.failed_block_ids), list(loaded.invalid_block_ids), stored.stored,
                      list(stored.invalid_block_ids)]
    x.close()
store.close()
print(json.dumps(report))
"""


@mooncake
def test_the_issue_reproducer_reports_failed_blocks_instead_of_crashing(master: EmbeddedMaster) -> None:
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(REPRODUCER), master.rpc_address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-3000:]}"
    report = json.loads(child.stdout.strip().splitlines()[-1])
    expected = [[10**5], [10**5], 0, [-3]]
    assert report == {"multi_buffer": expected, "direct": expected, "staged": expected}


# ------------------------------------------------------------------------------------------- class 1: block ids


@mooncake
@pytest.mark.parametrize(("mode", "regions"), MODES)
@pytest.mark.parametrize("tp_rank", [0, 3])
def test_load_reports_out_of_range_ids_and_moves_only_the_good_blocks(
    store: MooncakeStore, model: str, mode: str, regions: int, tp_rank: int
) -> None:
    src, dst = Cache(regions, 9, 256, seed=1), Cache(regions, 9, 256, fill=0x5A)
    h = hashes(model, 8)
    good = [1, 2, 3, 4, 5, 6, 7, 8]
    with open_transfer(store, model, src, mode) as writer:
        assert writer.store(TransferRequest("r", 8 * 16, h, [good])).ok
    ids = [8, -1, 7, 10**5, 6, 2**62, 5, 2**63 - 1]  # the odd positions are outside [0, 9)
    with open_transfer(store, model, dst, mode, tp_rank=tp_rank) as reader:
        before = dst.snapshot()
        loaded = reader.load(TransferRequest("r", 8 * 16, h, [ids]))
    bad = {-1, 10**5, 2**62, 2**63 - 1}
    assert loaded.failed_block_ids == bad and loaded.loaded_block_ids == {8, 7, 6, 5}
    assert set(loaded.invalid_block_ids) == bad and loaded.error is None
    assert all("outside the registered blocks [0, 9)" in r for r in loaded.invalid_block_ids.values())
    assert loaded.outcomes == {"ok": 4, "invalid_block_id": 4} and loaded.bytes == 4 * regions * 256
    assert loaded.chunks == 8
    assert_blocks_equal(src, [1, 3, 5, 7], dst, [8, 7, 6, 5])
    for region, old in zip(dst.regions, before, strict=True):  # no other byte changed
        np.testing.assert_array_equal(region[:5], old[:5])


@mooncake
@pytest.mark.parametrize(("mode", "regions"), MODES)
def test_store_never_puts_a_chunk_on_an_out_of_range_id(
    store: MooncakeStore, model: str, mode: str, regions: int
) -> None:
    src = Cache(regions, 9, 256, seed=2)
    h = hashes(model, 6)
    ids = [1, 9, 2, -5, 2**62, 3]
    with open_transfer(store, model, src, mode) as writer:
        stored = writer.store(TransferRequest("r", 6 * 16, h, [ids]))
        keys = [writer.databases[0].key_for(x) for x in h]
    assert stored.stored == 3 and stored.chunks == 6 and not stored.ok and stored.saved_tokens == 0
    assert stored.failed_keys == [keys[1], keys[3], keys[4]]
    assert set(stored.invalid_block_ids) == {9, -5, 2**62}
    assert stored.outcomes == {"ok": 3, "invalid_block_id": 3} and stored.bytes == 3 * regions * 256
    assert store.batch_is_exist(keys).present == [True, False, True, False, False, True]


@mooncake
@pytest.mark.parametrize(("mode", "regions"), MODES)
def test_saved_tokens_stay_all_or_nothing_when_every_valid_key_is_already_stored(
    store: MooncakeStore, model: str, mode: str, regions: int
) -> None:
    """No put at all (the valid keys exist) does not make an out-of-range chunk count as saved."""
    src = Cache(regions, 9, 256, seed=5)
    h = hashes(model, 3)
    with open_transfer(store, model, src, mode) as writer:
        first = writer.store(TransferRequest("r", 3 * 16, h, [[1, 2, 3]]))
        assert first.ok and first.saved_tokens == 3 * 16
        again = writer.store(TransferRequest("r", 3 * 16, h, [[1, 9, 3]]))
        keys = [writer.databases[0].key_for(x) for x in h]
    assert again.already_present == 2 and again.stored == 0 and again.chunks == 3
    assert again.failed_keys == [keys[1]] and set(again.invalid_block_ids) == {9}
    assert not again.ok and again.saved_tokens == 0


@mooncake
@pytest.mark.parametrize(("mode", "regions"), MODES)
def test_regions_edited_after_registration_move_nothing(
    store: MooncakeStore, model: str, mode: str, regions: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache(regions, 5, 128, seed=3)
    h = hashes(model, 2)
    with open_transfer(store, model, cache, mode) as xfer:
        db = xfer.databases[0]
        db.set_block_len([1 << 20] * regions)  # a caller's edit: every address would now be wild
        calls = _spy_mooncake(store, monkeypatch)
        loaded = xfer.load(TransferRequest("r", 32, h, [[1, 2]]))
        assert loaded.failed_block_ids == {1, 2} and loaded.error is not None
        assert "changed after register_kv_caches" in loaded.error
        with pytest.raises(ValueError, match="changed after register_kv_caches"):
            xfer.store(TransferRequest("r", 32, h, [[1, 2]]))
        assert calls == []


def _spy_mooncake(store: MooncakeStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every call that reaches Mooncake through ``store``."""
    calls: list[str] = []
    for name in ("batch_is_exist", "batch_get_into", "batch_put_from", "batch_get_into_multi_buffers",
                 "batch_put_from_multi_buffers"):
        method = getattr(store, name)

        def spy(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            calls.append(_name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(store, name, spy)
    return calls


# Block ids as a buggy or hostile engine might send them: mostly valid, some far out of range on both sides.
block_id_lists = st.lists(
    st.one_of(
        st.integers(0, 8),
        st.integers(0, 8),
        st.integers(-(2**63), -1),
        st.integers(9, 2**63 - 1),
        st.sampled_from(BAD_IDS),
    ),
    min_size=1,
    max_size=8,
)


@mooncake
@pytest.mark.parametrize(("mode", "regions"), MODES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(store_ids=block_id_lists, load_ids=block_id_lists, tp_rank=st.integers(0, 7))
def test_random_bad_ids_never_reach_mooncake(
    store: MooncakeStore, mode: str, regions: int, store_ids: list[int], load_ids: list[int], tp_rank: int
) -> None:
    model = f"fuzz-{uuid.uuid4().hex[:12]}"
    n = min(len(store_ids), len(load_ids))
    store_ids, load_ids = store_ids[:n], load_ids[:n]
    src, dst = Cache(regions, 9, 64, seed=4), Cache(regions, 9, 64, fill=0xC3)
    h = hashes(model, n)
    valid = range(9)
    with open_transfer(store, model, src, mode, tp_rank=tp_rank) as xfer:
        stored = xfer.store(TransferRequest("r", n * 16, h, [store_ids]))
        keys = [xfer.databases[0].key_for(x) for x in h]
    # Stored: exactly the chunks on valid, non-null ids; the invalid ones are named with a reason.
    expected_stored = [b in valid and b != 0 for b in store_ids]
    assert store.batch_is_exist(keys).present == expected_stored
    assert set(stored.invalid_block_ids) == {b for b in store_ids if b not in valid}
    with open_transfer(store, model, dst, mode, tp_rank=tp_rank) as xfer:
        before = dst.snapshot()
        loaded = xfer.load(TransferRequest("r", n * 16, h, [load_ids]))
    assert loaded.error is None
    assert set(loaded.invalid_block_ids) == {b for b in load_ids if b not in valid}
    ok = {b for b, s in zip(load_ids, expected_stored, strict=True) if s and b in valid}
    touched = {b for b in load_ids if b in valid}
    # A block is loaded only when every chunk on it was (the same id may appear twice).
    missing = {b for b, s in zip(load_ids, expected_stored, strict=True) if b in valid and not s}
    assert loaded.loaded_block_ids == ok - missing
    assert loaded.failed_block_ids == set(load_ids) - loaded.loaded_block_ids
    for i, b in enumerate(load_ids):
        if b in loaded.loaded_block_ids and load_ids.count(b) == 1:
            assert dst.object_bytes(b) == src.object_bytes(store_ids[i])
    for r, (region, old) in enumerate(zip(dst.regions, before, strict=True)):
        untouched = [b for b in valid if b not in touched]
        np.testing.assert_array_equal(region[untouched], old[untouched], err_msg=f"region {r}")


@mooncake
@pytest.mark.parametrize(("mode", "regions"), MODES)
def test_a_block_id_equal_to_num_blocks_is_out_of_range(
    store: MooncakeStore, model: str, mode: str, regions: int
) -> None:
    """The edge itself, alone among valid ids (a fuzz list mixes it with ids the screen's slow path catches)."""
    src, dst = Cache(regions, 9, 64, seed=4), Cache(regions, 9, 64, fill=0xC3)
    h = hashes(model, 2)
    with open_transfer(store, model, src, mode) as xfer:
        stored = xfer.store(TransferRequest("r", 32, h, [[8, 9]]))
        assert set(stored.invalid_block_ids) == {9}
        keys = [xfer.databases[0].key_for(x) for x in h]
        assert store.batch_is_exist(keys).present == [True, False]
        assert xfer.store(TransferRequest("r", 32, h, [[8, 7]])).ok  # key 1 now exists (from block 7)
    with open_transfer(store, model, dst, mode) as xfer:
        before = dst.snapshot()
        loaded = xfer.load(TransferRequest("r", 32, h, [[8, 9]]))
    assert set(loaded.invalid_block_ids) == {9} and loaded.failed_block_ids == {9}
    assert loaded.loaded_block_ids == {8} and dst.object_bytes(8) == src.object_bytes(8)
    for region, old in zip(dst.regions, before, strict=True):
        np.testing.assert_array_equal(region[:8], old[:8])  # blocks 0-7 untouched; 9 is past the region


def test_an_empty_registration_is_refused_where_it_is_made() -> None:
    from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata

    store = MooncakeStore(StoreConfig(master_server_address="127.0.0.1:1"))
    xfer = KVTransfer(store, [ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)])
    with pytest.raises(ValueError, match="no KV-cache regions"):
        xfer.register_kv_caches([], 4)
    with pytest.raises(ValueError, match="no KV-cache regions"):
        xfer.register_kv_caches(iter([]), 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0 bytes is not a multiple"):
        xfer.register_kv_caches([np.zeros((0, 64), np.uint8)], 4)
    with pytest.raises(ValueError, match="0 bytes is not a multiple"):
        xfer.register_kv_caches([np.zeros((4, 64), np.uint8), np.zeros((4, 0), np.uint8)], 4)
    xfer.close()


# ------------------------------------------------------------------------------------------- class 2: after close


@mooncake
@pytest.mark.parametrize(("mode", "regions"), MODES)
def test_every_call_after_close_is_refused_before_mooncake(
    store: MooncakeStore, model: str, mode: str, regions: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache(regions, 5, 128, seed=5)
    xfer = transfer(store, model, cache, 16, transfer_mode=REQUESTED[mode])
    assert xfer.mode == mode
    xfer.close()
    calls = _spy_mooncake(store, monkeypatch)
    request = TransferRequest("r", 32, hashes(model, 2), [[1, 2]])
    refused: list[Any] = [
        lambda: xfer.load(request),
        lambda: xfer.store(request),
        lambda: xfer.lookup(32, request.block_hashes),
        lambda: xfer.submit_load(request),
        lambda: xfer.submit_store(request),
        lambda: xfer.register_kv_caches(cache.regions, 5),
        xfer.start,
    ]
    for call in refused:
        with pytest.raises(StoreClosedError, match="closed"):
            call()
    assert calls == []
    xfer.close()  # idempotent


@mooncake
def test_close_waits_for_a_load_in_flight(store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = Cache(1, 3, 4096, seed=6), Cache(1, 3, 4096)
    h = hashes(model, 2)
    with transfer(store, model, src, 16, start_threads=False) as writer:
        assert writer.store(TransferRequest("r", 32, h, [[1, 2]])).ok
    reader = transfer(store, model, dst, 16, start_threads=False)
    assert reader.mode == "direct"
    entered, release = threading.Event(), threading.Event()
    get = store.batch_get_into

    def slow_get(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(10)
        return get(*args, **kwargs)

    monkeypatch.setattr(store, "batch_get_into", slow_get)
    results: list[Any] = []
    loader = threading.Thread(target=lambda: results.append(reader.load(TransferRequest("r", 32, h, [[1, 2]]))))
    loader.start()
    assert entered.wait(10)
    closer = threading.Thread(target=reader.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # the caches stay registered and alive while the get runs
    with pytest.raises(StoreClosedError):
        reader.load(TransferRequest("r", 32, h, [[1, 2]]))
    release.set()
    loader.join(10)
    closer.join(10)
    assert not closer.is_alive() and results[0].ok
    assert_blocks_equal(src, [1, 2], dst, [1, 2])


def test_a_transfer_closed_before_registering_refuses_too() -> None:
    store = MooncakeStore(StoreConfig(master_server_address="127.0.0.1:1"))
    from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata

    xfer = KVTransfer(store, [ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)])
    xfer.close()
    with pytest.raises(StoreClosedError):
        xfer.load(TransferRequest("r", 16, [b"h"], [[1]]))
    with pytest.raises(StoreClosedError):
        xfer.register_kv_caches([np.zeros((2, 64), np.uint8)], 2)


@mooncake
def test_block_id_containers_are_sequences_of_ints(store: MooncakeStore, model: str) -> None:
    src, dst = Cache(2, 5, 128, seed=7), Cache(2, 5, 128)
    h = hashes(model, 3)
    with transfer(store, model, src, 16, transfer_mode="multi_buffer") as writer:
        with pytest.raises(TypeError, match="dict"):
            writer.store(TransferRequest("r", 48, h, [{1: 0, 2: 0, 3: 0}]))  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"must be an int|expected an int"):
            writer.store(TransferRequest("r", 48, h, [[1, 2.0, 3]]))  # type: ignore[list-item]
        assert writer.store(TransferRequest("r", 48, h, [np.array([1, 2, 3], dtype=np.uint32)])).ok
    with transfer(store, model, dst, 16, transfer_mode="staged") as reader:
        loaded = reader.load(TransferRequest("r", 48, h, [{3, 2, 1}]))  # type: ignore[list-item]
        assert loaded.error is not None and "set" in loaded.error and not loaded.loaded_block_ids
        loaded = reader.load(TransferRequest("r", 48, h, [np.array([1, 2, 3], dtype=np.int64)]))
        assert loaded.ok and loaded.loaded_block_ids == {1, 2, 3}
    assert_blocks_equal(src, [1, 2, 3], dst, [1, 2, 3])


def test_num_blocks_accepts_numpy_ints_and_rejects_the_rest() -> None:
    from mooncake_kvaddr.driver.bounds import RegisteredCaches

    caches = RegisteredCaches.from_regions([np.zeros((4, 64), np.uint8)], np.int64(4))
    assert caches.num_blocks == 4 and type(caches.num_blocks) is int and caches.block_lens == (64,)
    with pytest.raises(TypeError, match="num_blocks"):
        RegisteredCaches.from_regions([np.zeros((4, 64), np.uint8)], 4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks"):
        RegisteredCaches.from_regions([np.zeros((4, 64), np.uint8)], 0)


class _SameInt(int):
    """An int subclass with honest comparisons: still not an exact int."""


class _SameList(list):  # type: ignore[type-arg]
    """A list subclass with honest comparisons: still not an exact list."""


@pytest.mark.parametrize("which", ["bases", "block lengths"])
def test_the_database_check_takes_exact_lists_of_exact_ints_only(which: str) -> None:
    """``check_databases`` refuses a database whose bases or block lengths are not an exact list of exact ints,
    even one that compares equal to the registered values: a subclass's comparisons may lie while the native
    code reads other values (docs/transfer-modes.md, "Safety")."""
    from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
    from mooncake_kvaddr.driver.bounds import RegisteredCaches

    caches = RegisteredCaches.from_regions([np.zeros((4, 64), np.uint8), np.zeros((4, 128), np.uint8)], 4)
    registered = list(caches.bases) if which == "bases" else list(caches.block_lens)
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
    db.set_kv_caches_base_addr(list(caches.bases))
    db.set_block_len(list(caches.block_lens))
    caches.check_databases([db])  # the registered values, as exact lists: accepted
    for values in ([_SameInt(v) for v in registered], _SameList(registered)):
        assert values == registered
        if which == "bases":
            db.set_kv_caches_base_addr(values)
        else:
            db.set_block_len(values)
        with pytest.raises(ValueError, match=r"databases\[0\]: its regions changed"):
            caches.check_databases([db])


@mooncake
def test_the_null_block_next_to_an_invalid_id_is_skipped_and_a_request_of_only_invalid_ids_saves_nothing(
    store: MooncakeStore, model: str
) -> None:
    """Block 0 is vLLM's null block: next to an out-of-range id its chunk is neither stored nor reported (only
    the bad id is); a request whose every id is out of range stores nothing and saves 0 tokens."""
    src = Cache(3, 9, 256, seed=11)
    h = hashes(model, 3)
    with open_transfer(store, model, src, "multi_buffer") as writer:
        keys = [writer.databases[0].key_for(x) for x in h]
        stored = writer.store(TransferRequest("r", 3 * 16, h, [[0, 9, 2]]))
        assert stored.chunks == 2 and stored.stored == 1 and stored.failed_keys == [keys[1]]
        assert set(stored.invalid_block_ids) == {9}
        assert store.batch_is_exist(keys).present == [False, False, True]
        none = writer.store(TransferRequest("r2", 2 * 16, hashes(model + "-none", 2), [[9, -5]]))
    assert none.stored == 0 and none.chunks == 2 and len(none.failed_keys) == 2
    assert none.saved_tokens == 0 and not none.ok and set(none.invalid_block_ids) == {9, -5}
