"""Where the GIL goes on the native-off path, part by part (docs/benchmarks.md, "The plugin without a native
client").

One process with vLLM imported (a realistic heap), an embedded master, a ``NativeMooncakeStore`` with 100
registered buffers and the headline request stored (2,258 keys x 100 regions of 2 KiB): the thread CPU of each
part of a load through the wrapper without a native client, and of the plain-store path, medians of 7 calls,
three rounds. Run with the native client off:

    MOONCAKE_KVADDR_NATIVE_CLIENT=0 python3 bench/native_off_parts.py      # package installed
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _median_ms(fn: Callable[[], Any], n: int = 7) -> float:
    out = []
    for _ in range(n):
        t = time.thread_time()
        result = fn()
        del result
        out.append((time.thread_time() - t) * 1e3)
    return round(statistics.median(out), 2)


def main() -> None:
    import mooncake.store as ms
    import vllm  # noqa: F401  (the heap a vLLM worker has)

    from mooncake_kvaddr import _native
    from mooncake_kvaddr.driver.master import EmbeddedMaster
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore, bound_rows

    with EmbeddedMaster() as master:
        raw = ms.MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 1100 << 20, 16 << 20, "tcp", "", master.rpc_address) == 0
        store = NativeMooncakeStore(raw, armed=True)
        layers, blocks, size = 100, 2259, 2048
        caches = [np.zeros(blocks * size, np.uint8) for _ in range(layers)]
        for cache in caches:
            assert store.register_buffer(cache.ctypes.data, cache.nbytes) == 0
        engine = _native.LayoutEngine(128, 128, False, 0, 1, 256 << 20)
        engine.set_region_sources([c.ctypes.data for c in caches], [size] * layers)
        hashes = [i.to_bytes(32, "little") for i in range(2258)]
        ids = list(range(1, 2259))

        def plan(arrays: bool) -> Any:
            return engine.plan_load(["m@"], hashes, None, 2258 * 128, 0, None, None, ids, arrays)

        for _ in range(3):
            plan(False), plan(True)
        keys, addrs, sizes, _ = plan(True)
        _, addr_rows, size_rows, _ = plan(False)
        assert raw.batch_put_from_multi_buffers(keys, addr_rows, size_rows) == [0] * len(keys)
        assert store.native_client is None, "run with MOONCAKE_KVADDR_NATIVE_CLIENT=0"
        parts: dict[str, Callable[[], Any]] = {
            "plan, int64 matrices": lambda: plan(True),
            "plan, list rows (warm)": lambda: plan(False),
            "guard check of the matrices": lambda: store.guard.check_matrices(addrs, sizes),
            "bound_rows (after)": lambda: bound_rows(addrs, sizes),
            "tolist of both matrices (before)": lambda: (addrs.tolist(), sizes.tolist()),
            "bound get, engine rows": lambda: raw.batch_get_into_multi_buffers(keys, addr_rows, size_rows),
            "bound get, bound_rows": lambda: raw.batch_get_into_multi_buffers(keys, *bound_rows(addrs, sizes)),
            "bound get, tolist rows": lambda: raw.batch_get_into_multi_buffers(keys, addrs.tolist(), sizes.tolist()),
            "wrapper arrays entry (after)": lambda: store.batch_get_into_multi_buffers_arrays(keys, addrs, sizes),
        }
        results: dict[str, list[float]] = {}
        for _ in range(3):
            for name, fn in parts.items():
                results.setdefault(name, []).append(_median_ms(fn))
        for name, values in results.items():
            print(f"{name:36s} {values} ms")
        store.close()


if __name__ == "__main__":
    main()
