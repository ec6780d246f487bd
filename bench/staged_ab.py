"""The staged transports alone, for old/new build checks (docs/benchmarks.md, "Old and new build"): the driver's
staged store and load (KVTransfer over an embedded master, 256 keys x 16 regions x 2 KiB) and the vLLM wrapper's
staged multi-buffer put and get over an in-memory stand-in store, and the same with the stand-in answering
without copying (the wrapper's own cost); medians of 40 (200) calls each. Run it with each build's interpreter in turn:

    for i in 1 2 3 4; do OLD/bin/python bench/staged_ab.py; NEW/bin/python bench/staged_ab.py; done
"""

from __future__ import annotations

import ctypes
from typing import Any

import ab_timing
import numpy as np

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, KVTransfer, StoreConfig
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import TransferRequest
from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

KEYS, REGIONS, REGION = 256, 16, 2048


def median_ms(call: Any, reps: int = 40) -> float:
    return ab_timing.median_ms(call, reps, warmup=3)


class _Memory:
    """Mooncake's contiguous calls over a dict (the wrapper's staged calls use only these)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], *config: Any) -> list[int]:
        for key, ptr, size in zip(keys, ptrs, sizes):
            self.objects[key] = ctypes.string_at(ptr, size)
        return [0] * len(keys)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        for key, ptr in zip(keys, ptrs):
            obj = self.objects[key]
            ctypes.memmove(ptr, obj, len(obj))
        return [len(self.objects[k]) for k in keys]


def main() -> None:
    out: dict[str, float] = {}
    caches = [np.zeros((KEYS + 1, REGION), np.uint8) for _ in range(REGIONS)]
    wrapper = StagedMooncakeStore(_Memory(), staging_bytes=64 << 20)
    for cache in caches:
        wrapper.register_buffer(int(cache.ctypes.data), cache.nbytes)
    addrs = [[int(c.ctypes.data) + (k + 1) * REGION for c in caches] for k in range(KEYS)]
    sizes = [[REGION] * REGIONS for _ in range(KEYS)]
    keys = [f"k{i}" for i in range(KEYS)]
    out["wrapper put"] = median_ms(lambda: wrapper.batch_put_from_multi_buffers(keys, addrs, sizes))
    out["wrapper get"] = median_ms(lambda: wrapper.batch_get_into_multi_buffers(keys, addrs, sizes))
    # The wrapper's own cost (plan, lease, gather/scatter, answers): the stand-in's calls answer without copying.
    memory = wrapper.wrapped
    memory.batch_put_from = lambda k, p, s, *c: [0] * len(k)
    memory.batch_get_into = lambda k, p, s: list(s)
    out["wrapper put own"] = median_ms(lambda: wrapper.batch_put_from_multi_buffers(keys, addrs, sizes), reps=200)
    out["wrapper get own"] = median_ms(lambda: wrapper.batch_get_into_multi_buffers(keys, addrs, sizes), reps=200)
    data = KEYS * REGIONS * REGION
    config = StoreConfig(embedded_master=True, global_segment_size=24 * data + (64 << 20), local_buffer_size=0)
    with MooncakeStore(config) as store:
        db = ChunkedTokenDatabase(KeyMetadata("ab", 0, 1, 1, 0), 16)
        with KVTransfer(store, [db], transfer_mode="staged", start_threads=False) as transfer:
            transfer.register_kv_caches(caches, KEYS + 1)
            hashes = [i.to_bytes(8, "little") for i in range(KEYS)]
            ids = [list(range(1, KEYS + 1))]
            counter = iter(range(1 << 30))

            def store_once() -> None:
                # A fresh hash chain per call: Mooncake keeps the first write of a key.
                salt = next(counter).to_bytes(4, "little")
                assert transfer.store(TransferRequest("s", KEYS * 16, [salt + h for h in hashes], ids)).ok

            out["driver store"] = median_ms(store_once, reps=15)
            assert transfer.store(TransferRequest("l", KEYS * 16, hashes, ids)).ok
            out["driver load"] = median_ms(lambda: transfer.load(TransferRequest("l", KEYS * 16, hashes, ids)))
    print(" ".join(f"{name}={ms:.3f}" for name, ms in out.items()))


if __name__ == "__main__":
    main()
