"""The side-by-side benchmark: ``python -m mooncake_kvaddr.bench [--quick] [--json PATH] [--plot PATH]``.

One module per section (``addresses``, ``keys``, ``plan``, ``gil``, ``threads``, ``scaling``, ``end_to_end``,
``transfer_modes``, ``tcp``; and the producers :mod:`~mooncake_kvaddr.bench.external` prints:
``native_client``, ``vllm_layouts``, ``vllm_plugin``, ``netns_tcp``), one :mod:`~mooncake_kvaddr.bench.harness`
for timing, GIL-stall counting, tables and the JSON report, and :mod:`~mooncake_kvaddr.bench.workload` for the
request shapes. :mod:`~mooncake_kvaddr.bench.netns` (with ``netns_ip`` and ``netns_worker``) and
:mod:`~mooncake_kvaddr.bench.netns_client` are the network-namespace cluster harness (``docs/multihost.md``) that
``netns_tcp`` and ``tests/test_multihost.py`` use. Every table names its baseline. See ``docs/benchmarks.md``.
Nothing outside this package imports it (``docs/architecture.md``).

``main`` loads on first use, so that a worker started as ``python -m mooncake_kvaddr.bench.netns_client`` does
not import every section.
"""

from __future__ import annotations

from typing import Any

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    if name == "main":
        from mooncake_kvaddr.bench.cli import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
