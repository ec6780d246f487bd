"""Regression tests of a second adversarial audit of the native entry points (issue 9, SECURITY.md).

Each test is a case the earlier hardening tests (test_native_hostile_inputs.py,
test_layouts_and_transfer_screen_hostile.py, test_fuzz_native.py) missed: instances made by ``__new__`` without
``__init__``, int arguments that went through pybind11's own int casters (floats truncated, ``__index__``
exceptions replaced), ndarray subclasses read as raw memory, lookup prefixes given as a set, and a few loose
types on the Python side of the vLLM mirror. Tests that compare with vLLM 0.33 itself carry the ``vllm`` marker.
"""

from __future__ import annotations

import os
from decimal import Decimal
from typing import Any

import numpy as np
import pytest

from mooncake_kvaddr import BlobBlockHashes, ChunkedTokenDatabase, KeyMetadata, _native
from mooncake_kvaddr.core.keys import build_lookup_keys, reduce_exists
from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase
from mooncake_kvaddr.integrations.vllm import data as M

MD = KeyMetadata("m", 0, 0, 0, 0)
BASES = [1000, 2000]
LENS = [10, 10]
HASHES = [bytes([i]) * 4 for i in range(4)]


class Boom(Exception):
    """A user exception: must come out of every call unchanged."""


class RaisingIndex:
    def __index__(self) -> int:
        raise Boom("from __index__")


def seed_pair() -> tuple[ChunkedTokenDatabase, OracleChunkedTokenDatabase]:
    native = ChunkedTokenDatabase(MD, 16, 16)
    oracle = OracleChunkedTokenDatabase(MD, 16, 16)
    for db in (native, oracle):
        db.set_kv_caches_base_addr(list(BASES))
        db.set_block_len(list(LENS))
    return native, oracle


def rank_local() -> M.RankLocalStoreLayout:
    layout = M.RankLocalStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    layout.set_kv_caches_base_addr(list(BASES))
    layout.set_block_len(list(LENS))
    return layout


def vllm_data() -> Any:
    if os.environ.get("KVADDR_SANITIZE"):
        pytest.skip("vLLM (torch) is not imported under the sanitizer preload")
    data = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data")
    return data


# --- instances made by __new__ without __init__ ----------------------------------------------------------------

ENGINE_CALLS: dict[str, Any] = {
    "prepare_values": lambda o: o.prepare_values([(0, 16)], [1], [0]),
    "prepare_values_array": lambda o: o.prepare_values_array([(0, 16)], [1], [0]),
    "prepare_value_for_block": lambda o: o.prepare_value_for_block(1),
    "plan_load": lambda o: o.plan_load(["p"], HASHES, None, 64, 0, None, None, [1, 2, 3, 4]),
    "plan_load slots": lambda o: o.plan_load(["p"], HASHES, None, 64, 0, None, None, [1, 2, 3, 4], True, 64),
    "plan_store": lambda o: o.plan_store(["p"], HASHES, None, 64, 0, None, 1, 0, [1, 2, 3, 4], True),
    "set_region_sources": lambda o: o.set_region_sources([1000], [10]),
    "set_templates": lambda o: o.set_templates([]),
    "cache_info": lambda o: o.cache_info(),
    "clear_cache": lambda o: o.clear_cache(),
    "pin_regions": lambda o: o.pin_regions([1000], [10]),
    "unpin_regions": lambda o: o.unpin_regions(),
    "cache_capacity": lambda o: o.cache_capacity,
    "set cache_capacity": lambda o: setattr(o, "cache_capacity", 0),
    "immutable_rows": lambda o: o.immutable_rows,
    "set immutable_rows": lambda o: setattr(o, "immutable_rows", True),
    "region_pins": lambda o: o.region_pins,
    "segment_count": lambda o: o.segment_count,
}
CLIENT_CALLS: dict[str, Any] = {
    "batch_get_into_multi_buffers": lambda o: o.batch_get_into_multi_buffers(["k"], [[4096]], [[8]]),
    "batch_put_from_multi_buffers": lambda o: o.batch_put_from_multi_buffers(["k"], [[4096]], [[8]]),
    "batch_get_into": lambda o: o.batch_get_into(["k"], [4096], [8]),
    "batch_put_from": lambda o: o.batch_put_from(["k"], [4096], [8]),
    "batch_is_exist": lambda o: o.batch_is_exist(["k"]),
    "same_client": lambda o: o.same_client(None),
    "close": lambda o: o.close(),
    "closed": lambda o: o.closed,  # returned False before
    "library": lambda o: o.library,  # MemoryError before
    "slots": lambda o: o.slots,  # SIGSEGV before
    "abi_id": lambda o: o.abi_id,
}


@pytest.mark.parametrize(
    ("cls", "call"),
    [(_native.LayoutEngine, c) for c in ENGINE_CALLS.values()]
    + [(_native.MooncakeClient, c) for c in CLIENT_CALLS.values()],
    ids=[f"LayoutEngine.{n}" for n in ENGINE_CALLS]
    + [f"MooncakeClient.{n}" for n in CLIENT_CALLS],
)
def test_an_instance_made_by_new_without_init_refuses_every_method(cls: Any, call: Any) -> None:
    # pybind11 lazily allocates raw memory for an instance whose __init__ never ran and handed it to the method
    # as the C++ object: garbage reads (cache_info returned random numbers), then SIGSEGV.
    for make in (lambda: cls.__new__(cls), lambda: cls.__mro__[1].__new__(cls)):  # the class's, pybind11_object's
        obj = make()
        with pytest.raises(TypeError, match="not initialised"):
            call(obj)
        del obj


def test_methods_refuse_a_self_of_another_class() -> None:
    client = _native.MooncakeClient.__new__(_native.MooncakeClient)
    with pytest.raises(TypeError):
        _native.LayoutEngine.prepare_values(client, [(0, 16)], [1], [0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.LayoutEngine.cache_info(object())  # type: ignore[arg-type]


def test_the_seed_rules_are_rank_local_and_keep_to_their_own_calls() -> None:
    # One engine, two sets of rules: a call of one set on an engine of the other is refused, never mixed.
    with pytest.raises(ValueError, match="rank-local"):
        _native.LayoutEngine(16, 16, True, 0, 1, 0, seed_rules=True)
    with pytest.raises(ValueError, match="TP-shared"):
        _native.LayoutEngine(16, 16, False, 0, 1, 0, 8, seed_rules=True)
    with pytest.raises(ValueError, match="rank-local"):
        _native.LayoutEngine(16, 16, False, 0, 2, 0, seed_rules=True)
    seed = _native.LayoutEngine(16, 16, False, 0, 1, 0, seed_rules=True)
    seed.set_region_sources([1000], [10])
    with pytest.raises(TypeError, match="no shards"):
        seed.prepare_values([(0, 16)], [3], [0])
    with pytest.raises(TypeError, match="no shards"):
        seed.prepare_values_array([(0, 16)], [3], [0])
    layout = _native.LayoutEngine(16, 16, False, 0, 1, 0)
    layout.set_region_sources([1000], [10])
    with pytest.raises(TypeError, match="shard_prefixes"):
        layout.plan_store("p", HASHES, None, 64, 0, None, 1, 0, [1, 2, 3, 4], True)
    store_chunks = _native.LayoutEngine(16, 16, True, 0, 1, 0, 8)
    with pytest.raises(RuntimeError, match="store chunks"):
        store_chunks.plan_store(["p"], HASHES, None, 64, 0, None, 1, 0, [1, 2, 3, 4], True)
    # The send walk: floor start (seed) vs ceiling (vLLM), pairs vs (start, end, shard) entries, one per shard.
    assert seed.plan_store(["p"], HASHES, None, 64, 8, None, 1, 0, [1, 0, 3, 4], True)[1:] == (
        [(0, 16), (32, 48), (48, 64)], [1, 3, 4]
    )
    assert layout.plan_store(["p"], HASHES, None, 64, 8, None, 1, 0, [1, 0, 3, 4], False)[1:] == (
        [(16, 32, 0), (32, 48, 0), (48, 64, 0)], [0, 3, 4]
    )
    shared = _native.LayoutEngine(16, 16, True, 2, 2, 0)
    keys, chunks, ids = shared.plan_store(["a", "b"], HASHES, None, 64, 16, None, 1, 0, [5, 6, 0], True)
    assert keys == ["a@" + HASHES[1].hex(), "b@" + HASHES[1].hex()] and ids == [6, 6]
    assert chunks == [(16, 32, 2), (16, 32, 3)]  # block 2 is NULL, block 3 past the ids
    with pytest.raises(TypeError):  # vLLM's rules need the shard ids
        layout.prepare_values([(0, 16)], [3])
    # The seed walk starts at floor(mask_num / block_size), vLLM's at the ceiling: mask_num 8 keeps chunk 0 in one.
    assert seed.plan_load(["p"], HASHES, None, 64, 8, None, None, [1, 2, 3, 4])[3] == [1, 2, 3, 4]
    assert layout.plan_load(["p"], HASHES, None, 64, 8, None, None, [1, 2, 3, 4])[3] == [2, 3, 4]


def test_each_rule_set_reads_its_own_hash_forms_in_every_plan() -> None:
    # The seed-era rules read any buffer (the driver's hashes); vLLM's only what its key_for hexes alike (bytes,
    # memoryview): a numpy-array hash is refused by a layout's walk, store and load plans, never keyed by its bytes.
    arrays = [np.frombuffer(h, dtype=np.uint8) for h in HASHES]
    seed = _native.LayoutEngine(16, 16, False, 0, 1, 0, seed_rules=True)
    layout = _native.LayoutEngine(16, 16, False, 0, 1, 0)
    for engine in (seed, layout):
        engine.set_region_sources([1000], [10])
    expected = ["p@" + h.hex() for h in HASHES]
    assert seed.plan_store(["p"], arrays, None, 64, 0, None, 1, 0, [1, 2, 3, 4], True)[0] == expected
    assert seed.plan_load(["p"], arrays, None, 64, 0, None, None, [1, 2, 3, 4])[0] == expected
    with pytest.raises(TypeError):
        layout.plan_store(["p"], arrays, None, 64, 0, None, 1, 0, [1, 2, 3, 4], True)
    with pytest.raises(TypeError):
        layout.plan_load(["p"], arrays, None, 64, 0, None, None, [1, 2, 3, 4])
    with pytest.raises(TypeError):
        layout.walk_load(["p"], arrays, None, 64, 0, None, None)
    assert layout.plan_store(["p"], HASHES, None, 64, 0, None, 1, 0, [1, 2, 3, 4], True)[0] == expected
    assert layout.walk_load(["p"], HASHES, None, 64, 0, None, None)[0] == expected


@pytest.mark.parametrize("seed_rules", [True, False])
def test_plan_load_slots_are_the_staging_layout_of_its_sizes(seed_rules: bool) -> None:
    engine = _native.LayoutEngine(16, 4, False, 0, 1, 0, seed_rules=seed_rules)  # a partial last chunk
    engine.set_region_sources([1 << 20, 2 << 20, 3 << 20], [100, 36, 8])
    hashes = [bytes([i]) * 4 for i in range(15)]
    keys, addrs, sizes, ids, offsets, object_sizes, total = engine.plan_load(
        ["p"], hashes, None, 60, 0, None, None, [7, 8, 9, 10], False, 128
    )
    plain = engine.plan_load(["p"], hashes, None, 60, 0, None, None, [7, 8, 9, 10], True)
    assert keys == plain[0] == [f"p@{h.hex()}" for h in (hashes[3], hashes[7], hashes[11], hashes[14])]
    assert ids.tolist() == plain[3].tolist() == [7, 8, 9, 10]
    assert np.array_equal(addrs, plain[1]) and np.array_equal(sizes, plain[2])
    expected = _native.staging_plan_slots(sizes, 128)
    assert offsets.tolist() == expected[0].tolist() and object_sizes.tolist() == expected[1].tolist()
    assert total == expected[2] and object_sizes.tolist() == [144] * 4
    for bad in (0, 3, -64):
        with pytest.raises(ValueError, match="power of two"):
            engine.plan_load(["p"], hashes, None, 60, 0, None, None, [7, 8, 9, 10], True, bad)
    nothing = engine.plan_load(["p"], hashes, None, 0, 0, None, None, [], False, 64)
    assert nothing[0] == [] and len(nothing) == 7 and nothing[6] == 0


def test_a_second_init_changes_nothing() -> None:
    table = _native.LayoutEngine(16, 16, False, 0, 1, 1 << 20, seed_rules=True)
    table.set_region_sources([1000], [10])
    table.__init__(32, 16, False, 0, 1, 0)  # type: ignore[misc]
    # Still block_size 16 (block index 1, not 0) and still the seed's rules (no shard ids).
    assert table.prepare_values([(16, 32)], [3, 4]) == ([[1040]], [[10]], [4])


# --- int arguments: strict conversion, user exceptions unchanged --------------------------------------------


def int_entry_points() -> dict[str, Any]:
    """Entry points taking one int argument `v` (every other argument valid)."""
    db, _ = seed_pair()
    layout = rank_local()
    vdb = M.ChunkedTokenDatabase(M.KeyMetadata("m", 0, 0, 0, 0), 16, 16, layout)
    return {
        "plan_load token_len": lambda v: db.plan_load(v, HASHES, [1, 2, 3, 4]),
        "plan_load mask_num": lambda v: db.plan_load(64, HASHES, [1, 2, 3, 4], mask_num=v),
        "plan_load_arrays token_len": lambda v: db.plan_load_arrays(v, HASHES, [1, 2, 3, 4]),
        "plan_load_arrays slot_alignment": lambda v: db.plan_load_arrays(64, HASHES, [1, 2, 3, 4], slot_alignment=v),
        "plan_store token_len": lambda v: db.plan_store(v, HASHES, [1, 2, 3, 4]),
        "plan_store mask_num": lambda v: db.plan_store(64, HASHES, [1, 2, 3, 4], mask_num=v),
        "plan_store put_step": lambda v: db.plan_store(64, HASHES, [1, 2, 3, 4], put_step=v),
        "plan_store put_step_rank": lambda v: db.plan_store(64, HASHES, [1, 2, 3, 4], put_step_rank=v),
        "process_tokens token_len": lambda v: list(db.process_tokens(v, HASHES)),
        "process_tokens mask_num": lambda v: list(db.process_tokens(64, HASHES, v)),
        "process_tokens put_step": lambda v: list(db.process_tokens(64, HASHES, put_step=v)),
        "walk_load token_len": lambda v: db.walk_load(v, HASHES),
        "ChunkedTokenDatabase block_size": lambda v: ChunkedTokenDatabase(MD, v, 16),
        "address_cache_bytes": lambda v: setattr(db, "address_cache_bytes", v),
        "vllm process_tokens token_len": lambda v: list(vdb.process_tokens(v, HASHES)),
        "vllm process_tokens put_step_rank": lambda v: list(vdb.process_tokens(64, HASHES, put_step_rank=v)),
        "layout plan_load token_len": lambda v: layout.plan_load(v, HASHES, 0, None, [1, 2, 3, 4]),
        "layout plan_load mask_num": lambda v: layout.plan_load(64, HASHES, v, None, [1, 2, 3, 4]),
        "layout row_cache_bytes": lambda v: setattr(layout, "row_cache_bytes", v),
        "LayoutEngine block_size": lambda v: _native.LayoutEngine(v, 16, False, 0, 1, 0),
        "LayoutEngine n_shards": lambda v: _native.LayoutEngine(16, 16, True, 0, v, 0),
        "seed LayoutEngine cache_bytes": lambda v: _native.LayoutEngine(16, 16, False, 0, 1, v, seed_rules=True),
        "staging_plan_slots alignment": lambda v: _native.staging_plan_slots(np.full((2, 3), 64, np.int64), v),
        "staging gather staging_ptr": lambda v: _native._staging_gather(*EMPTY_JOB[:2], v, 0, *EMPTY_JOB[2:]),
        "staging scatter staging_len": lambda v: _native._staging_scatter(*EMPTY_JOB[:2], 0, v, *EMPTY_JOB[2:]),
        "staging gather threads": lambda v: _native._staging_gather(*EMPTY_JOB[:2], 0, 0, *EMPTY_JOB[2:], threads=v),
    }


# A staging job with no keys (every argument but the one under test valid): addrs, sizes, offsets, ranges.
EMPTY_JOB: tuple[Any, ...] = (np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int64), np.zeros(0, np.int64), [])


ENTRY_NAMES = list(int_entry_points())


@pytest.mark.parametrize("name", ENTRY_NAMES)
@pytest.mark.parametrize("value", [np.float32(32.5), Decimal("48.9"), 32.0], ids=["float32", "Decimal", "float"])
def test_non_integer_ints_raise_type_error_instead_of_being_truncated(name: str, value: Any) -> None:
    # pybind11's int caster converted anything with __int__ (np.float32(32.5) → 32, Decimal("48.9") → 48):
    # plan_load(np.float32(32.5), ...) planned 32 tokens where the reference raises.
    with pytest.raises(TypeError):
        int_entry_points()[name](value)


@pytest.mark.parametrize("name", ENTRY_NAMES)
def test_an_index_exception_comes_out_unchanged(name: str) -> None:
    # pybind11 swallowed it and raised "incompatible function arguments" (TypeError) instead.
    with pytest.raises(Boom):
        int_entry_points()[name](RaisingIndex())


@pytest.mark.parametrize("name", [n for n in ENTRY_NAMES if "vllm" not in n and "layout plan_load mask" not in n])
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**64])
def test_ints_outside_int64_raise_overflow_error(name: str, value: int) -> None:
    expected: tuple[type[Exception], ...] = (OverflowError,)
    if value < 0 and any(word in name for word in ("cache", "n_shards", "alignment", "Database block_size")):
        expected = (OverflowError, ValueError)  # a size may be refused for its sign before its range
    with pytest.raises(expected):
        int_entry_points()[name](value)


@pytest.mark.parametrize("value", [-1, -(2**63)])
def test_negative_sizes_raise_value_error(value: int) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        _native.LayoutEngine(16, 16, False, 0, 1, value, seed_rules=True)
    with pytest.raises(ValueError, match=">= 0"):
        _native.LayoutEngine(16, 16, False, 0, 1, value)
    table = _native.LayoutEngine(16, 16, False, 0, 1, 0, seed_rules=True)
    with pytest.raises(ValueError, match=">= 0"):
        table.cache_capacity = value
    with pytest.raises(ValueError, match=">= 0"):
        _native.set_gil_release_min_work_ns(value)


def test_integer_like_ints_still_work() -> None:
    db, oracle = seed_pair()
    expected = db.plan_load(64, HASHES, [1, 2, 3, 4], mask_num=16)
    assert db.plan_load(np.int64(64), HASHES, [1, 2, 3, 4], mask_num=np.uint8(16)) == expected
    assert db.plan_load(True * 64, HASHES, [1, 2, 3, 4], mask_num=16) == expected
    assert list(db.process_tokens(np.int32(64), HASHES)) == list(oracle.process_tokens(64, HASHES))


# --- ndarray subclasses are read through their own methods ------------------------------------------------


class Remapped(np.ndarray):  # type: ignore[type-arg]
    """An ndarray whose items, read the reference's way (block_ids[i]), are not its raw memory."""

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        return item + 100 if isinstance(index, (int, np.integer)) else item


class Plain(np.ndarray):  # type: ignore[type-arg]
    """An ndarray subclass that changes nothing."""


class ByteSwappedAstype(np.ndarray):  # type: ignore[type-arg]
    """A byte-swapped ndarray whose astype returns something that is not an array."""

    def astype(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return [1, 2, 3]


def test_ndarray_subclass_block_ids_read_like_the_oracle() -> None:
    # The raw int64 memory was read: block id 5 where the oracle's block_ids[0] is 105.
    db, oracle = seed_pair()
    ids = np.array([5, 6, 7]).view(Remapped)
    chunks = [(0, 16), (32, 48)]
    assert db.prepare_values(chunks, ids) == oracle.prepare_values(chunks, ids)
    arrays = db.prepare_values_array(chunks, ids)
    assert arrays[2].tolist() == [105, 107]
    assert db.plan_load(48, HASHES, ids).block_ids == [105, 106, 107]
    assert db.plan_store(48, HASHES, ids).block_ids == [105, 106, 107]


def test_byte_swapped_subclass_never_converts_through_its_own_astype() -> None:
    # The subclass's astype result (a list) was then read as an ndarray struct: "got 1342737840 dimensions".
    db, oracle = seed_pair()
    ids = np.array([5, 6, 7], dtype=">i8" if np.little_endian else "<i8").view(ByteSwappedAstype)
    chunks = [(0, 16), (16, 32)]
    assert db.prepare_values(chunks, ids) == oracle.prepare_values(chunks, ids)
    assert db.prepare_values_array(chunks, ids)[2].tolist() == [5, 6]


def test_ndarray_subclass_chunks_array_read_like_a_sequence() -> None:
    class Rows(np.ndarray):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter([np.array([32, 48]), np.array([0, 16])])

    db, oracle = seed_pair()
    chunks = np.array([[0, 16], [32, 48]]).view(Rows)
    addrs, _sizes, ids = db.prepare_values_array(chunks, [1, 2, 3])
    assert ids.tolist() == [3, 1]  # what iterating the chunks gives, as the reference iterates them
    assert addrs.tolist() == oracle.prepare_values(list(chunks), [1, 2, 3])[0]


def test_layout_ndarray_subclass_block_and_shard_ids() -> None:
    layout = rank_local()
    ids = np.array([5, 6, 7]).view(Remapped)
    assert layout.prepare_values([(0, 16), (32, 48)], ids, [0, 0])[2] == [105, 107]
    assert layout.prepare_values_array([(0, 16)], ids, np.array([0]).view(Plain))[2].tolist() == [105]
    with pytest.raises(AssertionError):  # shard ids are read by iterating them, as vLLM does: 0 + 100 here
        layout.prepare_values([(0, 16)], ids, np.array([0]).view(Remapped))
    assert layout.plan_load(48, HASHES, 0, None, ids)[3] == [105, 106, 107]
    with pytest.raises(TypeError):
        layout.prepare_values(np.array([[0, 16]]).view(Remapped), [1], [0])


@pytest.mark.vllm
def test_layout_ndarray_subclass_block_ids_match_vllm() -> None:
    v = vllm_data()
    ours = rank_local()
    theirs = v.RankLocalStoreLayout(v.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    theirs.set_kv_caches_base_addr(list(BASES))
    theirs.set_block_len(list(LENS))
    ids = np.array([5, 6, 7]).view(Remapped)
    chunks = [(0, 16), (32, 48)]
    assert ours.prepare_values(chunks, ids, [0, 0]) == theirs.prepare_values(chunks, ids, [0, 0])


# --- lookup prefixes, exist results ------------------------------------------------------------------------


@pytest.mark.parametrize("prefixes", [{"a", "b", "c"}, frozenset({"a"}), {"a": 1}, b"ab", bytearray(b"a")])
def test_lookup_prefixes_refuse_sets_dicts_and_bytes(prefixes: Any) -> None:
    # A set was read in its arbitrary order and a dict by its keys: keys in an order the caller never gave.
    with pytest.raises(TypeError):
        build_lookup_keys(prefixes, HASHES)
    with pytest.raises(TypeError):
        _native.build_lookup_keys(prefixes, b"".join(HASHES), 4)


def test_lookup_prefixes_accept_sequences() -> None:
    expected = build_lookup_keys(["a", "b"], HASHES)
    assert build_lookup_keys(("a", "b"), HASHES) == expected
    assert build_lookup_keys(iter(["a", "b"]), HASHES) == expected


def test_layout_plan_load_refuses_a_set_of_shard_prefixes() -> None:
    engine = _native.LayoutEngine(16, 16, False, 0, 1, 0)
    engine.set_region_sources(list(BASES), list(LENS))
    with pytest.raises(TypeError):
        engine.plan_load({"p"}, HASHES, None, 64, 0, None, None, [1, 2, 3, 4])
    assert engine.plan_load(["p"], HASHES, None, 16, 0, None, None, [1])[0] == ["p@00000000"]


@pytest.mark.parametrize("big", [np.uint64(2**64 - 1), np.uint64(2**63)])
def test_reduce_exists_reads_index_results_outside_int64_as_absent(big: Any) -> None:
    # An int 2**64 - 1 read as absent; the same value as a numpy integer raised OverflowError.
    assert reduce_exists([int(big), 1], 1) == [False, True]
    assert reduce_exists([big, np.int64(1)], 1) == [False, True]
    assert reduce_exists([big, 1], [2]) == [False]
    with pytest.raises(TypeError):
        reduce_exists([1.0, 1], 1)
    with pytest.raises(Boom):
        reduce_exists([RaisingIndex()], 1)


# --- the vLLM mirror's Python side -----------------------------------------------------------------------


class FakeStorage:
    def __init__(self, ptr: Any, nbytes: Any) -> None:
        self._ptr, self._nbytes = ptr, nbytes

    def data_ptr(self) -> Any:
        return self._ptr

    def nbytes(self) -> Any:
        return self._nbytes


class FakeTensor:
    """Duck-typed KV cache: (num_blocks, width) of 2-byte elements at `ptr`."""

    def __init__(self, ptr: Any = 4096, element_size: Any = 2, stride0: Any = 8, nbytes: Any = 64) -> None:
        self.shape = (4, 8)
        self._ptr, self._element_size, self._stride0, self._nbytes = ptr, element_size, stride0, nbytes

    def stride(self) -> tuple[Any, ...]:
        return (self._stride0, 1)

    def element_size(self) -> Any:
        return self._element_size

    def data_ptr(self) -> Any:
        return self._ptr

    def untyped_storage(self) -> FakeStorage:
        return FakeStorage(self._ptr, self._nbytes)


@pytest.mark.parametrize("field", ["ptr", "element_size", "stride0", "nbytes"])
@pytest.mark.parametrize("bad", [4096.7, "4096", Decimal(4096)], ids=["float", "str", "Decimal"])
def test_register_kv_caches_refuses_non_integer_geometry(field: str, bad: Any) -> None:
    # int() truncated a float data_ptr (4096.7 → 4096) and parsed a string one into a region address.
    layout = M.RankLocalStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    layout.register_kv_caches([FakeTensor()], 4)
    assert (layout.kv_caches_base_addr, layout.block_len) == ([4096], [16])
    with pytest.raises(TypeError):
        layout.register_kv_caches([FakeTensor(**{field: bad})], 4)


def test_blob_view_with_an_int_subclass_hash_len_counts_its_blob() -> None:
    # The subclass's __rmod__/__rfloordiv__ decided the view's length: 1000 "hashes", all but 4 empty.
    class Lying(int):
        def __rmod__(self, other: Any) -> int:
            return 0

        def __rfloordiv__(self, other: Any) -> int:
            return 1000

    view = BlobBlockHashes(bytes(range(32)), Lying(8))
    assert len(view) == 4 and type(view.hash_len) is int
    assert all(len(h) == 8 for h in view)

    class LyingIndex(int):
        def __add__(self, other: Any) -> int:
            return 0

        def __lt__(self, other: Any) -> bool:
            return False

    assert bytes(view[LyingIndex(-1)]) == bytes(range(24, 32))


def test_layout_walk_with_a_mask_past_int64_is_empty() -> None:
    # vLLM's walk starting at ceil(mask_num / block_size) past every chunk is empty; the block-aligned mask
    # overflowed int64 (TypeError from the walk, OverflowError from the fused plan).
    layout = rank_local()
    db = M.ChunkedTokenDatabase(M.KeyMetadata("m", 0, 0, 0, 0), 16, 16, layout)
    for mask in (2**63 - 1, 2**63 - 2, 2**70):
        assert list(db.process_tokens(32, HASHES[:2], mask)) == []
    for mask in (2**63 - 1, 2**63 - 16):
        assert layout.plan_load(32, HASHES[:2], mask, None, [1, 2]) == ([], [], [], [])
    with pytest.raises(AssertionError):  # the asserts still run first
        list(db.process_tokens(33, HASHES[:2], 2**70))


@pytest.mark.vllm
@pytest.mark.parametrize("mask", [2**63 - 1, 2**63 - 16, 2**63 + 5, 2**70])
def test_layout_walk_with_a_mask_past_int64_matches_vllm(mask: int) -> None:
    v = vllm_data()
    ours = M.ChunkedTokenDatabase(M.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    theirs = v.ChunkedTokenDatabase(v.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    assert list(ours.process_tokens(32, HASHES[:2], mask)) == list(theirs.process_tokens(32, HASHES[:2], mask))


def test_layout_chunks_whose_len_lies_raise_value_error() -> None:
    class Short(list):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 1

    layout = rank_local()
    with pytest.raises(ValueError, match="__len__"):
        layout.prepare_values(Short([(0, 16), (16, 32)]), [1, 2], [0])


# --- strided hash buffers, flag arguments ------------------------------------------------------------------


def strided_hashes() -> list[Any]:
    grid = np.arange(16, dtype=np.uint8).reshape(4, 4)
    return [memoryview(b"abcdefgh")[::2], memoryview(grid[:, 1]), np.arange(8, dtype=np.uint8)[::2]]


@pytest.mark.parametrize("index", range(3))
def test_strided_hash_buffers_key_like_their_bytes(index: int) -> None:
    # A memoryview slice with a step raised BufferError; the reference keys it by its hex(), i.e. its bytes.
    db, oracle = seed_pair()
    h = strided_hashes()[index]
    expected = db.key_prefix + "@" + bytes(h).hex()
    if isinstance(h, memoryview):
        assert oracle.key_for(h) == expected
    assert db.key_for(h) == expected
    assert db.keys_for([h, h]) == [expected, expected]
    assert db.keys_for([h], hash_len=len(bytes(h))) == [expected]
    assert build_lookup_keys(["a"], [h]) == ["a@" + bytes(h).hex()]
    blob = memoryview(bytes(range(16)))[::2]
    assert db.keys_for(blob, hash_len=4) == [db.key_prefix + "@" + bytes(blob)[i : i + 4].hex() for i in (0, 4)]
    assert db.plan_load(32, [h, h], [1, 2]).keys == [expected, expected]


class RaisingBool:
    def __bool__(self) -> bool:
        raise Boom("from __bool__")


def test_flag_arguments_propagate_their_own_exceptions() -> None:
    # pybind11's bool caster replaced the exception with "incompatible function arguments".
    db, _ = seed_pair()
    with pytest.raises(Boom):
        db.plan_store(64, HASHES, [1, 2, 3, 4], skip_null_block=RaisingBool())
    assert db.plan_store(64, HASHES, [0, 2, 3, 4], skip_null_block=[]).block_ids == [0, 2, 3, 4]
    assert db.plan_store(64, HASHES, [0, 2, 3, 4], skip_null_block=[1]).block_ids == [2, 3, 4]
    layout = rank_local()
    with pytest.raises(Boom):
        layout.plan_load(64, HASHES, 0, None, [1, 2, 3, 4], arrays=RaisingBool())  # type: ignore[arg-type]


def claims_2_62_bytes() -> Any:
    """A C-contiguous uint8 view claiming 2**62 bytes over one real byte (never repr it: that reads them)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=(2**62,), strides=(1,))


def test_a_hash_claiming_2_62_bytes_is_refused_before_its_key_size_overflows() -> None:
    # prefix_len + 1 + 2 * length overflowed Py_ssize_t (UB; a SystemError from PyUnicode_New in practice).
    # The view claims memory it does not have: nothing of it may be read. Called natively, so that no Python
    # frame holds the view as an argument (a failing test's traceback would repr it).
    with pytest.raises(OverflowError):
        _native.build_key("p", claims_2_62_bytes())
    with pytest.raises(OverflowError):
        _native.build_keys("p", [claims_2_62_bytes()])
    with pytest.raises(BufferError):  # non-contiguous and too large to copy
        _native.build_key("p", np.broadcast_to(np.uint8(7), (2**40,)))


@pytest.mark.parametrize("where", ["chunks", "shard_ids", "block_ids"])
def test_layout_lists_grown_by_a_callback_are_read_to_their_first_length(where: str) -> None:
    # The loops re-read the list's size: an __index__ that keeps appending was followed forever.
    layout = rank_local()
    chunks: list[Any] = [(0, 16), (16, 32)]
    shards: list[Any] = [0, 0]
    ids: list[Any] = [3, 4]
    target = {"chunks": chunks, "shard_ids": shards, "block_ids": ids}[where]
    grown = {"count": 0}

    class Grows:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            if grown["count"] < 1000:
                grown["count"] += 1
                target.append((32, 48) if where == "chunks" else Grows(0 if where == "shard_ids" else 5))
            return self.value

    if where == "chunks":
        chunks[0] = (Grows(0), 16)
    elif where == "shard_ids":
        shards[0] = Grows(0)
    else:
        ids[0] = Grows(3)
    try:
        addrs, _, got_ids = layout.prepare_values(chunks, ids, shards)
    except RuntimeError:  # chunks outgrew shard_ids: the counts disagree, as vLLM's len() check would say
        assert where == "chunks"
        return
    assert got_ids == [3, 4] and grown["count"] < 1000
    assert [list(r) for r in addrs] == [[b + i * 10 for b in BASES] for i in (3, 4)]


class IterRaises:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __iter__(self) -> Any:
        raise self.exc


@pytest.mark.parametrize("exc", [Boom("x"), TypeError("the caller's own")], ids=["Boom", "TypeError"])
def test_an_iteration_exception_comes_out_unchanged(exc: BaseException) -> None:
    # multi_buffer_arrays and every FastSequence read replaced it with "must be a sequence of ints" (TypeError).
    db, _ = seed_pair()
    calls = [
        lambda: _native.multi_buffer_arrays([IterRaises(exc)], [[1]]),
        lambda: _native.multi_buffer_arrays(IterRaises(exc), [[1]]),
        lambda: db.prepare_values(IterRaises(exc), [1]),
        lambda: db.keys_for(IterRaises(exc)),
        lambda: reduce_exists(IterRaises(exc), 1),
        lambda: reduce_exists([1], IterRaises(exc)),
        lambda: db.plan_load(64, HASHES, [1, 2, 3, 4], load_mask=IterRaises(exc)),  # type: ignore[arg-type]
        lambda: build_lookup_keys(IterRaises(exc), HASHES),
    ]
    for call in calls:
        with pytest.raises(type(exc)) as info:
            call()
        assert info.value is exc


def test_non_iterables_still_get_our_type_error() -> None:
    db, _ = seed_pair()
    with pytest.raises(TypeError, match="sequence"):
        _native.multi_buffer_arrays([5], [[1]])
    with pytest.raises(TypeError, match="sequence"):
        db.prepare_values(5, [1])  # type: ignore[arg-type]


def test_register_kv_caches_refuses_a_cache_without_blocks() -> None:
    # vLLM reads cache[0] first (IndexError); the mirror registered a region at address 0 with 16-byte blocks.
    layout = M.RankLocalStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    empty = FakeTensor(ptr=0, nbytes=0)
    empty.shape = (0, 8)
    for num_blocks in (0, 1):
        with pytest.raises(IndexError):
            layout.register_kv_caches([empty], num_blocks)
    assert (layout.kv_caches_base_addr, layout.block_len) == ([], [])


@pytest.mark.vllm
def test_register_kv_caches_of_an_empty_tensor_matches_vllm() -> None:
    v = vllm_data()
    torch = pytest.importorskip("torch")
    for num_blocks in (0, 1):
        outcomes = []
        for module in (M, v):
            layout = module.RankLocalStoreLayout(module.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
            try:
                layout.register_kv_caches([torch.zeros(0, 4)], num_blocks)
                outcomes.append((layout.kv_caches_base_addr, layout.block_len))
            except IndexError:
                outcomes.append("IndexError")
        assert outcomes[0] == outcomes[1] == "IndexError"


class ClaimsHuge:
    """A hash sequence whose __len__ claims 2**62 items; it really has 4."""

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> bytes:
        return HASHES[index]


@pytest.mark.parametrize("which", ["seed", "vllm mirror"])
def test_process_tokens_walks_in_bounded_windows_whatever_len_claims(which: str) -> None:
    # The whole walk was computed up front from len(block_hashes): 2**31 chunks (64 GiB of positions, then
    # three lists) for a lying __len__ before the first chunk was yielded. The reference reads lazily.
    import tracemalloc

    md = M.KeyMetadata("m", 0, 0, 0, 0)
    db: Any = ChunkedTokenDatabase(MD, 16, 16) if which == "seed" else M.ChunkedTokenDatabase(md, 16, 16)
    tracemalloc.start()
    try:
        walk = db.process_tokens(2**22 * 16, ClaimsHuge())
        first = [next(walk) for _ in range(4)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first == [(16 * i, 16 * i + 16, HASHES[i]) for i in range(4)]
    assert peak < 32 << 20, peak
    with pytest.raises(IndexError):  # the fifth hash does not exist: the reference's error, at the same point
        next(walk)


@pytest.mark.parametrize("mask_kind", ["none", "list", "tuple", "sequence"])
def test_windowed_walks_equal_one_walk(monkeypatch: pytest.MonkeyPatch, mask_kind: str) -> None:
    from mooncake_kvaddr.core import walk as walk_module

    monkeypatch.setattr(walk_module, "WINDOW", 5)
    monkeypatch.setattr(walk_module, "_ALL", (True,) * 5)
    hashes = [bytes([i]) for i in range(40)]
    flags = [i % 3 != 1 for i in range(30)]

    class Flags:
        def __len__(self) -> int:
            return len(flags)

        def __getitem__(self, index: int) -> bool:
            return flags[index]

    mask: Any = {"none": None, "list": flags, "tuple": tuple(flags), "sequence": Flags()}[mask_kind]
    native = ChunkedTokenDatabase(MD, 16, 4)
    oracle = OracleChunkedTokenDatabase(MD, 16, 4)
    for mask_num in (-5, 0, 7, 16, 33):
        for step, rank in ((1, 0), (3, 2)):
            got = list(native.process_tokens(160, hashes, mask_num, chunk_mask=mask, put_step=step, put_step_rank=rank))
            want = list(oracle.process_tokens(160, hashes, mask_num, chunk_mask=None if mask is None else flags,
                                              put_step=step, put_step_rank=rank))
            assert got == want


def test_one_native_walk_is_bounded() -> None:
    # 2**31 chunks were accepted: 64 GiB of positions for a lying n_hashes, before any list was built.
    with pytest.raises(ValueError, match="limit"):
        _native.chunk_walk(2**25 * 16, 2**62, 16, 16, 0, None, 1, 0)
    db, _ = seed_pair()
    with pytest.raises(ValueError, match="limit"):
        db.walk_load(2**25 * 16, ClaimsHuge())
    starts, _, _ = _native.chunk_walk(2**16 * 16, 2**62, 16, 16, 0, None, 1, 0)
    assert len(starts) == 2**16


class _RaisingFlag:
    def __bool__(self) -> bool:
        raise Boom


@pytest.mark.parametrize("copy", [_native._staging_gather, _native._staging_scatter], ids=["gather", "scatter"])
def test_staging_copy_reports_its_first_bad_argument_in_parameter_order(copy: Any) -> None:
    # Each scalar is converted in a statement of its own: a call's arguments are evaluated in an order the
    # compiler picks, and the error reported must not depend on it.
    streaming = _RaisingFlag()
    with pytest.raises(TypeError, match="staging_ptr"):
        copy(*EMPTY_JOB[:2], "x", "y", *EMPTY_JOB[2:], threads="z", streaming=streaming)
    with pytest.raises(TypeError, match="staging_len"):
        copy(*EMPTY_JOB[:2], 0, "y", *EMPTY_JOB[2:], threads="z", streaming=streaming)
    with pytest.raises(TypeError, match="threads"):
        copy(*EMPTY_JOB[:2], 0, 0, *EMPTY_JOB[2:], threads="z", streaming=streaming)
    with pytest.raises(Boom):
        copy(*EMPTY_JOB[:2], 0, 0, *EMPTY_JOB[2:], threads=1, streaming=streaming)
