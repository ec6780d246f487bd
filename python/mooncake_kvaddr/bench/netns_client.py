"""The worker that :class:`mooncake_kvaddr.bench.netns.NetnsCluster` runs inside a namespace.

Run as ``python -m mooncake_kvaddr.bench.netns_client``: one process per "host", driving the project's
:class:`~mooncake_kvaddr.driver.store.MooncakeStore` and :class:`~mooncake_kvaddr.driver.transfer.KVTransfer` by
one JSON command per line on stdin (replies and events on stdout) and verifying every load byte for byte
(:func:`verify`). Its commands, protocol and the rules a load must satisfy: ``docs/multihost.md``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

import numpy as np

# Set before the driver imports mooncake.store (read at load time).
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.metadata import KeyMetadata
from mooncake_kvaddr.driver.config import DEFAULT_REQUEST_TIMEOUT_S, StoreConfig
from mooncake_kvaddr.driver.staging import StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, LoadResult, TransferRequest

__all__ = ["dataset", "main", "verify"]

Array = np.ndarray[Any, np.dtype[np.uint8]]


def dataset(seed: int, regions: int, blocks: int, block_bytes: int) -> list[Array]:
    """The bytes of data set ``seed``: ``regions`` arrays of ``blocks`` x ``block_bytes`` (reproducible)."""
    rng = np.random.default_rng(seed)
    return [
        np.frombuffer(rng.bytes(blocks * block_bytes), dtype=np.uint8).reshape(blocks, block_bytes).copy()
        for _ in range(regions)
    ]


def hashes(tag: str, chunks: int) -> list[bytes]:
    """Block hashes of a request under key tag ``tag`` (distinct tags give distinct keys)."""
    return [f"{tag}:{i}".encode() for i in range(chunks)]


def verify(
    regions: list[Array],
    expected: list[Array],
    block_ids: list[int],
    result: LoadResult,
    sentinel: int,
) -> dict[str, Any]:
    """Check a load's claims against the bytes in the KV cache (see the module docstring)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    loaded = np.isin(ids, list(result.loaded_block_ids)) if result.loaded_block_ids else np.zeros(len(ids), bool)
    failed = np.isin(ids, list(result.failed_block_ids)) if result.failed_block_ids else np.zeros(len(ids), bool)
    exact = np.ones(len(ids), dtype=bool)
    all_sentinel = np.ones(len(ids), dtype=bool)
    plausible = np.ones(len(ids), dtype=bool)  # every byte is the sentinel or the right byte
    for region, want in zip(regions, expected, strict=True):
        got = region[ids]
        right = got == want[ids]
        blank = got == sentinel
        exact &= right.all(axis=1)
        all_sentinel &= blank.all(axis=1)
        plausible &= (right | blank).all(axis=1)
    return {
        "chunks": len(ids),
        "reported_loaded": int(loaded.sum()),
        "reported_failed": int(failed.sum()),
        "verified": int((loaded & exact).sum()),
        # Reported loaded but the bytes are not the object's: the one outcome that must never happen.
        "wrong": int((loaded & ~exact).sum()),
        # Bytes that are neither the sentinel nor this object's: another request's bytes (staging reuse).
        "stale": int((~plausible).sum()),
        # Failed chunks whose blocks were partly written with the right object's bytes (multi-buffer only).
        "partial": int((failed & ~all_sentinel).sum()),
        "unaccounted": int((~loaded & ~failed).sum()),
        "overlap": int((loaded & failed).sum()),
        "error": result.error,
        "stopped": result.stopped,
        "outcomes": dict(result.outcomes),
        "mode": result.mode,
    }


_DATASETS: dict[tuple[int, int, int, int], list[Array]] = {}


class _Cache:
    """A KV cache of ``regions`` arrays and the KVTransfer that moves it."""

    def __init__(self, store: MooncakeStore, args: dict[str, Any]) -> None:
        self.regions_n = int(args["regions"])
        self.blocks = int(args["blocks"])
        self.block_bytes = int(args["block_bytes"])
        self.block_size = int(args.get("block_size", 16))
        shape = (self.blocks, self.block_bytes)
        self.regions: list[Array] = [np.zeros(shape, dtype=np.uint8) for _ in range(self.regions_n)]
        staging = args.get("staging_bytes")
        self.pool = StagingPool(int(staging)) if staging else None
        db = ChunkedTokenDatabase(KeyMetadata(str(args.get("model", "mh")), 0, 0, 0, 0), self.block_size)
        probe = args.get("probe_peers")
        self.xfer = KVTransfer(
            store, [db], transfer_mode=str(args["mode"]), start_threads=False, staging_pool=self.pool,
            probe_peers=None if probe is None else bool(probe),
        )
        self.xfer.register_kv_caches(self.regions, self.blocks)

    def data(self, seed: int) -> list[Array]:
        """Data set ``seed`` in this cache's shape (the last two generated are kept, for every cache)."""
        key = (seed, self.regions_n, self.blocks, self.block_bytes)
        if key not in _DATASETS:
            while len(_DATASETS) >= 2:
                del _DATASETS[next(iter(_DATASETS))]
            _DATASETS[key] = dataset(*key)
        return _DATASETS[key]

    def request(self, tag: str, chunks: int) -> TransferRequest:
        if not 0 < chunks < self.blocks:
            raise ValueError(f"chunks: must be in 1..{self.blocks - 1}, got {chunks}")
        return TransferRequest(tag, chunks * self.block_size, hashes(tag, chunks), [list(range(1, chunks + 1))])

    def close(self) -> None:
        self.xfer.close()


class _CallHook:
    """Stands in for a store's Mooncake client: forwards everything, and reports each transfer call first.

    This is how a test aims a fault at the middle of a load: the worker counts the Mooncake calls of the
    current load and, at the requested one, announces ``paused`` and waits a moment before making it.
    """

    _CALLS = frozenset(
        ("batch_get_into", "batch_get_into_multi_buffers", "batch_put_from", "batch_put_from_multi_buffers")
    )

    def __init__(self, client: Any, before_call: Callable[[str], None]) -> None:
        self._client = client
        self._before_call = before_call

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in self._CALLS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._before_call(name)
            return attr(*args, **kwargs)

        return call


class Worker:
    """The command loop's state: named stores and caches."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.stores: dict[str, MooncakeStore] = {}
        self.caches: dict[str, _Cache] = {}
        self.calls = 0  # Mooncake transfer calls of the current load
        self.iteration = -1  # index of the current load in a load_loop
        self.pause: dict[str, Any] | None = None  # {"iteration", "call", "seconds"}

    def before_call(self, name: str) -> None:
        self.calls += 1
        pause = self.pause
        if pause is not None and pause["iteration"] == self.iteration and pause["call"] == self.calls:
            self.emit({"event": "paused", "iteration": self.iteration, "call": self.calls, "t": time.time()})
            time.sleep(float(pause["seconds"]))

    def emit(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    # ------------------------------------------------------------------ commands

    def op_setup(self, args: dict[str, Any]) -> dict[str, Any]:
        name = str(args.get("store", "main"))
        if name in self.stores:
            raise ValueError(f"store {name!r} exists")
        config = StoreConfig(
            local_hostname=str(args["hostname"]),
            master_server_address=str(args["master"]),
            global_segment_size=int(args.get("segment", 0)),
            local_buffer_size=0,
            max_regions_per_batch=args.get("region_budget"),
            setup_retries=int(args.get("setup_retries", 2)),
            close_timeout_s=float(args.get("close_timeout_s", 120.0)),
            request_timeout_s=args.get("request_timeout_s", DEFAULT_REQUEST_TIMEOUT_S),
        )
        t0 = time.perf_counter()
        store = MooncakeStore(config).setup()
        # Test-only: count the transfer calls (see _CallHook); the store hands this object to every call.
        store._client = _CallHook(store._client, self.before_call)
        if store._native is not None:  # transfers go to the native client when it is on
            store._native = _CallHook(store._native, self.before_call)  # type: ignore[assignment]
        self.stores[name] = store
        return {"seconds": time.perf_counter() - t0}

    def op_cache(self, args: dict[str, Any]) -> dict[str, Any]:
        name = str(args["cache"])
        if name in self.caches:
            self.caches.pop(name).close()
        cache = _Cache(self.stores[str(args.get("store", "main"))], args)
        self.caches[name] = cache
        return {"mode": cache.xfer.mode}

    def op_fill(self, args: dict[str, Any]) -> dict[str, Any]:
        cache = self.caches[str(args["cache"])]
        for region, src in zip(cache.regions, cache.data(int(args["seed"])), strict=True):
            region[...] = src
        return {}

    def op_store(self, args: dict[str, Any]) -> dict[str, Any]:
        cache = self.caches[str(args["cache"])]
        request = cache.request(str(args["tag"]), int(args["chunks"]))
        t0 = time.perf_counter()
        result = cache.xfer.store(request)
        return {
            "seconds": time.perf_counter() - t0,
            "stored_ok": result.ok,
            "chunks": result.chunks,
            "stored": result.stored,
            "already_present": result.already_present,
            "failed": len(result.failed_keys),
            "saved_tokens": result.saved_tokens,
            "outcomes": dict(result.outcomes),
            "mode": result.mode,
            "bytes": result.bytes,
            "timings": dict(result.timings),
        }

    def _load_once(self, cache: _Cache, tag: str, chunks: int, seed: int, sentinel: int, index: int) -> dict[str, Any]:
        request = cache.request(tag, chunks)
        ids = request.block_ids[0]
        for region in cache.regions:
            region[1 : chunks + 1] = sentinel
        expected = cache.data(seed)
        self.iteration, self.calls = index, 0
        t_start = time.time()
        self.emit({"event": "load_started", "index": index, "tag": tag, "t": t_start})
        t0 = time.perf_counter()
        result = cache.xfer.load(request)
        seconds = time.perf_counter() - t0
        report = verify(cache.regions, expected, list(ids), result, sentinel)
        report.update(
            seconds=seconds, index=index, tag=tag, t_start=t_start, t_end=t_start + seconds,
            bytes=result.bytes, timings=dict(result.timings), calls=self.calls,
        )  # fmt: skip
        return report

    def op_load(self, args: dict[str, Any]) -> dict[str, Any]:
        cache = self.caches[str(args["cache"])]
        return self._load_once(
            cache, str(args["tag"]), int(args["chunks"]), int(args["seed"]), int(args.get("sentinel", 0xA5)), 0
        )

    def op_load_loop(self, args: dict[str, Any]) -> dict[str, Any]:
        cache = self.caches[str(args["cache"])]
        sets = [(str(tag), int(seed)) for tag, seed in args["datasets"]]
        chunks = int(args["chunks"])
        sentinel = int(args.get("sentinel", 0xA5))
        deadline = time.monotonic() + float(args["duration_s"])
        max_iters = int(args.get("max_iters", 1 << 30))
        self.pause = args.get("pause")
        reports: list[dict[str, Any]] = []
        while time.monotonic() < deadline and len(reports) < max_iters:
            tag, seed = sets[len(reports) % len(sets)]
            report = self._load_once(cache, tag, chunks, seed, sentinel, len(reports))
            self.emit({"event": "iteration", **report})
            reports.append(report)
        self.pause, self.iteration = None, -1
        return {"iterations": reports}

    def op_exist(self, args: dict[str, Any]) -> dict[str, Any]:
        store = self.stores[str(args.get("store", "main"))]
        keys = hashes_keys(self.caches[str(args["cache"])], str(args["tag"]), int(args["chunks"]))
        result = store.batch_is_exist(keys)
        return {"present": sum(result.present), "summary": result.summary()}

    def op_remove_all(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"removed": self.stores[str(args.get("store", "main"))].remove_all(force=True)}

    def op_health(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"health": self.stores[str(args.get("store", "main"))].health_check().name}

    def op_close(self, args: dict[str, Any]) -> dict[str, Any]:
        self.close_all()
        return {}

    def close_all(self) -> None:
        for cache in self.caches.values():
            cache.close()
        self.caches.clear()
        for store in self.stores.values():
            store.close()
        self.stores.clear()

    # ------------------------------------------------------------------ loop

    def serve(self, commands: IO[str]) -> None:
        self.emit({"event": "hello", "pid": os.getpid()})
        handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")
        }
        for line in commands:
            if not line.strip():
                continue
            try:
                args = json.loads(line)
                op = str(args.get("op"))
            except (json.JSONDecodeError, AttributeError) as exc:
                self.emit({"reply": None, "ok": False, "error": f"bad command line: {exc}"})
                continue
            if op == "exit":
                break
            handler = handlers.get(op)
            if handler is None:
                self.emit({"reply": op, "ok": False, "error": f"unknown op {op!r}"})
                continue
            try:
                self.emit({"reply": op, "ok": True, **handler(args)})
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                self.emit({"reply": op, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        self.close_all()


def hashes_keys(cache: _Cache, tag: str, chunks: int) -> list[str]:
    """The store keys of a request under ``tag`` (the same the cache's KVTransfer uses)."""
    db = cache.xfer.databases[0]
    request = cache.request(tag, chunks)
    return list(db.plan_store(request.token_len, request.block_hashes, request.block_ids[0], 0).keys)


def main() -> int:
    """Serve commands on stdin until ``exit`` or EOF; the protocol goes to the original stdout only."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything native code prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    Worker(protocol).serve(sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
