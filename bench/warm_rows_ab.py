"""Warm-cache row output of the one address engine, for old/new build checks (docs/benchmarks.md, "Old and new
build"): the seed-era table's lists and tuples and a two-shard TP-shared layout's lists, 2,048 chunks x 96
regions, median of 60 calls each. Run it with each build's interpreter in turn:

    for i in 1 2 3 4; do OLD/bin/python bench/warm_rows_ab.py; NEW/bin/python bench/warm_rows_ab.py; done
"""

from __future__ import annotations

from typing import Any

import ab_timing

from mooncake_kvaddr import _native


def median_ms(call: Any, reps: int = 60) -> float:
    return ab_timing.median_ms(call, reps, warmup=3)


def main() -> None:
    regions, n = 96, 2048
    bases = [(r + 1) << 36 for r in range(regions)]
    chunks = [(i * 16, (i + 1) * 16) for i in range(n)]
    ids = list(range(100, 100 + n))
    table = _native.LayoutEngine(16, 16, False, 0, 1, 64 << 20, seed_rules=True)
    table.set_region_sources(bases, [4096])
    out = {}
    for tuples in (False, True):
        table.immutable_rows = tuples
        out["tuples" if tuples else "lists"] = median_ms(lambda: table.prepare_values(chunks, ids))
    engine = _native.LayoutEngine(16, 16, True, 0, 2, 64 << 20)
    second = [b + (1 << 30) for b in bases]
    engine.set_templates([(bases, [4096] * regions, [512] * regions), (second, [4096] * regions, [512] * regions)])
    shards = [i % 2 for i in range(n)]
    out["tp lists"] = median_ms(lambda: engine.prepare_values(chunks, ids, shards))
    print(" ".join(f"{name}={ms:.3f}" for name, ms in out.items()))


if __name__ == "__main__":
    main()
