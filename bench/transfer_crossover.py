"""Staged vs multi-buffer transfers across region sizes and segments per key: the data behind ``auto``.

Run from the repository root (after an in-place build)::

    PYTHONPATH=python python3 bench/transfer_crossover.py [--reps 7] [--mib 32] [--tcp]

For each shape (region bytes x segments per key, keys sized to ``--mib`` per request, plus a 1,000-key shape)
one writer/reader pair per mode loads and stores the same request, interleaved (ABBA), through a real store:
in-process (embedded master, this process holds the segment: Mooncake copies in memory) and, with ``--tcp``,
across processes (the segment is held by a separate ``mooncake_client``; this process is a pure client).
Prints medians in ms and the staged / multi-buffer ratio, and what ``auto`` picks for the shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.master import EmbeddedMaster, find_master_binary, free_ports, pdeathsig_preexec
from mooncake_kvaddr.driver.rules import choose_auto_mode
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

MODES = ("multi_buffer", "staged")


def measure(store: MooncakeStore, keys: int, regions: int, block_bytes: int, reps: int) -> dict[str, Any]:
    """Median load and store times per mode for one request of ``keys`` x ``regions`` x ``block_bytes``."""
    block_size = 16
    num_blocks = keys + 1
    rng = np.random.default_rng(0)
    source = [rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]
    target = [np.ones((num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]
    request = TransferRequest("x", keys * block_size, [i.to_bytes(8, "little") * 4 for i in range(keys)],
                              [list(range(1, num_blocks))])
    pairs = {}
    for mode in MODES:
        md = KeyMetadata(f"crossover-{regions}-{block_bytes}", 0, 0, 0, 0)
        writer = KVTransfer(store, [ChunkedTokenDatabase(md, block_size)], transfer_mode=mode, start_threads=False)
        reader = KVTransfer(store, [ChunkedTokenDatabase(md, block_size)], transfer_mode=mode, start_threads=False)
        writer.register_kv_caches(source, num_blocks)
        reader.register_kv_caches(target, num_blocks)
        pairs[mode] = (writer, reader)
    samples: dict[str, dict[str, list[float]]] = {m: {"load": [], "store": []} for m in MODES}
    verified = True
    try:
        for rep in range(reps + 1):  # the first round warms the segment and the staging pools
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                writer, reader = pairs[mode]
                store.remove_all(force=True)
                t0 = time.perf_counter()
                stored = writer.store(request)
                t1 = time.perf_counter()
                loaded = reader.load(request)
                t2 = time.perf_counter()
                if not (stored.ok and loaded.ok):
                    raise RuntimeError(f"{mode}: transfer failed: {stored.outcomes} {loaded.outcomes} {loaded.error}")
                if rep == 0:
                    verified &= all(np.array_equal(a[1:], b[1:]) for a, b in zip(source, target, strict=True))
                    for t in target:
                        t[:] = 1
                    continue
                samples[mode]["store"].append((t1 - t0) * 1e3)
                samples[mode]["load"].append((t2 - t1) * 1e3)
    finally:
        for writer, reader in pairs.values():
            writer.close()
            reader.close()
    med = {m: {op: statistics.median(v) for op, v in ops.items()} for m, ops in samples.items()}
    return {"keys": keys, "regions": regions, "block_bytes": block_bytes, "verified": verified, "ms": med}


@contextmanager
def in_process_store(mib: int) -> Iterator[MooncakeStore]:
    """An embedded master and a client that holds the only segment (in-process memcpy transfers)."""
    config = StoreConfig(embedded_master=True, global_segment_size=f"{4 * mib + 64}MiB", local_buffer_size=0,
                         max_regions_per_batch=1 << 30)
    with MooncakeStore(config) as store:
        yield store


@contextmanager
def tcp_store(mib: int) -> Iterator[MooncakeStore]:
    """A pure client; the only segment lives in a separate ``mooncake_client`` (every byte crosses TCP)."""
    with EmbeddedMaster() as master:
        (port,) = free_ports(1)
        holder = subprocess.Popen(
            [str(find_master_binary().with_name("mooncake_client")), "-host=127.0.0.1", f"-port={port}",
             f"-global_segment_size={4 * mib + 64}MB", f"-master_server_address={master.rpc_address}",
             "-metadata_server=P2PHANDSHAKE", "-protocol=tcp"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pdeathsig_preexec(),
        )
        try:
            config = StoreConfig(master_server_address=master.rpc_address, global_segment_size=0,
                                 local_buffer_size=0)
            with MooncakeStore(config) as store:
                probe = np.zeros(4096, np.uint8)
                deadline = time.monotonic() + 15
                while not store.batch_put_from(["crossover-probe"], [probe.ctypes.data], [4096]).ok:
                    if time.monotonic() > deadline or holder.poll() is not None:
                        raise RuntimeError("the mooncake_client segment holder did not come up")
                    time.sleep(0.1)
                yield store
        finally:
            holder.terminate()
            try:
                holder.wait(10)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()


def shapes(mib: int) -> list[tuple[int, int, int]]:
    """(keys, regions, block_bytes): a sweep sized to ``mib`` per request, and a 1,000-key shape."""
    out = []
    for block_kib in (2, 8, 32):
        for regions in (4, 16, 100):
            keys = max(4, (mib << 20) // (regions * block_kib << 10))
            out.append((keys, regions, block_kib << 10))
    out.append((1000, 8, 2 << 10))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--mib", type=int, default=32, help="bytes per request of the sweep, in MiB")
    parser.add_argument("--tcp", action="store_true", help="also across processes over TCP (smaller requests)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--shape", action="append", default=[],
                        help="keys:regions:KiB instead of the sweep (repeatable)")
    parser.add_argument("--no-local", action="store_true", help="skip the in-process run")
    args = parser.parse_args()
    only = [tuple(int(x) for x in s.split(":")) for s in args.shape]
    chosen = [(k, r, kib << 10) for k, r, kib in only]
    runs = [] if args.no_local else [("in-process", in_process_store, args.mib, args.reps)]
    if args.tcp:
        runs.append(("tcp", tcp_store, max(1, args.mib // 8), max(3, args.reps // 2)))
    rows = []
    for where, factory, mib, reps in runs:
        print(f"\n{where}: medians of {reps} (ms), ratio = staged / multi_buffer (< 1: staged faster)")
        print(f"{'keys':>6} {'regions':>7} {'region':>7} | {'load mb':>8} {'load st':>8} {'ratio':>6} | "
              f"{'store mb':>8} {'store st':>8} {'ratio':>6} | auto, its loss vs the better mode (load, store)")
        with factory(max(mib, (max((k * r * b >> 20) + 1 for k, r, b in chosen) if chosen else 0))) as store:
            for keys, regions, block_bytes in chosen or shapes(mib):
                row = measure(store, keys, regions, block_bytes, reps)
                ms = row["ms"]
                load_ratio = ms["staged"]["load"] / ms["multi_buffer"]["load"]
                store_ratio = ms["staged"]["store"] / ms["multi_buffer"]["store"]
                auto_by_op = {
                    op: choose_auto_mode(regions, block_bytes, local_copy=where == "in-process", direction=op)
                    for op in ("load", "store")
                }
                loss = {op: ms[auto_by_op[op]][op] / min(ms[m][op] for m in MODES) - 1 for op in ("load", "store")}
                short = {"multi_buffer": "mb", "staged": "st", "direct": "direct"}
                auto = auto_by_op["load"] if len(set(auto_by_op.values())) == 1 else (
                    f"{short[auto_by_op['load']]} / {short[auto_by_op['store']]}")
                row.update(where=where, load_ratio=load_ratio, store_ratio=store_ratio, auto=auto, auto_loss=loss)
                rows.append(row)
                print(f"{keys:>6} {regions:>7} {block_bytes >> 10:>5}Ki | {ms['multi_buffer']['load']:>8.1f} "
                      f"{ms['staged']['load']:>8.1f} {load_ratio:>6.2f} | {ms['multi_buffer']['store']:>8.1f} "
                      f"{ms['staged']['store']:>8.1f} {store_ratio:>6.2f} | {auto:<12} "
                      f"{loss['load']:>+6.1%} {loss['store']:>+6.1%}"
                      + ("" if row["verified"] else "  BYTES DIFFER"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
