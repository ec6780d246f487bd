"""Side-by-side benchmark: ``python -m mooncake_kvaddr.bench [--quick] [--json PATH]``.

Every variant of a section runs interleaved in one process (round-robin, after a warm-up), so machine noise
hits all of them alike; we report medians, p10/p90 and each variant's speed-up over the numpy anchor (vLLM's
current vectorised ``prepare_values``) or over the Python code a native path replaces. Times include freeing
the result, which is GIL time too.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, __version__
from mooncake_kvaddr.core.keys import build_lookup_keys
from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase, numpy_prepare_values

ANCHOR = "numpy + tolist (anchor)"
ANCHOR_PLAN = "Python path (walk + key_for + numpy)"
LOOKUP_ANCHOR = "lookup keys: Python f-strings"
ANCHORS = (ANCHOR, ANCHOR_PLAN, LOOKUP_ANCHOR, "keys: Python key_for per chunk")


@dataclass(frozen=True)
class Shape:
    """One request's shape: chunks of ``block_size`` tokens over ``regions`` KV-cache regions."""

    tokens: int = 289_024
    regions: int = 100
    block_size: int = 128
    hash_block_size: int = 16
    block_bytes: int = 32 << 10

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.block_size)

    def describe(self) -> str:
        return (
            f"{self.chunks} chunks x {self.regions} regions, block_size {self.block_size}, "
            f"hash_block_size {self.hash_block_size}, {self.block_bytes // 1024} KiB blocks"
        )


HEADLINE = Shape()


@dataclass
class Result:
    """Timings of one variant, in milliseconds."""

    name: str
    samples: list[float] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def summary(self, anchor: float | None) -> dict[str, Any]:
        return {
            "median_ms": self.median,
            "p10_ms": self.quantile(0.1),
            "p90_ms": self.quantile(0.9),
            "samples": len(self.samples),
            "speedup_vs_anchor": (anchor / self.median) if anchor else None,
        }


def run_interleaved(variants: dict[str, Callable[[int], object]], reps: int, warmup: int = 2) -> list[Result]:
    """Time each variant ``reps`` times, round-robin with a rotating start; ``fn(rep)`` returns a result
    that is freed inside the timed region."""
    names = list(variants)
    results = {name: Result(name) for name in names}
    for rep in range(-warmup, reps):
        offset = rep % len(names)
        for name in names[offset:] + names[:offset]:
            fn = variants[name]
            t0 = time.perf_counter()
            out = fn(rep)
            del out
            elapsed = (time.perf_counter() - t0) * 1e3
            if rep >= 0:
                results[name].samples.append(elapsed)
    return list(results.values())


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Where the numbers come from."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "mooncake": _dist_version("mooncake-transfer-engine-non-cuda") or _dist_version("mooncake-transfer-engine"),
        "mooncake_kvaddr": __version__,
        "platform": platform.platform(),
    }


def make_databases(shape: Shape) -> tuple[ChunkedTokenDatabase, OracleChunkedTokenDatabase]:
    """A native database and an oracle over ``shape``'s regions (K/V regions 1 GiB apart)."""
    md = KeyMetadata("DeepSeek-V3", 0, 0, 0, 0)
    bases = [0x7F00_0000_0000 + r * (1 << 30) for r in range(shape.regions)]
    lens = [shape.block_bytes] * shape.regions
    native = ChunkedTokenDatabase(md, shape.block_size, shape.hash_block_size, address_cache_bytes=256 << 20)
    oracle = OracleChunkedTokenDatabase(md, shape.block_size, shape.hash_block_size)
    for db in (native, oracle):
        db.set_kv_caches_base_addr(list(bases))
        db.set_block_len(list(lens))
    return native, oracle


def request_chunks(shape: Shape) -> list[tuple[int, int]]:
    """The load path's chunks: one per block, the last one a hash-aligned partial tail."""
    return [(s, min(s + shape.block_size, shape.tokens)) for s in range(0, shape.tokens, shape.block_size)]


def address_section(shape: Shape, reps: int, include_oracle: bool = True) -> list[Result]:
    """The address/size matrix of one request, every variant on the same chunks."""
    native, oracle = make_databases(shape)
    chunks = request_chunks(shape)
    rng = random.Random(0)
    warm_ids = rng.sample(range(1 << 20), shape.chunks)
    bases, lens = native.kv_caches_base_addr, native.block_len

    def cold_ids(rep: int) -> list[int]:
        # Never-seen block ids: a disjoint range per repetition (and per warm-up round).
        first = (1 << 21) + (rep + 8) * shape.chunks
        return list(range(first, first + shape.chunks))

    native.prepare_values(chunks, warm_ids)
    variants: dict[str, Callable[[int], object]] = {
        "oracle (pure Python loop)": lambda rep: oracle.prepare_values(chunks, warm_ids),
        ANCHOR: lambda rep: numpy_prepare_values(
            chunks, warm_ids, bases, lens, shape.block_size, shape.hash_block_size
        ),
        "native lists, cold block ids": lambda rep: native.prepare_values(chunks, cold_ids(rep)),
        "native lists, warm block ids": lambda rep: native.prepare_values(chunks, warm_ids),
        "native arrays (no Python ints)": lambda rep: native.prepare_values_array(chunks, warm_ids),
    }
    if not include_oracle:
        del variants["oracle (pure Python loop)"]
    expected = oracle.prepare_values(chunks, warm_ids)
    if native.prepare_values(chunks, warm_ids) != expected:
        raise AssertionError("native result differs from the oracle on the benchmark shape")
    return run_interleaved(variants, reps)


def key_section(shape: Shape, reps: int, namespaces: int = 8) -> tuple[list[Result], list[Result]]:
    """Key strings for one request's sha256 hashes: Python f-strings vs the native writer."""
    native, oracle = make_databases(shape)
    rng = random.Random(1)
    hashes = [rng.randbytes(32) for _ in range(shape.chunks)]
    blob = b"".join(hashes)
    prefix = native.key_prefix
    prefixes = [prefix.replace("tp_rank:0", f"tp_rank:{i}") for i in range(namespaces)]

    def python_lookup_keys() -> list[str]:
        keys: list[str] = []
        for h in hashes:
            hex_ = h.hex()
            keys.extend(f"{p}@{hex_}" for p in prefixes)
        return keys

    if build_lookup_keys(prefixes, blob, 32) != python_lookup_keys():
        raise AssertionError("native lookup keys differ from f-strings")
    variants: dict[str, Callable[[int], object]] = {
        "keys: Python key_for per chunk": lambda rep: [oracle.key_for(h) for h in hashes],
        "keys: Python f-string list": lambda rep: [f"{prefix}@{h.hex()}" for h in hashes],
        "keys: native build_keys (list)": lambda rep: native.keys_for(hashes),
        "keys: native build_keys (blob)": lambda rep: native.keys_for(blob, 32),
        LOOKUP_ANCHOR: lambda rep: python_lookup_keys(),
        "lookup keys: native (blob)": lambda rep: build_lookup_keys(prefixes, blob, 32),
    }
    results = run_interleaved(variants, reps)
    split = [r.name.startswith("lookup") for r in results]
    return ([r for r, s in zip(results, split) if not s], [r for r, s in zip(results, split) if s])


def plan_section(shape: Shape, reps: int) -> list[Result]:
    """A receive thread's per-group preparation: the Python path (process_tokens + key_for + numpy
    prepare_values) vs the fused native plan, on never-seen and on repeated block ids."""
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

    def cold_ids(rep: int) -> list[int]:
        first = (1 << 22) + (rep + 8) * shape.chunks
        return list(range(first, first + shape.chunks))

    keys, rows = python_path(warm_ids)
    if tuple(native.plan_load(token_len, hashes, warm_ids)) != (keys, *rows):
        raise AssertionError("fused plan differs from the Python path")
    variants: dict[str, Callable[[int], object]] = {
        ANCHOR_PLAN: lambda rep: python_path(warm_ids),
        "fused plan_load, cold block ids": lambda rep: native.plan_load(token_len, hashes, cold_ids(rep)),
        "fused plan_load, warm block ids": lambda rep: native.plan_load(token_len, hashes, warm_ids),
    }
    return run_interleaved(variants, reps)


class StallCounter:
    """A busy pure-Python thread that timestamps every iteration: while another thread holds the GIL it
    cannot run, so its gaps measure GIL-held time. ``reset()`` opens a window; read ``longest`` (s),
    ``stalled`` (s, summed gaps over 0.5 ms) and ``iterations`` afterwards."""

    STALL = 0.0005

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.reset()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.longest = 0.0
        self.stalled = 0.0
        self.iterations = 0

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            gap = now - last
            if gap > self.longest:
                self.longest = gap
            if gap > self.STALL:
                self.stalled += gap
            self.iterations += 1
            last = now

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> StallCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _beside_spinner(fn: Callable[[], object], seconds: float) -> tuple[float, float, float]:
    """Call ``fn`` repeatedly for ``seconds`` beside a :class:`StallCounter`; returns (median ms per call,
    the thread's longest stall in ms, its iterations per second in millions)."""
    samples = []
    with StallCounter() as counter:
        time.sleep(0.01)
        counter.reset()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            c0 = time.perf_counter()
            out = fn()
            del out
            samples.append((time.perf_counter() - c0) * 1e3)
        elapsed = time.perf_counter() - t0
        longest, iterations = counter.longest, counter.iterations
    return statistics.median(samples), longest * 1e3, iterations / elapsed / 1e6


def gil_section(shape: Shape, seconds: float) -> dict[str, Any]:
    """How much each variant slows a co-resident pure-Python thread (GIL held = thread stalled)."""
    native, _ = make_databases(shape)
    chunks = request_chunks(shape)
    rng = random.Random(3)
    ids = rng.sample(range(1 << 20), shape.chunks)
    bases, lens = native.kv_caches_base_addr, native.block_len
    native.prepare_values(chunks, ids)
    cold = (list(range(first, first + shape.chunks)) for first in range(1 << 23, 1 << 62, shape.chunks))
    variants: dict[str, Callable[[], object]] = {
        "idle (no calls, sleep 1 ms)": lambda: time.sleep(0.001),
        ANCHOR: lambda: numpy_prepare_values(chunks, ids, bases, lens, shape.block_size, shape.hash_block_size),
        "native lists, warm block ids": lambda: native.prepare_values(chunks, ids),
        "native lists, cold block ids": lambda: native.prepare_values(chunks, next(cold)),
        "native arrays": lambda: native.prepare_values_array(chunks, ids),
    }
    rows: dict[str, Any] = {}
    print(f"\nGIL: a pure-Python thread beside each variant called for {seconds:.1f} s ({shape.describe()}); "
          f"switch interval {sys.getswitchinterval() * 1e3:.0f} ms")
    print(f"  {'variant':<40} {'ms/call':>9} {'thread stall ms':>16} {'thread M it/s':>14}")
    for name, fn in variants.items():
        per_call, stall, rate = _beside_spinner(fn, seconds)
        rows[name] = {"ms_per_call": per_call, "thread_longest_stall_ms": stall, "thread_mits": rate}
        print(f"  {name:<40} {per_call:>9.3f} {stall:>16.2f} {rate:>14.2f}")
    return rows


def threads_section(shape: Shape, requests: int) -> dict[str, Any]:
    """1, 2 and 4 receive threads preparing different requests: wall time vs doing them serially."""
    native, _ = make_databases(shape)
    chunks = request_chunks(shape)
    bases, lens = native.kv_caches_base_addr, native.block_len
    rng = random.Random(4)
    id_sets = [rng.sample(range(1 << 20), shape.chunks) for _ in range(requests)]
    for ids in id_sets:
        native.prepare_values(chunks, ids)
    variants: dict[str, Callable[[list[int]], object]] = {
        ANCHOR: lambda ids: numpy_prepare_values(chunks, ids, bases, lens, shape.block_size,
                                                 shape.hash_block_size),
        "native lists, warm block ids": lambda ids: native.prepare_values(chunks, ids),
        "native arrays": lambda ids: native.prepare_values_array(chunks, ids),
    }
    print(f"\nReceive threads: {requests} requests split over N threads, wall time vs serial")
    print(f"  {'variant':<40} {'serial ms':>10} {'N=2':>8} {'N=4':>8}")
    rows: dict[str, Any] = {}
    for name, fn in variants.items():
        walls = {}
        for n_threads in (1, 2, 4):
            def worker(part: list[list[int]], call: Callable[[list[int]], object] = fn) -> None:
                for ids in part:
                    out = call(ids)
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
            walls[n_threads] = statistics.median(samples)
        rows[name] = {"wall_ms": walls, "speedup_2": walls[1] / walls[2], "speedup_4": walls[1] / walls[4]}
        print(f"  {name:<40} {walls[1]:>10.2f} {walls[1] / walls[2]:>7.2f}x {walls[1] / walls[4]:>7.2f}x")
    return rows


SCALING_TOKENS = (1_024, 4_096, 16_384, 65_536, 262_144, 1_048_576)
SCALING_REGIONS = (1, 61, 96, 160)


def scaling_section(tokens: Sequence[int], regions: Sequence[int], reps: int) -> dict[str, Any]:
    """Each address variant over request lengths and region counts: median ms and speed-up vs numpy."""
    rows: dict[str, Any] = {}
    print(f"\nScaling: median ms per request (speed-up vs numpy), block_size {HEADLINE.block_size}")
    header = f"  {'tokens':>9} {'R':>4}"
    names = None
    for n_regions in regions:
        for n_tokens in tokens:
            shape = Shape(tokens=n_tokens, regions=n_regions)
            results = address_section(shape, reps, include_oracle=n_tokens * n_regions <= 65_536 * 160)
            anchor = next(r.median for r in results if r.name == ANCHOR)
            if names is None:
                names = [r.name for r in results if r.name != "oracle (pure Python loop)"]
                print(header + "".join(f" {short(n):>20}" for n in names))
            by_name = {r.name: r for r in results}
            cells = "".join(
                f" {by_name[n].median:>11.3f} ({anchor / by_name[n].median:>5.1f}x)" for n in names
            )
            print(f"  {n_tokens:>9} {n_regions:>4}{cells}")
            rows[f"{n_tokens}x{n_regions}"] = {
                "tokens": n_tokens,
                "regions": n_regions,
                "chunks": shape.chunks,
                "variants": {r.name: r.summary(anchor) for r in results},
            }
    return rows


def short(name: str) -> str:
    """A column title for a variant."""
    return {
        ANCHOR: "numpy",
        "native lists, cold block ids": "lists cold",
        "native lists, warm block ids": "lists warm",
        "native arrays (no Python ints)": "arrays",
        "oracle (pure Python loop)": "oracle",
    }.get(name, name)


def e2e_section(shape: Shape, reps: int) -> dict[str, Any] | None:
    """One load request through a real Mooncake store on loopback (embedded master, in-process copy).

    Splits each request's GIL-held time into our preparation (keys + address rows) and Mooncake's conversion
    of the argument lists, and times the transfer, for the numpy-era path and the native plan."""
    if importlib.util.find_spec("mooncake") is None:
        print("\nEnd to end through Mooncake: skipped (no mooncake wheel; pip install mooncake_kvaddr[mooncake])")
        return None
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
    config = StoreConfig(global_segment_size=data_bytes + data_bytes // 4 + (64 << 20), local_buffer_size=0,
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

        samples: dict[str, list[float]] = {k: [] for k in (
            "numpy-era prep", "native prep (cold rows)", "native prep (warm rows)", "mooncake conversion",
            "get (conversion + transfer)", "staged prep (walk + arrays + slots)", "staged mooncake conversion",
            "staged load (total)")}
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
            for name, value in zip(samples, values):
                samples[name].append(value * 1e3)
        # Block 0 is never loaded (ids start at 1): compare the blocks the request covers.
        verified = all(np.array_equal(s_[block_bytes:], t_[block_bytes:]) for s_, t_ in zip(source, target))
        staged.close()

    med = {k: statistics.median(v) for k, v in samples.items()}
    old_gil = med["numpy-era prep"] + med["mooncake conversion"]
    new_cold = med["native prep (cold rows)"] + med["mooncake conversion"]
    new_warm = med["native prep (warm rows)"] + med["mooncake conversion"]
    transfer = max(0.0, med["get (conversion + transfer)"] - med["mooncake conversion"])
    print(f"\nEnd to end through Mooncake (embedded master, in-process copy): {shape.chunks} keys x "
          f"{shape.regions} regions x {block_bytes} B = {data_bytes / 2**20:.0f} MiB per load; bytes verified: "
          f"{verified}")
    for name, value in med.items():
        print(f"  {name:<40} {value:>10.3f} ms")
    print(f"  {'transfer (get minus conversion)':<40} {transfer:>10.3f} ms")
    print(f"  GIL-held per load, numpy-era (prep + conversion)      {old_gil:>8.3f} ms")
    print(f"  GIL-held per load, native cold (prep + conversion)    {new_cold:>8.3f} ms  "
          f"({new_cold / old_gil:.2f}x of numpy-era)")
    print(f"  GIL-held per load, native warm (prep + conversion)    {new_warm:>8.3f} ms  "
          f"({new_warm / old_gil:.2f}x of numpy-era)")
    staged_gil = med["staged prep (walk + arrays + slots)"] + med["staged mooncake conversion"]
    print(f"  GIL-held per load, staged (prep + conversion)         {staged_gil:>8.3f} ms  "
          f"({staged_gil / old_gil:.2f}x of numpy-era)")
    return {"medians_ms": med, "transfer_ms": transfer, "gil_held_ms": {
        "numpy_era": old_gil, "native_cold": new_cold, "native_warm": new_warm, "staged": staged_gil},
        "ratio_cold": new_cold / old_gil, "ratio_warm": new_warm / old_gil, "ratio_staged": staged_gil / old_gil,
        "verified": verified, "bytes": data_bytes}


def transfer_section(chunks: int, regions: int, block_bytes: int, reps: int,
                     concurrency: Sequence[int] = (1, 2, 4)) -> dict[str, Any] | None:
    """Staged vs multi-buffer loads and stores of one request through a real Mooncake store (embedded master,
    in-process copy), interleaved: total time, GIL-held time beside a busy Python thread, and N concurrent
    loads on N receive threads. Bytes are verified once per mode."""
    if importlib.util.find_spec("mooncake") is None:
        print("\nTransfer modes: skipped (no mooncake wheel; pip install mooncake_kvaddr[mooncake])")
        return None
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
    # No region-budget splitting: in one process Mooncake copies in memory (MOONCAKE.md), so a whole request
    # is one call in either mode.
    config = StoreConfig(global_segment_size=data + data // 4 + (64 << 20), local_buffer_size=0,
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
                    time.sleep(0.01)
                    counter.reset()
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

    title = (f"Transfer modes: {chunks} keys x {regions} regions x {block_bytes} B = {data / 2**20:.0f} MiB per "
             f"request, embedded master, in-process copy; medians of {reps}; bytes verified: {verified}")
    print(f"\n{title}")
    print(f"  {'':<34} {'multi_buffer ms':>16} {'staged ms':>10} {'staged/mb':>10}")
    rows: dict[str, Any] = {}
    for name in samples["multi_buffer"]:
        mb = statistics.median(samples["multi_buffer"][name])
        st = statistics.median(samples["staged"][name])
        rows[name] = {"multi_buffer_ms": mb, "staged_ms": st, "ratio": st / mb if mb else None}
        print(f"  {name:<34} {mb:>16.2f} {st:>10.2f} {st / mb if mb else float('nan'):>10.2f}")
    return {"shape": {"chunks": chunks, "regions": regions, "block_bytes": block_bytes, "bytes": data},
            "verified": verified, "rows": rows}


def tcp_section(chunks: int, regions: int, block_bytes: int, reps: int) -> dict[str, Any] | None:
    """Staged vs multi-buffer over real TCP: the pool's only segment is held by a separate ``mooncake_client``
    process, this process is a pure client (global segment 0) with the default TCP region budget."""
    if importlib.util.find_spec("mooncake") is None:
        print("\nReal TCP: skipped (no mooncake wheel; pip install mooncake_kvaddr[mooncake])")
        return None
    from mooncake_kvaddr.driver.config import StoreConfig
    from mooncake_kvaddr.driver.master import EmbeddedMaster, find_master_binary, free_ports, pdeathsig_preexec
    from mooncake_kvaddr.driver.store import MooncakeStore
    from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

    block_size = 128
    data = chunks * regions * block_bytes
    num_blocks = chunks + 1
    rng = np.random.default_rng(1)
    source = [rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]
    target = [np.ones((num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]
    request = TransferRequest("tcp", chunks * block_size, [i.to_bytes(8, "little") * 4 for i in range(chunks)],
                              [list(range(1, num_blocks))])
    client_binary = find_master_binary().with_name("mooncake_client")
    rows: dict[str, Any] = {}
    with EmbeddedMaster() as master:
        (port,) = free_ports(1)
        holder = subprocess.Popen(
            [str(client_binary), "-host=127.0.0.1", f"-port={port}",
             f"-global_segment_size={(2 * data >> 20) + 64}MB", f"-master_server_address={master.rpc_address}",
             "-metadata_server=P2PHANDSHAKE", "-protocol=tcp"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pdeathsig_preexec(),
        )
        try:
            config = StoreConfig(master_server_address=master.rpc_address, global_segment_size=0,
                                 local_buffer_size=0)
            with MooncakeStore(config) as store:
                # Ready when the holder's segment is mounted: a small put then finds space (bounded wait).
                probe = [source[0][1].ctypes.data]
                deadline = time.monotonic() + 15
                while not store.batch_put_from(["tcp-ready-probe"], probe, [block_bytes]).ok:
                    if time.monotonic() > deadline or holder.poll() is not None:
                        raise RuntimeError("the mooncake_client segment holder did not come up")
                    time.sleep(0.1)
                for mode in ("staged", "multi_buffer"):
                    md = KeyMetadata(f"tcp-{mode}", 0, 0, 0, 0)
                    writer = KVTransfer(store, [ChunkedTokenDatabase(md, block_size)], transfer_mode=mode,
                                        start_threads=False)
                    reader = KVTransfer(store, [ChunkedTokenDatabase(md, block_size)], transfer_mode=mode,
                                        start_threads=False)
                    writer.register_kv_caches(source, num_blocks)
                    reader.register_kv_caches(target, num_blocks)
                    loads, stores, verified = [], [], True
                    for _ in range(reps):
                        store.remove_all(force=True)
                        t0 = time.perf_counter()
                        stored = writer.store(request)
                        stores.append((time.perf_counter() - t0) * 1e3)
                        for region in target:
                            region[:] = 1
                        t0 = time.perf_counter()
                        loaded = reader.load(request)
                        loads.append((time.perf_counter() - t0) * 1e3)
                        verified &= stored.ok and loaded.ok and all(
                            np.array_equal(a[1:], b[1:]) for a, b in zip(source, target))
                    writer.close()
                    reader.close()
                    rows[mode] = {"store_ms": statistics.median(stores), "load_ms": statistics.median(loads),
                                  "verified": verified}
                budget = config.region_budget
        finally:
            holder.terminate()
            try:
                holder.wait(10)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
    print(f"\nReal TCP across processes: {chunks} keys x {regions} regions x {block_bytes} B = "
          f"{data / 2**20:.0f} MiB, segment in a separate mooncake_client, region budget {budget}; "
          f"medians of {reps}")
    print(f"  {'mode':<14} {'store ms':>10} {'load ms':>10}  verified")
    for mode, row in rows.items():
        print(f"  {mode:<14} {row['store_ms']:>10.1f} {row['load_ms']:>10.1f}  {row['verified']}")
    speedup = {op: rows["multi_buffer"][f"{op}_ms"] / rows["staged"][f"{op}_ms"] for op in ("store", "load")}
    print(f"  staged speed-up: store {speedup['store']:.1f}x, load {speedup['load']:.1f}x")
    return {"shape": {"chunks": chunks, "regions": regions, "block_bytes": block_bytes, "bytes": data},
            "rows": rows, "speedup": speedup}


def plot(report: dict[str, Any], path: str) -> bool:
    """Speed-up over numpy vs request length, one line per variant (one panel per region count)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install mooncake_kvaddr[bench]); no plot written")
        return False
    rows = report["sections"].get("scaling", {})
    regions = sorted({r["regions"] for r in rows.values()})
    fig, axes = plt.subplots(1, len(regions), figsize=(4.2 * len(regions), 3.8), squeeze=False, sharey=True)
    for ax, n_regions in zip(axes[0], regions):
        points = sorted((r for r in rows.values() if r["regions"] == n_regions), key=lambda r: r["tokens"])
        for name in points[0]["variants"]:
            xs = [r["tokens"] for r in points if name in r["variants"]]
            ys = [r["variants"][name]["speedup_vs_anchor"] for r in points if name in r["variants"]]
            ax.plot(xs, ys, marker="o", label=short(name))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"R = {n_regions} regions")
        ax.set_xlabel("request length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("speed-up vs numpy + tolist")
    axes[0][-1].legend(fontsize=8)
    machine_ = report["machine"]
    fig.suptitle(f"mooncake_kvaddr {machine_['mooncake_kvaddr']} prepare_values, {machine_['cpu']} "
                 f"({machine_['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return True


def print_table(title: str, results: list[Result]) -> dict[str, Any]:
    """Print one section and return its JSON form."""
    anchor = next((r.median for r in results if r.name in ANCHORS), None)
    print(f"\n{title}")
    print(f"  {'variant':<40} {'median ms':>10} {'p10':>8} {'p90':>8} {'speed-up':>9}")
    rows = {}
    for r in results:
        s = r.summary(anchor)
        ratio = f"{s['speedup_vs_anchor']:.1f}x" if s["speedup_vs_anchor"] else "-"
        print(f"  {r.name:<40} {s['median_ms']:>10.3f} {s['p10_ms']:>8.3f} {s['p90_ms']:>8.3f} {ratio:>9}")
        rows[r.name] = s
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print (and optionally save) the results."""
    parser = argparse.ArgumentParser(prog="python -m mooncake_kvaddr.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run under a minute")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of speed-up vs request length (matplotlib)")
    parser.add_argument("--no-mooncake", action="store_true", help="skip the end-to-end Mooncake section")
    args = parser.parse_args(argv)
    reps = args.reps or (5 if args.quick else 30)

    info = machine()
    print(f"mooncake_kvaddr {__version__} bench on {info['cpu']} ({info['cores']} cores), "
          f"Python {info['python']}, numpy {info['numpy']}; gc {'on' if gc.isenabled() else 'off'}")
    report: dict[str, Any] = {"machine": info, "reps": reps, "sections": {}}

    shape = HEADLINE
    title = f"Addresses and sizes per request: {shape.describe()}"
    report["sections"]["addresses"] = {"shape": shape.describe(), "rows": print_table(title,
                                                                                    address_section(shape, reps))}
    keys, lookup = key_section(shape, reps)
    title = f"Key strings for {shape.chunks} sha256 hashes (speed-up vs Python key_for)"
    report["sections"]["keys"] = {"shape": shape.describe(), "rows": print_table(title, keys)}
    title = f"Lookup keys: {shape.chunks} sha256 hashes x 8 namespaces"
    report["sections"]["lookup_keys"] = {"shape": shape.describe(), "rows": print_table(title, lookup)}
    title = f"Fused load plan per group vs the Python path: {shape.describe()}"
    report["sections"]["plan"] = {"shape": shape.describe(), "rows": print_table(title, plan_section(shape, reps))}
    report["sections"]["gil"] = gil_section(shape, seconds=0.3 if args.quick else 1.5)
    report["sections"]["threads"] = threads_section(shape, requests=8 if args.quick else 16)
    if args.quick:
        scaling = scaling_section((1_024, 16_384, 262_144), (1, 96), reps=3)
    else:
        scaling = scaling_section(SCALING_TOKENS, SCALING_REGIONS, reps=max(5, reps // 4))
    report["sections"]["scaling"] = scaling
    if not args.no_mooncake:
        e2e_shape = Shape(tokens=32_768) if args.quick else HEADLINE
        report["sections"]["end_to_end"] = e2e_section(e2e_shape, reps=3 if args.quick else 10)
        if args.quick:
            shapes = [(256, 100, 2048)]
        else:  # equal payloads at 2 and 8 KiB; 32 KiB at a quarter of the chunks to fit in memory
            shapes = [(2258, 100, 2048), (2258, 100, 8192), (565, 100, 32768)]
        report["sections"]["tcp"] = tcp_section(100 if args.quick else 1000, 100, 2048, reps=1 if args.quick else 3)
        report["sections"]["transfer_modes"] = [
            transfer_section(c, r, b, reps=3 if args.quick else 7) for c, r, b in shapes
        ]
    if args.plot:
        plot(report, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
