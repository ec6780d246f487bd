"""Native keys, lookup namespaces and reduction, chunk walk and fused plans vs the oracle (docs/keys.md,
docs/address-rows.md)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr_testing import oracle_regions, paired
from mooncake_kvaddr import BlobBlockHashes, ChunkedTokenDatabase, KeyMetadata, PoolKey, _native
from mooncake_kvaddr.core.keys import (
    SpecKind,
    build_keys,
    build_lookup_keys,
    lookup_namespaces,
    lookup_prefixes,
    reduce_exists,
    replication_factor,
)
from mooncake_kvaddr.driver.staging import plan_slots

prefixes = st.text(min_size=0, max_size=40)  # includes non-ASCII, astral and surrogate code points
hash_lists = st.integers(1, 40).flatmap(
    lambda n: st.lists(st.binary(min_size=n, max_size=n), min_size=0, max_size=30).map(lambda hs: (n, hs))
)


@settings(max_examples=500, deadline=None)
@given(prefixes, hash_lists)
def test_build_keys_equal_fstrings(prefix: str, sized: tuple[int, list[bytes]]) -> None:
    n, hashes = sized
    expected = [f"{prefix}@{h.hex()}" for h in hashes]
    assert build_keys(prefix, hashes) == expected
    assert build_keys(prefix, hashes, n) == expected
    assert build_keys(prefix, b"".join(hashes), n) == expected
    assert build_keys(prefix, memoryview(bytearray(b"".join(hashes))), n) == expected
    assert build_keys(prefix, BlobBlockHashes(memoryview(b"".join(hashes)), n)) == expected
    assert build_keys(prefix, [memoryview(h) for h in hashes]) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(prefixes, min_size=0, max_size=8), hash_lists)
def test_build_lookup_keys_hash_major(prefix_list: list[str], sized: tuple[int, list[bytes]]) -> None:
    n, hashes = sized
    expected = [f"{p}@{h.hex()}" for h in hashes for p in prefix_list]
    assert build_lookup_keys(prefix_list, hashes) == expected
    assert build_lookup_keys(prefix_list, b"".join(hashes), n) == expected


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.lists(prefixes, min_size=0, max_size=8), hash_lists)
def test_lookup_key_blob_is_the_lookup_keys_utf8(prefix_list: list[str], sized: tuple[int, list[bytes]]) -> None:
    n, hashes = sized
    if not all(_encodable(p) for p in prefix_list):
        with pytest.raises(UnicodeEncodeError):  # what Mooncake's own conversion of such a key str raises
            _native.lookup_key_blob(prefix_list, hashes)
        return
    expected = [k.encode() for k in build_lookup_keys(prefix_list, hashes)]
    for args in ((prefix_list, hashes), (prefix_list, b"".join(hashes), n), (tuple(prefix_list), hashes, n),
                 (prefix_list, [memoryview(h) for h in hashes])):  # fmt: skip
        blob, offsets = _native.lookup_key_blob(*args)
        assert isinstance(blob, bytes) and offsets.dtype == np.int64 and offsets.shape == (len(expected) + 1,)
        assert [blob[offsets[i] : offsets[i + 1]] for i in range(len(expected))] == expected
        assert offsets[0] == 0 and offsets[-1] == len(blob)


def test_lookup_key_blob_refuses_bad_input() -> None:
    for args in ((["ok"], [1]), ("one str", [b"x"]), ([b"bytes"], [b"x"]), ({"a"}, [b"x"]), (["ok"], "str"),
                 (["ok"], b"abc", 2), (["ok"], [b"ab", b"abc"], 2), (["ok"], b"abcd"), (["ok"], [b"ab"], 0),
                 ([1], [b"x"]), (["ok"], {b"x"})):  # fmt: skip
        with pytest.raises((TypeError, ValueError)):
            _native.lookup_key_blob(*args)
    with pytest.raises(UnicodeEncodeError):
        _native.lookup_key_blob(["\ud800"], [b"x"])


def test_key_for_non_ascii_model_name() -> None:
    md = KeyMetadata("Модель-ü😀", 0, 0, 0, 0, cache_prefix="dépA")
    db = ChunkedTokenDatabase(md, 16)
    assert db.key_for(b"\x00\xff") == f"{PoolKey.build_prefix(md)}@00ff"
    assert db.keys_for([b"\x01", b"\x02"]) == [db.key_for(b"\x01"), db.key_for(b"\x02")]


def test_key_errors() -> None:
    with pytest.raises(ValueError):
        build_keys("p", b"abc", 2)  # blob not a multiple of hash_len
    with pytest.raises(ValueError):
        build_keys("p", b"abcd")  # blob without hash_len
    with pytest.raises(ValueError):
        build_keys("p", [b"ab", b"abc"], 2)
    with pytest.raises(ValueError):
        build_keys("p", b"abcd", 0)
    with pytest.raises(TypeError):
        build_keys("p", ["ab"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        build_keys("p", [1])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        build_keys("p", "abcd")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        build_keys(b"p", [b"a"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        build_lookup_keys("ab", [b"a"])
    with pytest.raises(TypeError):
        ChunkedTokenDatabase(KeyMetadata("t", 0, 0, 0, 0), 16).key_for("ab")  # type: ignore[arg-type]


@pytest.mark.parametrize("odd", [b"a", b"abc", b""], ids=["shorter", "longer", "empty"])
def test_a_hash_of_another_length_than_hash_len_is_refused(odd: bytes) -> None:
    """With ``hash_len`` given, every hash of a sequence must have exactly that many bytes: a shorter one too."""
    hashes = [b"ab", odd, b"cd"]
    match = rf"hash 1 has {len(odd)} bytes, expected hash_len 2"
    for build in (
        lambda: build_keys("p", hashes, 2),
        lambda: build_lookup_keys(["p", "q"], hashes, 2),
        lambda: _native.lookup_key_blob(["p"], hashes, 2),
        lambda: ChunkedTokenDatabase(KeyMetadata("t", 0, 0, 0, 0), 16).keys_for(hashes, hash_len=2),
    ):
        with pytest.raises(ValueError, match=match):
            build()


# Lookup namespaces (docs/keys.md).
def prefixes_for(md: KeyMetadata, tp: int, pcp: int, dcp: int, pp: int, factor: int) -> list[str]:
    return lookup_prefixes(md, lookup_namespaces(tp, pcp, dcp, pp, factor))


def test_dcp_namespaces() -> None:
    md = KeyMetadata("m", 0, 0, 0, 0)
    factor = replication_factor(SpecKind.ATTENTION, tp_size=4, dcp_size=4, num_kv_heads=1)
    assert factor == 1
    assert prefixes_for(md, 4, 1, 4, 1, factor) == [
        f"m@tp_rank:{i}@pcp0@dcp{i}@pp_rank:0@group:0" for i in range(4)
    ]
    # One namespace missing → the unit is absent (the lookup's hit is then 0: tests/test_lookup.py).
    assert reduce_exists([1, 1, 0, 1], 4) == [False]


def test_pcp_namespaces() -> None:
    md = KeyMetadata("m", 0, 0, 0, 0)
    factor = replication_factor("attention", tp_size=4, dcp_size=1, num_kv_heads=1)
    assert prefixes_for(md, 4, 2, 1, 1, factor) == [
        "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0",
        "m@tp_rank:0@pcp1@dcp0@pp_rank:0@group:0",
    ]


def test_replication_factors() -> None:
    assert [replication_factor(k, 4, 1, 2) for k in ("mla", "attention", "mamba")] == [4, 2, 1]
    assert replication_factor(["mla", "attention"], 4, 1, 2) == 2
    assert replication_factor(["attention", "mla"], 4, 1, 2) == 2
    assert replication_factor(["mla", "mamba"], 4, 1, 2) == 1
    assert replication_factor("attention", 2, 1, 1) == 2
    assert replication_factor("mla", 4, 2, 1) == 1
    counts = [len(lookup_namespaces(4, 1, 1, 1, f)) for f in (4, 2, 1)]
    assert counts == [1, 2, 4]
    with pytest.raises(ValueError):
        replication_factor("gqa", 4, 1, 2)
    with pytest.raises(ValueError):
        lookup_namespaces(0, 1, 1, 1, 1)


def test_replication_factor_refuses_what_has_no_factor() -> None:
    """Sizes that are not positive, a group without a spec kind and, where heads decide it, no heads: a clear
    ``ValueError`` each, never a factor (a factor of 0 would divide by zero later; a negative one names no rank)."""
    for tp, dcp in ((0, 1), (-2, 1), (4, 0), (4, -1)):
        with pytest.raises(ValueError, match=f"tp_size and dcp_size must be positive, got {tp}, {dcp}"):
            replication_factor("attention", tp, dcp, 2)
    with pytest.raises(ValueError, match="at least one spec kind"):
        replication_factor([], 4, 1, 2)
    for heads in (0, -1):
        with pytest.raises(ValueError, match=f"num_kv_heads must be positive, got {heads}"):
            replication_factor("attention", 4, 1, heads)
    # Heads do not decide MLA, Mamba or DCP groups: no heads needed there.
    assert [replication_factor(k, 4, 1, 0) for k in ("mla", "mamba")] == [4, 1]
    assert replication_factor("attention", 4, 2, 0) == 1


def test_a_hash_view_and_a_hash_len_that_disagree_are_refused() -> None:
    """Keys built from a ``BlobBlockHashes`` with another ``hash_len`` than the view's: refused, not cut at the
    wrong width; the view's own width (or none) builds the keys."""
    view = BlobBlockHashes(b"\x01" * 8 + b"\x02" * 8, 8)
    expected = ["p@" + "01" * 8, "p@" + "02" * 8]
    assert build_keys("p", view) == build_keys("p", view, 8) == expected
    with pytest.raises(ValueError, match="hash_len 4 differs from the view's 8"):
        build_keys("p", view, 4)
    with pytest.raises(ValueError, match="hash_len 16 differs from the view's 8"):
        build_lookup_keys(["p", "q"], view, 16)


def test_a_hash_view_refuses_a_negative_width_a_non_buffer_and_width_zero_for_bytes() -> None:
    for bad in (-1, -8, 2.0, True, "8"):
        with pytest.raises(ValueError, match="hash_len must be a positive int"):
            BlobBlockHashes(b"\x00" * 8, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="blob must be bytes-like, not list"):
        BlobBlockHashes([1, 2, 3, 4], 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hash_len must be positive for a non-empty blob"):
        BlobBlockHashes(b"\x00" * 8, 0)
    assert len(BlobBlockHashes(b"", 0)) == 0


def test_fa_plus_mamba_prefixes() -> None:
    g0 = KeyMetadata("m", 0, 0, 0, 0, group_id=0)
    g1 = KeyMetadata("m", 0, 0, 0, 0, group_id=1)
    assert prefixes_for(g0, 2, 1, 1, 1, replication_factor("attention", 2, 1, 1)) == [
        "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
    ]
    assert prefixes_for(g1, 2, 1, 1, 1, replication_factor("mamba", 2, 1, 1)) == [
        "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1",
        "m@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1",
    ]


def test_reduce_exists_variable_widths_and_values() -> None:
    assert reduce_exists([1, 1, 1, -900, 1, 2, 1 << 70], [2, 2, 1, 0, 2]) == [True, False, True, True, False]
    # An answer outside int64 is never "present", alone or beside present ones (fresh mutant M8-03).
    assert reduce_exists([1 << 70, 1, 1 << 64, 1, -(1 << 70)], [1, 2, 2]) == [False, False, False]
    assert reduce_exists([1 << 63, 1], 1) == [False, True]
    with pytest.raises(ValueError):
        reduce_exists([1, 1, 1], 2)
    with pytest.raises(ValueError):
        reduce_exists([1, 1, 1], [1, 1])


def test_keys_start_with_prefix_and_model_and_end_with_the_hash() -> None:
    """A key's cache prefix and model lead it and its hash hex is its last ``@`` field, whatever the rank and
    group fields between them."""
    md = KeyMetadata("m", 3, 0, 0, 0, group_id=2, cache_prefix="dep")
    keys = ChunkedTokenDatabase(md, 16).keys_for([b"\xab", b"\xcd"])
    assert [key.rpartition("@")[2] for key in keys] == ["ab", "cd"]
    assert all(key.startswith("dep@m@") for key in keys)


# The chunk walk and the fused plans against the oracle's composition.
walks = st.fixed_dictionaries(
    {
        "bs_hbs": st.sampled_from([(16, 16), (32, 8), (16, 4), (128, 16), (4, 4)]),
        "chunks": st.integers(0, 30),
        "tail": st.integers(0, 3),
        "mask_num": st.integers(-40, 600),
        "mask": st.none() | st.lists(st.booleans(), max_size=40),
        "put_step": st.integers(1, 4),
        "rank": st.integers(-1, 4),
        "n_ids": st.integers(0, 40),
    }
)


def walk_setup(w: dict[str, Any]) -> tuple[ChunkedTokenDatabase, Any, list[bytes], int, list[int]]:
    bs, hbs = w["bs_hbs"]
    token_len = w["chunks"] * bs + min(w["tail"], bs // hbs - 1) * hbs
    hashes = [os.urandom(8) for _ in range(token_len // hbs + 1)]
    native, oracle = paired(*oracle_regions(5, 3), bs, hbs)
    block_ids = [(i * 7) % 11 for i in range(w["n_ids"])]
    return native, oracle, hashes, token_len, block_ids


@settings(max_examples=400, deadline=None)
@given(walks)
def test_process_tokens_matches_oracle(w: dict[str, Any]) -> None:
    native, oracle, hashes, token_len, _ = walk_setup(w)
    kwargs = dict(chunk_mask=w["mask"], put_step=w["put_step"], put_step_rank=w["rank"])
    assert list(native.process_tokens(token_len, hashes, w["mask_num"], **kwargs)) == list(
        oracle.process_tokens(token_len, hashes, w["mask_num"], **kwargs)
    )


@settings(max_examples=400, deadline=None)
@given(walks)
def test_plan_load_matches_composition(w: dict[str, Any]) -> None:
    native, oracle, hashes, token_len, block_ids = walk_setup(w)
    mask = w["mask"]
    chunks, keys = [], []
    for start, end, h in oracle.process_tokens(token_len, hashes, w["mask_num"]):
        index = start // native.block_size
        if mask is None or (index < len(mask) and mask[index]):
            chunks.append((start, end))
            keys.append(oracle.key_for(h))
    try:
        expected: Any = (keys, *oracle.prepare_values(chunks, block_ids))
    except IndexError:
        expected = IndexError
    for hashes_arg, hash_len in ((hashes, None), (b"".join(hashes), 8)):
        if expected is IndexError:
            with pytest.raises(IndexError):
                native.plan_load(token_len, hashes_arg, block_ids, w["mask_num"], mask, hash_len=hash_len)
        else:
            plan = native.plan_load(token_len, hashes_arg, block_ids, w["mask_num"], mask, hash_len=hash_len)
            assert tuple(plan) == tuple(expected)


def test_plan_load_arrays_refuses_a_slot_alignment_of_zero_or_below() -> None:
    """0 is no power of two: its mask (-1) would round every slot offset down to 0, all keys on one slot."""
    native, _ = paired(*oracle_regions(4, 2), 32, 16)
    hashes = [bytes([i]) * 8 for i in range(8)]
    for bad in (0, -64, 3):
        with pytest.raises(ValueError, match="slot_alignment"):
            native.plan_load_arrays(128, hashes, [5, 6, 7, 8], slot_alignment=bad)
    for good in (1, 64):
        plan = native.plan_load_arrays(128, hashes, [5, 6, 7, 8], slot_alignment=good)
        assert plan.offsets.tolist() == plan_slots(plan.sizes, good).offsets.tolist()
        assert len(set(plan.offsets.tolist())) == len(plan.keys) == 4


class _OwnHex(bytes):
    def hex(self, *args: Any) -> str:  # vLLM would key this hash by it; the seed-era database does not
        return "ff"


def test_the_seed_era_database_keys_any_bytes_like_hash_by_its_bytes_in_every_plan() -> None:
    """docs/keys.md, "Which hash objects are read": vLLM's rule (exact ``bytes`` or ``memoryview``) is the
    plugin's; the seed-era database's ``key_for``, ``keys_for``, ``plan_load``, ``plan_load_arrays`` and
    ``plan_store`` read any bytes-like hash by its bytes (a bytearray, numpy arrays, a strided view, a ``bytes``
    subclass with its own ``hex``) and give the plans of the same hashes as ``bytes``."""
    native, _ = paired(*oracle_regions(4, 2), 32, 16)
    raw = [bytes([i + 1]) * 8 for i in range(8)]  # 128 tokens: four 32-token chunks, eight 16-token hashes
    block_ids = [5, 6, 7, 8]

    def strided(h: bytes) -> np.ndarray:
        wide = np.zeros(2 * len(h), dtype=np.uint8)
        wide[::2] = np.frombuffer(h, dtype=np.uint8)
        return wide[::2]

    forms = {
        "bytearray": [bytearray(h) for h in raw],
        "numpy": [np.frombuffer(h, dtype=np.uint8).copy() for h in raw],
        "numpy_u64": [np.frombuffer(h, dtype=np.uint64).copy() for h in raw],
        "strided": [strided(h) for h in raw],
        "own_hex": [_OwnHex(h) for h in raw],
    }
    keys = native.keys_for(raw)
    load = tuple(native.plan_load(128, raw, block_ids))
    arrays = native.plan_load_arrays(128, raw, block_ids)
    store = tuple(native.plan_store(128, raw, block_ids))
    assert len(load[0]) == 4 and len(store[0]) == 4
    for name, hashes in forms.items():
        assert [native.key_for(h) for h in hashes] == keys, name
        assert native.keys_for(hashes) == keys, name
        assert tuple(native.plan_load(128, hashes, block_ids)) == load, name
        got = native.plan_load_arrays(128, hashes, block_ids)
        assert got.keys == arrays.keys, name
        assert got.addrs.tolist() == arrays.addrs.tolist() and got.sizes.tolist() == arrays.sizes.tolist(), name
        assert tuple(native.plan_store(128, hashes, block_ids)) == store, name


@pytest.mark.parametrize("odd", ["own_hex", "bytearray", "numpy"])
def test_the_plugins_key_paths_refuse_hashes_vllm_keys_otherwise(odd: str) -> None:
    """docs/keys.md, "Which hash objects are read": without ``any_buffer`` (the vLLM plugin's lookup keys and key
    blob), only exact ``bytes`` and ``memoryview`` hashes are keyed natively; any other, a ``bytes`` subclass with
    its own ``hex`` included, is a ``TypeError`` naming it (the plugin then hands the call to vLLM). The driver's
    rule (``any_buffer=True``) keys the same hashes by their bytes."""
    raw = [b"\x01" * 8, b"\x02" * 8]
    convert = {"own_hex": _OwnHex, "bytearray": bytearray, "numpy": lambda h: np.frombuffer(h, dtype=np.uint8)}[odd]
    hashes = [raw[0], convert(raw[1])]
    prefixes = ["p", "q"]
    for build in (_native.build_lookup_keys, _native.lookup_key_blob):
        with pytest.raises(TypeError, match=r"hash 1 is a .*: only bytes and memoryview hashes"):
            build(prefixes, hashes)
    expected = _native.build_lookup_keys(prefixes, raw)
    assert _native.build_lookup_keys(prefixes, hashes, any_buffer=True) == expected
    assert _native.build_lookup_keys(prefixes, [raw[0], memoryview(raw[1])]) == expected


@settings(max_examples=400, deadline=None)
@given(walks, st.booleans())
def test_plan_store_matches_composition(w: dict[str, Any], skip_null: bool) -> None:
    native, oracle, hashes, token_len, block_ids = walk_setup(w)
    kwargs = dict(chunk_mask=w["mask"], put_step=w["put_step"], put_step_rank=w["rank"])
    keys, chunks, ids = [], [], []
    for start, end, h in oracle.process_tokens(token_len, hashes, w["mask_num"], **kwargs):
        index = start // native.block_size
        if index >= len(block_ids) or (skip_null and block_ids[index] == 0):
            continue
        keys.append(oracle.key_for(h))
        chunks.append((start, end))
        ids.append(block_ids[index])
    plan = native.plan_store(token_len, hashes, block_ids, w["mask_num"], w["mask"], put_step=w["put_step"],
                             put_step_rank=w["rank"], skip_null_block=skip_null)
    assert tuple(plan) == (keys, chunks, ids)


def test_plan_asserts_like_process_tokens() -> None:
    db = ChunkedTokenDatabase(KeyMetadata("t", 0, 0, 0, 0), 32, 8)
    with pytest.raises(AssertionError):
        db.plan_load(33, [b"a"] * 8, [0])
    with pytest.raises(AssertionError):
        db.plan_load(64, [b"a"] * 4, [0, 1])
    with pytest.raises(AssertionError):
        db.plan_store(32, [b"a"] * 4, [0], put_step=0)
    assert tuple(db.plan_load(64, [], [0])) == ([], [], [], [])


@pytest.mark.parametrize("dcp", [1, 4])
def test_put_striding_covers_every_get(dcp: int) -> None:
    tp, kv_heads, bs = 4, 1, 16
    hashes = [bytes([i]) for i in range(12)]
    block_ids = list(range(1, 13))
    factor = replication_factor("attention", tp, dcp, kv_heads)
    puts: set[str] = set()
    gets: set[str] = set()
    for rank in range(tp):
        md = KeyMetadata("m", rank // factor, 0, rank % dcp, 0)
        db = ChunkedTokenDatabase(md, bs)
        puts.update(db.plan_store(len(hashes) * bs, hashes, block_ids, put_step=factor,
                                  put_step_rank=rank % factor).keys)
        gets.update(db.plan_load(len(hashes) * bs, hashes, block_ids).keys)
    assert gets <= puts
