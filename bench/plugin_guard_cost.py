"""Cost of the vLLM plugin's registered-range guard (docs/vllm-plugin.md, "Registered-range guard").

One process, guard off and on side by side: a ``NativeMooncakeStore`` on an embedded master with 100 registered
buffers, the headline request's shape (2,258 keys x 100 regions of 2 KiB), keys missing (Mooncake answers -704
without copying, so the figures are the guard and the argument handling). Per call: the calling thread's CPU
minus the time the native client held no GIL (GIL-held), and the wall time; medians of 3 x 15 calls.

    PYTHONPATH=python python3 bench/plugin_guard_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def main() -> None:
    import mooncake.store as ms

    from mooncake_kvaddr import _native
    from mooncake_kvaddr.driver.master import EmbeddedMaster
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    with EmbeddedMaster() as master:
        raw = ms.MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 0, "tcp", "", master.rpc_address) == 0
        store = NativeMooncakeStore(raw)
        layers, blocks, size = 100, 4096, 2048
        caches = [np.zeros(blocks * size, np.uint8) for _ in range(layers)]
        for cache in caches:
            assert store.register_buffer(cache.ctypes.data, cache.nbytes) == 0
        ids = np.random.default_rng(0).integers(0, blocks, 2258)
        bases = np.array([c.ctypes.data for c in caches], np.int64)
        addrs = (bases[None, :] + ids[:, None] * size).astype(np.int64)
        sizes = np.full(addrs.shape, size, np.int64)
        lists = addrs.tolist(), sizes.tolist()
        keys = [f"guard-cost-missing-{i}" for i in range(len(ids))]
        assert store.native_client is not None, "the native client is off here"

        def measure(fn: Callable[[], Any], native: bool) -> tuple[float, float]:
            gil, wall = [], []
            for _ in range(15):
                w, t = time.perf_counter(), time.thread_time()
                fn()
                cpu, elapsed = time.thread_time() - t, time.perf_counter() - w
                released = _native.mooncake_client_last_release_ns() / 1e9 if native else 0.0
                gil.append(1e3 * max(cpu - released, 0.0))
                wall.append(1e3 * elapsed)
            return statistics.median(gil), statistics.median(wall)

        cases: dict[str, tuple[Callable[[], Any], bool]] = {
            "native wrapper, arrays entry (receive handler)": (
                lambda: store.batch_get_into_multi_buffers_arrays(keys, addrs, sizes), True,
            ),
            "native wrapper, lists (vLLM's call)": (lambda: store.batch_get_into_multi_buffers(keys, *lists), True),
            "numpy check alone, matrices (staged wrapper)": (lambda: store.guard.check_matrices(addrs, sizes), False),
            "numpy check alone, lists (bound-method fallback)": (lambda: store.guard.check_multi(keys, *lists), False),
        }  # fmt: skip
        for name, (fn, native) in cases.items():
            runs = []
            for _ in range(3):
                store.ranges._armed = False
                off = measure(fn, native)
                store.ranges._armed = True
                runs.append((off, measure(fn, native)))
            med = [statistics.median(r[k][j] for r in runs) for k in (0, 1) for j in (0, 1)]
            print(f"{name}: GIL held off/on {med[0]:.2f}/{med[2]:.2f} ms, wall off/on {med[1]:.2f}/{med[3]:.2f} ms")
        store.close()


if __name__ == "__main__":
    main()
