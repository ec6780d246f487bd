"""The fused load plan (``LayoutEngine.plan_load``) of an engine with Store chunks (vLLM 0.34's TP-shared rule):
the walk steps by the Store chunk, the load mask is read per physical block, each kept chunk expands to one key
per owned shard, and the rows are the engine's ``prepare_values`` of those chunks (itself checked against a
reference in test_layout_engine_034.py). The expected side is written out here in plain Python."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from mooncake_kvaddr import _native

N: Any = _native


def _engine(rng: random.Random) -> tuple[Any, int, int, int, int, int]:
    hash_block = rng.choice([4, 8, 16])
    chunk = hash_block * rng.choice([1, 2])
    block = chunk * rng.choice([1, 2, 4])
    shards = rng.randint(1, 3)
    first = rng.randrange(0, 4) * shards
    engine = N.LayoutEngine(block, hash_block, True, first, shards, 1 << 16, store_chunk_size=chunk)
    width = rng.randint(1, 3)
    engine.set_templates(
        [
            [
                (
                    [rng.randrange(1 << 20, 1 << 32) for _ in range(width)],
                    [rng.choice([4096, 65536]) for _ in range(width)],
                    [rng.choice([16, 256]) for _ in range(width)],
                )
                for _ in range(shards)
            ]
            for _ in range(block // chunk)
        ]
    )
    return engine, block, chunk, hash_block, first, shards


def _expected(
    engine: Any, prefixes: list[str], hashes: list[bytes], token_len: int, mask_num: int, mask: Any,
    tail: int | None, block_ids: list[int], block: int, chunk: int, hash_block: int, first: int, shards: int,
) -> tuple[list[str], Any, Any, Any]:  # fmt: skip
    keys: list[str] = []
    chunks: list[tuple[int, int]] = []
    shard_ids: list[int] = []
    if hashes:
        for chunk_id in range(max(0, -(-mask_num // chunk)), -(-token_len // chunk)):
            start, end = chunk_id * chunk, min(chunk_id * chunk + chunk, token_len)
            index = start // block
            if mask is not None and (index >= len(mask) or not mask[index]):
                continue
            key_end = tail if tail is not None and end == token_len else end
            digest = hashes[key_end // hash_block - 1]
            for k in range(shards):
                keys.append(f"{prefixes[k]}@{digest.hex()}")
                chunks.append((start, end))
                shard_ids.append(first + k)
    if not chunks:
        return keys, [], [], []
    addrs, sizes, ids = engine.prepare_values(chunks, block_ids, shard_ids)
    return keys, addrs, sizes, ids


@pytest.mark.parametrize("seed", range(4))
def test_plan_load_with_store_chunks_equals_the_walk_and_prepare_values(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        engine, block, chunk, hash_block, first, shards = _engine(rng)
        blocks = rng.randint(1, 6)
        token_len = rng.randint(1, blocks * block // hash_block) * hash_block
        hashes = [rng.randbytes(8) for _ in range(token_len // hash_block + rng.randint(0, 2))]
        mask_num = rng.choice([0, rng.randrange(0, token_len + 1), token_len])
        mask = None if rng.random() < 0.2 else [rng.random() < 0.7 for _ in range(rng.randint(0, blocks + 1))]
        tail = None if rng.random() < 0.5 else rng.randrange(hash_block, token_len + 1, hash_block)
        block_ids = [rng.randrange(0, 1000) for _ in range(blocks)]
        prefixes = [f"m@tp_rank:{first + k}" for k in range(shards)]
        args = (token_len, mask_num, mask, tail, block_ids, block, chunk, hash_block, first, shards)
        want = _expected(engine, prefixes, hashes, *args)
        got = engine.plan_load(prefixes, hashes, None, token_len, mask_num, mask, tail, block_ids, False)
        assert list(got) == list(want)
        arrays = engine.plan_load(prefixes, hashes, None, token_len, mask_num, mask, tail, block_ids, True)
        assert arrays[0] == want[0]
        if want[0]:
            assert np.array_equal(arrays[1], np.asarray(want[1], dtype=np.int64))
            assert np.array_equal(arrays[2], np.asarray(want[2], dtype=np.int64))
            assert arrays[3].tolist() == want[3]


def test_plan_load_with_store_chunks_refuses_a_missing_block_and_a_bad_mask() -> None:
    rng = random.Random(7)
    engine, block, _, hash_block, _, shards = _engine(rng)
    hashes = [rng.randbytes(8) for _ in range(2 * block // hash_block)]
    prefixes = [f"p{k}" for k in range(shards)]
    with pytest.raises(ValueError, match="no local cache block"):
        engine.plan_load(prefixes, hashes, None, 2 * block, 0, None, None, [3], False)

    class Boom:
        def __bool__(self) -> bool:
            raise RuntimeError("mask item")

    with pytest.raises(RuntimeError, match="mask item"):
        engine.plan_load(prefixes, hashes, None, 2 * block, 0, [Boom()], None, [3, 4], False)
    with pytest.raises(ValueError, match="one key prefix per local shard"):
        engine.plan_load(prefixes[:-1] if shards > 1 else [], hashes, None, 2 * block, 0, None, None, [3, 4], False)
