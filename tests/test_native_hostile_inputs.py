"""One regression test (or more) per hardening class of the native entry points (SECURITY.md, docs/errors.md).

Classes: re-entrancy (3), shared rows (4), unchecked arithmetic (5), loose types (6), leaked buffer exports (7),
raw staging pointers (8), hash views that count elements (issue 16), and the mutation-test survivors.
"""

from __future__ import annotations

import array
import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvaddr_testing import oracle_regions, paired
from mooncake_kvaddr import BlobBlockHashes, ChunkedTokenDatabase, KeyMetadata, _native
from mooncake_kvaddr.core.keys import build_keys, build_lookup_keys, reduce_exists
from mooncake_kvaddr.driver.staging import HostCopyBackend, StagingBuffer, StagingPool, gather, plan_slots, scatter

MD = KeyMetadata("m", 0, 0, 0, 0)


def small_pair(**kwargs: Any) -> tuple[ChunkedTokenDatabase, Any]:
    return paired(*oracle_regions(4, 2), 16, **kwargs)


# --- class 3: re-entrancy -----------------------------------------------------------------------------------


class ClearsItsList:
    """An int-like chunk bound whose __index__ empties the list that holds it."""

    def __init__(self, value: int, victim: list[Any]) -> None:
        self.value = value
        self.victim = victim

    def __index__(self) -> int:
        self.victim.clear()
        gc.collect()
        return self.value


def test_index_that_clears_its_own_chunk_list_is_safe() -> None:
    native, oracle = small_pair()
    chunk: list[Any] = []
    chunk.extend([ClearsItsList(0, chunk), 16])
    assert native.prepare_values([chunk], [3]) == oracle.prepare_values([(0, 16)], [3])
    outer: list[Any] = []
    outer.extend([(ClearsItsList(0, outer), 16), (16, 32)])
    with pytest.raises(RuntimeError, match="changed size"):
        native.prepare_values(outer, [3, 4])


def test_index_that_clears_block_ids_is_safe() -> None:
    native, _ = small_pair()
    ids: list[Any] = []
    ids.extend([ClearsItsList(5, ids), 6])
    with pytest.raises((RuntimeError, IndexError)):  # as the reference: the list is empty when chunk 1 reads it
        native.prepare_values([(0, 16), (16, 32)], ids)


class Reconfigures:
    """An int whose __index__ re-registers the database's regions (a callback that reconfigures mid-call)."""

    def __init__(self, value: int, db: ChunkedTokenDatabase, bases: list[int]) -> None:
        self.value, self.db, self.bases = value, db, bases

    def __index__(self) -> int:
        self.db.set_kv_caches_base_addr(self.bases)
        return self.value


@pytest.mark.parametrize("where", ["block_id", "chunk", "base"])
def test_index_that_reconfigures_never_leaves_stale_rows_cached(where: str) -> None:
    native, oracle = small_pair()
    old_bases = list(native.kv_caches_base_addr)
    new_bases = [b + (1 << 20) for b in old_bases]
    chunks: list[Any] = [(0, 16), (16, 32)]
    ids: list[Any] = [7, 8]
    if where == "block_id":
        ids[0] = Reconfigures(7, native, new_bases)
    elif where == "chunk":
        chunks[1] = (Reconfigures(16, native, new_bases), 32)
    else:
        bases: list[Any] = list(old_bases)
        bases[0] = Reconfigures(old_bases[0], native, new_bases)
        native.set_kv_caches_base_addr(bases)
    native.prepare_values(chunks, ids)  # whichever snapshot it used, it must not poison later calls
    oracle.set_kv_caches_base_addr(new_bases)
    for _ in range(2):
        assert native.prepare_values([(0, 16), (16, 32)], [7, 8]) == oracle.prepare_values([(0, 16), (16, 32)], [7, 8])


class TouchesDatabaseOnDel:
    def __init__(self, db: ChunkedTokenDatabase) -> None:
        self.db = db

    def __del__(self) -> None:
        self.db.clear_address_cache()
        self.db.prepare_values([(0, 16)], [1])
        self.db.set_kv_caches_base_addr(list(self.db.kv_caches_base_addr))


def test_destructor_in_a_returned_row_cannot_run_inside_the_cache() -> None:
    # A tiny cache: every call evicts. Before the fix a row holding this object was the cache's own list, and
    # evicting it ran __del__ (which re-enters the database) in the middle of the eviction.
    native, oracle = small_pair(address_cache_bytes=400)
    for i in range(50):
        addrs, sizes, _ = native.prepare_values([(0, 16), (16, 32)], [i, i + 1])
        addrs[0].append(TouchesDatabaseOnDel(native))
        sizes[1].append(TouchesDatabaseOnDel(native))
        del addrs, sizes
        gc.collect()
    assert native.prepare_values([(0, 16)], [3]) == oracle.prepare_values([(0, 16)], [3])


# --- class 4: results never alias -------------------------------------------------------------------------


def all_rows(result: tuple[list[list[int]], ...]) -> Iterator[list[int]]:
    for part in result[:2]:
        yield from part


@pytest.mark.parametrize("api", ["prepare_values", "plan_load"])
def test_editing_a_result_never_changes_another(api: str) -> None:
    native, oracle = small_pair()
    chunks = [(0, 16), (16, 32), (32, 48)]
    ids = [5, 5, 6]  # two chunks on the same block id, equal block counts

    def call() -> tuple[list[list[int]], list[list[int]], list[int]]:
        if api == "prepare_values":
            return native.prepare_values(chunks, ids)
        plan = native.plan_load(48, [b"a" * 4, b"b" * 4, b"c" * 4], ids)
        return plan.addrs, plan.sizes, plan.block_ids

    expected = oracle.prepare_values(chunks, ids)
    first, second = call(), call()
    rows = list(all_rows(first)) + list(all_rows(second))
    assert len({id(r) for r in rows}) == len(rows), "two rows of the results are one object"
    for row in all_rows(first):
        row.append(-1)
        row[0] = -2
    first[2][0] = -3
    assert second == expected
    assert call() == expected
    for row in all_rows(second):
        row.clear()
    assert call() == expected


def test_prepare_value_and_for_block_are_fresh() -> None:
    native, oracle = small_pair()
    a = native.prepare_value(0, 16, [9])
    a[0].append(1)
    assert native.prepare_value(0, 16, [9]) == oracle.prepare_value(0, 16, [9])
    b = native.prepare_value_for_block(4)
    b[1][0] = 0
    assert native.prepare_value_for_block(4) == oracle.prepare_value_for_block(4)


# --- class 5: overflow-checked arithmetic -----------------------------------------------------------------


def test_walk_near_int64_max_raises_and_never_reads_before_the_blob() -> None:
    db = ChunkedTokenDatabase(MD, 2**62, 2**61)
    with pytest.raises(OverflowError):
        db.plan_load(3 * 2**61, bytes(range(1, 13)), [1, 2], hash_len=4)
    with pytest.raises(OverflowError):
        db.plan_load_arrays(3 * 2**61, bytes(range(1, 13)), [1, 2], hash_len=4)
    with pytest.raises(OverflowError):
        db.plan_store(3 * 2**61, bytes(range(1, 13)), [1, 2], hash_len=4)
    with pytest.raises(OverflowError):
        list(db.process_tokens(3 * 2**61, [b"a", b"b", b"c"]))


def test_walk_keys_stay_inside_the_hashes_at_the_edge() -> None:
    # The largest token_len the rule allows: every key names one of the given hashes.
    bs = 2**61
    db = ChunkedTokenDatabase(MD, bs, bs)
    token_len = 2**63 - 1 - bs
    token_len -= token_len % bs
    n = token_len // bs
    hashes = bytes(range(1, 4 * n + 1))
    keys = db.plan_load(token_len, hashes, list(range(n)), hash_len=4).keys
    assert keys == build_keys(db.key_prefix, hashes, 4)


def test_reduce_exists_width_sum_that_wraps_is_rejected() -> None:
    with pytest.raises(ValueError):
        reduce_exists([1], [2**63 - 1, 2**63 - 1, 3])
    with pytest.raises(ValueError):
        reduce_exists([1, 1], [2**62, 2**62, 2**62, 2**62, -(2**62) + 2])


def test_chunk_walk_refuses_a_lying_hash_count() -> None:
    with pytest.raises((ValueError, OverflowError, AssertionError)):
        _native.chunk_walk(2**62, -1, 1, 1, 0, None, 1, 0)
    starts, _, _ = _native.chunk_walk(2**40, 2**62, 2**20, 2**20, 0, None, 1, 0)
    assert len(starts) == 2**20


# --- class 6: strict input types --------------------------------------------------------------------------


class Boom(Exception):
    pass


class LyingLength:
    def __init__(self, length: int, items: list[int]) -> None:
        self.length, self.items = length, items

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return self.items[index]


class RaisingItems:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        raise Boom(index)


@pytest.mark.parametrize("bad", [{0: 5, 1: 6}, {5, 6}, "56", b"\x05\x06", bytearray(b"\x05"), 7, None, 5.0])
def test_block_ids_of_the_wrong_type_raise_type_error(bad: object) -> None:
    native, _ = small_pair()
    for call in (
        lambda: native.prepare_values([(0, 16)], bad),  # type: ignore[arg-type]
        lambda: native.prepare_values_array([(0, 16)], bad),  # type: ignore[arg-type]
        lambda: native.plan_load(16, [b"h"], bad),  # type: ignore[arg-type]
        lambda: native.plan_load_arrays(16, [b"h"], bad),  # type: ignore[arg-type]
        lambda: native.plan_store(16, [b"h"], bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError):
            call()


def test_block_ids_accepted_types_agree() -> None:
    native, oracle = small_pair()
    chunks = [(0, 16), (32, 48)]
    expected = oracle.prepare_values(chunks, [5, 6, 7])
    for ids in ([5, 6, 7], (5, 6, 7), np.array([5, 6, 7]), np.array([5, 6, 7], np.int32),
                np.array([5, 6, 7], np.uint64), np.array([5, 0, 6, 0, 7])[::2], array.array("q", [5, 6, 7]),
                range(5, 8), LyingLength(3, [5, 6, 7])):
        assert native.prepare_values(chunks, ids) == expected, ids  # type: ignore[arg-type]
        arrays = native.prepare_values_array(chunks, ids)  # type: ignore[arg-type]
        assert arrays[0].tolist() == expected[0]


def test_block_ids_bad_arrays() -> None:
    native, _ = small_pair()
    with pytest.raises(TypeError):
        native.prepare_values([(0, 16)], np.array([1.0]))
    with pytest.raises(TypeError):
        native.prepare_values([(0, 16)], np.array([[1]]))
    for value in (2**63, 2**64 - 1):  # 2**64 - 1 would wrap to -1: a valid-looking block id
        with pytest.raises(OverflowError):
            native.prepare_values([(0, 16)], np.array([value], np.uint64))
        with pytest.raises(OverflowError):
            native.prepare_values_array([(0, 16)], np.array([value], np.uint64))


def test_lying_len_is_a_clear_error_and_user_exceptions_propagate() -> None:
    native, _ = small_pair()
    with pytest.raises(ValueError, match="__len__"):
        native.prepare_values([(32, 48)], LyingLength(5, [1, 2]))
    with pytest.raises(Boom):
        native.prepare_values([(0, 16)], RaisingItems())
    with pytest.raises(Boom):
        native.plan_store(16, [b"h"], RaisingItems())

    class BadLen:
        def __len__(self) -> int:
            raise Boom("len")

        def __getitem__(self, i: int) -> int:
            return 1

    with pytest.raises(Boom):
        native.prepare_values([(0, 16)], BadLen())

    class BadIndex:
        def __index__(self) -> int:
            raise Boom("index")

    with pytest.raises(Boom):
        native.prepare_values([(0, 16)], [BadIndex()])
    with pytest.raises(Boom):
        native.prepare_values([(BadIndex(), 16)], [1])


def test_masks_and_hashes_refuse_dicts_and_sets() -> None:
    native, _ = small_pair()
    with pytest.raises(TypeError):
        native.plan_load(32, [b"a", b"b"], [1, 2], load_mask={0: True})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.keys_for({b"a", b"b"})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        reduce_exists({1: 1}, 1)  # type: ignore[arg-type]


# --- class 7: buffer exports released on every path ---------------------------------------------------------


def test_blob_errors_release_the_buffer() -> None:
    native, _ = small_pair()
    blob = bytearray(b"x" * 10)
    before = sys.getrefcount(blob)
    calls = [
        lambda: native.keys_for(blob, 4),
        lambda: build_lookup_keys(["a", "b"], blob, 4),
        lambda: native.plan_load(16, blob, [1], hash_len=4),
        lambda: native.plan_load_arrays(16, blob, [1], hash_len=4),
        lambda: native.plan_store(16, blob, [1], hash_len=4),
        lambda: native.key_for(blob[:0] if False else "not bytes"),  # type: ignore[arg-type]
    ]
    for call in calls:
        for _ in range(3):
            with pytest.raises((ValueError, TypeError)):
                call()
    assert sys.getrefcount(blob) == before
    blob.extend(b"yy")  # resizable: no export left behind
    assert len(blob) == 12
    assert native.keys_for(blob, 4) == build_keys(native.key_prefix, bytes(blob), 4)
    blob.extend(b"z")


# --- class 8: staging is project-owned memory only ----------------------------------------------------------


def test_raw_staging_pointers_are_refused() -> None:
    kv = np.zeros(4096, np.uint8)
    backend = HostCopyBackend([(kv.ctypes.data, kv.nbytes)])
    addrs = np.array([[kv.ctypes.data]], np.int64)
    sizes = np.array([[64]], np.int64)
    offsets = np.zeros(1, np.int64)
    for bogus in [(0x1000, 4096), (kv.ctypes.data + 64, 1024), (2**62, 2**20)]:
        with pytest.raises(ValueError, match="staging"):
            backend.gather(addrs, sizes, bogus, offsets)
        with pytest.raises(ValueError, match="staging"):
            scatter(addrs, sizes, bogus, offsets, backend.allowed_ranges)
    with pytest.raises(TypeError):
        backend.gather(addrs, sizes, "staging", offsets)  # type: ignore[arg-type]
    buf = StagingBuffer(4096)
    kv[:64] = 7
    assert backend.gather(addrs, sizes, buf, offsets) == 64
    assert gather(addrs, sizes, buf.span(64, 128), offsets, backend.allowed_ranges) == 64
    assert (buf.array[:64] == 7).all() and (buf.array[64:128] == 7).all()
    pool = StagingPool(1 << 16)
    lease = pool.acquire(64)
    assert backend.gather(addrs, sizes, lease, offsets) == 64
    lease.release()
    with pytest.raises(ValueError, match="released"):
        backend.gather(addrs, sizes, lease, offsets)
    # A range of a buffer that is gone is refused too.
    gone = StagingBuffer(4096)
    gone_range = gone.range
    del gone
    gc.collect()
    with pytest.raises(ValueError, match="staging"):
        backend.gather(addrs, sizes, gone_range, offsets)


def test_staging_pointer_api_is_private() -> None:
    assert not hasattr(_native, "staging_gather") and not hasattr(_native, "staging_scatter")
    assert callable(_native._staging_gather) and callable(_native._staging_scatter)


# --- issue 16: hash views count bytes, and follow (lock) their buffer ----------------------------------------


def test_hash_views_count_bytes_for_every_format() -> None:
    words = array.array("I", range(1, 9))  # 32 bytes, 8 items
    raw = words.tobytes()
    view = BlobBlockHashes(memoryview(words), 4)
    assert len(view) == 8
    assert [bytes(h) for h in view] == [raw[i : i + 4] for i in range(0, 32, 4)]
    prefix = "p"
    assert build_keys(prefix, view) == build_keys(prefix, raw, 4) == build_keys(prefix, memoryview(words), 4)
    assert build_lookup_keys(["a", "b"], view) == build_lookup_keys(["a", "b"], raw, 4)
    db = ChunkedTokenDatabase(MD, 4)
    assert db.plan_load(32, view, list(range(8))).keys == db.plan_load(32, raw, list(range(8)), hash_len=4).keys
    assert len(BlobBlockHashes(np.arange(4, dtype=np.uint16), 2)) == 4


def test_blob_view_locks_a_bytearray_and_never_yields_empty_hashes() -> None:
    blob = bytearray(b"abcdefgh")
    view = BlobBlockHashes(blob, 4)
    with pytest.raises(BufferError):
        del blob[4:]
    assert len(view) == 2 and [bytes(h) for h in view] == [b"abcd", b"efgh"]
    assert all(not k.endswith("@") for k in build_keys("p", view))
    blob[0:1] = b"z"  # in-place writes are seen
    assert bytes(view[0]) == b"zbcd"
    view.release()
    del blob[4:]  # unlocked
    assert len(view) == 0
    with pytest.raises(ValueError):
        BlobBlockHashes(b"abcde", 4)
    with pytest.raises(ValueError):
        BlobBlockHashes(memoryview(b"abcdefgh")[::2], 2)


# --- mutation-test survivors (shared/TESTING.md) ----------------------------------------------------------


def test_size_row_overflow_is_raised_for_lists_and_arrays() -> None:
    db = ChunkedTokenDatabase(MD, 16)
    db.set_kv_caches_base_addr([0])
    db.set_block_len([1 << 40])
    chunk = [(0, 16 * (1 << 24))]
    with pytest.raises(OverflowError):
        db.prepare_values(chunk, [1])
    with pytest.raises(OverflowError):
        db.prepare_values_array(chunk, [1])
    with pytest.raises(OverflowError):
        db.prepare_values_array(np.array(chunk, np.int64), np.array([1]))


@pytest.mark.parametrize("how", ["in_place", "setter"])
def test_block_len_only_change_is_noticed(how: str) -> None:
    native, oracle = paired(*oracle_regions(4, 2), 16)
    chunks, ids = [(0, 16), (16, 48)], [3, 4, 5]
    assert native.prepare_values(chunks, ids) == oracle.prepare_values(chunks, ids)
    new_lens = list(native.block_len)
    new_lens[1] += 512
    if how == "in_place":
        native.block_len[1] = new_lens[1]
    else:
        native.set_block_len(new_lens)
    oracle.set_block_len(new_lens)
    assert native.prepare_values(chunks, ids) == oracle.prepare_values(chunks, ids)
    assert native.prepare_values_array(chunks, ids)[1].tolist() == oracle.prepare_values(chunks, ids)[1]


@pytest.mark.parametrize("bounds", [(2**64 - 32, 2**64 - 16), (2**63, 2**63 + 16)])
def test_uint64_chunk_bounds_near_2_64_overflow(bounds: tuple[int, int]) -> None:
    # Bounds a uint64 array can hold (2**64 itself cannot: numpy would raise before the call) but int64 cannot:
    # a cast would wrap them to negative tokens, which the block ids, counted from the end, would then resolve.
    db = ChunkedTokenDatabase(MD, 16)
    db.set_kv_caches_base_addr([0])
    db.set_block_len([8])
    chunks = np.array([bounds], np.uint64)
    with pytest.raises(OverflowError):
        db.prepare_values_array(chunks, [1, 2])
    with pytest.raises(OverflowError):
        db.prepare_values(chunks, [1, 2])  # type: ignore[arg-type]


def test_ints_below_minus_2_63_overflow_everywhere() -> None:
    db = ChunkedTokenDatabase(MD, 16)
    db.set_kv_caches_base_addr([0])
    db.set_block_len([8])
    with pytest.raises(OverflowError):
        db.prepare_values([(0, 16)], [-(1 << 64)])
    with pytest.raises(OverflowError):
        db.prepare_values([(-(1 << 64), 16)], [1])
    with pytest.raises(OverflowError):
        db.prepare_values([(0, -(1 << 64))], [1])
    db.set_block_len([-(1 << 64)])
    with pytest.raises(OverflowError):
        db.prepare_values([(0, 16)], [1])
    db.set_block_len([8])
    db.set_kv_caches_base_addr([-(1 << 63) - 1])
    with pytest.raises(OverflowError):
        db.prepare_values([(0, 16)], [1])


def test_streaming_copy_is_fenced() -> None:
    """Non-temporal stores are weakly ordered: the built module must contain the store fence."""
    if not _native.STAGING_STREAMING_STORES:
        pytest.skip("no streaming stores in this build")
    path = Path(_native.__file__)
    try:
        out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("objdump not available")
    assert "movnt" in out
    assert "sfence" in out


# --- the fused array plan --------------------------------------------------------------------------------


def test_plan_load_arrays_equals_plan_load_and_plan_slots() -> None:
    native, _ = paired(*oracle_regions(6, 3), 32, 16)
    hashes = [bytes([i]) * 8 for i in range(12)]
    ids = list(range(100, 106))
    mask = [True, False, True, True, False, True]
    for mask_num in (0, 16, 64):
        plan = native.plan_load(192, hashes, ids, mask_num, mask)
        arrays = native.plan_load_arrays(192, hashes, ids, mask_num, mask)
        assert arrays.keys == plan.keys
        assert arrays.addrs.tolist() == plan.addrs and arrays.sizes.tolist() == plan.sizes
        assert arrays.block_ids.tolist() == plan.block_ids
        slots = plan_slots(arrays.sizes)
        assert arrays.offsets.tolist() == slots.offsets.tolist()
        assert arrays.object_sizes.tolist() == slots.object_sizes.tolist()
        assert arrays.total_bytes == slots.total_bytes
    empty = native.plan_load_arrays(0, [], ids)
    assert empty.keys == [] and empty.addrs.shape[0] == 0 and empty.total_bytes == 0
    with pytest.raises(ValueError):
        native.plan_load_arrays(192, hashes, ids, slot_alignment=3)
