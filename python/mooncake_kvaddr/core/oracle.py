"""The reference semantics in plain Python, and the numpy approach: what tests and the benchmark compare to.

``OracleChunkedTokenDatabase`` is the original per-chunk loop (docs/address-rows.md), kept simple and obviously right;
it is never used by the library itself. ``numpy_prepare_values`` is vLLM's current vectorised
``prepare_values`` (broadcast, then ``.tolist()``), the benchmark's anchor. Both keep the reference's
exception types (``AssertionError`` for misaligned spans, ``ZeroDivisionError`` for an empty ``block_len``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.metadata import KeyMetadata


class OracleChunkedTokenDatabase:
    """Pure-Python ``ChunkedTokenDatabase``: unbounded ints, one loop per chunk and region."""

    def __init__(self, metadata: KeyMetadata, block_size: int, hash_block_size: int | None = None) -> None:
        self.metadata = metadata
        self.block_size = block_size
        self.hash_block_size = hash_block_size or block_size
        if block_size % self.hash_block_size != 0:
            raise ValueError(f"block_size ({block_size}) must be a multiple of ({self.hash_block_size})")
        self.kv_caches_base_addr: list[int] = []
        self.block_len: list[int] = []
        md = metadata
        namespace = f"{md.cache_prefix}@" if md.cache_prefix else ""
        self._key_prefix = (
            f"{namespace}{md.model_name}@tp_rank:{md.tp_rank}@pcp{md.pcp_rank}@dcp{md.dcp_rank}"
            f"@pp_rank:{md.pp_rank}@group:{md.group_id}"
        )

    def set_kv_caches_base_addr(self, kv_caches_base_addr: list[int]) -> None:
        """Register region base addresses (by reference)."""
        self.kv_caches_base_addr = kv_caches_base_addr

    def set_block_len(self, block_len: list[int]) -> None:
        """Register block lengths (by reference)."""
        self.block_len = block_len

    def key_for(self, chunk_hash: BlockHash) -> str:
        """``prefix@hex``."""
        return self._key_prefix + "@" + chunk_hash.hex()

    def _region_lengths(self) -> list[int]:
        n_lens = len(self.block_len)
        return [self.block_len[i % n_lens] for i in range(len(self.kv_caches_base_addr))]

    def prepare_values(
        self, chunks: Sequence[Sequence[int]], block_ids: Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Per chunk: ``base[r] + bid * blen[r]`` and ``blen[r] * ceil(span / block_size)``."""
        if len(chunks) == 0:
            return [], [], []
        blens = self._region_lengths()
        spans = [c[1] - c[0] for c in chunks]
        for span in spans:
            assert span % self.hash_block_size == 0
        addr_rows: list[list[int]] = []
        size_rows: list[list[int]] = []
        chunk_ids: list[int] = []
        for chunk, span in zip(chunks, spans):
            block_id = int(block_ids[chunk[0] // self.block_size])
            count = (span + self.block_size - 1) // self.block_size
            addr_rows.append([int(b) + block_id * n for b, n in zip(self.kv_caches_base_addr, blens)])
            size_rows.append([n * count for n in blens])
            chunk_ids.append(block_id)
        return addr_rows, size_rows, chunk_ids

    def prepare_value(self, start: int, end: int, block_ids: Sequence[int]) -> tuple[list[int], list[int], int]:
        """One chunk's ``(addr_row, size_row, block_id)``."""
        addrs, sizes, ids = self.prepare_values([(start, end)], block_ids)
        return addrs[0], sizes[0], ids[0]

    def prepare_value_for_block(self, block_id: int) -> tuple[list[int], list[int]]:
        """One block in every region."""
        blens = self._region_lengths()
        return [b + block_id * n for b, n in zip(self.kv_caches_base_addr, blens)], list(blens)

    def process_tokens(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash],
        mask_num: int = 0,
        *,
        chunk_mask: Sequence[bool] | None = None,
        put_step: int = 1,
        put_step_rank: int = 0,
    ) -> Iterator[tuple[int, int, BlockHash]]:
        """The reference chunk walk (floor ``start_chunk``, as in the canonical fork)."""
        assert put_step > 0
        if not block_hashes:
            return
        assert token_len % self.hash_block_size == 0
        assert token_len // self.hash_block_size <= len(block_hashes)
        start_chunk = max(0, mask_num // self.block_size)
        max_chunks = (token_len + self.block_size - 1) // self.block_size
        if chunk_mask is not None:
            max_chunks = min(max_chunks, start_chunk + len(chunk_mask))
        for chunk_id in range(start_chunk, max_chunks):
            if chunk_mask is not None and not chunk_mask[chunk_id - start_chunk]:
                continue
            if chunk_id % put_step != put_step_rank:
                continue
            start = chunk_id * self.block_size
            end = min(start + self.block_size, token_len)
            yield start, end, block_hashes[end // self.hash_block_size - 1]


def numpy_prepare_values(
    chunks: Sequence[Sequence[int]],
    block_ids: Sequence[int],
    kv_caches_base_addr: Sequence[int],
    block_len: Sequence[int],
    block_size: int,
    hash_block_size: int,
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """vLLM's vectorised ``prepare_values``: int64 broadcast then ``.tolist()`` (wraps on overflow)."""
    if not chunks:
        return [], [], []
    base = np.asarray(kv_caches_base_addr, dtype=np.int64)
    n_lens = len(block_len)
    blen = np.asarray([block_len[i % n_lens] for i in range(base.shape[0])], dtype=np.int64)
    n = len(chunks)
    starts = np.fromiter((c[0] for c in chunks), dtype=np.int64, count=n)
    spans = np.fromiter((c[1] for c in chunks), dtype=np.int64, count=n) - starts
    assert not (spans % hash_block_size).any()
    bids = np.fromiter((block_ids[i] for i in (starts // block_size).tolist()), dtype=np.int64, count=n)
    addrs = base[None, :] + bids[:, None] * blen[None, :]
    counts = (spans + block_size - 1) // block_size
    sizes = blen[None, :] * counts[:, None]
    return addrs.tolist(), sizes.tolist(), bids.tolist()
