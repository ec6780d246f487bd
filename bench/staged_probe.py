"""Staged vs multi-buffer KVTransfer, one process, interleaved (issue 6 item 6). Not part of the package.

python bench/staged_probe.py [--block-bytes 2048] [--reps 7] [--chunks 2258] [--regions 100]

Per rep and mode: a load (KVTransfer.load) and a store (KVTransfer.store of absent keys, after remove_all)
alone, then the same beside a pure-Python counter thread that records its longest stall and the sum of its
stalls (gaps > 0.5 ms): the time the transfer held the GIL. Medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, MooncakeStore, StoreConfig
from mooncake_kvaddr.staging import SLOT_ALIGNMENT, HostCopyBackend, StagingPool
from mooncake_kvaddr.transfer import KVTransfer, TransferRequest


class Counter:
    """A busy pure-Python thread; ``window()`` returns (longest stall, summed stalls > 0.5 ms) since ``start``."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.reset()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        self.longest = 0.0
        self.stalled = 0.0
        self.iterations = 0

    def _run(self) -> None:
        last = time.perf_counter()
        while not self.stop.is_set():
            now = time.perf_counter()
            gap = now - last
            if gap > self.longest:
                self.longest = gap
            if gap > 0.0005:
                self.stalled += gap
            self.iterations += 1
            last = now

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=2258)
    parser.add_argument("--regions", type=int, default=100)
    parser.add_argument("--block-bytes", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--copy-threads", type=int, default=0, help="native copy threads (0 = auto: 2 from 8 MiB)")
    parser.add_argument("--budget", type=int, default=1 << 20, help="max_regions_per_batch (1000 = tcp default)")
    args = parser.parse_args()
    chunks, regions, bb = args.chunks, args.regions, args.block_bytes
    bs = 128
    data = chunks * regions * bb
    num_blocks = chunks + 1
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, (num_blocks, bb), dtype=np.uint8) for _ in range(regions)]
    dst = [np.zeros((num_blocks, bb), dtype=np.uint8) for _ in range(regions)]
    for region in dst:
        region[:] = 1  # fault the pages in: a real KV cache is resident
    ids = list(range(1, num_blocks))
    hashes = [i.to_bytes(8, "little") * 4 for i in range(chunks)]
    request = TransferRequest("r", chunks * bs, hashes, [ids])

    config = StoreConfig(global_segment_size=data + data // 4 + (64 << 20), local_buffer_size=0,
                         max_regions_per_batch=args.budget)
    with MooncakeStore(config) as store:
        pool = StagingPool(data + chunks * SLOT_ALIGNMENT)
        pairs: dict[str, tuple[KVTransfer, KVTransfer]] = {}
        for mode in ("multi_buffer", "staged"):
            md = KeyMetadata("probe", 0, 0, 0, 0)
            kw: dict[str, Any] = {"transfer_mode": mode, "start_threads": False}
            if mode == "staged":
                kw["staging_pool"] = pool
            w = KVTransfer(store, [ChunkedTokenDatabase(md, bs)], **kw)
            r = KVTransfer(store, [ChunkedTokenDatabase(md, bs)], **kw)
            w.register_kv_caches(src, num_blocks)
            r.register_kv_caches(dst, num_blocks)
            for xfer in (w, r):
                if isinstance(xfer.copy_backend, HostCopyBackend):
                    xfer.copy_backend.threads = args.copy_threads
            pairs[mode] = (w, r)
        # Warm the segment (first write page-faults it) and check bytes once per mode.
        for mode, (w, r) in pairs.items():
            store.remove_all(force=True)
            assert w.store(request).ok
            for region in dst:
                region[:] = 1
            loaded = r.load(request)
            assert loaded.ok and all(np.array_equal(a[1:], b[1:]) for a, b in zip(src, dst, strict=True)), mode

        rows: dict[str, dict[str, list[float]]] = {m: {} for m in pairs}

        def rec(mode: str, name: str, value: float) -> None:
            rows[mode].setdefault(name, []).append(value)

        counter: Counter | None = None
        for rep in range(args.reps):
            for beside in (False, True):
                if beside:
                    counter = Counter()
                    time.sleep(0.02)
                order = list(pairs.items()) if rep % 2 == 0 else list(pairs.items())[::-1]
                for mode, (w, r) in order:
                    suffix = "_busy" if beside else ""
                    if counter:
                        counter.reset()
                    t0 = time.perf_counter()
                    res = r.load(request)
                    rec(mode, "load" + suffix, time.perf_counter() - t0)
                    assert res.ok
                    if counter:
                        rec(mode, "load_gil_longest", counter.longest)
                        rec(mode, "load_gil_total", counter.stalled)
                    else:
                        for phase, sec in res.timings.items():
                            rec(mode, "load." + phase, sec)
                    store.remove_all(force=True)
                    if counter:
                        counter.reset()
                    t0 = time.perf_counter()
                    st = w.store(request)
                    rec(mode, "store" + suffix, time.perf_counter() - t0)
                    assert st.ok and st.stored == chunks
                    if counter:
                        rec(mode, "store_gil_longest", counter.longest)
                        rec(mode, "store_gil_total", counter.stalled)
                    else:
                        for phase, sec in st.timings.items():
                            rec(mode, "store." + phase, sec)
                if counter:
                    counter.close()
                    counter = None
        for w, r in pairs.values():
            w.close()
            r.close()

    print(f"{chunks} keys x {regions} regions x {bb} B = {data / (1 << 20):.1f} MiB; reps {args.reps}; "
          f"budget {args.budget}; copy threads {args.copy_threads or 'auto'}; medians in ms")
    names = sorted({n for m in rows.values() for n in m})
    print(f"{'':28}{'multi_buffer':>14}{'staged':>10}{'ratio':>8}")
    for name in names:
        mb = statistics.median(rows["multi_buffer"].get(name, [float("nan")])) * 1e3
        stg = statistics.median(rows["staged"].get(name, [float("nan")])) * 1e3
        ratio = stg / mb if mb else float("nan")
        print(f"{name:28}{mb:14.2f}{stg:10.2f}{ratio:8.2f}")


if __name__ == "__main__":
    main()
