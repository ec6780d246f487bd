"""The seed-era database's fused ``plan_load`` (cold rows: no row cache), for old/new build checks
(docs/benchmarks.md, "Old and new build"): the native call alone and the whole method (2,048 chunks x 32
regions), three interleaved medians of 80 calls each. Run it with each build's interpreter in turn:

    for i in 1 2 3; do OLD/bin/python bench/plan_ab.py; NEW/bin/python bench/plan_ab.py; done
"""

from __future__ import annotations

from typing import Any

import ab_timing

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.core.keys import _unwrap


def median_ms(call: Any, reps: int = 80) -> float:
    return ab_timing.median_ms(call, reps, warmup=0)


def main() -> None:
    n, regions = 2048, 32
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 1, 1, 0), 16, address_cache_bytes=0)
    db.set_kv_caches_base_addr([(r + 1) << 36 for r in range(regions)])
    db.set_block_len([4096] * regions)
    hashes = [i.to_bytes(8, "little") for i in range(n)]
    ids = list(range(1, n + 1))
    data, length = _unwrap(hashes, None)
    native = lambda: db._engine.plan_load([db._key_prefix], data, length, n * 16, 0, None, None, ids)  # noqa: E731
    out = []
    for _ in range(3):
        out.append(f"native={median_ms(native):.2f}")
        out.append(f"plan_load={median_ms(lambda: db.plan_load(n * 16, hashes, ids)):.2f}")
    print(" ".join(out))


if __name__ == "__main__":
    main()
