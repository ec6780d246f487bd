"""Regression tests from an adversarial audit of the hardening promises (issue 9, SECURITY.md).

Each test is a case the earlier hardening tests missed: mostly the vLLM 0.32+ mirror's layout engine
(``integrations.vllm.data``: ``ChunkedTokenDatabase`` over ``RankLocalStoreLayout`` / TP-shared layouts), which
the seed-era database's tests do not reach, and the transfer driver's block-id screen.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

from mooncake_kvaddr import _native
from mooncake_kvaddr.integrations.vllm.data import ChunkedTokenDatabase, KeyMetadata, RankLocalStoreLayout

MD = KeyMetadata("m", 0, 0, 0, 0)
BASES = [1000, 2000]
LENS = [10, 10]


def rank_local() -> tuple[ChunkedTokenDatabase, RankLocalStoreLayout]:
    layout = RankLocalStoreLayout(MD, 16, 16)
    db = ChunkedTokenDatabase(MD, 16, 16, layout)
    db.set_kv_caches_base_addr(list(BASES))
    db.set_block_len(list(LENS))
    return db, layout


def expected_row(bases: list[int], block_id: int) -> list[int]:
    return [b + block_id * n for b, n in zip(bases, LENS, strict=True)]


# --- re-entrancy in the layout engine -----------------------------------------------------------------------


@pytest.mark.parametrize("immutable", [False, True])
@pytest.mark.parametrize("nested", ["prepare_value_for_block", "prepare_values", "plan_load"])
def test_layout_index_that_reconfigures_and_reenters_never_caches_stale_rows(immutable: bool, nested: str) -> None:
    # The block id's __index__ edits the region list in place and makes a nested call, which syncs the new
    # regions (a new cache generation). The outer call computed on its earlier snapshot; before the fix it
    # then cached those old-region rows under the new generation, and every later call returned them.
    db, layout = rank_local()
    layout.immutable_rows = immutable
    db.store_layout.prepare_values([(0, 16)], [5], [0])
    new_bases = [10**6, 2000]

    class Reconfigures:
        done = False

        def __index__(self) -> int:
            if not Reconfigures.done:
                Reconfigures.done = True
                db.kv_caches_base_addr[0] = new_bases[0]
                if nested == "prepare_value_for_block":
                    db.prepare_value_for_block(3)
                elif nested == "prepare_values":
                    layout.prepare_values([(0, 16)], [3], [0])
                else:
                    layout.plan_load(16, [b"h0"], 0, None, [3])
            return 7

    layout.prepare_values([(0, 16), (16, 32)], [Reconfigures(), 7], [0, 0])
    for _ in range(3):
        addrs, _, _ = layout.prepare_values([(0, 16), (16, 32)], [7, 7], [0, 0])
        assert [list(r) for r in addrs] == [expected_row(new_bases, 7)] * 2
        _, addrs, _, _ = layout.plan_load(32, [b"h0", b"h1"], 0, None, [7, 7])
        assert [list(r) for r in addrs] == [expected_row(new_bases, 7)] * 2


@pytest.mark.parametrize("immutable", [False, True])
@pytest.mark.parametrize("k", range(12))
def test_layout_finalizer_caching_the_same_row_mid_call_keeps_the_cache_consistent(immutable: bool, k: int) -> None:
    # A GC pass while the outer call builds a row it is about to cache runs a finalizer whose nested call
    # caches the same (shard, block id). Before the fix the outer call cached it a second time: a leaked
    # reference and an order entry whose eviction dereferenced a missing map entry (SIGSEGV). `k` picks the
    # GC pass (during the outer call) at which the nested call runs.
    row_cost = 64 + len(BASES) * 40
    _, layout = rank_local()
    layout.immutable_rows = immutable
    state = {"count": 0, "on": False, "busy": False}

    class Bomb:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            if not state["on"] or state["busy"]:
                return
            Bomb()
            n = state["count"]
            state["count"] += 1
            if n == k:
                state["busy"] = True
                layout.prepare_values([(0, 16), (16, 32)], [9, 9], [0, 0])
                state["busy"] = False

    layout.prepare_values([(0, 16)], [9], [0])  # the first sighting of block 9
    gc.collect()
    Bomb()
    old = gc.get_threshold()
    state["on"] = True
    gc.set_threshold(1, 1000, 1000)
    try:
        addrs, _, _ = layout.prepare_values([(0, 16)], [9], [0])
    finally:
        gc.set_threshold(*old)
        state["on"] = False
    gc.collect()
    assert [list(r) for r in addrs] == [expected_row(BASES, 9)]
    info = layout.row_cache_info()
    assert info["bytes"] == info["entries"] * row_cost, info
    layout.row_cache_bytes = 0  # evicts every entry: must find each one
    assert layout.row_cache_info()["entries"] == 0
    layout.row_cache_bytes = 1 << 20
    assert [list(r) for r in layout.prepare_values([(0, 16)], [9], [0])[0]] == [expected_row(BASES, 9)]


def test_native_layout_engine_directly_gets_the_same_guarantees() -> None:
    engine = _native.LayoutEngine(16, 16, False, 0, 1, 1 << 20)
    bases, lens = list(BASES), list(LENS)
    engine.set_region_sources(bases, lens)

    class Reconfigures:
        def __index__(self) -> int:
            bases[0] = 10**6
            engine.prepare_value_for_block(1)
            return 7

    engine.prepare_values([(0, 16), (16, 32)], [Reconfigures(), 7], [0, 0])
    assert engine.prepare_values([(0, 16)], [7], [0])[0] == [[10**6 + 70, 2070]]


# --- the transfer driver's block-id screen --------------------------------------------------------------------


class LyingInt(int):
    """An int subclass whose comparisons always say yes: min/max/range checks on it prove nothing."""

    def __lt__(self, other: object) -> bool:
        return True

    __le__ = __gt__ = __ge__ = __lt__
    __hash__ = int.__hash__


class Flips:
    """An __index__ that answers a good id the first time and a wild one afterwards (comparisons lie too)."""

    def __init__(self) -> None:
        self.calls = 0

    def __index__(self) -> int:
        self.calls += 1
        return 1 if self.calls == 1 else 10**5

    def __lt__(self, other: object) -> bool:
        return True

    __le__ = __gt__ = __ge__ = __lt__


@pytest.mark.parametrize("mode", ["multi_buffer", "auto", "staged"])
@pytest.mark.parametrize("make_bad", [lambda: LyingInt(10**5), lambda: LyingInt(-3), Flips])
def test_block_ids_whose_comparisons_or_index_lie_never_reach_mooncake(
    monkeypatch: pytest.MonkeyPatch, mode: str, make_bad: Any
) -> None:
    # Before the fix the screen trusted min()/max() (the objects' own comparisons): in multi_buffer mode the
    # id 10**5 reached Mooncake, whose put read unrelated process memory into the store (here the fake's
    # ctypes read segfaulted).
    from fake_mooncake import fake_store
    from kvaddr_testing import Cache, hashes, make_transfer
    from mooncake_kvaddr.driver.transfer import TransferRequest

    regions = 1 if mode == "auto" else 3
    with fake_store(monkeypatch) as (store, fake):
        src = Cache(regions, 9, 256, seed=1)
        with make_transfer(store, "m", src, 16, transfer_mode=mode, start_threads=False) as xfer:
            h = hashes("m", 2)
            bad = make_bad()
            stored = xfer.store(TransferRequest("r", 32, h, [[2, bad]]))
            # The chunk on the bad id is either stored from the block its first answer named (Flips: one
            # conversion, block 1) or reported invalid; never anything else.
            if isinstance(bad, Flips):
                assert stored.ok and bad.calls == 1
                assert fake.objects[xfer.databases[0].key_for(h[1])] == src.object_bytes(1)
            else:
                assert stored.stored == 1 and set(stored.invalid_block_ids) == {int(bad)}
                assert xfer.databases[0].key_for(h[1]) not in fake.objects
            before = src.snapshot()
            bad = make_bad()
            loaded = xfer.load(TransferRequest("r", 32, h, [[2, bad]]))
            if isinstance(bad, Flips):
                assert loaded.ok and loaded.loaded_block_ids == {1, 2} and bad.calls == 1
            else:
                assert loaded.loaded_block_ids == {2} and set(loaded.invalid_block_ids) == {int(bad)}
            for region, old in zip(src.regions, before, strict=True):  # the same bytes came back, nothing else
                assert region.tobytes() == old.tobytes()


# --- region lists: strict types (vLLM's np.asarray raises for these; the engine read dict keys, set order,
# --- bytes values, and a generator once then as empty) ------------------------------------------------------


BAD_REGION_LISTS = [
    lambda: {1000: 0, 2000: 1},
    lambda: {1000, 2000},
    lambda: frozenset({1000}),
    lambda: b"\x01\x02",
    lambda: bytearray(b"\x01"),
    lambda: "12",
    lambda: (x for x in [1000, 2000]),
    lambda: iter([1000, 2000]),
]


@pytest.mark.parametrize("make", BAD_REGION_LISTS)
@pytest.mark.parametrize("which", ["base", "block_len"])
@pytest.mark.parametrize("flavour", ["mirror", "seed"])
def test_region_lists_must_be_sequences_of_ints(make: Any, which: str, flavour: str) -> None:
    from mooncake_kvaddr import ChunkedTokenDatabase as SeedDatabase

    db: Any = ChunkedTokenDatabase(MD, 16) if flavour == "mirror" else SeedDatabase(MD, 16)
    bad = make()
    with pytest.raises(TypeError, match="must be a sequence"):
        if which == "base":
            db.set_kv_caches_base_addr(bad)
        else:
            db.set_block_len(bad)
    # Nothing was installed: the database still computes from its last good regions.
    db.set_kv_caches_base_addr([1000, 2000])
    db.set_block_len([10])
    rows = db.store_layout.prepare_values([(0, 16)], [1], [0]) if flavour == "mirror" else db.prepare_values(
        [(0, 16)], [1]
    )
    assert [list(r) for r in rows[0]] == [[1010, 2010]]


def test_region_lists_accept_lists_tuples_ranges_and_int_arrays() -> None:
    import numpy as np

    for bases in ([1000, 2000], (1000, 2000), range(1000, 2001, 1000), np.array([1000, 2000], np.int64)):
        db = ChunkedTokenDatabase(MD, 16)
        db.set_kv_caches_base_addr(bases)  # type: ignore[arg-type]
        db.set_block_len((10,))  # type: ignore[arg-type]
        assert db.store_layout.prepare_values([(0, 16)], [1], [0])[0] == [[1010, 2010]]
        assert db.prepare_value_for_block(2) == ([1020, 2020], [10, 10])


def test_boundary_block_id_whose_index_edits_the_regions_reads_them_in_each_rules_order() -> None:
    """The seed-era database converts the id before it reads the regions, vLLM's rules read the regions first:
    an id whose ``__index__`` edits the region list in place is seen by the one and not by the other."""
    from mooncake_kvaddr.core.database import ChunkedTokenDatabase as SeedDatabase

    class EditingId:
        def __init__(self, bases: list[int]) -> None:
            self.bases = bases

        def __index__(self) -> int:
            self.bases[0] = 5000
            return 2

    seed_bases, vllm_bases = [1000, 2000], [1000, 2000]
    seed = SeedDatabase(MD, 16)
    seed.set_kv_caches_base_addr(seed_bases)
    seed.set_block_len([10])
    layout = RankLocalStoreLayout(MD, 16, 16)
    layout.set_kv_caches_base_addr(vllm_bases)
    layout.set_block_len([10])
    assert seed.prepare_value_for_block(EditingId(seed_bases)) == ([5020, 2020], [10, 10])
    assert layout.prepare_value_for_block(EditingId(vllm_bases)) == ([1020, 2020], [10, 10])
    assert vllm_bases == [5000, 2000] and layout.prepare_value_for_block(2) == ([5020, 2020], [10, 10])


# --- TP-shared shard ids: compared before any arithmetic ---------------------------------------------------


@pytest.mark.parametrize("shard", [-(2**63), -1, 0, 3, 2**63 - 1])
def test_tp_shared_foreign_shard_ids_are_refused_without_overflow(shard: int) -> None:
    # first shard 1: before the fix `shard - first_shard` was computed before the ownership check, a signed
    # overflow (UB; UBSan) for shard -2**63.
    engine = _native.LayoutEngine(16, 16, True, 1, 2, 1 << 20)
    engine.set_templates([([0], [64], [64]), ([4096], [64], [64])])
    with pytest.raises(ValueError, match="not owned"):
        engine.prepare_values([(0, 16)], [1], [shard])
    assert engine.prepare_values([(0, 16), (0, 16)], [1], [1, 2])[0] == [[64], [4160]]


@pytest.mark.parametrize(("first", "count"), [(-1, 1), (2**63 - 1, 2), (-(2**63), 0)])
def test_tp_shared_shard_range_must_fit_in_int64(first: int, count: int) -> None:
    with pytest.raises(ValueError, match="first_shard"):
        _native.LayoutEngine(16, 16, True, first, count, 1 << 20)


@pytest.mark.parametrize(("block_size", "hash_block_size"), [(0, 16), (16, 0), (-16, 16), (16, -1)])
@pytest.mark.parametrize("tp_shared", [False, True])
def test_a_layout_engine_of_block_size_zero_is_refused(block_size: int, hash_block_size: int, tp_shared: bool) -> None:
    # Every walk and row divides by these (a 0 would be a division by zero in the kernels).
    with pytest.raises(ValueError, match="block_size and hash_block_size must be positive"):
        _native.LayoutEngine(block_size, hash_block_size, tp_shared, 0, 1, 1 << 20)


# --- TP-shared layouts: segments re-registered after the transfer's registration --------------------------


@pytest.mark.parametrize("how", ["layout.register_kv_caches", "templates"])
def test_tp_shared_layout_reregistered_after_the_transfer_moves_nothing(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # A buggy engine re-registers a TP-shared layout with other tensors after the transfer registered its KV
    # caches. Before the fix the transfer screened block ids against num_blocks only, and a store put the
    # other tensor's bytes (memory the transfer never registered) into the shared store.
    torch = pytest.importorskip("torch")
    from fake_mooncake import fake_store
    from kvaddr_testing import hashes
    from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest
    from mooncake_kvaddr.integrations.vllm.data import LBHNCStoreLayout

    nb, bs, heads = 4, 4, 2
    md = KeyMetadata("m", 0, 0, 0, 0, store_namespace=LBHNCStoreLayout.shared_namespace(1, 1))
    layout = LBHNCStoreLayout(md, bs, bs, 1, 1, 0, heads)
    db = ChunkedTokenDatabase(md, bs, bs, layout)
    caches = [torch.zeros((nb, heads, bs, 8))]
    secret = torch.full((nb, heads, bs, 8), 7.0)
    with fake_store(monkeypatch) as (store, fake):
        with KVTransfer(store, [db], start_threads=False) as xfer:
            xfer.register_kv_caches(caches, nb)
            h = hashes("m", 2)
            assert xfer.store(TransferRequest("r", 4, h[:1], [[1]])).stored == 1  # the registered caches: fine
            if how == "templates":
                block = secret.stride(0) * 4
                layout._set_segment_templates([([secret.data_ptr()], [block], [block])])
            else:
                layout.register_kv_caches([secret], nb)
            with pytest.raises(ValueError, match="outside the KV caches registered"):
                xfer.store(TransferRequest("r", 8, h, [[1, 2]]))
            loaded = xfer.load(TransferRequest("r", 4, h[:1], [[3]]))
            assert loaded.failed_block_ids == {3} and "outside the KV caches registered" in (loaded.error or "")
            assert not caches[0][3].any()
            assert len(fake.objects) == 1 and all(b"\x00\x00\xe0@" not in v for v in fake.objects.values())
            layout.register_kv_caches(caches, nb)  # back to the registered caches: moves again
            assert xfer.load(TransferRequest("r", 4, h[:1], [[3]])).loaded_block_ids == {3}


# --- container subclasses: read through their own __getitem__, as the reference reads them ----------------


class OffsetTable(list):  # type: ignore[type-arg]
    """A block table that translates logical positions (a list subclass overriding __getitem__)."""

    def __getitem__(self, index: Any) -> Any:
        return list.__getitem__(self, index) + 100


class SwappedChunk(tuple):  # type: ignore[type-arg]
    """A chunk whose c[0]/c[1] are not its stored items."""

    def __getitem__(self, index: Any) -> Any:
        return tuple.__getitem__(self, index) + 16


def test_list_subclass_block_ids_are_read_through_getitem_like_vllm() -> None:
    vllm_data = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data")
    from mooncake_kvaddr import ChunkedTokenDatabase as SeedDatabase
    from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase

    chunks = [(0, 16), (16, 32)]
    reference = vllm_data.ChunkedTokenDatabase(vllm_data.KeyMetadata("m", 0, 0, 0, 0), 16)
    mirror = ChunkedTokenDatabase(MD, 16)
    for db in (reference, mirror):
        db.set_kv_caches_base_addr([0, 1 << 20])
        db.set_block_len([64])
    want = reference.store_layout.prepare_values(chunks, OffsetTable([1, 2]), [0, 0])
    assert want[2] == [101, 102]
    assert mirror.store_layout.prepare_values(chunks, OffsetTable([1, 2]), [0, 0]) == want
    assert mirror.store_layout.prepare_values(chunks, tuple(OffsetTable([1, 2])), [0, 0]) != want  # plain tuple
    seed, oracle = SeedDatabase(MD, 16), OracleChunkedTokenDatabase(MD, 16)
    for db in (seed, oracle):
        db.set_kv_caches_base_addr([0, 1 << 20])
        db.set_block_len([64])
    assert seed.prepare_values(chunks, OffsetTable([1, 2])) == oracle.prepare_values(chunks, OffsetTable([1, 2]))
    assert seed.prepare_values(chunks, OffsetTable([1, 2]))[2] == [101, 102]
    # A chunk that is a tuple subclass is read through c[0], c[1] too.
    swapped = [SwappedChunk((0, 16))]
    assert mirror.store_layout.prepare_values(swapped, [5, 6, 7], [0]) == reference.store_layout.prepare_values(
        swapped, [5, 6, 7], [0]
    )
    assert seed.prepare_values(swapped, [5, 6, 7]) == oracle.prepare_values(swapped, [5, 6, 7])


# --- loose types in the row and lookup helpers ----------------------------------------------------------------


@pytest.mark.parametrize("row", [b"ab", bytearray(b"ab"), "ab", {1: 2}, {1, 2}])
def test_multi_buffer_rows_refuse_bytes_str_dict_set(row: Any) -> None:
    # bytes rows were read as their byte values (b"ab" -> addresses 97, 98).
    with pytest.raises(TypeError, match="sequence of ints"):
        _native.multi_buffer_arrays([row], [[1, 1]])
    with pytest.raises(TypeError, match="sequence of ints"):
        _native.multi_buffer_arrays([[4096, 8192]], [row])
    with pytest.raises(TypeError, match="sequence of ints"):
        _native.multi_buffer_arrays(row, [[1, 1]])


def test_reduce_exists_accepts_numpy_integer_widths() -> None:
    import numpy as np

    from mooncake_kvaddr.core.keys import reduce_exists

    results = [1, 1, 1, 0, 1, 1]
    for width in (np.int64(2), np.int32(2), np.uint8(2)):
        assert reduce_exists(results, width) == [True, False, True]
    assert reduce_exists(results, [np.int64(3), np.int64(3)]) == [True, False]
    with pytest.raises(ValueError, match="positive"):
        reduce_exists(results, np.int64(0))


# --- the transfer's region check must not trust __eq__ ---------------------------------------------------------


class EqualToAnything(list):  # type: ignore[type-arg]
    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


class IntEqualToAnything(int):
    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = int.__hash__


@pytest.mark.parametrize("how", ["list subclass", "int subclass items"])
@pytest.mark.parametrize("mode", ["multi_buffer", "auto", "staged"])
def test_regions_whose_equality_lies_move_nothing(monkeypatch: pytest.MonkeyPatch, how: str, mode: str) -> None:
    # Before the fix the transfer compared the database's lists with ==: these said "equal" and, in
    # multi_buffer mode, a store put the bytes at the wild base (here a 0x41-filled array) into the store.
    import numpy as np

    from fake_mooncake import fake_store
    from kvaddr_testing import Cache, hashes, make_transfer
    from mooncake_kvaddr.driver.transfer import TransferRequest

    regions = 1 if mode == "auto" else 2
    secret = np.full(4096, 0x41, np.uint8)
    with fake_store(monkeypatch) as (store, fake):
        src = Cache(regions, 9, 64, seed=1)
        with make_transfer(store, "m", src, 16, transfer_mode=mode, start_threads=False) as xfer:
            wild = [int(secret.ctypes.data)] * regions
            bad = EqualToAnything(wild) if how == "list subclass" else [IntEqualToAnything(w) for w in wild]
            xfer.databases[0].set_kv_caches_base_addr(bad)
            with pytest.raises(ValueError, match="changed after register_kv_caches"):
                xfer.store(TransferRequest("r", 16, hashes("m", 1), [[1]]))
            loaded = xfer.load(TransferRequest("r", 16, hashes("m", 1), [[1]]))
            assert loaded.failed_block_ids == {1} and "changed after register_kv_caches" in (loaded.error or "")
            assert not fake.objects and not (secret != 0x41).any()


# --- numpy block ids in another byte order ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [">i8", ">i4", ">i2", ">u8", ">u4", ">u2", "<i8", "<u4"])
def test_byte_swapped_block_id_arrays_read_their_values(dtype: str) -> None:
    # The seed-era database read a byte-swapped array's raw bytes as native integers: block id 1 of a '>i4'
    # array became 16777216 (an address 1 GiB past the region for 64-byte blocks).
    import numpy as np

    from mooncake_kvaddr import ChunkedTokenDatabase as SeedDatabase
    from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase

    ids = np.array([1, 2, 3], dtype=dtype)
    chunks = [(0, 16), (16, 32), (32, 48)]
    native, oracle = SeedDatabase(MD, 16), OracleChunkedTokenDatabase(MD, 16)
    for db in (native, oracle):
        db.set_kv_caches_base_addr([1 << 20, 1 << 30])
        db.set_block_len([64])
    want = oracle.prepare_values(chunks, ids)
    assert native.prepare_values(chunks, ids) == want
    assert native.prepare_values_array(chunks, ids)[0].tolist() == want[0]
    assert native.plan_load(48, [b"a", b"b", b"c"], ids, 0).addrs == want[0]
    assert native.plan_store(48, [b"a", b"b", b"c"], ids, 0).block_ids == [1, 2, 3]
    mirror = ChunkedTokenDatabase(MD, 16)
    mirror.set_kv_caches_base_addr([1 << 20, 1 << 30])
    mirror.set_block_len([64])
    assert mirror.store_layout.prepare_values(chunks, ids, [0, 0, 0])[0] == want[0]


# --- the staged wrapper's registrations ------------------------------------------------------------------------


def test_staged_wrapper_survives_registrations_its_range_table_cannot_hold() -> None:
    # A buffer Mooncake accepted at [2**63 - 10, +100) (or a negative pointer, a float) made the wrapper's
    # int64 range table raise OverflowError, on that registration and on every later one.
    from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

    class Store:
        def register_buffer(self, ptr: Any, size: Any) -> int:
            return 0

        def unregister_buffer(self, ptr: Any) -> int:
            return 0

    staged = StagedMooncakeStore(Store(), staging_bytes=1 << 16)
    for ptr, size in ((2**63 - 10, 100), (-4096, 100), (1.5, 10), (4096, 2**70), (0, 64)):
        assert staged.register_buffer(ptr, size) == 0
    assert staged.register_buffer(8192, 100) == 0
    assert staged.ranges.ranges.items == ((8192, 100),)  # only the range staging may touch
    assert staged.unregister_buffer(1.5) == 0 and staged.unregister_buffer(8192) == 0
    assert staged.ranges.ranges.items == ()


@pytest.mark.parametrize("tail", [-(2**63), -(2**63) + 1, -1, 0, 2**63 - 1])
def test_layout_plan_load_tail_tokens_extremes_index_like_python(tail: int) -> None:
    # hash_block_size 1: tail // 1 - 1 wrapped for tail = -2**63 (signed overflow, UB; UBSan).
    layout = RankLocalStoreLayout(MD, 1, 1)
    layout.set_kv_caches_base_addr([1 << 20])
    layout.set_block_len([8])
    hashes = [b"a", b"b", b"c"]
    index = tail // 1 - 1
    if -len(hashes) <= index < len(hashes):
        keys, _, _, _ = layout.plan_load(3, hashes, 0, None, [1, 2, 3], tail)
        assert keys[-1] == layout.key_for(0, hashes[index])
    else:
        with pytest.raises(IndexError):
            layout.plan_load(3, hashes, 0, None, [1, 2, 3], tail)


# --- the chunk walk: an empty range far apart -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token_len", "mask_num"), [(-(2**63), 2**63 - 1), (-(2**63) + 16, 2**62), (-16, 2**63 - 1), (0, 2**63 - 1)]
)
def test_walk_whose_first_chunk_is_far_past_its_last_is_empty_without_overflow(token_len: int, mask_num: int) -> None:
    # first chunk = mask_num // block_size, stop = ceil(token_len / block_size): stop - first overflowed (UB;
    # UBSan) when the two were more than 2**63 apart, before the empty walk was noticed; the wrapped length
    # then made an empty walk raise OverflowError (token_len -2**63 + 16, mask_num 2**62).
    from mooncake_kvaddr import ChunkedTokenDatabase as SeedDatabase

    assert _native.chunk_walk(token_len, 4, 1, 1, mask_num, None, 1, 0) == ([], [], [])
    assert _native.chunk_walk(token_len, 4, 1, 1, mask_num, [True] * 4, 1, 0, absolute_mask=True) == ([], [], [])
    for db in (SeedDatabase(MD, 1), ChunkedTokenDatabase(MD, 1)):
        assert list(db.process_tokens(token_len, [b"a", b"b", b"c", b"d"], mask_num)) == []
