"""vLLM 0.33's own store and receive threads and lookup, patched by the plugin, over an HA cluster whose leader
is SIGKILLed (tests/test_ha_plugin.py runs this as a child: Mooncake's client binds one etcd per process).

Everything is observed as vLLM sees it (save offsets, failed block ids, lookup hits) and written as JSON; the
test asserts on it. ``python3 tests/ha_plugin_run.py --json OUT`` runs it by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncake_kvaddr.bench.vllm_rig import BLOCK, RigShape, VllmStoreRig, mode_flags, plugin_mode
from mooncake_kvaddr.driver.cluster import EmbeddedCluster

CHUNKS = 8  # chunks (= blocks) per request
REGIONS = 4
REGION_BYTES = 2048
# Blocks 1..CHUNKS are stored from, blocks CHUNKS+1..2*CHUNKS are loaded into: a store and a load in flight at
# once never touch the same block.
SOURCE = list(range(1, CHUNKS + 1))
TARGET = list(range(CHUNKS + 1, 2 * CHUNKS + 1))


class Harness:
    """One rig (a Mooncake client over the cluster, wrapped as the plugin's worker hook wraps it, vLLM's send
    and receive threads) plus a stand-in worker for vLLM's lookup; every job timed against ``bound_s``."""

    def __init__(self, cluster: EmbeddedCluster, mode: str, bound_s: float) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as worker_module
        from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec

        from mooncake_kvaddr.integrations.vllm.transports import TRANSPORT_ATTR, maybe_stage_store

        self.mode = mode
        self.bound_s = bound_s
        self.torch = torch
        _, staged, native = mode_flags(mode)
        shape = RigShape(blocks=2 * CHUNKS, regions=REGIONS, region_bytes=REGION_BYTES)
        self.rig = VllmStoreRig(cluster.master_server_address, shape, staged=staged, native=native,
                                staging_bytes=1 << 20, model=f"ha-plugin/{mode}")  # fmt: skip
        # The rig wraps vLLM's store as the worker hook does (maybe_stage_store): same wrapper types, and the
        # registered-range guard armed (by the registrations here, by construction there).
        extra = {"mooncake_kvaddr_staged": staged, "mooncake_kvaddr_native_client": native}
        hook = maybe_stage_store(self.rig.raw_store, self.rig.caches, extra)
        self.wrappers = _chain(self.rig.store)
        assert self.wrappers == _chain(hook), (self.wrappers, _chain(hook))
        self.native_client = _native_client_live(self.rig.store)
        self.ops: list[tuple[str, str, str]] = []  # (thread, operation, status), as vLLM records them
        self._ops_lock = threading.Lock()
        self.rig.sender._record_operation_cb = self._recorder("send")
        for receiver in self.rig.receivers:
            receiver._record_operation_cb = self._recorder("recv")
        self.lookup_fn = worker_module.MooncakeStoreWorker.__dict__["lookup"]
        head_size = REGION_BYTES // (BLOCK * 2)
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=head_size, dtype=torch.float16)
        db = self.rig.db
        worker = types.SimpleNamespace(
            _capacity_only=False, coord=self.rig.coord, token_dbs=self.rig.dbs,
            _kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}" for i in range(REGIONS)], spec)],
            _lookup_key_prefixes=(tuple(db.store_layout.lookup_key_prefixes(((0, 0, 0, 0),))),),
            hash_block_size=BLOCK, store=self.rig.raw_store,
            _record_kv_connector_operation=lambda op, _s, _n, **kw: self._record("lookup", op, kw),
        )  # fmt: skip
        worker._tail_key_boundaries = types.MethodType(worker_module.MooncakeStoreWorker._tail_key_boundaries, worker)
        # What the worker hook leaves on a worker whose transfer threads got a transport wrapper.
        worker.__dict__[TRANSPORT_ATTR] = (self.rig.raw_store, self.rig.store)
        self.worker = worker
        self._sources: dict[int, list[Any]] = {}

    def _record(self, thread: str, op: str, kwargs: dict[str, Any]) -> None:
        with self._ops_lock:
            self.ops.append((thread, op, str(kwargs.get("status", "ok"))))

    def _recorder(self, thread: str) -> Callable[..., None]:
        return lambda *, operation, status, **_: self._record(thread, operation, {"status": status})

    def handler_counts(self) -> dict[str, int]:
        """Requests our send and receive handlers and lookup planned themselves (not handed to vLLM's)."""
        worker = self.rig._worker
        send = worker.KVCacheStoreSendingThread._handle_request
        recv = worker.KVCacheStoreRecvingThread._handle_request
        return {
            "send_fast": send.stats.fast_requests,
            "recv_fast": recv.stats.fast_requests,
            "lookup_fast": self.lookup_fn.stats.fast,
            "lookup_blob_calls": self.lookup_fn.stats.blob_calls,
        }

    # --- requests ------------------------------------------------------------------------------------------

    @staticmethod
    def hashes(seed: int) -> list[bytes]:
        return VllmStoreRig.hashes(seed, CHUNKS)

    def store(self, seed: int) -> dict[str, Any]:
        """Fill the source blocks with request ``seed``'s bytes and store them with vLLM's send thread."""
        gen = self.torch.Generator().manual_seed(seed)
        for cache in self.rig.caches:
            noise = self.torch.randint(-(1 << 15), 1 << 15, cache[SOURCE].shape, generator=gen,
                                       dtype=self.torch.int16)  # fmt: skip
            cache[SOURCE] = noise.view(self.torch.float16)
        self._sources[seed] = [cache[SOURCE].clone() for cache in self.rig.caches]
        rig = self.rig
        rig._job += 1
        req_id = f"store-{self.mode}-{seed}"
        meta = rig._data.ReqMeta(req_id=req_id, token_len_chunk=CHUNKS * BLOCK, block_ids=(SOURCE,),
                                 block_hashes=self.hashes(seed), can_save=True, store_job_id=rig._job)  # fmt: skip
        start = time.monotonic()
        rig.sender.add_request(meta)
        while time.monotonic() - start < self.bound_s:
            if rig.sender.take_completed_saves():
                # vLLM's own record of what a store job saved (it resumes from this offset).
                saved = rig.sender._saved_offset.get(req_id, 0) == CHUNKS * BLOCK
                return {"ended": True, "seconds": time.monotonic() - start, "saved": saved, "end": time.monotonic()}
            time.sleep(0.005)
        return {"ended": False, "seconds": time.monotonic() - start, "saved": False, "end": time.monotonic()}

    def load(self, seed: int, tokens: int = CHUNKS * BLOCK) -> dict[str, Any]:
        """Load ``tokens`` of request ``seed`` into the (zeroed) target blocks with vLLM's receive thread;
        every block it does not report failed is compared with what was stored."""
        rig = self.rig
        for cache in rig.caches:
            cache[TARGET] = 0
        req_id = f"load-{self.mode}-{seed}-{time.monotonic_ns()}"
        spec = rig._data.LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=tokens, can_load=True, token_len=tokens)
        meta = rig._data.ReqMeta(req_id=req_id, token_len_chunk=tokens, block_ids=(TARGET,),
                                 block_hashes=self.hashes(seed), load_spec=spec)  # fmt: skip
        start = time.monotonic()
        rig.load_queue.put(meta)
        ended = False
        while time.monotonic() - start < self.bound_s:
            if any(req_id in r.get_and_clear_finished_requests() for r in rig.receivers):
                ended = True
                break
            time.sleep(0.005)
        seconds = time.monotonic() - start
        failed: set[int] = set()
        failed_requests: set[str] = set()
        for receiver in rig.receivers:
            failed |= receiver.get_and_clear_block_ids_with_load_errors()
            failed_requests |= receiver.get_and_clear_failed_requests()
        chunks = tokens // BLOCK
        source = self._sources.get(seed)
        right = wrong = 0
        for i, block in enumerate(TARGET[:chunks]):
            if block in failed:
                continue
            same = source is not None and all(
                bool(self.torch.equal(cache[block].view(self.torch.int16), src[i].view(self.torch.int16)))
                for cache, src in zip(rig.caches, source, strict=True)
            )
            right += same
            wrong += not same
        return {
            "ended": ended, "seconds": seconds, "failed_blocks": len(failed & set(TARGET[:chunks])),
            "stray_failed": sorted(failed - set(TARGET[:chunks])), "request_failed": req_id in failed_requests,
            "right": right, "wrong": wrong, "chunks": chunks,
        }  # fmt: skip

    def lookup(self, seed: int) -> dict[str, Any]:
        """vLLM's ``MooncakeStoreWorker.lookup`` (ours, patched in) for the whole request plus one token."""
        start = time.monotonic()
        result = self.lookup_fn(self.worker, CHUNKS * BLOCK + 1, self.hashes(seed))
        return {"ended": True, "seconds": time.monotonic() - start, "hit": int(result.hit_length)}

    def checked_lookup(self, seed: int) -> dict[str, Any]:
        """A lookup, and the load of whatever it hit: a hit must load in full, byte for byte."""
        found = self.lookup(seed)
        if found["hit"] > 0:
            found["load"] = self.load(seed, found["hit"])
        return found


def _chain(store: Any) -> list[str]:
    names = []
    while store is not None and type(store).__module__.startswith("mooncake_kvaddr"):
        names.append(type(store).__name__)
        store = getattr(store, "wrapped", None)
    return names


def _native_client_live(store: Any) -> bool:
    while store is not None:
        if getattr(store, "native_client", None) is not None:
            return True
        store = getattr(store, "wrapped", None)
    return False


def _timed(fn: Callable[[], dict[str, Any]], out: dict[str, Any], name: str) -> threading.Thread:
    def run() -> None:
        try:
            out[name] = fn()
        except BaseException as exc:  # reported to the test, which fails on it
            out[name] = {"ended": True, "error": f"{type(exc).__name__}: {exc}"}

    return threading.Thread(target=run, name=f"ha-plugin-{name}", daemon=True)


def failover(cluster: EmbeddedCluster, h: Harness, seed: int, service_bound_s: float) -> dict[str, Any]:
    """Store and check request A; kill the leader; at once start a store job (B), and lookups and loads of A
    in a loop until service is back (a store job that saves); then what became of A and B, and a fresh
    request."""
    a, b = 10 * seed, 10 * seed + 1
    report: dict[str, Any] = {"mode": h.mode, "wrappers": h.wrappers, "native_client": h.native_client}
    counts = h.handler_counts()
    report["before"] = {"store": h.store(a), "lookup": h.lookup(a), "load": h.load(a)}
    leader = cluster.wait_for_leader()
    during: dict[str, Any] = {}
    store_job = _timed(lambda: h.store(b), during, "store")
    reads: list[dict[str, Any]] = []
    done = threading.Event()

    def reader() -> None:
        # Lookups and loads of A, one after the other, from the kill until service is back.
        while not done.is_set():
            for kind, call in (("lookup", h.lookup), ("load", h.load)):
                at = time.monotonic() - killed_at
                try:
                    reads.append({"kind": kind, "at": at, **call(a)})
                except BaseException as exc:  # reported to the test, which fails on it
                    reads.append({"kind": kind, "at": at, "ended": True, "error": f"{type(exc).__name__}: {exc}"})
                if not reads[-1].get("ended"):
                    return  # a job past the bound: the receive thread is stuck, nothing more can be read
            done.wait(0.1)

    read_thread = threading.Thread(target=reader, name="ha-plugin-reader", daemon=True)
    killed_at = time.monotonic()
    leader.kill()
    store_job.start()
    read_thread.start()
    store_job.join(h.bound_s + 5)
    report["during"] = during
    report["reads"] = reads
    if not during.get("store", {}).get("ended"):
        report["stuck"] = True
        done.set()
        return report
    # Time to service: from the kill to the end of the first store job, started after it, that saved.
    attempts = [during["store"]]
    seed_c = 10 * seed + 2
    while not attempts[-1].get("saved") and time.monotonic() - killed_at < service_bound_s:
        time.sleep(0.2)
        seed_c += 1
        attempts.append(h.store(seed_c))
        if not attempts[-1]["ended"]:
            report["stuck"] = True
            done.set()
            return report
    done.set()
    read_thread.join(h.bound_s + 5)
    if read_thread.is_alive() or not all(r.get("ended") for r in reads):
        report["stuck"] = True
        return report
    first = attempts[-1]
    report["service_s"] = first["end"] - killed_at if first.get("saved") else None
    report["store_attempts"] = len(attempts)
    report["failed_store_jobs"] = sum(not s.get("saved") for s in attempts)
    report["store_seconds_max"] = max(s["seconds"] for s in attempts)
    new_leader = cluster.wait_for_leader(exclude=leader)
    report["leader_s"] = time.monotonic() - killed_at  # upper bound: read after service returned
    report["killed"], report["new_leader"] = leader.index, new_leader.index
    report["after"] = {
        "lost": {"lookup": h.checked_lookup(a), "load": h.load(a)},
        "during_store": h.checked_lookup(b),
        "first_saved": h.checked_lookup(seed_c) if first.get("saved") else None,
        "fresh_store": h.store(seed_c + 1),
        "fresh": h.checked_lookup(seed_c + 1),
    }
    report["handlers"] = {k: v - counts[k] for k, v in h.handler_counts().items()}
    with h._ops_lock:
        tally: dict[str, int] = {}
        for thread, op, status in h.ops:
            tally[f"{thread}:{op}:{status}"] = tally.get(f"{thread}:{op}:{status}", 0) + 1
        h.ops.clear()
    report["vllm_ops"] = tally
    cluster.revive(leader)
    cluster.wait_for_leader()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", default="recv_native,recv_staged_native")
    parser.add_argument("--bound", type=float, default=60.0, help="seconds a vLLM job may take (asserted)")
    parser.add_argument("--service-bound", type=float, default=60.0)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"kills": [], "pid": os.getpid()}
    started = time.monotonic()
    cluster = EmbeddedCluster(masters=2)
    try:
        cluster.start()
        out["cluster_start_s"] = time.monotonic() - started
        harnesses: dict[str, Harness] = {}
        for seed, mode in enumerate(args.modes.split(","), start=1):
            with plugin_mode(mode):
                t0 = time.monotonic()
                harnesses[mode] = Harness(cluster, mode, args.bound)
                setup_s = time.monotonic() - t0
                report = failover(cluster, harnesses[mode], seed, args.service_bound)
                report["setup_s"] = setup_s
                out["kills"].append(report)
                print(json.dumps(report), flush=True)
                if report.get("stuck"):
                    break
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        out["total_s"] = time.monotonic() - started
        Path(args.json).write_text(json.dumps(out, indent=1))
        cluster.close()
        sys.stdout.flush()
        sys.stderr.flush()
    # The Mooncake clients are not closed: an HA client's close() takes ~30 s (docs/deployment.md), and this
    # process ends here; its cluster is already stopped.
    with contextlib.suppress(Exception):
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
