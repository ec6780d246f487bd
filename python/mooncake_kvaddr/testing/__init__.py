"""Test and benchmark harnesses that need more than one process (see ``docs/multihost.md``).

:mod:`mooncake_kvaddr.testing.netns` builds a small "cluster" of Linux network namespaces (a master, a
segment-holding writer and a reader, each with its own address on a private bridge) for fault tests and the
cross-namespace TCP benchmark; :mod:`mooncake_kvaddr.testing.netns_client` is the worker process that runs
inside one of those namespaces; :mod:`mooncake_kvaddr.testing.netns_bench` is the benchmark function.

Nothing here is imported by the rest of the package.
"""

from __future__ import annotations

__all__: list[str] = []
