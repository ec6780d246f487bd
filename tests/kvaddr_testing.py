"""The one testing helper module: realistic region layouts, a paired native/oracle database, host KV caches
and transfers on a real store, and small utilities (polling, recording hashes and store calls)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase
from mooncake_kvaddr.driver.process import children, process_is_running

#: The upstream oracle test's layout: a 48-layer K/V model, 1 GiB apart, growing block lengths.
ORACLE_BASE = 0x7F00_0000_0000


def oracle_regions(n_regions: int, n_lens: int) -> tuple[list[int], list[int]]:
    """Bases and block lengths of the upstream oracle test's layout, with ``n_lens`` distinct lengths."""
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


def live_children(name: str) -> list[int]:
    """PIDs of live processes called ``name`` (``mooncake_master``, ``etcd``) whose parent is this process."""
    return [pid for pid, command in children() if command == name and process_is_running(pid)]


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


# ------------------------------------------------------------------------------------------- transfers


class Cache:
    """A host KV cache: ``regions`` arrays of ``num_blocks`` blocks of ``block_bytes``, random (``seed``) or
    filled with ``fill``."""

    def __init__(
        self, regions: int, num_blocks: int, block_bytes: int, seed: int | None = None, *, fill: int = 0
    ) -> None:
        rng = np.random.default_rng(seed)
        self.num_blocks = num_blocks
        self.regions: list[Any] = [
            rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
            if seed is not None
            else np.full((num_blocks, block_bytes), fill, dtype=np.uint8)
            for _ in range(regions)
        ]

    def blocks(self, block_ids: list[int]) -> list[Any]:
        """Each region's rows for ``block_ids`` (copies)."""
        return [region[block_ids] for region in self.regions]

    def object_bytes(self, block_id: int) -> bytes:
        """What a one-block chunk on ``block_id`` is stored as: its regions' blocks, concatenated in order."""
        return b"".join(region[block_id].tobytes() for region in self.regions)

    def snapshot(self) -> list[Any]:
        """Copies of every region (to prove later that nothing was written)."""
        return [region.copy() for region in self.regions]


def hashes(tag: str, count: int) -> list[bytes]:
    """``count`` distinct block hashes derived from ``tag``."""
    return [f"{tag}:{i}".encode() for i in range(count)]


def make_transfer(store: Any, model: str, cache: Cache, block_size: int, *, groups: int = 1, **kwargs: Any) -> Any:
    """A ``KVTransfer`` with ``groups`` databases of ``model`` over ``cache``, caches registered."""
    from mooncake_kvaddr.driver.transfer import KVTransfer

    dbs = [ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0, group_id=g), block_size) for g in range(groups)]
    xfer = KVTransfer(store, dbs, **kwargs)
    xfer.register_kv_caches(cache.regions, cache.num_blocks)
    return xfer


def assert_blocks_equal(src: Cache, src_ids: list[int], dst: Cache, dst_ids: list[int]) -> None:
    """Block ``src_ids[i]`` of ``src`` equals block ``dst_ids[i]`` of ``dst`` in every region."""
    for a, b in zip(src.blocks(src_ids), dst.blocks(dst_ids), strict=True):
        np.testing.assert_array_equal(a, b)


class Calls:
    """Records the keys of every contiguous / multi-buffer call a store makes (wrapping its bound methods)."""

    NAMES = ("batch_get_into", "batch_put_from", "batch_get_into_multi_buffers", "batch_put_from_multi_buffers")

    def __init__(self, store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int]] = []
        for name in self.NAMES:
            monkeypatch.setattr(store, name, self._wrap(name, getattr(store, name)))

    def _wrap(self, name: str, method: Any) -> Any:
        def recorded(keys: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, len(keys)))
            return method(keys, *args, **kwargs)

        return recorded

    def named(self, name: str) -> list[int]:
        """Key counts of the recorded calls of ``name``, in order."""
        return [n for call, n in self.calls if call == name]
