"""How Mooncake's in-process copies scale with concurrent callers: the wall-time floor of N receive threads.

Run from the repository root (after an in-place build)::

    PYTHONPATH=python python3 bench/mooncake_copy_threads.py [--keys 2258] [--regions 100] [--region-bytes 2048]

One Mooncake client holds the only segment (embedded master: Mooncake copies in memory). The request's keys
are stored once; then 1, 2 and 4 threads each load the whole request at the same time into their own
buffers, with ``batch_get_into_multi_buffers`` (every region, as vLLM's receive thread asks) and with
``batch_get_into`` (one contiguous object per key, as the staged transport asks). A ``numpy`` copy of the same
bytes per thread is the machine's own floor. Prints the median wall time per thread count (ms) and the
ratio to one thread: when the ratio grows like N, the copies run one after another, whichever thread asks.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np

from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.store import MooncakeStore


def _concurrently(count: int, work: Callable[[int], object]) -> float:
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2258)
    parser.add_argument("--regions", type=int, default=100)
    parser.add_argument("--region-bytes", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4")
    args = parser.parse_args(argv)
    keys, regions, region_bytes = args.keys, args.regions, args.region_bytes
    counts = [int(x) for x in args.threads.split(",")]
    nbytes = keys * regions * region_bytes
    segment = max(64 << 20, 2 * nbytes)
    config = StoreConfig(embedded_master=True, global_segment_size=segment, local_buffer_size=0,
                         max_regions_per_batch=1 << 30)  # fmt: skip
    with MooncakeStore(config) as store:
        src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        dsts = [np.zeros(nbytes, dtype=np.uint8) for _ in range(max(counts))]
        names = [f"copy-threads-{i}" for i in range(keys)]
        region_index = np.arange(regions)[None, :] * keys + np.arange(keys)[:, None]  # layer-major, like a KV cache

        def rows(buffer: np.ndarray) -> list[list[int]]:
            rows_of: list[list[int]] = (int(buffer.ctypes.data) + region_index * region_bytes).tolist()
            return rows_of

        sizes = [[region_bytes] * regions for _ in range(keys)]
        assert store.batch_put_from_multi_buffers(names, rows(src), sizes).ok
        dst_rows = [rows(d) for d in dsts]
        contiguous = [[int(d.ctypes.data) + i * regions * region_bytes for i in range(keys)] for d in dsts]
        object_sizes = [regions * region_bytes] * keys

        def multi(i: int) -> None:
            assert store.batch_get_into_multi_buffers(names, dst_rows[i], sizes, check_values=False).ok

        def whole(i: int) -> None:
            assert store.batch_get_into(names, contiguous[i], object_sizes, check_values=False).ok

        def floor(i: int) -> None:
            np.copyto(dsts[i], src)

        print(f"{keys} keys x {regions} regions x {region_bytes} B = {nbytes / (1 << 20):.0f} MiB per thread; "
              f"medians of {args.reps} (ms)")  # fmt: skip
        print(f"  {'call':32}" + "".join(f"{f'{n} thr':>10} {'/1':>4}" for n in counts))
        # An object is its regions in order: contiguous per key, it is the key-major view of the layer-major source.
        key_major = src.reshape(regions, keys, region_bytes).transpose(1, 0, 2).ravel()
        for label, work, expected in (("batch_get_into_multi_buffers", multi, src),
                                      ("batch_get_into (one per key)", whole, key_major),
                                      ("numpy copy (the machine)", floor, src)):  # fmt: skip
            for d in dsts:
                d.fill(0)
            work(0)  # warm-up: first touch of the buffers
            medians = [statistics.median(_concurrently(n, work) for _ in range(args.reps)) for n in counts]
            cells = "".join(f"{m:>10.1f} {m / medians[0]:4.1f}" for m in medians)
            print(f"  {label:32}{cells}")
            for d in dsts[: max(counts)]:
                np.testing.assert_array_equal(d, expected)
        print("bytes verified")


if __name__ == "__main__":
    main()
