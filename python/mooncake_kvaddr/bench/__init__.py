"""The side-by-side benchmark: ``python -m mooncake_kvaddr.bench [--quick] [--json PATH] [--plot PATH]``.

Every benchmark the package ships, in one place, so that each is measured by the same harness and names its
baseline (``docs/benchmarks.md``; its modules in ``docs/architecture.md``). Nothing outside this package imports
it. ``main`` loads on first use, so that a worker started as ``python -m mooncake_kvaddr.bench.netns_client``
does not import every section.
"""

from __future__ import annotations

from typing import Any

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    if name == "main":
        from mooncake_kvaddr.bench.cli import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
