"""Benchmark: Mooncake's bound batch methods vs the native client (docs/native-client.md, "Measuring it").

Usage: ``python -m mooncake_kvaddr.bench.native_client [--quick] [--repeats N]``. The native client exists to cut
the GIL-held time of Mooncake's batch calls; this measures that time, the total time and the bytes moved for one
headline load and store, side by side with the bound methods in one process against an embedded master.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mooncake_kvaddr import _native
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.native_client import NativeClient
from mooncake_kvaddr.driver.store import load_mooncake

__all__ = ["run"]

HEADLINE_KEYS = 2258
QUICK_KEYS = 200
REGIONS = 100
REGION_BYTES = 2048


class _BusyThread:
    """A pure-Python loop; the longest gap between its iterations inside a window is the GIL-held time."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._window = False
        self._longest = 0.0
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            if self._window and now - last > self._longest:
                self._longest = now - last
            last = now

    @contextmanager
    def running(self) -> Iterator[_BusyThread]:
        self._thread.start()
        try:
            time.sleep(0.02)
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def stall_of(self, call: Callable[[], Any]) -> float:
        """Seconds of the longest stall of this thread while ``call()`` runs."""
        self._longest = 0.0
        self._window = True
        try:
            call()
        finally:
            self._window = False
        return self._longest


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _held(path: str, elapsed: float, conversion: dict[str, Callable[[], Any]]) -> float:
    """GIL-held seconds of the call just made on ``path`` (see :func:`run`)."""
    if path.startswith("native"):
        return max(elapsed - _native.mooncake_client_last_release_ns() / 1e9, 0.0)
    probe = conversion["multi" if "multi" in path else "contiguous"]
    start = time.perf_counter()
    probe()
    return time.perf_counter() - start


def run(quick: bool = False, repeats: int | None = None) -> list[dict[str, Any]]:
    """Measure bound vs native calls for one headline load and store; one dict per (op, path)."""
    ms = load_mooncake()

    n = QUICK_KEYS if quick else HEADLINE_KEYS
    reps = repeats if repeats is not None else (3 if quick else 5)
    key_bytes = REGIONS * REGION_BYTES
    total = n * key_bytes
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    offsets = np.arange(n * REGIONS, dtype=np.int64).reshape(n, REGIONS) * REGION_BYTES
    src_addrs = src.ctypes.data + offsets
    dst_addrs = dst.ctypes.data + offsets
    sizes = np.full((n, REGIONS), REGION_BYTES, dtype=np.int64)
    # Bound-path arguments, built once outside every timed region.
    src_lists = src_addrs.tolist()
    dst_lists = dst_addrs.tolist()
    size_lists = sizes.tolist()
    flat_src = src_addrs[:, 0].copy()
    flat_dst = dst_addrs[:, 0].copy()
    flat_sizes = np.full(n, key_bytes, dtype=np.int64)
    flat_src_list = flat_src.tolist()
    flat_dst_list = flat_dst.tolist()
    flat_size_list = flat_sizes.tolist()
    keys = [f"bench-native-{i:06d}" for i in range(n)]
    segment = total + total // 4 + (64 << 20)

    rows: list[dict[str, Any]] = []
    with EmbeddedMaster() as master:
        store = ms.MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", master.rpc_address)
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed: {rc}")
        try:
            native, reason = NativeClient.probe(store)
            if native is None:
                return [{"section": "native_client", "skipped": reason}]
            config = ms.ReplicateConfig()

            def clear() -> None:
                store.remove_all(True)

            loads: dict[str, Callable[[], list[int]]] = {
                "bound multi-buffer": lambda: list(store.batch_get_into_multi_buffers(keys, dst_lists, size_lists)),
                "native multi-buffer": lambda: native.batch_get_into_multi_buffers(keys, dst_addrs, sizes),
                # vLLM hands over list[list[int]]: our C++ converts them once, then the native call.
                "native multi-buffer, list args": lambda: native.batch_get_into_multi_buffers(
                    keys, dst_lists, size_lists
                ),
                "bound contiguous": lambda: list(store.batch_get_into(keys, flat_dst_list, flat_size_list)),
                "native contiguous": lambda: native.batch_get_into(keys, flat_dst, flat_sizes),
            }
            stores: dict[str, Callable[[], list[int]]] = {
                "bound multi-buffer": lambda: list(
                    store.batch_put_from_multi_buffers(keys, src_lists, size_lists, config)
                ),
                "native multi-buffer": lambda: native.batch_put_from_multi_buffers(keys, src_addrs, sizes),
                "bound contiguous": lambda: list(store.batch_put_from(keys, flat_src_list, flat_size_list, config)),
                "native contiguous": lambda: native.batch_put_from(keys, flat_src, flat_sizes),
            }
            # Warm the segment (first writes page-fault) and the transfer path.
            clear()
            if stores["native multi-buffer"]() != [0] * n:
                raise RuntimeError("warm-up put failed")
            expected_get = [key_bytes] * n
            for call in loads.values():
                call()

            # GIL-held time measured directly. Bound: the binding's argument conversion, timed alone (the call
            # returns right after converting: no keys / one pointer short). Native: the call's wall time minus
            # the interval the C++ ran with the GIL released.
            conversion = {
                "multi": lambda: store.batch_get_into_multi_buffers([], dst_lists, size_lists),
                "contiguous": lambda: store.batch_get_into(keys, flat_dst_list[:-1], flat_size_list[:-1]),
            }
            totals: dict[tuple[str, str], list[float]] = {}
            held: dict[tuple[str, str], list[float]] = {}
            stalls: dict[tuple[str, str], list[float]] = {}
            correct: dict[tuple[str, str], bool] = {}
            for _ in range(reps):
                for path, call in loads.items():
                    dst[:] = 0
                    start = time.perf_counter()
                    codes = call()
                    elapsed = time.perf_counter() - start
                    totals.setdefault(("load", path), []).append(elapsed)
                    held.setdefault(("load", path), []).append(_held(path, elapsed, conversion))
                    ok = codes == expected_get and np.array_equal(src, dst)
                    correct[("load", path)] = correct.get(("load", path), True) and ok
                for path, call in stores.items():
                    clear()
                    start = time.perf_counter()
                    codes = call()
                    elapsed = time.perf_counter() - start
                    totals.setdefault(("store", path), []).append(elapsed)
                    held.setdefault(("store", path), []).append(_held(path, elapsed, conversion))
                    correct[("store", path)] = correct.get(("store", path), True) and codes == [0] * n
            clear()
            stores["native multi-buffer"]()
            with _BusyThread().running() as busy:
                for _ in range(reps):
                    for path, call in loads.items():
                        stalls.setdefault(("load", path), []).append(busy.stall_of(call))
                    for path, call in stores.items():
                        clear()
                        stalls.setdefault(("store", path), []).append(busy.stall_of(call))
            clear()
        finally:
            store.close()

    for (op, path), times in totals.items():
        bound = totals[(op, "bound multi-buffer" if "multi" in path else "bound contiguous")]
        rows.append(
            {
                "section": "native_client",
                "op": op,
                "path": path,
                "keys": n,
                "regions_per_key": REGIONS if "multi" in path else 1,
                "mib": round(total / (1 << 20), 1),
                "total_ms_median": _ms(statistics.median(times)),
                "total_ms_min": _ms(min(times)),
                "gil_held_ms_median": _ms(statistics.median(held[(op, path)])),
                "gil_held_ms_min": _ms(min(held[(op, path)])),
                "gil_held_ms_max": _ms(max(held[(op, path)])),
                "gil_stall_ms_median": _ms(statistics.median(stalls[(op, path)])),
                "gil_stall_ms_max": _ms(max(stalls[(op, path)])),
                "vs_bound_median": round(statistics.median(times) / statistics.median(bound), 3),
                "correct": correct[(op, path)],
                "repeats": reps,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print :func:`run`'s rows as a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_KEYS} keys instead of {HEADLINE_KEYS}")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    rows = run(quick=args.quick, repeats=args.repeats)
    if rows and "skipped" in rows[0]:
        print(f"native client unavailable: {rows[0]['skipped']}")
        return 1
    head = f"{'op':6} {'path':30} {'median ms':>10} {'min ms':>8} {'x bound':>8}"
    print(f"{head} {'GIL held ms med/min':>20} {'stall ms':>9} ok")
    for row in rows:
        timing = f"{row['total_ms_median']:>10.1f} {row['total_ms_min']:>8.1f} {row['vs_bound_median']:>8.3f}"
        gil = f"{row['gil_held_ms_median']:>10.3f} /{row['gil_held_ms_min']:>8.3f} {row['gil_stall_ms_median']:>9.2f}"
        print(f"{row['op']:6} {row['path']:30} {timing} {gil} {row['correct']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
