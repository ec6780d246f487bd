"""Per-call cost of the store-call layer: the driver's ``batch_is_exist`` and the vLLM native wrapper's arrays get
and exist, each on an in-memory stand-in (no native client: the bound path), 20,000 calls, median of 7 (docs/
benchmarks.md, "The noise floor of a quick A/B"). Run it with each build's interpreter in turn:

    python3 bench/dispatch_ab.py
"""

import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
from types import SimpleNamespace

import pytest

from fake_mooncake import FakeClock, FakeMooncake
from mooncake_kvaddr.driver import store as store_module
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore


class Bound:
    def batch_get_into_multi_buffers(self, keys, a, s):
        return [0] * len(keys)

    def batch_is_exist(self, keys):
        return [1] * len(keys)


def per_call(fn, n=20000):
    best = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(best)


w = NativeMooncakeStore(Bound())
w._client = None
keys = [f"k{i}" for i in range(4)]
a = np.arange(12, dtype=np.int64).reshape(4, 3)
s = np.ones((4, 3), np.int64)
mp = pytest.MonkeyPatch()
client = FakeMooncake(FakeClock())
mp.setattr(
    store_module,
    "load_mooncake",
    lambda: SimpleNamespace(MooncakeDistributedStore=lambda: client, ReplicateConfig=lambda: None),
)
with MooncakeStore(master_server_address="127.0.0.1:1") as store:
    r1 = per_call(lambda: store.batch_is_exist(keys))
r2 = per_call(lambda: w.batch_get_into_multi_buffers_arrays(keys, a, s))
r3 = per_call(lambda: w.batch_is_exist(keys))
print(f"driver batch_is_exist {r1:.2f} us  wrapper arrays get {r2:.2f} us  wrapper exist {r3:.2f} us")
