"""Section "threads": N receive threads preparing different requests, wall time vs doing them serially.

Baseline: each variant's own serial run (N=1); a ratio above 1 means the threads overlapped.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from mooncake_kvaddr.bench.harness import NUMPY_BASELINE, Col, table
from mooncake_kvaddr.bench.workload import Shape, make_databases, request_chunks
from mooncake_kvaddr.core.oracle import numpy_prepare_values


def _wall_ms(fn: Callable[[list[int]], object], id_sets: list[list[int]], n_threads: int) -> float:
    """Median wall time (of 3) for ``n_threads`` threads sharing ``id_sets`` between them."""

    def worker(part: list[list[int]]) -> None:
        for ids in part:
            out = fn(ids)
            del out

    parts = [id_sets[i::n_threads] for i in range(n_threads)]
    samples = []
    for _ in range(3):
        threads = [threading.Thread(target=worker, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run(shape: Shape, requests: int) -> dict[str, Any]:
    """Print and return the section."""
    native, _ = make_databases(shape)
    chunks = request_chunks(shape)
    bases, lens = native.kv_caches_base_addr, native.block_len
    rng = random.Random(4)
    id_sets = [rng.sample(range(1 << 20), shape.chunks) for _ in range(requests)]
    for ids in id_sets:
        native.prepare_values(chunks, ids)
    variants: dict[str, Callable[[list[int]], object]] = {
        NUMPY_BASELINE: lambda ids: numpy_prepare_values(
            chunks, ids, bases, lens, shape.block_size, shape.hash_block_size
        ),
        "native lists, warm block ids": lambda ids: native.prepare_values(chunks, ids),
        "native arrays": lambda ids: native.prepare_values_array(chunks, ids),
    }
    rows: dict[str, Any] = {}
    for name, fn in variants.items():
        walls = {n: _wall_ms(fn, id_sets, n) for n in (1, 2, 4)}
        rows[name] = {"wall_ms": walls, "serial_ms": walls[1], "speedup_2": walls[1] / walls[2],
                      "speedup_4": walls[1] / walls[4]}
    cols = (Col("serial_ms", "serial ms", ".2f"), Col("speedup_2", "N=2", ".2f", "x"),
            Col("speedup_4", "N=4", ".2f", "x"))
    return table(f"Receive threads: {requests} requests split over N threads ({shape.describe()})",
                 "the same variant run serially on one thread (ratio = serial wall / N-thread wall)", rows, cols)
