"""Section "gil": how long each ``prepare_values`` variant keeps a co-resident pure-Python thread waiting.

A GIL-holding call stalls the busy thread for its whole duration; a call that releases the GIL lets it run.
Baseline: the idle row (the same thread beside ``sleep(1 ms)``), which shows the machine's own noise; the
numpy row is vLLM 0.33's ``prepare_values``.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from mooncake_kvaddr.bench.harness import NUMPY_BASELINE, Col, beside_spinner, table
from mooncake_kvaddr.bench.workload import Shape, make_databases, request_chunks
from mooncake_kvaddr.core.oracle import numpy_prepare_values

IDLE = "idle (no calls, sleep 1 ms)"


def run(shape: Shape, seconds: float) -> dict[str, Any]:
    """Print and return the section: each variant called for ``seconds`` beside the busy thread."""
    native, _ = make_databases(shape)
    chunks = request_chunks(shape)
    ids = random.Random(3).sample(range(1 << 20), shape.chunks)
    bases, lens = native.kv_caches_base_addr, native.block_len
    native.prepare_values(chunks, ids)

    def cold_ids() -> Iterator[list[int]]:
        for first in range(1 << 23, 1 << 62, shape.chunks):
            yield list(range(first, first + shape.chunks))

    cold = cold_ids()
    variants: dict[str, Callable[[], object]] = {
        IDLE: lambda: time.sleep(0.001),
        NUMPY_BASELINE: lambda: numpy_prepare_values(
            chunks, ids, bases, lens, shape.block_size, shape.hash_block_size
        ),
        "native lists, warm block ids": lambda: native.prepare_values(chunks, ids),
        "native lists, cold block ids": lambda: native.prepare_values(chunks, next(cold)),
        "native arrays": lambda: native.prepare_values_array(chunks, ids),
    }
    rows = {name: beside_spinner(fn, seconds) for name, fn in variants.items()}
    title = (f"GIL: a pure-Python thread beside each variant called for {seconds:.1f} s ({shape.describe()}); "
             f"switch interval {sys.getswitchinterval() * 1e3:.0f} ms")
    cols = (Col("ms_per_call", "ms/call"), Col("thread_longest_stall_ms", "thread stall ms", ".2f"),
            Col("thread_mits", "thread M it/s", ".2f"))
    return table(title, f"'{IDLE}' (the busy thread's stalls with no call at all)", rows, cols,
                 shape=shape.describe())
