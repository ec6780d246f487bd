"""The layout engine under vLLM 0.34's rules (docs/vllm.md, "vLLM 0.34 rules") against a pure-Python reference.

vLLM 0.34 gave rank-local regions a block stride apart from the bytes stored and cut TP-shared blocks into store
chunks. The engine computes both beside 0.33's rules, so a generated differential (values, Python types, errors,
list and array outputs, warm caches, in-place edits) checks the new rules and that switching rules never leaks.
No vLLM needed: the reference below restates vLLM 0.34's two ``prepare_values`` with exact integers.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from kvaddr_testing import assert_native_ints
from mooncake_kvaddr import _native

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
Rows = tuple[list[list[int]], list[list[int]], list[int]]
Template = tuple[list[int], list[int], list[int]]

# A different stream every run (the seed is in every failure message); KVADDR_034_SEED replays one.
SEED = int(os.environ.get("KVADDR_034_SEED", str(time.time_ns() % (1 << 32))))
CASES = 6_000  # per rule: 12,000 generated cases, each through prepare_values and prepare_values_array


# --- the reference --------------------------------------------------------------------------------------


def _fit(rows: Rows) -> Rows:
    """vLLM computes in 64-bit numpy and wraps; the engine raises instead, as this reference does."""
    for row in (*rows[0], *rows[1]):
        for value in row:
            if not INT64_MIN <= value <= INT64_MAX:
                raise OverflowError("a cell does not fit in int64")
    return rows


def ref_regions(
    bases: Sequence[int], block_len: Sequence[int], block_stride: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Each region's stride and stored bytes: ``block_stride[r % L]``, ``block_len[r % L]``, L = len(block_stride)."""
    length = len(block_stride)
    strides = [block_stride[r % length] for r in range(len(bases))]  # ZeroDivisionError when empty
    lens = [block_len[r % length] for r in range(len(bases))]  # IndexError when block_len is short
    return strides, lens


def ref_regions_then_no_rows(bases: Sequence[int], block_len: Sequence[int], block_stride: Sequence[int]) -> Rows:
    ref_regions(bases, block_len, block_stride)
    return [], [], []


def ref_rank_local(
    bases: Sequence[int],
    block_len: Sequence[int],
    block_stride: Sequence[int],
    chunks: Sequence[tuple[int, int]],
    block_ids: Sequence[int],
    shard_ids: Sequence[int],
    block_size: int,
    hash_block_size: int,
) -> Rows:
    """vLLM 0.34's RankLocalStoreLayout.prepare_values. With ``block_stride = block_len`` it is vLLM 0.33's."""
    if not chunks:
        return [], [], []
    assert len(chunks) == len(shard_ids) and all(s == 0 for s in shard_ids)
    strides, lens = ref_regions(bases, block_len, block_stride)
    spans = [end - start for start, end in chunks]
    assert all(span % hash_block_size == 0 for span in spans)
    ids = []
    for start, _ in chunks:
        block_id = int(block_ids[start // block_size])
        if not INT64_MIN <= block_id <= INT64_MAX:
            raise OverflowError("block id outside int64")
        ids.append(block_id)
    counts = [-(-span // block_size) for span in spans]
    addrs = [[b + block_id * s for b, s in zip(bases, strides)] for block_id in ids]
    sizes = [[s * (count - 1) + n for s, n in zip(strides, lens)] for count in counts]
    return _fit((addrs, sizes, ids))


def ref_tp_chunked(
    templates: Sequence[Sequence[Template]],
    block_size: int,
    chunk_size: int,
    first_shard: int,
    n_shards: int,
    chunks: Sequence[tuple[int, int]],
    block_ids: Sequence[int],
    shard_ids: Sequence[int],
) -> Rows:
    """vLLM 0.34's TPShardedStoreLayout.prepare_values (stacked templates), ids kept to int64."""
    if not chunks:
        return [], [], []
    if len(chunks) != len(shard_ids):
        raise ValueError("Each Store chunk must have one shard ID")
    if n_shards == 0:
        raise IndexError("store_shard_ids[0] of a rank that owns no shard")
    ids: list[int] = [0] * len(chunks)

    def boundary(k: int) -> None:
        start, end = chunks[k]
        if start % chunk_size or not 0 < end - start <= chunk_size:
            raise ValueError("Invalid Store chunk boundary")

    def owned(k: int) -> None:
        if not 0 <= shard_ids[k] - first_shard < n_shards:
            raise ValueError("Store shard is not owned by this TP rank")

    def has_block(k: int) -> None:
        if chunks[k][0] // block_size >= len(block_ids):
            raise ValueError("Store chunk has no local cache block")

    def block_id(k: int) -> None:
        ids[k] = int(block_ids[chunks[k][0] // block_size])
        if not 0 <= ids[k] <= INT64_MAX:  # vLLM: uint64 (negative → OverflowError); the engine: int64
            raise OverflowError("block id outside [0, 2**63)")

    steps = (boundary, owned, has_block, block_id)
    if len(chunks) > 16:
        for step in steps:
            for k in range(len(chunks)):
                step(k)
    else:
        for k in range(len(chunks)):
            for step in steps:
                step(k)
    addrs, sizes = [], []
    for (start, _), shard_id, bid in zip(chunks, shard_ids, ids):
        offset = start % block_size
        bases, strides, seg_sizes = templates[offset // chunk_size][shard_id - first_shard]
        addrs.append([b + bid * s for b, s in zip(bases, strides)])
        sizes.append(list(seg_sizes))
    return _fit((addrs, sizes, ids))


# --- comparing ------------------------------------------------------------------------------------------


def outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", call(*args)
    except (AssertionError, IndexError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return "error", exc


def same(want: tuple[str, Any], got: tuple[str, Any], arrays: bool, exact_messages: bool, context: str) -> str:
    """Compares one engine outcome with the reference's; returns the outcome's name (for the coverage count)."""
    where = f"{context} (KVADDR_034_SEED={SEED}, {'arrays' if arrays else 'lists'})"
    assert got[0] == want[0], f"{where}: reference {want}, engine {got}"
    if want[0] == "error":
        assert isinstance(got[1], type(want[1])), f"{where}: reference {want[1]!r}, engine {got[1]!r}"
        if exact_messages and type(want[1]) is ValueError:
            assert str(got[1]) == str(want[1]), where
        return type(want[1]).__name__ + (f": {want[1]}" if exact_messages and type(want[1]) is ValueError else "")
    if arrays:
        addrs, sizes, ids = got[1]
        for array in (addrs, sizes, ids):
            assert type(array) is np.ndarray and array.dtype == np.int64, where
        n = len(want[1][2])
        width = len(want[1][0][0]) if n else 0
        if n:
            assert addrs.shape == (n, width) and sizes.shape == (n, width) and ids.shape == (n,), where
        assert (addrs.tolist(), sizes.tolist(), ids.tolist()) == want[1], where
    else:
        assert got[1] == want[1], f"{where}: reference {want[1]}, engine {got[1]}"
        assert_native_ints(got[1])
    return "ok"


# --- generators -----------------------------------------------------------------------------------------


def pick_block_id(rng: random.Random, stride_hint: int) -> int:
    roll = rng.random()
    if roll < 0.9:
        return rng.randint(-3, 1 << 30)
    if roll < 0.97:  # ids near where base + id * stride leaves int64
        edge = INT64_MAX // max(1, stride_hint)
        return edge + rng.randint(-2, 2)
    return rng.choice([INT64_MAX, INT64_MIN, 1 << 63, -(1 << 63) - 1])  # the last two are not int64


def region_lists(rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    n_regions = rng.choice([0, 1, 2, 3, 5, 8, 12])
    length = rng.randint(1, n_regions + 2) if rng.random() < 0.97 else 0  # len(block_stride)
    lens, strides = [], []
    for _ in range(length):
        n = rng.randint(1, 1 << 20)
        roll = rng.random()
        if roll < 0.8:
            stride = n + rng.randint(1, 1 << 16)  # padding after the stored bytes
        elif roll < 0.9:
            stride = n
        elif roll < 0.97:
            stride = rng.randint(1, n)  # never registered by vLLM, but accepted: the same arithmetic
        else:
            stride = rng.randint(1 << 60, 1 << 62)
        lens.append(n)
        strides.append(stride)
    roll = rng.random()
    if roll < 0.05 and lens:
        del lens[rng.randrange(len(lens)) :]  # shorter than block_stride: IndexError when a region reads past it
    elif roll < 0.1:
        lens += [rng.randint(1, 99) for _ in range(rng.randint(1, 3))]  # longer: the tail is never read
    top = INT64_MAX if rng.random() < 0.05 else 1 << 48
    bases = [rng.randint(0, top) for _ in range(n_regions)]
    return bases, lens, strides


def rank_local_call(rng: random.Random, block_size: int, hbs: int, n_blocks: int) -> tuple[list[Any], list[int]]:
    n_chunks = rng.choice([0, 1, 1, 2, 3, 5, 9])
    chunks: list[Any] = []
    for _ in range(n_chunks):
        block_index = rng.randint(-n_blocks, n_blocks - 1)  # negative ones index from the end, as Python does
        if rng.random() < 0.02:
            block_index = rng.choice([-n_blocks - 1, n_blocks])  # IndexError
        start = block_index * block_size + rng.randrange(block_size // hbs) * hbs
        span = rng.randint(-2, 3 * block_size // hbs) * hbs  # multi-block, below a block, empty, negative
        if rng.random() < 0.02:
            span += 1 if hbs > 1 else 0
        chunks.append((start, start + span) if rng.random() < 0.8 else [start, start + span])
    shard_ids = [0] * n_chunks
    if rng.random() < 0.02 and n_chunks:
        shard_ids[rng.randrange(n_chunks)] = 1
    if rng.random() < 0.02:
        shard_ids.append(0)
    return chunks, shard_ids


def edit_in_place(rng: random.Random, lists: tuple[list[int], list[int], list[int]]) -> None:
    target = rng.choice(lists)
    roll = rng.random()
    if target and roll < 0.6:
        target[rng.randrange(len(target))] += rng.randint(1, 4096)
    elif roll < 0.8:
        target.append(rng.randint(1, 1 << 20))
    elif target:
        target.pop()


def test_rank_local_034_differential() -> None:
    rng = random.Random(SEED)
    seen: Counter[str] = Counter()
    done = 0
    while done < CASES:
        block_size = rng.choice([1, 2, 4, 8, 16, 32, 64, 128])
        hbs = rng.choice([d for d in (1, 2, 4, 8, 16, 32) if block_size % d == 0])
        bases, lens, strides = region_lists(rng)
        with_strides = rng.random() < 0.85  # else vLLM 0.33's rules on the same engine
        engine = _native.LayoutEngine(block_size, hbs, False, 0, 1, rng.choice([0, 1 << 20]))
        engine.set_region_sources(bases, lens, strides if with_strides else None)
        n_blocks = rng.randint(1, 6)
        block_ids = [pick_block_id(rng, max(strides, default=1)) for _ in range(n_blocks)]
        for call in range(rng.randint(1, 6)):  # warm rows, edits and rule switches in between
            if call and rng.random() < 0.3:
                edit_in_place(rng, (bases, lens, strides))
            if call and rng.random() < 0.08:
                with_strides = not with_strides
                engine.set_region_sources(bases, lens, strides if with_strides else None)
            chunks, shard_ids = rank_local_call(rng, block_size, hbs, n_blocks)
            ids: Any = block_ids
            if rng.random() < 0.2 and all(INT64_MIN <= i <= INT64_MAX for i in block_ids):
                ids = np.asarray(block_ids, dtype=np.int64)
            rule = strides if with_strides else lens
            want = outcome(ref_rank_local, bases, lens, rule, chunks, ids, shard_ids, block_size, hbs)
            context = f"rank-local case {done}: {bases=} {lens=} {strides=} {with_strides=} {chunks=} {block_ids=}"
            for arrays in (False, True):
                method = engine.prepare_values_array if arrays else engine.prepare_values
                got = outcome(method, chunks, ids, shard_ids)
                if arrays and not chunks:
                    # The array form reads the regions even for no chunks (as under 0.33's rules): their errors.
                    want = outcome(ref_regions_then_no_rows, bases, lens, rule)
                seen[same(want, got, arrays, False, context)] += 1
            done += 1
    # Every outcome the rules have was generated (a generator that stops covering one fails here).
    for kind in ("ok", "AssertionError", "ZeroDivisionError", "IndexError", "OverflowError"):
        assert seen[kind] >= 10, (kind, seen, SEED)


def tp_templates(rng: random.Random, chunks_per_block: int, n_shards: int) -> list[list[Template]]:
    width = rng.choice([0, 1, 2, 3, 5])
    big = rng.random() < 0.1
    return [
        [
            (
                [rng.randint(0, INT64_MAX if big else 1 << 48) for _ in range(width)],
                [rng.randint(1, 1 << 62 if big else 1 << 24) for _ in range(width)],
                [rng.randint(1, 1 << 20) for _ in range(width)],
            )
            for _ in range(n_shards)
        ]
        for _ in range(chunks_per_block)
    ]


def tp_call(
    rng: random.Random, block_size: int, chunk_size: int, first: int, n_shards: int, n_blocks: int
) -> tuple[list[Any], list[int]]:
    n_chunks = rng.choice([0, 1, 2, 4, 7, 16, 17, 24, 40])  # <= 16: one by one; > 16: in phases
    error_rate = rng.choice([0.0, 0.0, 0.01, 0.05])
    chunks: list[Any] = []
    shard_ids = []
    for _ in range(n_chunks):
        block_index = rng.randint(-n_blocks, n_blocks - 1)
        if rng.random() < error_rate:
            block_index = n_blocks + rng.randint(0, 2)  # no local cache block
        elif rng.random() < error_rate:
            block_index = -n_blocks - 1 - rng.randint(0, 2)  # IndexError
        start = block_index * block_size + rng.randrange(block_size // chunk_size) * chunk_size
        length = rng.randint(1, chunk_size)
        if rng.random() < error_rate:
            roll = rng.random()
            if roll < 0.3 and chunk_size > 1:
                start += rng.randint(1, chunk_size - 1)  # not on a store chunk boundary
            elif roll < 0.6:
                length = rng.choice([0, -chunk_size])
            else:
                length = chunk_size + rng.randint(1, 3)
        chunks.append((start, start + length) if rng.random() < 0.8 else [start, start + length])
        shard = first + rng.randrange(max(1, n_shards))
        if rng.random() < error_rate:
            shard = rng.choice([first - 1, first + n_shards, first + n_shards + 5])
        shard_ids.append(shard)
    if rng.random() < 0.02:
        shard_ids.append(first)  # one shard id too many
    return chunks, shard_ids


def test_tp_chunked_034_differential() -> None:
    rng = random.Random(SEED + 1)
    seen: Counter[str] = Counter()
    done = 0
    while done < CASES:
        block_size = rng.choice([1, 2, 4, 8, 16, 32, 64])
        chunk_size = rng.choice([d for d in (1, 2, 4, 8, 16, 32, 64) if block_size % d == 0])
        n_shards = rng.choice([1, 1, 2, 2, 3, 4]) if rng.random() < 0.97 else 0  # 0: store TP < local TP
        first = rng.randint(0, 6)
        per_block = block_size // chunk_size
        engine = _native.LayoutEngine(block_size, 1, True, first, n_shards, rng.choice([0, 1 << 20]), chunk_size)
        assert engine.chunks_per_block == per_block and engine.store_chunk_size == chunk_size
        templates = tp_templates(rng, per_block, n_shards)
        engine.set_templates(templates)
        width = len(templates[0][0][0]) if n_shards else 0
        assert engine.segment_count == width
        n_blocks = rng.randint(1, 6)
        block_ids = [pick_block_id(rng, 1 << 24) for _ in range(n_blocks)]
        for call in range(rng.randint(1, 5)):
            if call and rng.random() < 0.15:
                templates = tp_templates(rng, per_block, n_shards)  # a re-registration drops cached rows
                engine.set_templates(templates)
            if call and rng.random() < 0.2:
                block_ids[rng.randrange(n_blocks)] = pick_block_id(rng, 1 << 24)  # in place
            chunks, shard_ids = tp_call(rng, block_size, chunk_size, first, n_shards, n_blocks)
            ids: Any = block_ids
            roll = rng.random()
            if roll < 0.15 and all(INT64_MIN <= i <= INT64_MAX for i in block_ids):
                ids = np.asarray(block_ids, dtype=np.int64)
            elif roll < 0.25:
                ids = tuple(block_ids)
            want = outcome(ref_tp_chunked, templates, block_size, chunk_size, first, n_shards, chunks, ids, shard_ids)
            context = f"TP case {done}: {block_size=} {chunk_size=} {first=} {n_shards=} {chunks=} {shard_ids=} " + (
                f"{block_ids=} {templates=}"
            )
            for arrays in (False, True):
                method = engine.prepare_values_array if arrays else engine.prepare_values
                got = outcome(method, chunks, ids, shard_ids)
                seen[same(want, got, arrays, True, context)] += 1
            done += 1
    for kind in (
        "ok",
        "ValueError: Each Store chunk must have one shard ID",
        "ValueError: Invalid Store chunk boundary",
        "ValueError: Store shard is not owned by this TP rank",
        "ValueError: Store chunk has no local cache block",
        "IndexError",
        "OverflowError",
    ):
        assert seen[kind] >= 10, (kind, seen, SEED)


# --- pinned cases ---------------------------------------------------------------------------------------


def test_rank_local_034_values_by_hand() -> None:
    """Two regions, stride 64/128 with 10/20 bytes stored: a two-block chunk covers the padding between."""
    engine = _native.LayoutEngine(16, 16, False, 0, 1, 1 << 20)
    engine.set_region_sources([1000, 2000], [10, 20], [64, 128])
    assert engine.prepare_values([(0, 16), (16, 48)], [3, 5, 7], [0, 0]) == (
        [[1192, 2384], [1320, 2640]],
        [[10, 20], [64 + 10, 128 + 20]],
        [3, 5],
    )
    assert engine.prepare_value_for_block(2) == ([1128, 2256], [10, 20])
    engine.set_region_sources([1000, 2000], [10, 20])  # back to vLLM 0.33's rules: stride = size = block_len
    assert engine.prepare_values([(16, 48)], [3, 5], [0]) == ([[1050, 2100]], [[20, 40]], [5])


def test_0_33_size_at_the_int64_edge_is_unchanged() -> None:
    """size0 + (count - 1) * stride is computed exactly: where 0.33's size0 * count fits, it is returned even
    though (count - 1) * stride alone would not fit."""
    for with_strides in (False, True):
        engine = _native.LayoutEngine(1, 1, False, 0, 1, 0)
        engine.set_region_sources([0], [1 << 62], [1 << 62] if with_strides else None)
        assert engine.prepare_values([(2, 0)], [0, 0, 0], [0])[1] == [[INT64_MIN]]  # 2**62 * -2
        with pytest.raises(OverflowError):
            engine.prepare_values([(0, 2)], [0, 0], [0])  # 2**62 * 2


def test_rank_local_reads_bases_then_strides_then_lens() -> None:
    log: list[str] = []

    class Logged:
        def __init__(self, name: str, value: int) -> None:
            self.name, self.value = name, value

        def __index__(self) -> int:
            log.append(self.name)
            return self.value

    engine = _native.LayoutEngine(16, 16, False, 0, 1, 0)
    bases = [Logged("base", 0), Logged("base", 4096)]
    engine.set_region_sources(bases, [Logged("len", 8)], [Logged("stride", 64)])
    engine.prepare_values([(0, 16)], [1], [0])
    assert log == ["base", "base", "stride", "len"]
    log.clear()
    engine.set_region_sources([], [Logged("len", 8)], [Logged("stride", 64)])  # no regions: nothing else read
    assert engine.prepare_values([(0, 16)], [1], [0]) == ([[]], [[]], [1]) and log == []


def test_rank_local_list_errors() -> None:
    engine = _native.LayoutEngine(16, 16, False, 0, 1, 0)
    engine.set_region_sources([0, 1, 2], [8], [64, 64])  # region 1 reads block_len[1]
    with pytest.raises(IndexError, match="block_len"):
        engine.prepare_values([(0, 16)], [1], [0])
    engine.set_region_sources([0, 1, 2], [8], [])
    with pytest.raises(ZeroDivisionError, match="block_stride is empty"):
        engine.prepare_values([(0, 16)], [1], [0])
    with pytest.raises(TypeError):
        engine.set_region_sources([0], [8], {64})
    tp = _native.LayoutEngine(16, 16, True, 0, 1, 0)
    with pytest.raises(RuntimeError, match="rank-local"):
        tp.set_region_sources([0], [8], [64])


def test_cache_drops_rows_when_only_the_strides_change() -> None:
    """Warm address and size rows of one generation are never served after a stride edit in place."""
    engine = _native.LayoutEngine(16, 16, False, 0, 1, 1 << 20)
    bases, lens, strides = [0, 1 << 30], [8, 16], [64, 128]
    engine.set_region_sources(bases, lens, strides)
    for _ in range(3):
        assert engine.prepare_values([(16, 48)], [0, 2, 3], [0]) == ([[128, (1 << 30) + 256]], [[72, 144]], [2])
    assert engine.cache_info()["hits"] > 0
    strides[1] = 256
    assert engine.prepare_values([(16, 48)], [0, 2, 3], [0]) == ([[128, (1 << 30) + 512]], [[72, 272]], [2])
    lens[0] = 9
    assert engine.prepare_values([(16, 48)], [0, 2, 3], [0]) == ([[128, (1 << 30) + 512]], [[73, 272]], [2])


def test_pin_covers_the_strides() -> None:
    engine = _native.LayoutEngine(16, 16, False, 0, 1, 0)
    bases, lens, strides = [4096], [8], [64]
    engine.set_region_sources(bases, lens, strides)
    engine.pin_regions(bases, lens, block_stride=strides)
    assert engine.prepare_values([(0, 16)], [1], [0]) == ([[4160]], [[8]], [1])
    strides[0] = 1 << 20  # in place, after registration: addresses would leave the registered cache
    with pytest.raises(ValueError, match="changed after register_kv_caches"):
        engine.prepare_values([(0, 16)], [1], [0])
    strides[0] = 64
    with pytest.raises(ValueError, match="pinned to other values"):
        engine.pin_regions(bases, lens)  # a second transfer's pin: strides = block_len, not these
    engine.unpin_regions()
    # Pinned without strides: the strides must be the pinned block lengths (vLLM 0.33's stride).
    engine.pin_regions(bases, lens)
    with pytest.raises(ValueError, match="changed after register_kv_caches"):
        engine.prepare_values([(0, 16)], [1], [0])
    strides[0] = 8
    assert engine.prepare_values([(0, 16)], [1], [0]) == ([[4104]], [[8]], [1])
    engine.unpin_regions()
    assert engine.region_pins == 0


def test_store_chunk_size_construction_and_templates() -> None:
    message = "Store chunk size must divide the local block size"
    for bad in (0, -4, 3, 64):
        with pytest.raises(ValueError, match=message):
            _native.LayoutEngine(32, 16, True, 0, 2, 0, store_chunk_size=bad)
    with pytest.raises(ValueError, match="TP-shared"):
        _native.LayoutEngine(32, 16, False, 0, 1, 0, store_chunk_size=16)
    with pytest.raises(TypeError):
        _native.LayoutEngine(32, 16, True, 0, 2, 0, store_chunk_size=16.0)
    plain = _native.LayoutEngine(32, 16, True, 0, 2, 0)
    assert plain.store_chunk_size is None and plain.chunks_per_block == 0
    engine = _native.LayoutEngine(32, 16, True, 2, 2, 0, store_chunk_size=8)
    assert engine.store_chunk_size == 8 and engine.chunks_per_block == 4
    one: Template = ([0], [1], [1])
    with pytest.raises(ValueError, match="4 store chunk templates"):
        engine.set_templates([[one, one]] * 3)
    with pytest.raises(ValueError, match="expected 2"):
        engine.set_templates([[one, one]] * 3 + [[one]])
    with pytest.raises(ValueError, match="same number of segments"):
        engine.set_templates([[one, one]] * 3 + [[one, ([0, 1], [1, 1], [1, 1])]])
    with pytest.raises(ValueError, match="one length"):
        engine.set_templates([[one, one]] * 3 + [[one, ([0, 1], [1], [1])]])
    engine.set_templates([[([c * 10 + s], [1000], [c + 1]) for s in range(2)] for c in range(4)])
    assert engine.segment_count == 1
    # Block 1 of [5, 6], store chunk 2 of the block (tokens 48..55), shard 3 (local 1): template 2*2+1.
    assert engine.prepare_values([(48, 53)], [5, 6], [3]) == ([[21 + 6 * 1000]], [[3]], [6])
    # A key over a whole block is no longer one chunk: the 0.33 rule does not apply.
    with pytest.raises(ValueError, match="Invalid Store chunk boundary"):
        engine.prepare_values([(0, 32)], [5, 6], [2])
    # The fused load plan walks by Store chunk (test_plan_load_034.py): tokens 0..16 of block 1 are two chunk
    # keys per owned shard, each keyed by the hash ending its chunk.
    fine = _native.LayoutEngine(32, 8, True, 2, 2, 0, store_chunk_size=8)
    fine.set_templates([[([c * 10 + s], [1000], [c + 1]) for s in range(2)] for c in range(4)])
    keys, addrs, sizes, ids = fine.plan_load(["a", "b"], [b"x", b"y"], None, 16, 0, None, None, [1], False)
    assert keys == ["a@78", "b@78", "a@79", "b@79"] and ids == [1, 1, 1, 1]
    assert addrs == [[1000], [1001], [1010], [1011]] and sizes == [[1], [1], [2], [2]]


def test_chunked_negative_and_huge_block_ids() -> None:
    engine = _native.LayoutEngine(4, 4, True, 0, 1, 0, store_chunk_size=2)
    engine.set_templates([[([0], [1 << 40], [2])], [([1], [1 << 40], [2])]])
    with pytest.raises(OverflowError):
        engine.prepare_values([(0, 2)], [-1], [0])  # vLLM's uint64 refuses a negative id
    assert engine.prepare_values([(-2, -1)], [7, 9], [0]) == ([[1 + 9 * (1 << 40)]], [[2]], [9])  # block -1
    with pytest.raises(IndexError):
        engine.prepare_values([(-10, -9)], [7, 9], [0])  # block -3 of 2
    with pytest.raises(OverflowError):
        engine.prepare_values([(0, 2)], [1 << 23], [0])  # 2**63: the address leaves int64


def test_store_chunk_engines_take_exact_start_end_pairs() -> None:
    """vLLM 0.34's TP-shared rule unpacks each chunk: a chunk of three items (or an array of three columns) is a
    ValueError there, where the 0.33 rules read items 0 and 1 only."""
    engine = _native.LayoutEngine(32, 8, True, 0, 1, 0, store_chunk_size=8)
    engine.set_templates([[([c], [100], [1])] for c in range(4)])
    with pytest.raises(ValueError, match="more than"):
        engine.prepare_values([(0, 8), (8, 16, 3)], [5], [0, 0])
    with pytest.raises(ValueError, match=r"\(n, 2\)"):
        engine.prepare_values(np.array([[0, 8, 1]], dtype=np.int64), [5], [0])
    assert engine.prepare_values([(0, 8), [8, 16]], [5], [0, 0]) == ([[500], [501]], [[1], [1]], [5, 5])
    plain = _native.LayoutEngine(32, 32, True, 0, 1, 0)
    plain.set_templates([([7], [100], [1])])
    assert plain.prepare_values([(0, 32, 3)], [5], [0]) == ([[507]], [[1]], [5])
