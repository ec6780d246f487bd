"""KVTransfer multi_buffer loads with the store's native client on vs off, side by side in one process.

Usage: PYTHONPATH=python:tests python3 tools/bench_native_driver.py [--keys 2258] [--repeats 7]

Per load: total wall time of ``KVTransfer.load``; GIL held by the store call measured directly (native: each
call's wall time minus the interval its C++ ran with the GIL released; bound: the binding's conversion of the
same-shaped rows, timed alone); and the longest stall of a busy Python thread during the whole load (includes
CPU starvation on a loaded machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvaddr_testing import Cache, hashes, make_transfer
from mooncake_kvaddr import _native
from mooncake_kvaddr.bench.native_client import _BusyThread
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import TransferRequest

REGIONS, REGION_BYTES, BLOCK = 100, 2048, 16


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=2258)
    ap.add_argument("--repeats", type=int, default=7)
    ns = ap.parse_args()
    n = ns.keys
    src = Cache(REGIONS, n + 1, REGION_BYTES, seed=1)
    dst = Cache(REGIONS, n + 1, REGION_BYTES)
    h = hashes("bench", n)
    ids = list(range(1, n + 1))
    request = TransferRequest("r", n * BLOCK, h, [ids])
    segment = max(2 * n * REGIONS * REGION_BYTES, 64 << 20)
    with EmbeddedMaster().start() as master:
        cfg = StoreConfig(
            master_server_address=master.rpc_address,
            global_segment_size=segment,
            local_buffer_size=0,
            max_regions_per_batch=1 << 20,  # one Mooncake call per load, as in the headline
        )
        # One client; "off" detaches its native client for the load (the driver then takes the bound path).
        with MooncakeStore(cfg) as store:
            native = store._native
            assert native is not None
            held_native: list[float] = []
            handle = native._handle

            class TimedHandle:
                """The native client's C++ handle (its calls are the handle's own methods), timing each get."""

                def __getattr__(self, name: str) -> Any:
                    return getattr(handle, name)

                def batch_get_into_multi_buffers(self, *args: Any, **kwargs: Any) -> Any:
                    t0 = time.perf_counter()
                    out = handle.batch_get_into_multi_buffers(*args, **kwargs)
                    held_native.append(time.perf_counter() - t0 - _native.mooncake_client_last_release_ns() / 1e9)
                    return out

            native._handle = TimedHandle()
            rows_a = (dst.regions[0].ctypes.data + np.arange(n * REGIONS, dtype=np.int64) * 4096).reshape(n, REGIONS)
            rows_a, rows_s = rows_a.tolist(), np.full((n, REGIONS), REGION_BYTES, dtype=np.int64).tolist()
            with (
                make_transfer(store, "bench", src, BLOCK, transfer_mode="multi_buffer") as writer,
                make_transfer(store, "bench", dst, BLOCK, transfer_mode="multi_buffer") as reader,
            ):
                stored = writer.store(request)
                assert stored.stored == n, stored.outcomes
                results: dict[str, dict[str, list[float]]] = {
                    k: {"total": [], "held": [], "stall": []} for k in ("off", "on")
                }
                def one_load(name: str, busy: _BusyThread | None) -> tuple[float, float]:
                    """(total seconds, busy-thread stall) of one verified load with the native client on/off."""
                    store._native = native if name == "on" else None
                    assert store.native_client_active == (name == "on")
                    for r in dst.regions:
                        r[:] = 0
                    held_native.clear()
                    out: list[Any] = []
                    t0 = time.perf_counter()
                    if busy is None:
                        out.append(reader.load(request))
                        stall = 0.0
                    else:
                        stall = busy.stall_of(lambda: out.append(reader.load(request)))
                    total = time.perf_counter() - t0
                    store._native = native
                    got = out[0]
                    assert got.ok and got.loaded_block_ids == set(ids), got
                    for region_src, region_dst in zip(src.regions, dst.regions, strict=True):
                        assert (region_src[1:] == region_dst[1:]).all()
                    return total, stall

                # Totals and GIL-held time without a competing thread (re-taking the GIL from a busy thread
                # costs up to the 5 ms switch interval, which is waiting, not holding); stalls with one.
                for rep in range(ns.repeats + 1):
                    for name in ("off", "on"):
                        total, _ = one_load(name, None)
                        held = sum(held_native) if name == "on" else store.time_argument_conversion(rows_a, rows_s)
                        if rep:
                            results[name]["total"].append(total)
                            results[name]["held"].append(held)
                with _BusyThread().running() as busy:
                    for _ in range(ns.repeats):
                        for name in ("off", "on"):
                            results[name]["stall"].append(one_load(name, busy)[1])
    mib = n * REGIONS * REGION_BYTES / (1 << 20)
    print(f"{n} keys x {REGIONS} regions x {REGION_BYTES} B = {mib:.0f} MiB per load, medians of {ns.repeats}")
    base = statistics.median(results["off"]["total"])
    for name in ("off", "on"):
        r = results[name]
        med = {k: statistics.median(v) * 1e3 for k, v in r.items()}
        print(
            f"native {name:3}: total {med['total']:7.1f} ms ({med['total'] / base / 1e3:.2f}x)  "
            f"GIL held by the store call {med['held']:6.2f} ms (min {min(r['held']) * 1e3:.2f})  "
            f"busy-thread stall {med['stall']:6.1f} ms"
        )
    print("bytes identical to the source on every load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
