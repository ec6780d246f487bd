"""Shared builders for the tests: realistic region layouts and a paired native/oracle database."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase

#: The upstream oracle test's layout: a 48-layer K/V model, 1 GiB apart, growing block lengths.
ORACLE_BASE = 0x7F00_0000_0000


def oracle_regions(n_regions: int, n_lens: int) -> tuple[list[int], list[int]]:
    """Bases and block lengths of SPEC.md §4.2's oracle layout, with ``n_lens`` distinct lengths."""
    bases = [ORACLE_BASE + i * (1 << 30) for i in range(n_regions)]
    lens = [30208 + 512 * i for i in range(n_lens)]
    return bases, lens


def paired(
    bases: list[int],
    lens: list[int],
    block_size: int,
    hash_block_size: int | None = None,
    metadata: KeyMetadata | None = None,
    **kwargs: int,
) -> tuple[ChunkedTokenDatabase, OracleChunkedTokenDatabase]:
    """A native database and an oracle configured identically (separate list objects)."""
    md = metadata or KeyMetadata("t", 1, 0, 0, 0)
    native = ChunkedTokenDatabase(md, block_size, hash_block_size, **kwargs)
    oracle = OracleChunkedTokenDatabase(md, block_size, hash_block_size)
    native.set_kv_caches_base_addr(list(bases))
    native.set_block_len(list(lens))
    oracle.set_kv_caches_base_addr(list(bases))
    oracle.set_block_len(list(lens))
    return native, oracle


def assert_native_ints(result: tuple[list[list[int]], list[list[int]], list[int]]) -> None:
    """Every element of a prepare_values result is a native Python int (not a numpy scalar)."""
    addrs, sizes, ids = result
    assert type(addrs) is list and type(sizes) is list and type(ids) is list
    for row in (*addrs, *sizes):
        assert type(row) is list
        assert all(type(v) is int for v in row)
    assert all(type(v) is int for v in ids)


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; the final answer of ``condition``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


class RecordingHashes(Sequence[bytes]):
    """Block hashes that record which indices were read."""

    def __init__(self, values: list[bytes]) -> None:
        self.values = values
        self.accessed: list[int] = []

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self.values)
        if not 0 <= index < len(self.values):
            raise IndexError(index)
        self.accessed.append(index)
        return self.values[index]
