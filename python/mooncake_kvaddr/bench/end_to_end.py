"""Section "end_to_end": one load request through a real Mooncake store (embedded master, in-process copy).

It shows where a load's GIL-held time goes: our preparation (keys + address rows) apart from Mooncake's
conversion of the argument lists, with the transfer timed too, for the numpy-era path vLLM 0.33 runs (the
baseline), our native multi-buffer plan and the staged load (``docs/benchmarks.md``, "Sections and their
baselines").
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import numpy as np

from mooncake_kvaddr.bench.harness import Col, table
from mooncake_kvaddr.bench.workload import Shape, make_databases
from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.oracle import numpy_prepare_values

BASELINE = "numpy-era (Python walk + key_for + numpy prepare_values, then Mooncake's multi-buffer conversion)"


def run(shape: Shape, reps: int) -> dict[str, Any]:
    """Print and return the section (needs Mooncake; the caller checks)."""
    from mooncake_kvaddr.driver.config import StoreConfig
    from mooncake_kvaddr.driver.store import MooncakeStore
    from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

    block_bytes = 2048
    native, oracle = make_databases(Shape(shape.tokens, shape.regions, shape.block_size, shape.hash_block_size,
                                          block_bytes))
    num_blocks = shape.chunks + 1
    source = [np.random.default_rng(r).integers(0, 256, num_blocks * block_bytes, dtype=np.uint8)
              for r in range(shape.regions)]
    target = [np.zeros(num_blocks * block_bytes, dtype=np.uint8) for _ in range(shape.regions)]
    rng = random.Random(5)
    hashes = [rng.randbytes(32) for _ in range(shape.tokens // shape.hash_block_size)]
    token_len = len(hashes) * shape.hash_block_size
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    data_bytes = shape.chunks * shape.regions * block_bytes
    # One call per request: in one process Mooncake copies in memory, no TCP budget applies (docs/benchmarks.md).
    config = StoreConfig(embedded_master=True, global_segment_size=data_bytes + data_bytes // 4 + (64 << 20),
                         local_buffer_size=0,
                         max_regions_per_batch=1 << 30)
    lens = [block_bytes] * shape.regions

    def use(db: Any, arrays: list[Any]) -> list[int]:
        bases = [int(a.ctypes.data) for a in arrays]
        db.set_kv_caches_base_addr(bases)
        db.set_block_len(list(lens))
        return bases

    with MooncakeStore(config) as store:
        staged = KVTransfer(store, [ChunkedTokenDatabase(native.metadata, shape.block_size, shape.hash_block_size)],
                            transfer_mode="staged", start_threads=False)
        staged.register_kv_caches([t.reshape(num_blocks, block_bytes) for t in target], num_blocks)
        staged_request = TransferRequest("bench", token_len, hashes, [ids])
        use(native, source)
        put_plan = native.plan_load(token_len, hashes, ids)
        if not store.batch_put_from_multi_buffers(put_plan.keys, put_plan.addrs, put_plan.sizes).ok:
            raise RuntimeError("benchmark put failed")
        target_bases = use(native, target)
        use(oracle, target)

        def numpy_prep() -> tuple[list[str], list[list[int]], list[list[int]]]:
            keys, chunks = [], []
            for start, end, h in oracle.process_tokens(token_len, hashes, 0):
                keys.append(oracle.key_for(h))
                chunks.append((start, end))
            addrs, sizes, _ = numpy_prepare_values(chunks, ids, target_bases, lens, shape.block_size,
                                                   shape.hash_block_size)
            return keys, addrs, sizes

        names = ("numpy-era prep", "native prep (cold rows)", "native prep (warm rows)", "mooncake conversion",
                 "get (conversion + transfer)", "staged prep (walk + arrays + slots)", "staged mooncake conversion",
                 "staged load (total)")
        samples: dict[str, list[float]] = {k: [] for k in names}
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            keys, addrs, sizes = numpy_prep()
            t1 = time.perf_counter()
            native.clear_address_cache()
            t2 = time.perf_counter()
            native.plan_load(token_len, hashes, ids)
            t3 = time.perf_counter()
            plan = native.plan_load(token_len, hashes, ids)
            t4 = time.perf_counter()
            conversion = store.time_argument_conversion(plan.addrs, plan.sizes)
            for a in target:
                a.fill(0)
            t5 = time.perf_counter()
            got = store.batch_get_into_multi_buffers(plan.keys, plan.addrs, plan.sizes, check_values=False)
            t6 = time.perf_counter()
            if not got.ok or (keys, addrs, sizes) != (plan.keys, plan.addrs, plan.sizes):
                raise RuntimeError("benchmark get failed or the paths disagree")
            t7 = time.perf_counter()
            loaded = staged.load(staged_request)
            t8 = time.perf_counter()
            if not loaded.ok:
                raise RuntimeError(f"staged benchmark load failed: {loaded.error or loaded.outcomes}")
            staged_prep = loaded.timings.get("plan", 0.0) + loaded.timings.get("staging_wait", 0.0)
            ptrs = [0x1000 + 4096 * i for i in range(len(plan.keys))]  # never dereferenced: rejected first
            object_sizes = [sum(row) for row in plan.sizes]
            staged_conversion = store.time_contiguous_argument_conversion(plan.keys, ptrs, object_sizes)
            if rep == 0:  # warm-up
                continue
            values = (t1 - t0, t3 - t2, t4 - t3, conversion, t6 - t5, staged_prep, staged_conversion, t8 - t7)
            for name, value in zip(names, values):
                samples[name].append(value * 1e3)
        # Block 0 is never loaded (ids start at 1): compare the blocks the request covers.
        verified = all(np.array_equal(s_[block_bytes:], t_[block_bytes:]) for s_, t_ in zip(source, target))
        staged.close()

    med = {k: statistics.median(v) for k, v in samples.items()}
    transfer = max(0.0, med["get (conversion + transfer)"] - med["mooncake conversion"])
    gil = {
        "numpy-era (prep + conversion)": med["numpy-era prep"] + med["mooncake conversion"],
        "native cold (prep + conversion)": med["native prep (cold rows)"] + med["mooncake conversion"],
        "native warm (prep + conversion)": med["native prep (warm rows)"] + med["mooncake conversion"],
        "staged (prep + conversion)": med["staged prep (walk + arrays + slots)"] + med["staged mooncake conversion"],
    }
    old = gil["numpy-era (prep + conversion)"]
    shape_text = (f"{shape.chunks} keys x {shape.regions} regions x {block_bytes} B = {data_bytes / 2**20:.0f} MiB "
                  f"per load")
    phases = table(f"End to end through Mooncake (embedded master, in-process copy): {shape_text}; medians of "
                   f"{reps}; bytes verified: {verified}", None,
                   {**{k: {"ms": v} for k, v in med.items()}, "transfer (get minus conversion)": {"ms": transfer}},
                   (Col("ms", "median ms"),), label="phase")
    held = table("GIL-held time per load (our preparation + Mooncake's argument conversion)", BASELINE,
                 {k: {"ms": v, "ratio": v / old} for k, v in gil.items()},
                 (Col("ms", "ms"), Col("ratio", "of baseline", ".2f", "x")), label="path")
    return {
        "baseline": BASELINE,
        "shape": shape_text,
        "medians_ms": med,
        "transfer_ms": transfer,
        "gil_held_ms": gil,
        "ratio_cold": gil["native cold (prep + conversion)"] / old,
        "ratio_warm": gil["native warm (prep + conversion)"] / old,
        "ratio_staged": gil["staged (prep + conversion)"] / old,
        "verified": verified,
        "bytes": data_bytes,
        "tables": [phases, held],
    }
