"""A store / lookup / load workload over an HA cluster, shared by tests/test_ha_cluster.py and
bench/ha_failover.py: every call timed against its deadline, every loaded block checked byte for byte.

The two must measure the same thing, so the workload lives once, here (the bench script puts tests/ on its
path; nothing in the package imports it).
"""

from __future__ import annotations

import functools
import hashlib
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver.cluster import ClusterError, EmbeddedCluster, HaMaster, find_etcd_binary
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

BLOCK_SIZE = 16  # tokens per block = per chunk
REGIONS = 4
BLOCK_BYTES = 512
CHUNKS = 16  # chunks (blocks) per request
UNLOADED = 0xEE  # what a reader block holds before a load: any other byte there came from the store


def etcd_missing() -> str | None:
    """Why no etcd can be started here (the install hint), or None: the HA tests' skip reason."""
    try:
        find_etcd_binary()
    except ClusterError as exc:
        return str(exc)
    return None


def chained_hashes(seed: int, count: int = CHUNKS) -> list[bytes]:
    """Prefix-chained block hashes, distinct per ``seed``."""
    out: list[bytes] = []
    previous = seed.to_bytes(8, "little", signed=True)
    for i in range(count):
        previous = hashlib.sha256(previous + i.to_bytes(4, "little")).digest()
        out.append(previous)
    return out


def store_config(cluster: EmbeddedCluster, request_timeout_s: float, mode: str = "auto") -> StoreConfig:
    return StoreConfig(
        master_server_address=cluster.master_server_address,
        global_segment_size="64MiB",
        local_buffer_size=0,
        request_timeout_s=request_timeout_s,
        transfer_mode=mode,
        staging_buffer_size="4MiB",
    )


class Pair:
    """A writer and a reader KVTransfer on one store, each over its own small host KV cache."""

    def __init__(self, store: MooncakeStore, mode: str, model: str) -> None:
        metadata = KeyMetadata(model, 0, 0, 0, 0)
        self.num_blocks = CHUNKS + 1  # block 0 is vLLM's null block
        self.ids = list(range(1, self.num_blocks))
        self.source = [np.zeros((self.num_blocks, BLOCK_BYTES), np.uint8) for _ in range(REGIONS)]
        self.target = [np.full((self.num_blocks, BLOCK_BYTES), UNLOADED, np.uint8) for _ in range(REGIONS)]
        self.writer = KVTransfer(store, [ChunkedTokenDatabase(metadata, BLOCK_SIZE)], transfer_mode=mode)
        self.reader = KVTransfer(store, [ChunkedTokenDatabase(metadata, BLOCK_SIZE)], transfer_mode=mode)
        self.writer.register_kv_caches(self.source, self.num_blocks)
        self.reader.register_kv_caches(self.target, self.num_blocks)

    @staticmethod
    def content(seed: int) -> np.ndarray[Any, Any]:
        """The bytes request ``seed`` stores: (regions, chunks, block bytes)."""
        return np.random.default_rng(seed & 0xFFFF_FFFF_FFFF).integers(
            0, 256, (REGIONS, CHUNKS, BLOCK_BYTES), dtype=np.uint8
        )

    def store(self, seed: int) -> Any:
        data = self.content(seed)
        for r in range(REGIONS):
            self.source[r][self.ids] = data[r]
        return self.writer.store(TransferRequest(f"s{seed}", CHUNKS * BLOCK_SIZE, chained_hashes(seed), [self.ids]))

    def lookup(self, seed: int) -> int:
        # One token more than stored: a complete hit covers every stored chunk.
        return self.reader.lookup(CHUNKS * BLOCK_SIZE + 1, chained_hashes(seed))

    def load(self, seed: int, tokens: int = CHUNKS * BLOCK_SIZE) -> tuple[Any, int, int]:
        """Load ``tokens`` of request ``seed``; returns (result, blocks with the right bytes, wrong blocks).

        A block reported loaded must hold exactly the stored bytes; a block reported failed is not checked
        (the caller recomputes it).
        """
        for region in self.target:
            region[self.ids] = UNLOADED
        result = self.reader.load(TransferRequest(f"l{seed}", tokens, chained_hashes(seed), [self.ids]))
        data = self.content(seed)
        right = wrong = 0
        for chunk, block in enumerate(self.ids):
            if block not in result.loaded_block_ids:
                continue
            if all(np.array_equal(self.target[r][block], data[r][chunk]) for r in range(REGIONS)):
                right += 1
            else:
                wrong += 1
        return result, right, wrong

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


@dataclass
class Call:
    kind: str  # "store", "lookup" or "load"
    start: float
    end: float
    ok: bool

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class WorkloadStats:
    calls: list[Call] = field(default_factory=list)
    wrong_blocks: int = 0  # loaded blocks whose bytes differ from what was stored: must stay 0
    unloadable_hits: int = 0  # lookup hits whose load failed with no kill in between: must stay 0
    unloadable: list[str] = field(default_factory=list)  # what each of those was
    errors: list[str] = field(default_factory=list)  # exceptions out of the public API: must stay empty


class Workload:
    """A thread storing, looking up and loading fresh requests in a loop until stopped."""

    def __init__(self, pair: Pair, kills: list[float], pause_s: float = 0.02) -> None:
        self.pair = pair
        self.kills = kills  # kill times (monotonic), appended by the thread that kills
        self.pause_s = pause_s
        self.stats = WorkloadStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ha-workload", daemon=True)
        self._seed = 1 << 40

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the workload thread did not stop")

    def _timed(self, kind: str, fn: Any) -> tuple[Any, Call]:
        start = time.monotonic()
        value = fn()
        call = Call(kind, start, time.monotonic(), True)
        self.stats.calls.append(call)
        return value, call

    def _killed_between(self, start: float, end: float) -> bool:
        return any(start - 1.0 <= k <= end for k in list(self.kills))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._seed += 1
            seed = self._seed
            try:
                stored, call = self._timed("store", functools.partial(self.pair.store, seed))
                call.ok = bool(stored.ok)
                hit, lookup_call = self._timed("lookup", functools.partial(self.pair.lookup, seed))
                lookup_call.ok = hit == CHUNKS * BLOCK_SIZE
                if hit > 0:
                    load = functools.partial(self.pair.load, seed, hit)
                    (loaded, _right, wrong), load_call = self._timed("load", load)
                    load_call.ok = bool(loaded.ok)
                    self.stats.wrong_blocks += wrong
                    if not loaded.ok and not self._killed_between(lookup_call.start, load_call.end):
                        self.stats.unloadable_hits += 1
                        last = max(self.kills, default=0.0)
                        self.stats.unloadable.append(
                            f"hit {hit} at kill+{lookup_call.start - last:.2f} s, load {loaded.outcomes} "
                            f"({len(loaded.failed_block_ids)} blocks failed, stopped={loaded.stopped})"
                        )
            except Exception as exc:  # counted, never raised: the public API must not raise for store trouble
                self.stats.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.pause_s)


@dataclass
class KillResult:
    killed: int  # index of the master killed
    service_s: float  # kill -> end of the first store, started after the kill, that stored every chunk
    leader_s: float  # kill -> a master serves again (the cluster's own view)
    settled_survived: int  # of CHUNKS chunks stored >= settle_s before the kill: loaded back byte for byte
    fresh_survived: int  # of CHUNKS chunks stored just before the kill (acknowledged, then SIGKILL at once)
    settled_hit: int  # lookup hit of the settled request after the failover (tokens)
    settled_hit_loadable: bool  # every block of that hit loaded
    stuck: str = ""  # no standby took over within the timeout: what the cluster said (the killed one was revived)


def kill_and_measure(
    cluster: EmbeddedCluster,
    probe: Pair,
    workload: Workload,
    seed: int,
    *,
    settle_s: float = 1.0,
    service_timeout_s: float = 60.0,
    revive: bool = True,
) -> KillResult:
    """One failover: store a settled and a fresh request, SIGKILL the leader, wait until stores succeed
    again, then count what of both requests the cluster still serves (loaded, bytes checked)."""
    settled, fresh = 2 * seed, 2 * seed + 1
    if not probe.store(settled).ok:
        raise AssertionError("the settled request was not stored before the kill")
    time.sleep(settle_s)
    leader = cluster.wait_for_leader()
    if not probe.store(fresh).ok:
        raise AssertionError("the fresh request was not stored before the kill")
    killed_at = time.monotonic()
    workload.kills.append(killed_at)  # before the kill: a call the workload finishes during it knows of it
    leader.kill()
    stuck = ""
    try:
        new_leader: HaMaster = cluster.wait_for_leader(service_timeout_s, exclude=leader)
    except ClusterError as exc:
        # Seen once in 40 kills: the standby kept naming the dead leader. Record it, restart the killed
        # master (it may win the election) and measure the time to service all the same.
        stuck = "; ".join(
            line for line in str(exc).splitlines()[:1] + _log_lines(cluster) if line
        )
        cluster.revive(leader)
        new_leader = cluster.wait_for_leader(service_timeout_s)
        deadline_extra = service_timeout_s
    else:
        deadline_extra = 0.0
    leader_s = time.monotonic() - killed_at
    deadline = killed_at + service_timeout_s + deadline_extra
    service_s = -1.0
    while time.monotonic() < deadline:
        done = [c for c in list(workload.stats.calls) if c.kind == "store" and c.start > killed_at and c.ok]
        if done:
            service_s = done[0].end - killed_at
            break
        time.sleep(0.05)
    if service_s < 0:
        raise AssertionError(f"no store succeeded within {service_timeout_s} s of the kill (leader {new_leader})")
    hit = probe.lookup(settled)
    _, settled_right, wrong_a = probe.load(settled)
    hit_loadable = True
    if hit > 0:
        partial, _, wrong_c = probe.load(settled, hit)
        hit_loadable = partial.ok
        wrong_a += wrong_c
    _, fresh_right, wrong_b = probe.load(fresh)
    workload.stats.wrong_blocks += wrong_a + wrong_b
    if revive:
        cluster.revive(leader)
    return KillResult(leader.index, service_s, leader_s, settled_right, fresh_right, hit, hit_loadable, stuck)


def _log_lines(cluster: EmbeddedCluster) -> list[str]:
    """The HA state lines each master logged last (what a stuck election looked like)."""
    out = []
    for master in cluster.masters:
        lines = [
            line[:200]
            for line in master.stderr_tail(20000).splitlines()
            if "Admin Metrics" not in line and ("state" in line or "leader" in line.lower() or line.startswith("E"))
        ]
        out.append(f"master #{master.index}: " + " | ".join(lines[-4:]))
    return out


def summary(kills: list[KillResult], stats: WorkloadStats, request_timeout_s: float) -> dict[str, Any]:
    """The figures the bench prints and the tests check."""
    service = [k.service_s for k in kills]
    by_kind: dict[str, dict[str, float]] = {}
    for kind in ("store", "lookup", "load"):
        calls = [c for c in stats.calls if c.kind == kind]
        by_kind[kind] = {
            "calls": len(calls),
            "failed": sum(not c.ok for c in calls),
            "max_s": round(max((c.seconds for c in calls), default=0.0), 3),
        }
    return {
        "kills": len(kills),
        "request_timeout_s": request_timeout_s,
        "wrong_blocks": stats.wrong_blocks,
        "calls_past_deadline": sum(c.seconds > request_timeout_s for c in stats.calls),
        "unloadable_hits": stats.unloadable_hits + sum(not k.settled_hit_loadable for k in kills),
        "errors": stats.errors[:5],
        "unloadable": stats.unloadable[:5],
        "service_s": {
            "median": round(statistics.median(service), 2) if service else None,
            "worst": round(max(service), 2) if service else None,
            "all": [round(s, 2) for s in service],
        },
        "leader_s": {"median": round(statistics.median(k.leader_s for k in kills), 2) if kills else None},
        "settled_survived": [k.settled_survived for k in kills],
        "fresh_survived": [k.fresh_survived for k in kills],
        "chunks_per_request": CHUNKS,
        "stuck_failovers": [k.stuck for k in kills if k.stuck],
        "calls": by_kind,
    }
