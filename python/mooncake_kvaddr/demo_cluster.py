"""``python -m mooncake_kvaddr demo --cluster``: a Mooncake HA cluster losing its leader, on loopback.

Starts etcd and two HA masters (driver/cluster.py), stores a request through the cluster's ``etcd://``
address, SIGKILLs the leader, and prints how long the store was out of service and what of the request the
new leader still serves (docs/deployment.md). Needs Debian's ``etcd-server``; says so in one line otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from mooncake_kvaddr._cli import verbose_requested
from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.metadata import KeyMetadata
from mooncake_kvaddr.demo import chained_hashes, kv_cache, run_or_report
from mooncake_kvaddr.driver.cluster import ClusterError, EmbeddedCluster, find_etcd_binary
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.master import MasterError
from mooncake_kvaddr.driver.store import MooncakeStore, StoreError
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

__all__ = ["main", "run_cluster_demo"]

_BLOCK_SIZE = 16
_REGIONS = 8
_BLOCK_BYTES = 1024
_SERVICE_LIMIT_S = 60.0
_START_TIMEOUT_S = 30.0  # each wait of the start: etcd healthy, each master answering, a leader serving


def run_cluster_demo(
    *, chunks: int = 16, oplog: bool = True, request_timeout_s: float = 10.0, say: Any = print
) -> dict[str, Any]:
    """Run the demo; returns its figures (``verified``: service came back and no wrong byte was loaded).

    Raises :class:`~mooncake_kvaddr.driver.cluster.ClusterError` when etcd or the masters cannot start.
    """
    find_etcd_binary()  # before anything starts: the one-line message when etcd is missing
    flags = ["-enable_oplog=true"] if oplog else []
    rng = np.random.default_rng(0)
    blocks = chunks + 1  # block 0 is vLLM's null block
    ids = list(range(1, blocks))
    source = kv_cache(_REGIONS, blocks, _BLOCK_BYTES, rng)
    target = kv_cache(_REGIONS, blocks, _BLOCK_BYTES, None)
    tokens = chunks * _BLOCK_SIZE
    data_bytes = chunks * _REGIONS * _BLOCK_BYTES  # one request
    metadata = KeyMetadata("demo-cluster", 0, 0, 0, 0)
    started = time.monotonic()
    say(f"starting etcd and two HA masters on loopback (each waited for up to {_START_TIMEOUT_S:.0f} s) ...")
    with EmbeddedCluster(masters=2, master_args=flags, start_timeout_s=_START_TIMEOUT_S) as cluster:
        leader = cluster.wait_for_leader()
        say(
            f"cluster: etcd {cluster.etcd_endpoint}, masters "
            + ", ".join(f"#{m.index} rpc {m.rpc_address}" for m in cluster.masters)
            + f"; leader #{leader.index}; replication: {'oplog' if oplog else 'none'} "
            f"(up in {time.monotonic() - started:.1f} s)"
        )
        config = StoreConfig(
            master_server_address=cluster.master_server_address,
            # The cluster's only pool: both requests, with slack (as demo's embedded master is sized).
            global_segment_size=2 * (data_bytes + data_bytes // 4) + (64 << 20),
            local_buffer_size=0,
            request_timeout_s=request_timeout_s,
        )
        with MooncakeStore(config) as store:
            writer = KVTransfer(store, [ChunkedTokenDatabase(metadata, _BLOCK_SIZE)])
            reader = KVTransfer(store, [ChunkedTokenDatabase(metadata, _BLOCK_SIZE)])
            try:
                writer.register_kv_caches(source, blocks)
                reader.register_kv_caches(target, blocks)
                before = chained_hashes(chunks, 1)
                expected = {"before": [region.copy() for region in source]}
                stored = writer.store(TransferRequest("before", tokens, before, [ids]))
                say(f"stored request 'before' through {cluster.master_server_address}: {stored.stored}/{chunks} chunks")
                time.sleep(1.0)  # settled: the oplog has reached etcd (docs/deployment.md)

                killed = cluster.kill_leader()
                killed_at = time.monotonic()
                say(f"SIGKILLed leader #{killed.index} (pid gone); storing request 'after' until it succeeds")
                after = chained_hashes(chunks, 2)
                for region in source:  # other bytes: a load of 'before' answered with 'after' would show
                    np.bitwise_not(region, out=region)
                expected["after"] = [region.copy() for region in source]
                attempts, slowest, first_failure = 0, 0.0, ""
                while True:
                    call_started = time.monotonic()
                    result = writer.store(TransferRequest("after", tokens, after, [ids]))
                    slowest = max(slowest, time.monotonic() - call_started)
                    attempts += 1
                    if result.ok:
                        break
                    if not first_failure:
                        first_failure = f"{result.outcomes} after {time.monotonic() - call_started:.1f} s"
                    if time.monotonic() - killed_at > _SERVICE_LIMIT_S:
                        raise StoreError(f"no store succeeded within {_SERVICE_LIMIT_S:.0f} s of the kill")
                    time.sleep(0.2)
                service_s = time.monotonic() - killed_at
                new_leader = cluster.wait_for_leader(exclude=killed)
                say(
                    f"time to service: {service_s:.1f} s (new leader #{new_leader.index}; {attempts} store "
                    f"attempts, first failed with {first_failure or '-'}; slowest call {slowest:.1f} s, "
                    f"deadline {request_timeout_s:g} s)"
                )

                survived: dict[str, Any] = {}
                wrong = 0
                for name, hashes in (("before", before), ("after", after)):
                    hit = reader.lookup(tokens + 1, hashes)
                    for region in target:
                        region[ids] = 0
                    loaded = reader.load(TransferRequest(name, tokens, hashes, [ids]))
                    right = 0
                    for block in loaded.loaded_block_ids:
                        if all(np.array_equal(target[r][block], expected[name][r][block]) for r in range(_REGIONS)):
                            right += 1
                        else:
                            wrong += 1
                    survived[name] = {"lookup_hit_tokens": hit, "loaded": right, "failed": len(loaded.failed_block_ids)}
                    say(
                        f"request '{name}': lookup hit {hit} of {tokens} tokens; {right}/{chunks} chunks loaded "
                        f"byte for byte, {len(loaded.failed_block_ids)} reported failed (recomputed by vLLM)"
                    )
            finally:
                writer.close()
                reader.close()
                say("closing the client (Mooncake's HA client takes up to 30 s to stop; Ctrl-C waits for it)")
    verified = wrong == 0 and survived["after"]["loaded"] == chunks
    say(
        "verified: service came back by itself and no wrong byte was loaded"
        if verified
        else f"NOT VERIFIED: {wrong} wrong blocks"
    )
    return {
        "verified": verified,
        "replication": "oplog" if oplog else "none",
        "time_to_service_s": round(service_s, 2),
        "slowest_call_s": round(slowest, 2),
        "survived": survived,
        "wrong_blocks": wrong,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``demo --cluster``'s command line; returns the exit status (0 when verified)."""
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_kvaddr demo --cluster",
        description="Run etcd and two HA Mooncake masters on loopback, kill the leader mid-run, and print the "
        "time to service and what survived.",
    )
    parser.add_argument("--chunks", type=int, default=16, help="chunks per request (16)")
    parser.add_argument("--no-oplog", action="store_true", help="run the masters without -enable_oplog")
    parser.add_argument("--verbose", action="store_true", help="show Mooncake's own log lines")
    args = parser.parse_args(argv)
    if args.chunks <= 0:
        parser.error("--chunks must be positive")
    try:
        verbose = verbose_requested(args.verbose)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        find_etcd_binary()
    except ClusterError as exc:
        print(f"demo --cluster needs etcd: {exc}", file=sys.stderr)
        return 2
    report = run_or_report(
        "demo --cluster",
        verbose,
        lambda: run_cluster_demo(chunks=args.chunks, oplog=not args.no_oplog, say=partial(print, flush=True)),
        (MasterError, StoreError, ImportError, OSError),
    )
    if report is None:
        return 2
    return 0 if report["verified"] else 1
