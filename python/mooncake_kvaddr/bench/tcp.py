"""Section "tcp": loads and stores over real TCP between processes.

A separate ``mooncake_client`` process holds the pool's only segment, so every byte crosses Mooncake's TCP
transport, where vLLM 0.33's one multi-buffer call per request (the baseline) can fail; beside it, our split
multi-buffer and staged paths. A failed path is reported with Mooncake's codes, never turned into a ratio
(``docs/benchmarks.md``, "The real-TCP table").
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import IO, Any

import numpy as np

from mooncake_kvaddr.bench.harness import Col, table
from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.metadata import KeyMetadata

VLLM = "multi_buffer, one call per request (vLLM 0.33)"
SPLIT = "multi_buffer, split to the region budget (ours; native client when verified)"
SPLIT_BOUND = "multi_buffer, split, Mooncake's bound methods (ours, native client off)"
STAGED = "staged (ours)"


class SegmentHolder:
    """A ``mooncake_client`` child process that mounts a global segment and serves it over TCP.

    Started on a free loopback port, with ``PR_SET_PDEATHSIG`` (it dies with us, however we die) and its log in
    a temporary file for error messages; :meth:`close` terminates it, then kills it after a grace period.
    """

    def __init__(self, master_address: str, segment_bytes: int) -> None:
        from mooncake_kvaddr.driver.master import find_master_binary, free_ports, pdeathsig_preexec

        binary = find_master_binary().with_name("mooncake_client")
        (port,) = free_ports(1)
        self._log: IO[bytes] = tempfile.TemporaryFile(prefix="mooncake_client_", suffix=".log")
        self.process = subprocess.Popen(
            [str(binary), "-host=127.0.0.1", f"-port={port}", f"-global_segment_size={segment_bytes >> 20}MB",
             f"-master_server_address={master_address}", "-metadata_server=P2PHANDSHAKE", "-protocol=tcp"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, close_fds=True,
            preexec_fn=pdeathsig_preexec(),
        )

    @property
    def alive(self) -> bool:
        """True while the holder runs."""
        return self.process.poll() is None

    def log_tail(self, limit: int = 2000) -> str:
        """The end of the holder's log (for errors)."""
        self._log.flush()
        size = self._log.seek(0, 2)
        self._log.seek(max(0, size - limit))
        return self._log.read().decode("utf-8", "replace").strip()

    def close(self) -> None:
        """Terminate the holder (kill after 10 s) and reap it; idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@contextlib.contextmanager
def segment_holder(master_address: str, segment_bytes: int) -> Iterator[SegmentHolder]:
    """A :class:`SegmentHolder` that is always stopped again."""
    holder = SegmentHolder(master_address, segment_bytes)
    try:
        yield holder
    finally:
        holder.close()


def _codes() -> dict[str, int]:
    """Outcome name -> Mooncake's error code, for printing failures as Mooncake reports them."""
    from mooncake_kvaddr.driver import store as store_module

    codes = (store_module.CODE_NO_SPACE, store_module.CODE_INVALID_PARAMS, store_module.CODE_NOT_FOUND,
             store_module.CODE_HAS_LEASE, store_module.CODE_TRANSFER_FAILED, store_module.CODE_MASTER_UNREACHABLE)
    return {store_module.Outcome.from_error(c).value: c for c in codes}


def describe_outcomes(outcomes: Mapping[str, int], error: str | None = None) -> str:
    """``"ok"`` or e.g. ``"FAILED: transfer_failed (-800) x 100"`` from a result's outcome counts."""
    failed = {k: n for k, n in outcomes.items() if k != "ok" and n}
    if not failed and not error:
        return "ok"
    codes = _codes()
    parts = [f"{k} ({codes[k]}) x {n}" if k in codes else f"{k} x {n}" for k, n in sorted(failed.items())]
    if error:
        parts.append(f"error: {error[:80]}")
    return "FAILED: " + ", ".join(parts)


def run(chunks: int, regions: int, block_bytes: int, reps: int) -> dict[str, Any]:
    """Print and return the section (needs Mooncake; the caller checks)."""
    from mooncake_kvaddr.driver.config import StoreConfig
    from mooncake_kvaddr.driver.master import EmbeddedMaster
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
    rows: dict[str, dict[str, Any]] = {}
    with EmbeddedMaster() as master, segment_holder(master.rpc_address, 2 * data + (64 << 20)) as holder:
        budgeted = StoreConfig(master_server_address=master.rpc_address, global_segment_size=0,
                               local_buffer_size=0)
        budget = budgeted.region_budget
        # vLLM calls Mooncake's bound methods: its path never uses our native client.
        unbounded = StoreConfig(master_server_address=master.rpc_address, global_segment_size=0,
                                local_buffer_size=0, max_regions_per_batch=1 << 30, native_client=False)
        bound = StoreConfig(master_server_address=master.rpc_address, global_segment_size=0,
                            local_buffer_size=0, native_client=False)
        with MooncakeStore(budgeted) as store, MooncakeStore(unbounded) as single_call_store, \
                MooncakeStore(bound) as bound_store:
            # Ready when the holder's segment is mounted: a small put then finds space (bounded wait).
            probe = [source[0][1].ctypes.data]
            deadline = time.monotonic() + 15
            while not store.batch_put_from(["tcp-ready-probe"], probe, [block_bytes]).ok:
                if time.monotonic() > deadline or not holder.alive:
                    raise RuntimeError(f"the mooncake_client segment holder did not come up:\n{holder.log_tail()}")
                time.sleep(0.1)
            md = KeyMetadata("tcp", 0, 0, 0, 0)

            def pair(store_: Any, mode: str, probe: bool | None = None) -> tuple[Any, Any]:
                writer = KVTransfer(store_, [ChunkedTokenDatabase(md, block_size)], transfer_mode=mode,
                                    start_threads=False)
                reader = KVTransfer(store_, [ChunkedTokenDatabase(md, block_size)], transfer_mode=mode,
                                    start_threads=False, probe_peers=probe)
                writer.register_kv_caches(source, num_blocks)
                reader.register_kv_caches(target, num_blocks)
                return writer, reader

            paths = {STAGED: pair(store, "staged"), SPLIT: pair(store, "multi_buffer"),
                     SPLIT_BOUND: pair(bound_store, "multi_buffer"),
                     VLLM: pair(single_call_store, "multi_buffer", probe=False)}  # vLLM probes no peer
            stores = {STAGED: store, SPLIT: store, SPLIT_BOUND: bound_store, VLLM: single_call_store}
            refill = paths[STAGED][0]  # puts the data back when a path's own store failed, so its load is timed
            for name, (writer, reader) in paths.items():
                stores_ms, loads_ms, store_status, load_status, verified, refilled = [], [], "ok", "ok", True, False
                for _ in range(reps):
                    store.remove_all(force=True)
                    t0 = time.perf_counter()
                    stored = writer.store(request)
                    stores_ms.append((time.perf_counter() - t0) * 1e3)
                    if not stored.ok or stored.stored != chunks:
                        store_status = describe_outcomes(stored.outcomes) if not stored.ok else "FAILED: partial"
                        refilled = True
                        store.remove_all(force=True)
                        if not refill.store(request).ok:
                            raise RuntimeError("the staged refill put failed: the holder's segment is unusable")
                    for region in target:
                        region[:] = 1
                    t0 = time.perf_counter()
                    loaded = reader.load(request)
                    loads_ms.append((time.perf_counter() - t0) * 1e3)
                    if not loaded.ok:
                        load_status = describe_outcomes(loaded.outcomes, loaded.error)
                    verified &= loaded.ok and all(np.array_equal(a[1:], b[1:]) for a, b in zip(source, target))
                    if store_status != "ok" and load_status != "ok":
                        break  # a path that fails both ways is not timed again (a failure can take a minute)
                rows[name] = {"store_ms": statistics.median(stores_ms), "load_ms": statistics.median(loads_ms),
                              "store": store_status, "load": load_status, "bytes_verified": verified,
                              "load_after_refill": refilled, "reps": len(loads_ms),
                              "native_client": stores[name].native_client_active}
            for writer, reader in paths.values():
                writer.close()
                reader.close()

    def ratio(base: str, path: str, op: str) -> float | None:
        """``base``'s median over ``path``'s for ``op``; None unless both succeeded."""
        if rows[base][op] != "ok" or rows[path][op] != "ok":
            return None
        return float(rows[base][f"{op}_ms"] / rows[path][f"{op}_ms"])

    for path in (STAGED, SPLIT, SPLIT_BOUND):
        for op in ("store", "load"):
            rows[path][f"{op}_speedup_vs_vllm"] = ratio(VLLM, path, op)
    vs_vllm = {op: ratio(VLLM, STAGED, op) for op in ("store", "load")}
    vs_split = {op: ratio(SPLIT, STAGED, op) for op in ("store", "load")}
    title = (f"Real TCP across processes: {chunks} keys x {regions} regions x {block_bytes} B = "
             f"{data / 2**20:.0f} MiB, segment in a separate mooncake_client, TCP region budget {budget}; "
             f"medians of up to {reps}")
    notes = [f"staged speed-up over {SPLIT}: store "
             + (f"{vs_split['store']:.1f}x" if vs_split["store"] else "n/a")
             + ", load " + (f"{vs_split['load']:.1f}x" if vs_split["load"] else "n/a")]
    if rows[VLLM]["store"] != "ok" or rows[VLLM]["load"] != "ok":
        notes.append("the baseline failed: a failed call's time is shown, its ratios are not computed")
    if any(r["load_after_refill"] for r in rows.values()):
        notes.append("a path whose store failed had its load timed on data put by the staged path")
    cols = (Col("store_ms", "store ms", ".1f"), Col("load_ms", "load ms", ".1f"),
            Col("store_speedup_vs_vllm", "store x", ".1f", "x"), Col("load_speedup_vs_vllm", "load x", ".1f", "x"),
            Col("bytes_verified", "verified"), Col("native_client", "native"),
            Col("store", "store outcome"), Col("load", "load outcome"))
    return table(title, f"{VLLM} (ratio = its median / the path's median)", rows, cols, label="path", notes=notes,
                 shape={"chunks": chunks, "regions": regions, "block_bytes": block_bytes, "bytes": data},
                 region_budget=budget, staged_speedup_vs_split=vs_split, staged_speedup_vs_vllm=vs_vllm)
