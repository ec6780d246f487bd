"""Request shapes and the databases the kernel sections measure (no timing here: see ``harness``)."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.metadata import KeyMetadata
from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase


@dataclass(frozen=True)
class Shape:
    """One request's shape: chunks of ``block_size`` tokens over ``regions`` KV-cache regions."""

    tokens: int = 289_024
    regions: int = 100
    block_size: int = 128
    hash_block_size: int = 16
    block_bytes: int = 32 << 10

    @property
    def chunks(self) -> int:
        """Chunks per request (the last one may be partial)."""
        return -(-self.tokens // self.block_size)

    def describe(self) -> str:
        """One line for a table title."""
        return (
            f"{self.chunks} chunks x {self.regions} regions, block_size {self.block_size}, "
            f"hash_block_size {self.hash_block_size}, {self.block_bytes // 1024} KiB blocks"
        )


# The headline request: 289K tokens = 2,258 chunks over 100 regions (docs/benchmarks.md).
HEADLINE = Shape()


def make_databases(shape: Shape) -> tuple[ChunkedTokenDatabase, OracleChunkedTokenDatabase]:
    """A native database and an oracle over ``shape``'s regions (K/V regions 1 GiB apart, never touched)."""
    md = KeyMetadata("DeepSeek-V3", 0, 0, 0, 0)
    bases = [0x7F00_0000_0000 + r * (1 << 30) for r in range(shape.regions)]
    lens = [shape.block_bytes] * shape.regions
    native = ChunkedTokenDatabase(md, shape.block_size, shape.hash_block_size, address_cache_bytes=256 << 20)
    oracle = OracleChunkedTokenDatabase(md, shape.block_size, shape.hash_block_size)
    for db in (native, oracle):
        db.set_kv_caches_base_addr(list(bases))
        db.set_block_len(list(lens))
    return native, oracle


def request_chunks(shape: Shape) -> list[tuple[int, int]]:
    """The load path's chunks: one per block, the last one a hash-aligned partial tail."""
    return [(s, min(s + shape.block_size, shape.tokens)) for s in range(0, shape.tokens, shape.block_size)]


def cold_block_ids(shape: Shape, rep: int, first: int) -> list[int]:
    """Block ids no earlier repetition used (a disjoint range per ``rep``, warm-up included), from ``first``."""
    start = first + (rep + 8) * shape.chunks
    return list(range(start, start + shape.chunks))
