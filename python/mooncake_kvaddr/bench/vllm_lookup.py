"""vLLM 0.33's ``MooncakeStoreWorker.lookup`` on the headline request at TP 8, with and without the plugin.

vLLM asks the store this for every new request, so its GIL time matters. Measured on a stand-in worker against a
real Mooncake master with every candidate key stored (a full hit): vLLM alone, the plugin with the native client
and the plugin without it, interleaved beside a busy Python thread; per lookup the wall time, CPU, GIL-held time
and the busy thread's stall (``docs/benchmarks.md``, "The lookup").
"""

from __future__ import annotations

import statistics
import threading
import time
import types
from typing import Any

TP = 8
BLOCK = 128
VARIANTS = ("vllm", "plugin", "plugin_native_off")


class _Spinner:
    """A busy Python thread recording every gap over 0.2 ms: time it could not run."""

    def __init__(self) -> None:
        self.gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lookup-bench-spinner")
        self._thread.start()

    def _run(self) -> None:
        clock, last = time.perf_counter, time.perf_counter()
        while not self._stop.is_set():
            now = clock()
            if now - last > 0.0002:
                self.gaps.append((last, now))
            last = now

    def lost(self, start: float, end: float) -> float:
        return sum(min(b, end) - max(a, start) for a, b in self.gaps if b > start and a < end)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class _Clock:
    """The last timed native call: the calling thread's CPU in it, and the part of it with the GIL held."""

    cpu = 0.0
    held = 0.0


def _timed_native(base: type) -> type:
    """A :class:`NativeMooncakeStore` subclass (so the lookup picks its blob path) whose ``batch_is_exist``
    records in :class:`_Clock` the calling thread's CPU in the call and the part of the call it held the GIL:
    its wall time less the interval the native client ran with the GIL released."""
    from mooncake_kvaddr import _native

    class Timed(base):  # type: ignore[misc]
        def batch_is_exist(self, keys: Any) -> Any:
            cpu0, start = time.thread_time(), time.perf_counter()
            result = super().batch_is_exist(keys)
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu0
            released = _native.mooncake_client_last_release_ns() / 1e9
            _Clock.cpu, _Clock.held = cpu, max(0.0, wall - released)
            return result

    return Timed


def _worker(worker_module: Any, coord: Any, group: Any, prefixes: tuple[str, ...], store: Any) -> Any:
    stub = types.SimpleNamespace(
        _capacity_only=False, coord=coord, token_dbs=[types.SimpleNamespace(block_size=BLOCK, chunk_size=BLOCK)],
        _kv_cache_groups=[group], _lookup_key_prefixes=(prefixes,), hash_block_size=BLOCK, store=store,
        _record_kv_connector_operation=lambda *args, **kwargs: None, _selective_lease=None,
    )  # fmt: skip
    # The worker methods its lookup calls on itself (vLLM 0.34 added _longest_hit), bound to the stand-in.
    for name in ("_tail_key_boundaries", "_longest_hit"):
        method = worker_module.MooncakeStoreWorker.__dict__.get(name)
        if method is not None:
            setattr(stub, name, types.MethodType(method, stub))
    return stub


def run(quick: bool = True, *, reps: int | None = None) -> list[dict[str, Any]]:
    """One row per variant (times in ms, medians); ``hit_ok``: every variant found the same full hit."""
    import importlib
    import os

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import coordinator, data
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as worker_module
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from mooncake_kvaddr import _native
    from mooncake_kvaddr.driver.master import EmbeddedMaster
    from mooncake_kvaddr.integrations.vllm.lookup import make_lookup
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
    from mooncake_kvaddr.integrations.vllm.plugin import TRANSPORT_ATTR

    units = 256 if quick else 2258
    reps = reps if reps is not None else (3 if quick else 9)
    original = worker_module.MooncakeStoreWorker.__dict__["lookup"]
    original = getattr(original, "__wrapped__", original)
    import vllm

    from mooncake_kvaddr.integrations.vllm.releases import for_version

    release = for_version(str(vllm.__version__))
    ours = make_lookup(original, worker_module, release.lookup_rules if release is not None else None)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
    group = KVCacheGroupSpec(["layer.0"], spec)
    coord = coordinator.MooncakeStoreCoordinator([group], scheduler_block_size=BLOCK, hash_block_size=BLOCK)
    db = data.ChunkedTokenDatabase(data.KeyMetadata("bench/lookup-model", 0, 0, 0, 0), BLOCK, hash_block_size=BLOCK)
    prefixes = tuple(db.store_layout.lookup_key_prefixes([(r, 0, 0, 0) for r in range(TP)]))
    hashes = [os.urandom(32) for _ in range(units)]
    num_tokens = units * BLOCK + 1  # a full hit is cut one unit below: the whole prompt but its last token
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    hits: dict[str, set[Any]] = {v: set() for v in VARIANTS}
    with EmbeddedMaster() as master:
        mooncake_store = importlib.import_module("mooncake.store")
        store = mooncake_store.MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 16 << 20, "tcp", "", master.rpc_address) != 0:
            raise RuntimeError("Mooncake client setup failed")
        timed = _timed_native(NativeMooncakeStore)
        native = timed(store, armed=True)
        try:
            for key in _native.build_lookup_keys(prefixes, hashes):
                if store.put(key, b"k") != 0:
                    raise RuntimeError(f"put {key} failed")
            plain = _worker(worker_module, coord, group, prefixes, store)
            with_native = _worker(worker_module, coord, group, prefixes, store)
            with_native.__dict__[TRANSPORT_ATTR] = (store, native)
            calls = {"vllm": (original, plain), "plugin": (ours, with_native), "plugin_native_off": (ours, plain)}
            spinner = _Spinner()
            try:
                for rep in range(reps + 1):
                    order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]  # rotate: no variant always runs first
                    for variant in order:
                        func, stub = calls[variant]
                        _Clock.cpu = _Clock.held = 0.0
                        cpu0, start = time.thread_time(), time.perf_counter()
                        result = func(stub, num_tokens, hashes)
                        end, cpu = time.perf_counter(), time.thread_time() - cpu0
                        gil = cpu - _Clock.cpu + _Clock.held  # the native call counts only while it held the GIL
                        hits[variant].add((result.hit_length, tuple(result.tail_key_boundaries)))
                        if rep == 0:
                            continue  # warm-up
                        timings = samples[variant]
                        for name, value in (("wall", end - start), ("cpu", cpu), ("cpu_gil", gil),
                                            ("stall", spinner.lost(start, end))):  # fmt: skip
                            timings.setdefault(name, []).append(value * 1e3)
            finally:
                spinner.close()
        finally:
            native.close()
    same = len({frozenset(h) for h in hits.values()}) == 1 and all(len(h) == 1 for h in hits.values())
    rows: list[dict[str, Any]] = []
    for variant in VARIANTS:
        row: dict[str, Any] = {"variant": variant, "units": units, "keys": units * TP, "hit_ok": same}
        row.update({f"{name}_ms": statistics.median(values) for name, values in samples[variant].items()})
        rows.append(row)
    base = rows[0]
    for row in rows:
        for name in ("cpu_gil_ms", "stall_ms"):
            if row.get(name):
                row[name.replace("_ms", "_x")] = base[name] / row[name]
    return rows
