"""Fuzz every public native entry point with hostile objects (hypothesis).

Hostile inputs: ints behind ``__index__`` (plain, re-entrant into the database, mutating their own container,
raising), lying sequences, huge and negative ints, mutating ``__bool__`` mask flags and hash items that change
under the call. Each call must either return the reference's value (when no hostile side effect happened) or
raise one of the documented exception classes (docs/errors.md); it must never crash, and afterwards a plain
call must still equal the reference (nothing cached from a half-finished call). ``tests/sanitize.sh`` runs this
module under ASan + UBSan.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, _native
from mooncake_kvaddr.core.keys import build_keys, build_lookup_keys, reduce_exists
from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase
from mooncake_kvaddr.driver.staging import HostCopyBackend, StagingBuffer, gather, plan_slots, scatter

MD = KeyMetadata("fz", 0, 0, 0, 0)
BS, HBS = 32, 16
BASES = [0x7F00_0000_0000 + i * (1 << 30) for i in range(3)]
LENS = [4096, 8192]

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class Boom(Exception):
    """A user exception: must come out of every call unchanged."""


ALLOWED = (TypeError, ValueError, IndexError, OverflowError, RuntimeError, AssertionError, ZeroDivisionError,
           BufferError, Boom)


class Hostile:
    """Records whether any hostile object ran a side effect during a call."""

    side_effects = 0


class IndexInt:
    """An int through __index__, optionally with a side effect first."""

    def __init__(self, value: int, action: Callable[[], None] | None = None) -> None:
        self.value, self.action = value, action

    def __index__(self) -> int:
        if self.action is not None:
            Hostile.side_effects += 1
            self.action()
        return self.value

    def __repr__(self) -> str:
        return f"IndexInt({self.value}, {getattr(self.action, '__name__', None)})"


class Flag:
    def __init__(self, value: bool, action: Callable[[], None] | None = None) -> None:
        self.value, self.action = value, action

    def __bool__(self) -> bool:
        if self.action is not None:
            Hostile.side_effects += 1
            self.action()
        return self.value


class LyingSeq:
    """A sequence whose __len__ may differ from its items."""

    def __init__(self, items: list[Any], length: int) -> None:
        self.items, self.length = items, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, slice):
            return self.items[index]
        return self.items[index]


def fresh_pair(cache: int = 1 << 20) -> tuple[ChunkedTokenDatabase, OracleChunkedTokenDatabase]:
    native = ChunkedTokenDatabase(MD, BS, HBS, address_cache_bytes=cache)
    oracle = OracleChunkedTokenDatabase(MD, BS, HBS)
    for db in (native, oracle):
        db.set_kv_caches_base_addr(list(BASES))
        db.set_block_len(list(LENS))
    return native, oracle


def actions(db: ChunkedTokenDatabase, victim: list[Any]) -> dict[str, Callable[[], None]]:
    """Side effects a hostile object may run: re-enter the database, mutate a container, raise, collect."""

    def reenter() -> None:
        db.prepare_values([(0, 16), (32, 64)], [1, 2])

    def clear_cache() -> None:
        db.clear_address_cache()

    def same_regions() -> None:
        db.set_kv_caches_base_addr(list(BASES))
        db.set_block_len(list(LENS))

    def shrink_cache() -> None:
        db.address_cache_bytes = 200

    def mutate() -> None:
        if victim:
            victim.pop()
        else:
            victim.append(0)

    def clear() -> None:
        victim.clear()

    def boom() -> None:
        raise Boom("from a callback")

    def collect() -> None:
        gc.collect()

    return {f.__name__: f for f in (reenter, clear_cache, same_regions, shrink_cache, mutate, clear, boom, collect)}


INT_EDGES = [0, 1, -1, 2**31, 2**62, 2**63 - 1, -(2**63), 2**63, 2**64, -(2**64), -(2**63) - 1]


@st.composite
def int_like(draw: st.DrawFn, small: st.SearchStrategy[int], db: ChunkedTokenDatabase, victim: list[Any]) -> Any:
    """A value meant as ``value``: sometimes a huge edge instead, sometimes wrapped in a hostile object."""
    value = draw(st.one_of(small, small, small, st.sampled_from(INT_EDGES)))
    kind = draw(st.sampled_from(["int", "int", "np", "index", "hostile", "bool"]))
    if kind == "np" and -(2**63) <= value < 2**63:
        return np.int64(value)
    if kind == "index":
        return IndexInt(value)
    if kind == "hostile":
        return IndexInt(value, actions(db, victim)[draw(st.sampled_from(sorted(actions(db, victim))))])
    if kind == "bool" and value in (0, 1):
        return bool(value)
    return value


def plain(value: Any) -> Any:
    if isinstance(value, IndexInt):
        return value.value
    if isinstance(value, np.integer):
        return int(value)
    return value


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except ALLOWED as exc:
        return "err", exc


def as_lists(value: Any, api: str) -> Any:
    """An immutable-rows result in the list form (every row must be a tuple)."""
    if api == "prepare_value":
        addr, size, block_id = value
        assert type(addr) is tuple and type(size) is tuple
        return list(addr), list(size), block_id
    addrs, sizes, ids = value
    assert all(type(row) is tuple for row in addrs + sizes)
    return [list(r) for r in addrs], [list(r) for r in sizes], ids


def check_clean_afterwards(native: ChunkedTokenDatabase, oracle: OracleChunkedTokenDatabase) -> None:
    """Whatever a hostile call did, a plain call afterwards equals the reference."""
    native.address_cache_bytes = 1 << 20
    native.immutable_rows = False
    native.set_kv_caches_base_addr(list(BASES))
    native.set_block_len(list(LENS))
    chunks, ids = [(0, 32), (32, 48), (64, 96)], [5, 6, 7, 8]
    assert native.prepare_values(chunks, ids) == oracle.prepare_values(chunks, ids)
    assert native.prepare_values_array(chunks, ids)[0].tolist() == oracle.prepare_values(chunks, ids)[0]


def containers(draw: st.DrawFn, items: list[Any]) -> Any:
    kind = draw(st.sampled_from(["list", "tuple", "lying_short", "lying_long", "array"]))
    if kind == "tuple":
        return tuple(items)
    if kind == "lying_short":
        return LyingSeq(items, max(0, len(items) - 1))
    if kind == "lying_long":
        return LyingSeq(items, len(items) + draw(st.integers(1, 3)))
    if kind == "array" and all(isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
                               for v in items):
        return np.array(items, dtype=np.int64)
    return items


@st.composite
def prepare_cases(draw: st.DrawFn) -> tuple[Any, ...]:
    native, oracle = fresh_pair(draw(st.sampled_from([0, 300, 1 << 20])))
    native.immutable_rows = draw(st.booleans())
    victim: list[Any] = []
    small_pos = st.integers(0, 6).map(lambda k: k * HBS)
    n = draw(st.integers(0, 5))
    chunk_items: list[Any] = []
    for _ in range(n):
        start = draw(int_like(small_pos, native, victim))
        end = draw(int_like(small_pos, native, victim))
        chunk_items.append(draw(st.sampled_from([tuple, list]))((start, end)))
    ids = [draw(int_like(st.integers(-2, 50), native, victim)) for _ in range(draw(st.integers(0, 8)))]
    victim.extend(draw(st.sampled_from([[], [0], [0, 0]])))
    victim_is = draw(st.sampled_from(["chunks", "ids", "none"]))
    chunks_obj = chunk_items
    ids_obj = containers(draw, ids)
    if victim_is == "chunks":
        victim[:] = chunk_items
        chunks_obj = victim
    elif victim_is == "ids" and isinstance(ids_obj, list):
        victim[:] = ids
        ids_obj = victim
    return native, oracle, chunks_obj, ids_obj


@given(prepare_cases())
@FUZZ
def test_prepare_values_family(case: tuple[Any, ...]) -> None:
    native, oracle, chunks, ids = case
    plain_chunks = [tuple(plain(v) for v in c) for c in list(chunks)]
    plain_ids = [plain(v) for v in (list(ids) if not isinstance(ids, LyingSeq) else ids.items[: len(ids)])]
    lying = isinstance(ids, LyingSeq) and ids.length != len(ids.items)
    expected = outcome(lambda: oracle.prepare_values(plain_chunks, plain_ids))
    Hostile.side_effects = 0
    for api in ("prepare_values", "prepare_values_array", "prepare_value"):
        if api == "prepare_value":
            if not plain_chunks:
                continue
            got = outcome(lambda: native.prepare_value(chunks[0][0], chunks[0][1], ids))
            exp = outcome(lambda: oracle.prepare_value(plain_chunks[0][0], plain_chunks[0][1], plain_ids))
        else:
            got = outcome(lambda api=api: getattr(native, api)(chunks, ids))
            exp = expected
        if Hostile.side_effects or lying:
            break  # a callback changed the inputs (or the lengths lie): any allowed outcome is fine
        rows: list[Any] = []
        if exp[0] == "ok":
            rows = [exp[1][0], exp[1][1]] if api == "prepare_value" else exp[1][0] + exp[1][1]
        if exp[0] == "ok" and any(abs(v) >= 2**63 for row in rows for v in row):
            assert got[0] == "err" and isinstance(got[1], OverflowError), (api, got)
            continue
        if got[0] == "ok":
            assert exp[0] == "ok", (api, got, exp)
            value = got[1]
            if api == "prepare_values_array":
                value = tuple(a.tolist() for a in value)
            elif native.immutable_rows:
                value = as_lists(value, api)
            assert value == exp[1], api
        else:
            assert exp[0] == "err" or isinstance(got[1], (OverflowError, TypeError)), (api, got, exp)
    check_clean_afterwards(native, oracle)


@st.composite
def walk_cases(draw: st.DrawFn) -> tuple[Any, ...]:
    native, oracle = fresh_pair(draw(st.sampled_from([0, 1 << 20])))
    victim: list[Any] = []
    n_hashes = draw(st.integers(0, 8))
    hash_len = draw(st.sampled_from([None, 4]))
    hashes: list[Any] = [bytes([i + 1]) * 4 for i in range(n_hashes)]
    hash_kind = draw(st.sampled_from(["list", "blob", "bytearray", "memoryview", "mixed"]))
    hashes_obj: Any = hashes
    if hash_kind == "blob":
        hashes_obj, hash_len = b"".join(hashes), 4
    elif hash_kind == "bytearray":
        hashes_obj, hash_len = bytearray(b"".join(hashes)), 4
    elif hash_kind == "memoryview":
        hashes_obj, hash_len = memoryview(b"".join(hashes)), 4
    elif hash_kind == "mixed":
        hashes_obj = [draw(st.sampled_from([bytes, bytearray, memoryview]))(h) for h in hashes]
    token_len = draw(st.one_of(st.integers(-1, n_hashes).map(lambda k: k * HBS), st.sampled_from(INT_EDGES[:7]),
                               st.integers(0, 200)))
    mask_num = draw(st.one_of(st.integers(-2, 8).map(lambda k: k * HBS), st.sampled_from(INT_EDGES[:7])))
    mask: Any = None
    if draw(st.booleans()):
        flags = draw(st.lists(st.booleans(), max_size=8))
        acts = actions(native, victim)
        mask = [Flag(f, acts[draw(st.sampled_from(sorted(acts)))]) if draw(st.integers(0, 5)) == 0 else f
                for f in flags]
        if draw(st.booleans()):
            victim[:] = mask
            mask = victim
    ids = [draw(int_like(st.integers(0, 50), native, victim)) for _ in range(draw(st.integers(0, 6)))]
    return native, oracle, token_len, hashes_obj, hashes, hash_len, mask_num, mask, ids


def expected_load(oracle: OracleChunkedTokenDatabase, token_len: int, hashes: list[bytes], mask_num: int,
                  mask: list[bool] | None, ids: list[int]) -> Any:
    chunks, keys = [], []
    for start, end, h in oracle.process_tokens(token_len, hashes, mask_num):
        cid = start // BS
        if mask is not None and (cid >= len(mask) or not mask[cid]):
            continue
        chunks.append((start, end))
        keys.append(oracle.key_for(h))
    rows = oracle.prepare_values(chunks, ids)
    return (keys, *rows)


@given(walk_cases())
@FUZZ
def test_fused_plans_and_walks(case: tuple[Any, ...]) -> None:
    native, oracle, token_len, hashes_obj, hashes, hash_len, mask_num, mask, ids = case
    plain_ids = [plain(v) for v in ids]
    plain_mask = None if mask is None else [bool(f.value) if isinstance(f, Flag) else f for f in list(mask)]
    Hostile.side_effects = 0
    got_load = outcome(lambda: tuple(native.plan_load(token_len, hashes_obj, ids, mask_num, mask, hash_len=hash_len)))
    got_arrays = outcome(lambda: native.plan_load_arrays(token_len, hashes_obj, ids, mask_num, mask,
                                                         hash_len=hash_len))
    got_store = outcome(lambda: tuple(native.plan_store(token_len, hashes_obj, ids, mask_num, mask,
                                                        hash_len=hash_len)))
    got_walk = outcome(lambda: list(native.process_tokens(token_len, hashes, mask_num, chunk_mask=mask)))
    got_chunk_walk = outcome(lambda: _native.chunk_walk(token_len, len(hashes), BS, HBS, mask_num, mask, 1, 0))
    if Hostile.side_effects:
        check_clean_afterwards(native, oracle)
        return
    exp_load = outcome(lambda: expected_load(oracle, token_len, hashes, mask_num, plain_mask, plain_ids))
    if got_load[0] == "ok":
        assert exp_load[0] == "ok" and got_load[1] == exp_load[1]
        assert got_arrays[0] == "ok"
        arrays = got_arrays[1]
        assert arrays.keys == exp_load[1][0] and arrays.addrs.tolist() == exp_load[1][1]
        assert arrays.offsets.tolist() == plan_slots(arrays.sizes).offsets.tolist()
    else:
        assert exp_load[0] == "err" or isinstance(got_load[1], OverflowError), (got_load, exp_load)
    exp_walk = outcome(lambda: list(oracle.process_tokens(token_len, hashes, mask_num, chunk_mask=plain_mask)))
    if got_walk[0] == "ok":
        assert exp_walk[0] == "ok" and [(s, e, bytes(h)) for s, e, h in got_walk[1]] == exp_walk[1]
        assert got_chunk_walk[0] == "ok"
        assert list(zip(got_chunk_walk[1][0], got_chunk_walk[1][1], strict=True)) == [(s, e) for s, e, _ in
                                                                                       exp_walk[1]]
    else:
        assert exp_walk[0] == "err" or isinstance(got_walk[1], OverflowError), (got_walk, exp_walk)
    if got_store[0] == "ok" and exp_walk[0] == "ok":
        kept = [(s, e, h) for s, e, h in exp_walk[1] if s // BS < len(plain_ids) and plain_ids[s // BS] != 0]
        assert got_store[1][1] == [(s, e) for s, e, _ in kept]
        assert got_store[1][0] == [oracle.key_for(h) for _, _, h in kept]
    check_clean_afterwards(native, oracle)


@st.composite
def key_cases(draw: st.DrawFn) -> tuple[Any, ...]:
    n = draw(st.integers(0, 6))
    length = draw(st.sampled_from([1, 4, 32]))
    hashes = [draw(st.binary(min_size=length, max_size=length)) for _ in range(n)]
    hash_len = draw(st.sampled_from([None, length, length + 1, 0, -1, 2**64]))
    kind = draw(st.sampled_from(["list", "tuple", "blob", "bytearray", "mv_words", "lying", "str", "ints"]))
    obj: Any = hashes
    if kind == "tuple":
        obj = tuple(hashes)
    elif kind == "blob":
        obj = b"".join(hashes) + draw(st.sampled_from([b"", b"x"]))
    elif kind == "bytearray":
        obj = bytearray(b"".join(hashes))
    elif kind == "mv_words":
        raw = b"".join(hashes)
        obj = memoryview(raw).cast("B") if len(raw) % 4 else memoryview(raw).cast("I")
    elif kind == "lying":
        obj = LyingSeq(hashes, n + draw(st.sampled_from([-1, 1])) if n else 0)
    elif kind == "str":
        obj = "deadbeef"
    elif kind == "ints":
        obj = [1, 2, 3]
    prefixes = draw(st.lists(st.sampled_from(["a", "é", "\U0001f600", "m@x"]), max_size=3))
    return hashes, obj, hash_len, prefixes


@given(key_cases())
@FUZZ
def test_key_builders(case: tuple[Any, ...]) -> None:
    hashes, obj, hash_len, prefixes = case
    db = ChunkedTokenDatabase(MD, BS, HBS)
    refcount_before = sys.getrefcount(obj)
    for fn in (lambda: build_keys("p", obj, hash_len), lambda: db.keys_for(obj, hash_len),
               lambda: build_lookup_keys(prefixes, obj, hash_len)):
        got = outcome(fn)
        if got[0] == "ok":
            keys = got[1]
            assert all(not k.endswith("@") for k in keys)
            raw = bytes(obj) if isinstance(obj, (bytes, bytearray, memoryview)) else None
            n = len(raw) // hash_len if raw is not None and hash_len else len(keys)
            flat = [raw[i * hash_len:(i + 1) * hash_len] for i in range(n)] if raw is not None else list(hashes)
            expected_flat = [h.hex() for h in flat]
            assert [k.rpartition("@")[2] for k in keys] == [x for x in expected_flat for _ in
                                                             range(len(keys) // max(1, len(expected_flat)))] or \
                [k.rpartition("@")[2] for k in keys] == expected_flat
        del got, fn
    if not isinstance(obj, (bytes, str, tuple)) or len(obj) > 1:  # empty and 1-item ones are shared singletons
        assert sys.getrefcount(obj) == refcount_before
    if isinstance(obj, bytearray):
        obj.extend(b"!")  # no export left


@given(st.lists(st.one_of(st.sampled_from([0, 1, -1, 2, 2**63, -(2**64)]), st.builds(IndexInt, st.integers(0, 1))),
                max_size=12),
       st.one_of(st.integers(-2, 4), st.lists(st.one_of(st.integers(-1, 4), st.sampled_from(INT_EDGES)), max_size=6)))
@FUZZ
def test_reduce_exists(results: list[Any], widths: Any) -> None:
    plain_results = [plain(r) for r in results]
    got = outcome(lambda: reduce_exists(results, widths))
    if got[0] == "err":
        return
    units = got[1]
    ws = [widths] * len(units) if isinstance(widths, int) else widths
    assert sum(ws) == len(plain_results)
    cursor = 0
    for unit, w in zip(units, ws, strict=True):
        assert unit == all(r == 1 for r in plain_results[cursor:cursor + w])
        cursor += w


@st.composite
def staging_cases(draw: st.DrawFn) -> tuple[Any, ...]:
    keys = draw(st.integers(0, 4))
    regions = draw(st.integers(0, 3))
    sizes = np.array([[draw(st.sampled_from([0, 1, 63, 64, 200, -1])) for _ in range(regions)] for _ in range(keys)],
                     dtype=np.int64).reshape(keys, regions)
    offsets_kind = draw(st.sampled_from(["plan", "zeros", "wild"]))
    return sizes, offsets_kind, draw(st.sampled_from(["inside", "outside", "wild", "staging"])), \
        draw(st.sampled_from(["buffer", "range", "bogus"]))


@given(staging_cases())
@FUZZ
def test_staging_never_touches_memory_it_does_not_own(case: tuple[Any, ...]) -> None:
    sizes, offsets_kind, addr_kind, staging_kind = case
    arena = np.arange(4096, dtype=np.uint64).view(np.uint8)[:4096].copy()
    snapshot = arena.copy()
    keys, regions = sizes.shape
    base = arena.ctypes.data
    addrs = np.full((keys, regions), base, dtype=np.int64)
    if addr_kind == "outside":
        addrs += 4096 - 10
    elif addr_kind == "wild":
        addrs[:] = 0x10
    buf = StagingBuffer(2048)
    if addr_kind == "staging":
        addrs[:] = buf.ptr
    offsets = np.zeros(keys, np.int64)
    if offsets_kind == "plan":
        p = outcome(lambda: plan_slots(np.maximum(sizes, 0)))
        if p[0] == "ok":
            offsets = p[1].offsets
    elif offsets_kind == "wild":
        offsets = np.full(keys, 2**62, np.int64)
    staging: Any = {"buffer": buf, "range": buf.range, "bogus": (0x1000, 1 << 20)}[staging_kind]
    backend = HostCopyBackend([(base, 4096)])
    for fn in (lambda: backend.gather(addrs, sizes, staging, offsets),
               lambda: gather(addrs, sizes, staging, offsets, [(base, 4096)], threads=2),
               lambda: scatter(addrs, sizes, staging, offsets, [(base, 4096)], select=np.ones(keys, bool))):
        got = outcome(fn)
        if staging_kind == "bogus" and np.any(sizes > 0):
            assert got[0] == "err"
    if addr_kind in ("outside", "wild", "staging") and np.any(sizes > 0):
        assert np.array_equal(arena, snapshot) or addr_kind == "outside"


def test_threads_reconfiguring_while_every_entry_point_runs() -> None:
    """A thread flips the regions between two layouts; every result must come from one of them."""
    import threading

    native, oracle_a = fresh_pair()
    oracle_b = OracleChunkedTokenDatabase(MD, BS, HBS)
    bases_b = [b + (1 << 24) for b in BASES]
    oracle_b.set_kv_caches_base_addr(bases_b)
    oracle_b.set_block_len(list(LENS))
    chunks, ids = [(0, 32), (32, 64), (64, 80)], [3, 4, 5]
    allowed = [oracle_a.prepare_values(chunks, ids), oracle_b.prepare_values(chunks, ids)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def flipper() -> None:
        while not stop.is_set():
            native.set_kv_caches_base_addr(list(bases_b))
            native.set_kv_caches_base_addr(list(BASES))

    def worker() -> None:
        try:
            for _ in range(300):
                assert native.prepare_values(chunks, ids) in allowed
                arrays = native.prepare_values_array(chunks, ids)
                assert tuple(a.tolist() for a in arrays) in allowed
                plan = native.plan_load(80, [b"a" * 4] * 5, ids)
                assert tuple(plan[1:]) in allowed
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=flipper)] + [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not errors, errors[0]


@pytest.mark.parametrize("seed", range(3))
def test_random_hostile_storm_never_crashes(seed: int) -> None:
    """Many random hostile calls on one database, then a clean call equals the reference."""
    rng = np.random.default_rng(seed)
    native, oracle = fresh_pair(400)
    victim: list[Any] = []
    acts = [a for name, a in sorted(actions(native, victim).items()) if name != "collect"]  # collect: slow
    for _ in range(150):
        n = int(rng.integers(0, 4))
        chunks = [(IndexInt(int(rng.integers(0, 4)) * HBS, acts[int(rng.integers(len(acts)))]),
                   int(rng.integers(0, 6)) * HBS) for _ in range(n)]
        victim[:] = [IndexInt(int(rng.integers(0, 40)), acts[int(rng.integers(len(acts)))]) for _ in range(4)]
        for fn in (lambda c=chunks: native.prepare_values(c, victim),
                   lambda c=chunks: native.prepare_values_array(c, victim),
                   lambda: native.plan_load(64, [b"h" * 4] * 4, victim),
                   lambda: native.plan_store(64, [b"h" * 4] * 4, victim)):
            outcome(fn)
    check_clean_afterwards(native, oracle)
