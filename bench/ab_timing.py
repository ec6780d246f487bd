"""The timing the old/new build scripts of this folder share (docs/benchmarks.md, "Old and new build")."""

from __future__ import annotations

import statistics
import time
from typing import Any


def median_ms(call: Any, reps: int, warmup: int = 3) -> float:
    """Median wall time of ``call()`` over ``reps`` calls after ``warmup`` untimed ones, in ms."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3
