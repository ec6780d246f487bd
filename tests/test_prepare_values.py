"""The pinned prepare_values / prepare_value / prepare_value_for_block cases, plus the array output."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from kvaddr_testing import assert_native_ints, oracle_regions, paired
from mooncake_kvaddr import BlockLenError, ChunkAlignmentError, ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.core.oracle import numpy_prepare_values

BLOCK_SIZE = 128


def upstream_chunks(rng: random.Random) -> list[tuple[int, int]]:
    """The upstream oracle test's chunk generator: spans of 1, 2 or 4 blocks with gaps of 0 or 1."""
    chunks = []
    b = 0
    while b < 296:
        span = rng.choice([1, 1, 1, 2, 4])
        chunks.append((b * BLOCK_SIZE, (b + span) * BLOCK_SIZE))
        b += span + rng.choice([0, 1])
    return chunks


@pytest.mark.parametrize(("n_regions", "n_lens"), [(96, 96), (96, 2), (1, 1)])
def test_matches_scalar_oracle_chunk_by_chunk(n_regions: int, n_lens: int) -> None:
    rng = random.Random(0)
    block_ids = [rng.randrange(1 << 20) for _ in range(300)]
    chunks = upstream_chunks(rng)
    bases, lens = oracle_regions(n_regions, n_lens)
    native, oracle = paired(bases, lens, BLOCK_SIZE)

    addrs, sizes, ids = native.prepare_values(chunks, block_ids)
    assert len(addrs) == len(sizes) == len(ids) == len(chunks)
    assert_native_ints((addrs, sizes, ids))
    for i, (start, end) in enumerate(chunks):
        # The scalar formula, written out independently of both implementations.
        bid = block_ids[start // BLOCK_SIZE]
        count = -(-(end - start) // BLOCK_SIZE)
        assert ids[i] == bid
        assert addrs[i] == [bases[r] + bid * lens[r % n_lens] for r in range(n_regions)]
        assert sizes[i] == [lens[r % n_lens] * count for r in range(n_regions)]
        assert (addrs[i], sizes[i], ids[i]) == oracle.prepare_value(start, end, block_ids)
    assert (addrs, sizes, ids) == oracle.prepare_values(chunks, block_ids)


def test_prepare_value_multi_block_span() -> None:
    bases, lens = oracle_regions(8, 8)
    native, oracle = paired(bases, lens, BLOCK_SIZE)
    result = native.prepare_value(5 * BLOCK_SIZE, 7 * BLOCK_SIZE, list(range(64)))
    assert type(result) is tuple
    assert result == oracle.prepare_value(5 * BLOCK_SIZE, 7 * BLOCK_SIZE, list(range(64)))
    assert result[2] == 5
    assert result[1] == [2 * n for n in lens]


def test_empty_chunks_return_three_fresh_lists() -> None:
    native, _ = paired(*oracle_regions(4, 4), BLOCK_SIZE)
    first = native.prepare_values([], [1, 2, 3])
    assert first == ([], [], [])
    first[0].append(1)
    assert native.prepare_values([], [1, 2, 3]) == ([], [], [])


def test_empty_chunks_never_touch_state() -> None:
    # Even with a broken configuration (block_len empty), an empty request is answered first.
    db = ChunkedTokenDatabase(KeyMetadata("t", 0, 0, 0, 0), BLOCK_SIZE)
    db.set_kv_caches_base_addr([0x1000])
    assert db.prepare_values([], [0]) == ([], [], [])
    assert db.prepare_values_array([], [0])[0].shape == (0, 0)


def test_misaligned_span_raises_assertion_compatible_error() -> None:
    native, oracle = paired(*oracle_regions(4, 4), BLOCK_SIZE)
    with pytest.raises(AssertionError):
        oracle.prepare_values([(0, 129)], [0, 1])
    with pytest.raises(AssertionError) as info:
        native.prepare_values([(0, 129)], [0, 1])
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ChunkAlignmentError)
    assert "129" in str(info.value)


def test_spans_validated_before_block_ids() -> None:
    # Chunk 0's block index is out of range, chunk 1 is misaligned: the span error wins (reference order).
    native, _ = paired(*oracle_regions(2, 2), 16, 16)
    with pytest.raises(ChunkAlignmentError):
        native.prepare_values([(10_000, 10_016), (0, 5)], [0])


def test_block_index_past_block_ids_raises_index_error() -> None:
    native, oracle = paired(*oracle_regions(2, 2), BLOCK_SIZE)
    for db in (native, oracle):
        with pytest.raises(IndexError):
            db.prepare_values([(2 * BLOCK_SIZE, 3 * BLOCK_SIZE)], [0, 1])


def test_negative_start_wraps_like_list_indexing() -> None:
    native, oracle = paired(*oracle_regions(3, 2), BLOCK_SIZE)
    chunks = [(-BLOCK_SIZE, 0), (-2 * BLOCK_SIZE, -BLOCK_SIZE)]
    assert native.prepare_values(chunks, [7, 8, 9]) == oracle.prepare_values(chunks, [7, 8, 9])
    with pytest.raises(IndexError):
        native.prepare_values([(-4 * BLOCK_SIZE, -3 * BLOCK_SIZE)], [7, 8, 9])


def test_zero_and_negative_spans_follow_floor_semantics() -> None:
    native, oracle = paired(*oracle_regions(3, 3), BLOCK_SIZE, 16)
    chunks = [(128, 128), (256, 128), (256, 240)]
    assert native.prepare_values(chunks, list(range(4))) == oracle.prepare_values(chunks, list(range(4)))


def test_non_integers_raise_type_error() -> None:
    native, _ = paired(*oracle_regions(2, 2), BLOCK_SIZE)
    with pytest.raises(TypeError):
        native.prepare_values([(0.0, 128)], [0])
    with pytest.raises(TypeError):
        native.prepare_values([("0", 128)], [0])
    with pytest.raises(TypeError):
        native.prepare_values([(0, 128)], [None])
    with pytest.raises(TypeError):
        native.prepare_values([(0, 128)], 5)
    native.set_kv_caches_base_addr([0x1000, "0x2000"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        native.prepare_values([(0, 128)], [0])


def test_numpy_integers_accepted_and_returned_as_int() -> None:
    native, oracle = paired(*oracle_regions(4, 2), BLOCK_SIZE)
    chunks = [(np.int64(0), np.int64(128)), (np.int32(128), np.int32(256))]
    for block_ids in ([np.int64(3), np.int64(9)], np.array([3, 9], dtype=np.int64), np.array([3, 9], np.int32)):
        result = native.prepare_values(chunks, block_ids)
        assert_native_ints(result)
        assert result == oracle.prepare_values([(0, 128), (128, 256)], [3, 9])


def test_uint64_block_id_array_accepts_the_int64_maximum() -> None:
    """A uint64 block id of exactly 2**63 - 1 fits int64: it converts (2**63 is the first refused)."""
    top = 2**63 - 1
    native, _ = paired([], [], BLOCK_SIZE)  # no regions: the id is echoed, no address to overflow
    ids = np.array([top, 5], np.uint64)
    assert native.prepare_values([(0, 128), (128, 256)], ids) == ([[], []], [[], []], [top, 5])
    assert native.prepare_values_array([(0, 128), (128, 256)], ids)[2].tolist() == [top, 5]
    with_regions, _ = paired([4096], [0], BLOCK_SIZE)  # block_len 0: every block id is at the base
    assert with_regions.prepare_values([(0, 128)], np.array([top], np.uint64)) == ([[4096]], [[0]], [top])


def test_address_overflow_raises_instead_of_wrapping() -> None:
    native, _ = paired([(1 << 62)], [1 << 20], BLOCK_SIZE)
    with pytest.raises(OverflowError):
        native.prepare_values([(0, 128)], [1 << 42])
    with pytest.raises(OverflowError):
        native.prepare_values_array([(0, 128)], [1 << 42])
    with pytest.raises(OverflowError):
        native.prepare_value_for_block(1 << 42)
    with pytest.raises(OverflowError):
        native.prepare_values([(0, 128)], [1 << 64])
    # numpy, the approach we replace, wraps silently here.
    wrapped, _, _ = numpy_prepare_values([(0, 128)], [1 << 42], [1 << 62], [1 << 20], BLOCK_SIZE, BLOCK_SIZE)
    assert wrapped[0][0] != (1 << 62) + (1 << 62)


def test_empty_block_len_with_regions_raises() -> None:
    db = ChunkedTokenDatabase(KeyMetadata("t", 0, 0, 0, 0), BLOCK_SIZE)
    db.set_kv_caches_base_addr([0x1000, 0x2000])
    with pytest.raises(BlockLenError) as info:
        db.prepare_values([(0, 128)], [0])
    assert isinstance(info.value, ValueError) and isinstance(info.value, ZeroDivisionError)
    with pytest.raises(ValueError):
        db.prepare_value_for_block(0)


def test_empty_block_len_with_one_region_raises() -> None:
    """One region is enough: the check is for any region without a block_len, not for several."""
    db = ChunkedTokenDatabase(KeyMetadata("t", 0, 0, 0, 0), BLOCK_SIZE)
    db.set_kv_caches_base_addr([0x1000])
    with pytest.raises(BlockLenError):
        db.prepare_values([(0, 128)], [0])
    with pytest.raises(BlockLenError):
        db.prepare_value_for_block(0)


def test_no_regions_gives_empty_rows() -> None:
    native, oracle = paired([], [], BLOCK_SIZE)
    result = native.prepare_values([(0, 128), (128, 256)], [4, 5])
    assert result == oracle.prepare_values([(0, 128), (128, 256)], [4, 5]) == ([[], []], [[], []], [4, 5])
    assert native.prepare_value_for_block(3) == ([], [])


def test_prepare_value_for_block() -> None:
    native, oracle = paired(*oracle_regions(5, 2), BLOCK_SIZE)
    for block_id in (0, 1, 77, -3):
        assert native.prepare_value_for_block(block_id) == oracle.prepare_value_for_block(block_id)


def test_chunks_may_be_triples_and_any_sequence() -> None:
    native, oracle = paired(*oracle_regions(4, 4), 16)
    triples = [(0, 16, b"h0"), (16, 32, b"h1")]
    expected = oracle.prepare_values([(0, 16), (16, 32)], [5, 6])
    assert native.prepare_values(triples, [5, 6]) == expected
    assert native.prepare_values(tuple([0, 16] for _ in range(1)), (5,)) == oracle.prepare_values([(0, 16)], [5])
    assert native.prepare_values(np.array([[0, 16], [16, 32]]), [5, 6]) == expected


def test_array_output_matches_lists() -> None:
    rng = random.Random(1)
    block_ids = [rng.randrange(1 << 20) for _ in range(300)]
    chunks = upstream_chunks(rng)
    native, oracle = paired(*oracle_regions(96, 2), BLOCK_SIZE)
    addrs, sizes, ids = native.prepare_values_array(chunks, block_ids)
    assert addrs.dtype == sizes.dtype == ids.dtype == np.int64
    assert (addrs.tolist(), sizes.tolist(), ids.tolist()) == oracle.prepare_values(chunks, block_ids)
    as_array = np.asarray(chunks, dtype=np.int64)
    again = native.prepare_values_array(as_array, np.asarray(block_ids, dtype=np.int64))
    assert all(np.array_equal(a, b) for a, b in zip(again, (addrs, sizes, ids)))
    # A uint64 chunk array (values could exceed int64) goes through the checked path, not a silent cast.
    assert native.prepare_values_array(as_array.astype(np.uint64), block_ids)[0].tolist() == addrs.tolist()


def test_inputs_never_mutated_and_results_never_change() -> None:
    bases, lens = oracle_regions(8, 2)
    native, _oracle = paired(bases, lens, 16)
    chunks = [(0, 16), (16, 48), (64, 80)]
    block_ids = [9, 8, 7, 6, 5, 4]
    inputs = copy.deepcopy((chunks, block_ids, native.kv_caches_base_addr, native.block_len))
    first = native.prepare_values(chunks, block_ids)
    snapshot = copy.deepcopy(first)
    native.prepare_values([(0, 16), (16, 32)], [1, 2])
    native.set_kv_caches_base_addr([b + 4096 for b in bases])
    native.prepare_values(chunks, block_ids)
    native.set_block_len([1, 2])
    native.prepare_values(chunks, block_ids)
    assert first == snapshot
    assert (chunks, block_ids) == inputs[:2]
    assert inputs[2] == bases and inputs[3] == lens


def test_in_place_region_changes_are_seen() -> None:
    bases, lens = oracle_regions(4, 4)
    native, oracle = paired(bases, lens, 16)
    chunks = [(0, 16), (16, 32)]
    native.prepare_values(chunks, [3, 4])  # warm the cache
    for db in (native, oracle):
        db.kv_caches_base_addr[2] += 1 << 20
        db.block_len[1] = 4096
    assert native.prepare_values(chunks, [3, 4]) == oracle.prepare_values(chunks, [3, 4])
    native.block_len.append(64)
    oracle.block_len.append(64)
    assert native.prepare_values(chunks, [3, 4]) == oracle.prepare_values(chunks, [3, 4])


def test_address_cache_is_bounded_and_configurable() -> None:
    bases, lens = oracle_regions(100, 100)
    native, oracle = paired(bases, lens, 16, address_cache_bytes=100_000)
    chunks = [(16 * i, 16 * (i + 1)) for i in range(200)]
    block_ids = list(range(1000, 1200))
    expected = oracle.prepare_values(chunks, block_ids)
    # 20 rows fit the cap (~24 rows of 100 regions): cached on their second sighting.
    for _ in range(2):
        assert native.prepare_values(chunks[:20], block_ids) == oracle.prepare_values(chunks[:20], block_ids)
    info = native.address_cache_info()
    assert info["entries"] == 20 and 0 < info["bytes"] <= 100_000
    # 200 rows do not: the cache stays within its cap.
    for _ in range(3):
        assert native.prepare_values(chunks, block_ids) == expected
    info = native.address_cache_info()
    assert info["bytes"] <= 100_000 and info["entries"] < 200
    assert native.prepare_values(chunks, block_ids) == expected
    native.address_cache_bytes = 0
    assert native.address_cache_info()["entries"] == 0
    assert native.prepare_values(chunks, block_ids) == expected
    assert native.address_cache_info()["entries"] == 0
    native.address_cache_bytes = 1 << 30
    native.prepare_values(chunks, block_ids)
    native.prepare_values(chunks, block_ids)  # a row is cached on its block id's second sighting
    warm = native.address_cache_info()
    native.prepare_values(chunks, block_ids)
    assert native.address_cache_info()["hits"] - warm["hits"] == 200
    native.clear_address_cache()
    assert native.address_cache_info()["entries"] == 0
    with pytest.raises(ValueError):
        native.address_cache_bytes = -1


def test_address_cache_exactly_at_its_capacity_holds_every_row() -> None:
    """A cap of exactly N rows' bytes holds N rows: a row is evicted only when the next one would not fit."""
    bases, lens = oracle_regions(10, 3)
    native, oracle = paired(bases, lens, 16)
    chunks = [(16 * i, 16 * (i + 1)) for i in range(6)]
    block_ids = list(range(700, 706))
    for _ in range(2):  # cached on the second sighting
        assert native.prepare_values(chunks[:1], block_ids) == oracle.prepare_values(chunks[:1], block_ids)
    row_bytes = native.address_cache_info()["bytes"]  # what one cached row of these regions costs
    assert native.address_cache_info()["entries"] == 1 and row_bytes > 0
    native.address_cache_bytes = 5 * row_bytes
    native.clear_address_cache()
    for _ in range(2):
        assert native.prepare_values(chunks[:5], block_ids) == oracle.prepare_values(chunks[:5], block_ids)
    info = native.address_cache_info()
    assert info["entries"] == 5 and info["bytes"] == 5 * row_bytes == info["capacity_bytes"]
    assert native.prepare_values(chunks, block_ids) == oracle.prepare_values(chunks, block_ids)
    assert native.prepare_values(chunks, block_ids) == oracle.prepare_values(chunks, block_ids)
    info = native.address_cache_info()
    assert info["entries"] == 5 and info["bytes"] == 5 * row_bytes  # a sixth row evicts one: still full


def test_address_cache_of_exactly_one_row_holds_it() -> None:
    """A cap of exactly one row's bytes still caches a row (admission is refused only when a row cannot fit)."""
    bases, lens = oracle_regions(10, 3)
    native, oracle = paired(bases, lens, 16)
    chunks, block_ids = [(0, 16)], [900]
    for _ in range(2):  # cached on the second sighting
        assert native.prepare_values(chunks, block_ids) == oracle.prepare_values(chunks, block_ids)
    row_bytes = native.address_cache_info()["bytes"]
    assert row_bytes > 0
    native.address_cache_bytes = row_bytes
    native.clear_address_cache()
    for _ in range(2):
        assert native.prepare_values(chunks, block_ids) == oracle.prepare_values(chunks, block_ids)
    info = native.address_cache_info()
    assert info["entries"] == 1 and info["bytes"] == row_bytes == info["capacity_bytes"]
    before = info["hits"]
    assert native.prepare_values(chunks, block_ids) == oracle.prepare_values(chunks, block_ids)
    assert native.address_cache_info()["hits"] - before == 1


def test_rows_are_cached_on_their_second_sighting() -> None:
    bases, lens = oracle_regions(8, 2)
    native, oracle = paired(bases, lens, 16)
    chunks = [(16 * i, 16 * (i + 1)) for i in range(50)]
    block_ids = list(range(5000, 5050))
    expected = oracle.prepare_values(chunks, block_ids)
    assert native.prepare_values(chunks, block_ids) == expected
    assert native.address_cache_info()["entries"] == 0  # first sighting: nothing cached, nothing evicted
    assert native.prepare_values(chunks, block_ids) == expected
    assert native.address_cache_info()["entries"] == 50
    before = native.address_cache_info()["hits"]
    assert native.prepare_values(chunks, block_ids) == expected
    assert native.address_cache_info()["hits"] - before == 50
    # A stream of never-seen block ids never fills the cache (a colliding sighting may cache a few early).
    for rep in range(20):
        fresh = list(range(10_000 + 50 * rep, 10_050 + 50 * rep))
        assert native.prepare_values(chunks, fresh) == oracle.prepare_values(chunks, fresh)
    assert native.address_cache_info()["entries"] < 50 + 100
    # Region changes drop the cache and the sightings: the next call sees every block id for the first time.
    native.block_len[0] += 64
    oracle.block_len[0] += 64
    assert native.prepare_values(chunks, block_ids) == oracle.prepare_values(chunks, block_ids)
    assert native.address_cache_info()["entries"] == 0


@pytest.mark.parametrize("warm", [False, True])
def test_immutable_rows_are_tuples_of_the_same_values(warm: bool) -> None:
    bases, lens = oracle_regions(12, 3)
    native, oracle = paired(bases, lens, BLOCK_SIZE)
    native.immutable_rows = True
    assert native.immutable_rows
    rng = random.Random(1)
    block_ids = [rng.randrange(1 << 20) for _ in range(300)]
    chunks = upstream_chunks(rng)
    if warm:
        native.prepare_values(chunks, block_ids)
        native.prepare_values(chunks, block_ids)
    addrs, sizes, ids = native.prepare_values(chunks, block_ids)
    want_addrs, want_sizes, want_ids = oracle.prepare_values(chunks, block_ids)
    assert type(addrs) is list and type(sizes) is list and type(ids) is list
    assert all(type(row) is tuple for row in addrs + sizes)
    assert [list(row) for row in addrs] == want_addrs
    assert [list(row) for row in sizes] == want_sizes
    assert ids == want_ids
    assert_native_ints(([list(row) for row in addrs], [list(row) for row in sizes], ids))
    # prepare_value and plan_load follow the switch; lists again once it is off.
    addr, size, block_id = native.prepare_value(*chunks[0], block_ids)
    assert type(addr) is tuple and list(addr) == want_addrs[0] and block_id == want_ids[0]
    assert type(size) is tuple and list(size) == want_sizes[0]
    hashes = [bytes([i + 1]) * 8 for i in range(8)]
    plan = native.plan_load(8 * BLOCK_SIZE, hashes, block_ids)
    want = oracle.prepare_values([(BLOCK_SIZE * i, BLOCK_SIZE * (i + 1)) for i in range(8)], block_ids)
    assert len(plan.addrs) == 8
    assert all(type(row) is tuple for row in plan.addrs + plan.sizes)
    assert [list(r) for r in plan.addrs] == want[0] and [list(r) for r in plan.sizes] == want[1]
    native.immutable_rows = False
    addrs, sizes, ids = native.prepare_values(chunks, block_ids)
    assert all(type(row) is list for row in addrs + sizes)
    assert (addrs, sizes, ids) == (want_addrs, want_sizes, want_ids)


def test_immutable_rows_follow_region_changes() -> None:
    bases, lens = oracle_regions(4, 4)
    native, oracle = paired(bases, lens, 16)
    native.immutable_rows = True
    chunks = [(0, 16), (16, 32)]
    for _ in range(3):
        first = native.prepare_values(chunks, [7, 8])
    native.kv_caches_base_addr[1] += 1 << 30
    oracle.kv_caches_base_addr[1] += 1 << 30
    second = native.prepare_values(chunks, [7, 8])
    want = oracle.prepare_values(chunks, [7, 8])
    assert [list(r) for r in second[0]] == want[0]
    assert [list(r) for r in first[0]] != want[0]  # the earlier result kept its values


def test_constructor_validation() -> None:
    md = KeyMetadata("t", 0, 0, 0, 0)
    # The façade's own check, named in its words (not a later layer's): block_size and hash_block_size.
    for block_size, hash_block_size in ((32, 12), (48, 32), (0, None), (-32, 16), (32, -16)):
        with pytest.raises(ValueError, match=rf"block_size \({block_size}\) must be a positive multiple of "
                                             rf"hash_block_size \({hash_block_size or block_size}\)"):
            ChunkedTokenDatabase(md, block_size, hash_block_size)
    with pytest.raises(ValueError):
        ChunkedTokenDatabase(md, 32, address_cache_bytes=-1)
    # 0 is the documented "cache off", accepted by the constructor as by the setter.
    off = ChunkedTokenDatabase(md, 32, address_cache_bytes=0)
    off.set_kv_caches_base_addr([1 << 30])
    off.set_block_len([64])
    for _ in range(2):
        assert off.prepare_values([(0, 32)], [3]) == ([[(1 << 30) + 3 * 64]], [[64]], [3])
    assert off.address_cache_bytes == 0 and off.address_cache_info()["entries"] == 0
    db = ChunkedTokenDatabase(md, 32, 0)
    assert db.hash_block_size == 32
    assert ChunkedTokenDatabase(md, 32, None).hash_block_size == 32
    # The native engine checks on its own (it is reachable without the façade): the same pairs, in its words.
    from mooncake_kvaddr import _native

    for block_size, hash_block_size in ((32, 12), (48, 32), (0, 16), (-32, 16), (32, -16), (32, 0)):
        with pytest.raises(ValueError, match="block_size"):
            _native.LayoutEngine(block_size, hash_block_size, False, 0, 1, 0, seed_rules=True)
    _native.LayoutEngine(32, 16, False, 0, 1, 0, seed_rules=True)


@pytest.mark.parametrize("immutable", [False, True])
def test_sizes_follow_new_block_lens_once_the_size_rows_were_cached(immutable: bool) -> None:
    """A size row is cached per block count; a new block_len must replace it, on every later call (the second
    call after the change is the one that reads the cache)."""
    bases, lens = oracle_regions(3, 3)
    native, oracle = paired(bases, lens, 16)
    native.immutable_rows = immutable
    chunks = [(0, 16), (16, 48), (48, 64)]
    for _ in range(3):
        native.prepare_values(chunks, [1, 2, 3, 4])
    for new in ([4096, 8192, 64], [512]):
        native.set_block_len(list(new))
        oracle.set_block_len(list(new))
        want = oracle.prepare_values(chunks, [1, 2, 3, 4])
        for _ in range(3):
            got = native.prepare_values(chunks, [1, 2, 3, 4])
            assert [list(r) for r in got[0]] == want[0] and [list(r) for r in got[1]] == want[1]
            a, s, _ = native.prepare_values_array(chunks, [1, 2, 3, 4])
            assert a.tolist() == want[0] and s.tolist() == want[1]


def test_walk_load_keeps_chunks_by_absolute_index_like_plan_load() -> None:
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
    db.set_kv_caches_base_addr([1 << 20])
    db.set_block_len([256])
    hashes = [bytes([i]) * 8 for i in range(6)]
    mask = [True, True, False, True, False, True]  # by absolute chunk id
    walk = db.walk_load(96, hashes, 32, mask)
    plan = db.plan_load(96, hashes, list(range(1, 7)), 32, mask)
    assert walk.keys == plan.keys == [db.key_for(hashes[3]), db.key_for(hashes[5])]
    assert walk.chunks.tolist() == [[48, 64], [80, 96]]
