"""The side-by-side benchmark: ``python -m mooncake_kvaddr.bench [--quick] [--json PATH] [--plot PATH]``.

One module per section (``addresses``, ``keys``, ``plan``, ``gil``, ``threads``, ``scaling``, ``end_to_end``,
``transfer_modes``, ``tcp``), one :mod:`~mooncake_kvaddr.bench.harness` for timing, GIL-stall counting, tables
and the JSON report, and :mod:`~mooncake_kvaddr.bench.workload` for the request shapes. Every table names its
baseline. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

from mooncake_kvaddr.bench.cli import main

__all__ = ["main"]
