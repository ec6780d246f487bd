"""Section "addresses": one request's address/size rows, every ``prepare_values`` variant on the same chunks.

Baseline: numpy broadcast + ``.tolist()``, the vectorised ``prepare_values`` vLLM 0.33 ships (our own
re-implementation, :func:`mooncake_kvaddr.core.oracle.numpy_prepare_values`, checked equal to the oracle).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from mooncake_kvaddr.bench.harness import NUMPY_BASELINE, ORACLE, Result, run_interleaved, timing_table
from mooncake_kvaddr.bench.workload import Shape, cold_block_ids, make_databases, request_chunks
from mooncake_kvaddr.core.oracle import numpy_prepare_values

LISTS_COLD = "native lists, cold block ids"
LISTS_WARM = "native lists, warm block ids"
TUPLES_COLD = "native tuples (immutable_rows), cold"
TUPLES_WARM = "native tuples (immutable_rows), warm"
ARRAYS = "native arrays (no Python ints)"


def measure(shape: Shape, reps: int, include_oracle: bool = True) -> list[Result]:
    """Interleaved timings of each variant on ``shape`` (the native result is checked against the oracle)."""
    native, oracle = make_databases(shape)
    tuples, _ = make_databases(shape)
    tuples.immutable_rows = True
    chunks = request_chunks(shape)
    warm_ids = random.Random(0).sample(range(1 << 20), shape.chunks)
    bases, lens = native.kv_caches_base_addr, native.block_len

    for db in (native, tuples):  # a row is cached on its block id's second sighting
        db.prepare_values(chunks, warm_ids)
        db.prepare_values(chunks, warm_ids)
    variants: dict[str, Callable[[int], object]] = {
        ORACLE: lambda rep: oracle.prepare_values(chunks, warm_ids),
        NUMPY_BASELINE: lambda rep: numpy_prepare_values(
            chunks, warm_ids, bases, lens, shape.block_size, shape.hash_block_size
        ),
        LISTS_COLD: lambda rep: native.prepare_values(chunks, cold_block_ids(shape, rep, 1 << 21)),
        LISTS_WARM: lambda rep: native.prepare_values(chunks, warm_ids),
        TUPLES_COLD: lambda rep: tuples.prepare_values(chunks, cold_block_ids(shape, rep, 1 << 22)),
        TUPLES_WARM: lambda rep: tuples.prepare_values(chunks, warm_ids),
        ARRAYS: lambda rep: native.prepare_values_array(chunks, warm_ids),
    }
    if not include_oracle:
        del variants[ORACLE]
    expected = oracle.prepare_values(chunks, warm_ids)
    if native.prepare_values(chunks, warm_ids) != expected:
        raise AssertionError("native result differs from the oracle on the benchmark shape")
    addrs, sizes, ids = tuples.prepare_values(chunks, warm_ids)
    if ([list(r) for r in addrs], [list(r) for r in sizes], ids) != expected:
        raise AssertionError("native tuple rows differ from the oracle on the benchmark shape")
    return run_interleaved(variants, reps)


def run(shape: Shape, reps: int) -> dict[str, Any]:
    """Print and return the section."""
    title = f"Addresses and sizes per request: {shape.describe()}"
    return timing_table(title, measure(shape, reps), NUMPY_BASELINE, shape=shape.describe())
