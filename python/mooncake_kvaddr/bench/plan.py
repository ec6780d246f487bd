"""Section "plan": a receive thread's per-group preparation, the Python path vs the fused native plan.

Baseline: the Python path a load runs without the native plan (the oracle's ``process_tokens`` walk, its
``key_for`` per chunk, numpy ``prepare_values``), on the same hashes and block ids.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from mooncake_kvaddr.bench.harness import run_interleaved, timing_table
from mooncake_kvaddr.bench.workload import Shape, cold_block_ids, make_databases
from mooncake_kvaddr.core.oracle import numpy_prepare_values

PLAN_BASELINE = "Python path (walk + key_for + numpy)"


def run(shape: Shape, reps: int) -> dict[str, Any]:
    """Print and return the section."""
    native, oracle = make_databases(shape)
    rng = random.Random(2)
    hashes = [rng.randbytes(32) for _ in range(shape.tokens // shape.hash_block_size)]
    warm_ids = rng.sample(range(1 << 20), shape.chunks)
    token_len = shape.tokens // shape.hash_block_size * shape.hash_block_size
    bases, lens = native.kv_caches_base_addr, native.block_len

    def python_path(block_ids: list[int]) -> tuple[list[str], tuple[list[list[int]], list[list[int]], list[int]]]:
        keys: list[str] = []
        chunks: list[tuple[int, int]] = []
        for start, end, h in oracle.process_tokens(token_len, hashes, 0):
            keys.append(oracle.key_for(h))
            chunks.append((start, end))
        rows = numpy_prepare_values(chunks, block_ids, bases, lens, shape.block_size, shape.hash_block_size)
        return keys, rows

    keys, rows = python_path(warm_ids)
    if tuple(native.plan_load(token_len, hashes, warm_ids)) != (keys, *rows):
        raise AssertionError("fused plan differs from the Python path")
    variants: dict[str, Callable[[int], object]] = {
        PLAN_BASELINE: lambda rep: python_path(warm_ids),
        "fused plan_load, cold block ids": lambda rep: native.plan_load(
            token_len, hashes, cold_block_ids(shape, rep, 1 << 22)
        ),
        "fused plan_load, warm block ids": lambda rep: native.plan_load(token_len, hashes, warm_ids),
    }
    title = f"Fused load plan per group: {shape.describe()}"
    return timing_table(title, run_interleaved(variants, reps), PLAN_BASELINE, shape=shape.describe())
