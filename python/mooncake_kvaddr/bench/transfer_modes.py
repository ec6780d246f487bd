"""Section "transfer_modes": staged vs multi-buffer loads and stores through a real Mooncake store.

It shows what the staged transport costs or saves where no region budget applies (embedded master, in-process
copy): total time, GIL-held time beside a busy Python thread, N concurrent loads, bytes verified once per mode.
Baseline: the multi-buffer mode with one call per request, vLLM 0.33's own data path; ratios are staged /
multi-buffer, below 1 is better for staged (``docs/benchmarks.md``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mooncake_kvaddr.bench.harness import Col, StallCounter, table
from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.metadata import KeyMetadata

BASELINE = "multi_buffer, one Mooncake call per request (vLLM 0.33's path); ratio = staged / multi_buffer"


def run(chunks: int, regions: int, block_bytes: int, reps: int,
        concurrency: Sequence[int] = (1, 2, 4)) -> dict[str, Any]:
    """Print and return the section for one shape (needs Mooncake; the caller checks)."""
    from mooncake_kvaddr.driver.config import StoreConfig
    from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT, StagingPool
    from mooncake_kvaddr.driver.store import MooncakeStore
    from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

    block_size = 128
    data = chunks * regions * block_bytes
    num_blocks = chunks + 1  # block 0 is the null block
    rng = np.random.default_rng(0)
    source = [rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]
    target = [np.ones((num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]  # resident pages
    ids = list(range(1, num_blocks))
    hashes = [i.to_bytes(8, "little") * 4 for i in range(chunks)]
    request = TransferRequest("bench", chunks * block_size, hashes, [ids])
    most = max(concurrency)
    # No region-budget splitting: in one process Mooncake copies in memory (docs/benchmarks.md), so a whole
    # request is one call in either mode.
    config = StoreConfig(embedded_master=True, global_segment_size=data + data // 4 + (64 << 20), local_buffer_size=0,
                         max_regions_per_batch=1 << 30)
    modes = ("multi_buffer", "staged")
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in modes}

    def record(mode: str, name: str, seconds: float) -> None:
        samples[mode].setdefault(name, []).append(seconds * 1e3)

    with MooncakeStore(config) as store:
        pool = StagingPool(most * (data + chunks * SLOT_ALIGNMENT))
        pairs: dict[str, tuple[Any, Any]] = {}
        for mode in modes:
            md = KeyMetadata("bench", 0, 0, 0, 0)
            kw: dict[str, Any] = {"transfer_mode": mode}
            if mode == "staged":
                kw["staging_pool"] = pool
            writer = KVTransfer(store, [ChunkedTokenDatabase(md, block_size)], **kw)
            reader = KVTransfer(store, [ChunkedTokenDatabase(md, block_size)], num_recv_threads=most, **kw)
            writer.register_kv_caches(source, num_blocks)
            reader.register_kv_caches(target, num_blocks)
            pairs[mode] = (writer, reader)
        verified = {}
        for mode, (writer, reader) in pairs.items():  # warm the segment, check every byte once per mode
            store.remove_all(force=True)
            stored_ok = writer.store(request).ok
            for region in target:
                region[:] = 1
            loaded_ok = reader.load(request).ok
            verified[mode] = stored_ok and loaded_ok and all(
                np.array_equal(a[1:], b[1:]) for a, b in zip(source, target))
        for rep in range(reps):
            for mode, (writer, reader) in (pairs.items() if rep % 2 == 0 else reversed(pairs.items())):
                t0 = time.perf_counter()
                ok = reader.load(request).ok
                record(mode, "load", time.perf_counter() - t0)
                store.remove_all(force=True)
                t0 = time.perf_counter()
                ok &= writer.store(request).ok
                record(mode, "store", time.perf_counter() - t0)
                with StallCounter() as counter:
                    ok &= reader.load(request).ok
                    record(mode, "load GIL longest stall", counter.longest)
                    record(mode, "load GIL stalled total", counter.stalled)
                    store.remove_all(force=True)
                    counter.reset()
                    ok &= writer.store(request).ok
                    record(mode, "store GIL longest stall", counter.longest)
                    record(mode, "store GIL stalled total", counter.stalled)
                for n in concurrency:
                    t0 = time.perf_counter()
                    futures = [reader.submit_load(request) for _ in range(n)]
                    ok &= all(f.result(600).ok for f in futures)
                    record(mode, f"{n} concurrent loads (wall)", time.perf_counter() - t0)
                if not ok:
                    raise RuntimeError(f"a {mode} transfer failed during the benchmark")
        for writer, reader in pairs.values():
            writer.close()
            reader.close()

    rows: dict[str, Any] = {}
    for name in samples["multi_buffer"]:
        mb = statistics.median(samples["multi_buffer"][name])
        st = statistics.median(samples["staged"][name])
        rows[name] = {"multi_buffer_ms": mb, "staged_ms": st, "ratio": st / mb if mb else None}
    title = (f"Transfer modes: {chunks} keys x {regions} regions x {block_bytes} B = {data / 2**20:.0f} MiB per "
             f"request, embedded master, in-process copy; medians of {reps}; bytes verified: {verified}")
    cols = (Col("multi_buffer_ms", "multi_buffer ms", ".2f"), Col("staged_ms", "staged ms", ".2f"),
            Col("ratio", "staged/mb", ".2f"))
    return table(title, BASELINE, rows, cols, label="measure",
                 shape={"chunks": chunks, "regions": regions, "block_bytes": block_bytes, "bytes": data},
                 verified=verified)
