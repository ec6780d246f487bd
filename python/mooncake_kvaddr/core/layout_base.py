"""The store-layout interface and what every engine-backed layout shares (the native ``LayoutEngine``,
array output, the fused load plan, the row cache), with the duck-typed tensor geometry the layouts read. The
concrete layouts build on it: :mod:`mooncake_kvaddr.core.layouts` (rank-local) and
:mod:`mooncake_kvaddr.core.layouts_tp` (TP-sharded); ``core.layouts`` re-exports every name.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.metadata import KeyMetadata

StoreShardId = int
#: Physical ranks encoded in a rank-local key: (TP, PCP, DCP, PP).
RankNamespace = tuple[int, int, int, int]
Int64Array = npt.NDArray[np.int64]

#: Default bytes of address rows a layout keeps per (shard, block id) for repeated block ids.
DEFAULT_ROW_CACHE_BYTES = 64 << 20


# --- tensor geometry, duck-typed -------------------------------------------------------------------------


def _is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when a view of ``shape``/``strides`` covers one gapless, non-overlapping range in some dimension
    order (vLLM's ``is_non_overlapping_and_dense``; size-1 dimensions are ignored)."""
    expected = 1
    for size, stride in sorted(zip(shape, strides), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _geometry(cache: Any) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(shape, element strides, element size, data pointer) of a tensor-like object, as exact ints.

    Each value goes through ``operator.index``: a float, a string or another non-integer (a duck-typed tensor
    whose ``data_ptr()`` returns ``4096.7`` or ``"4096"``) raises ``TypeError`` instead of being truncated
    into a wrong region address by ``int()``."""
    shape = tuple(operator.index(extent) for extent in cache.shape)
    strides = tuple(operator.index(stride) for stride in cache.stride())
    return shape, strides, operator.index(cache.element_size()), operator.index(cache.data_ptr())


# --- layouts -----------------------------------------------------------------------------------------------


class StoreLayout:
    """Store payload layout for one KV-cache group on one local TP rank (the interface)."""

    def __init__(self, metadata: KeyMetadata, block_size: int, hash_block_size: int) -> None:
        self.metadata = metadata
        self.block_size = block_size
        self.hash_block_size = hash_block_size

    @property
    def local_shard_ids(self) -> tuple[StoreShardId, ...]:
        """Store objects this local rank contributes or consumes."""
        raise NotImplementedError

    def key_for(self, shard_id: StoreShardId, chunk_hash: BlockHash) -> str:
        """The store key of one shard of a chunk."""
        raise NotImplementedError

    def lookup_key_prefixes(self, rank_namespaces: Sequence[RankNamespace]) -> tuple[str, ...]:
        """Prefixes that must all exist for a logical block to be reusable."""
        raise NotImplementedError

    def register_kv_caches(self, kv_caches: Sequence[Any], num_blocks: int) -> None:
        """Build descriptors from the local KV-cache tensors."""
        raise NotImplementedError

    def prepare_values(
        self, chunks: Sequence[tuple[int, int]], block_ids: list[int], shard_ids: Sequence[StoreShardId]
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Mooncake multi-buffer descriptors ``(addr rows, size rows, block ids)`` for logical chunks."""
        raise NotImplementedError


class _EngineLayout(StoreLayout):
    """The parts every engine-backed layout shares: the native engine, array output, the fused plan."""

    _engine: Any

    def prepare_values(
        self, chunks: Sequence[Sequence[int]], block_ids: Sequence[int], shard_ids: Sequence[StoreShardId] | None
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Descriptors as vLLM returns them: fresh lists of Python ints (no row aliases another or a cache).
        ``shard_ids`` is ``None`` under the seed-era rules (which have no shards)."""
        result: tuple[list[list[int]], list[list[int]], list[int]] = self._engine.prepare_values(
            chunks, block_ids, shard_ids
        )
        return result

    def prepare_values_array(
        self, chunks: Any, block_ids: Any, shard_ids: Any = None
    ) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The same descriptors as int64 arrays ``(keys × segments, keys × segments, keys)``."""
        result: tuple[Int64Array, Int64Array, Int64Array] = self._engine.prepare_values_array(
            chunks, block_ids, shard_ids
        )
        return result

    def _shard_prefixes(self) -> list[str]:
        raise NotImplementedError

    def plan_load(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash] | bytes | bytearray | memoryview,
        mask_num: int,
        load_mask: Sequence[bool] | None,
        block_ids: Any,
        tail_tokens: int | None = None,
        *,
        hash_len: int | None = None,
        arrays: bool = False,
        slot_alignment: int | None = None,
    ) -> tuple[Any, ...]:
        """One group's whole load preparation in one native call (docs/vllm.md, "Fused plan").

        Walks ``[mask_num, token_len)`` with vLLM 0.33's start rule (``ceil(mask_num / block_size)``; ``floor``
        under the seed-era rules), keeps the chunks ``load_mask`` (indexed by absolute chunk id; ``None`` keeps
        all) keeps, keys the chunk that ends at ``token_len`` by ``block_hashes[tail_tokens // hash_block_size -
        1]`` when a tail-key boundary is given, expands every kept chunk to one key per local shard id, and returns
        ``(keys, addr rows, size rows, block ids)`` — exactly what vLLM's receive thread builds with
        ``process_tokens``, ``key_for`` and ``prepare_values`` (int64 arrays for the rows when ``arrays``).
        ``block_hashes`` may be one flat blob of ``n * hash_len`` bytes. A ``slot_alignment`` (a power of two)
        implies arrays and appends the staging slot layout: ``(..., offsets, object sizes, total bytes)``.
        The seed-era database's and the driver's plans come here; the plugin's handlers call the same native
        ``LayoutEngine.plan_load`` of the engine that matches vLLM's layout.
        """
        result: tuple[Any, ...] = self._engine.plan_load(
            self._shard_prefixes(), block_hashes, hash_len, token_len, mask_num, load_mask, tail_tokens,
            block_ids, arrays, slot_alignment,
        )
        return result

    def walk_load(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash] | bytes | bytearray | memoryview,
        mask_num: int,
        load_mask: Sequence[bool] | None = None,
        tail_tokens: int | None = None,
        *,
        hash_len: int | None = None,
    ) -> tuple[list[str], Int64Array]:
        """:meth:`plan_load`'s keys and entries without rows: ``(keys, (n, 3) int64 (start, end, shard id))``;
        same walk, same order."""
        result: tuple[list[str], Int64Array] = self._engine.walk_load(
            self._shard_prefixes(), block_hashes, hash_len, token_len, mask_num, load_mask, tail_tokens
        )
        return result

    def plan_store(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash] | bytes | bytearray | memoryview,
        block_ids: Any,
        mask_num: int = 0,
        chunk_mask: Sequence[bool] | None = None,
        *,
        put_step: int = 1,
        put_step_rank: int = 0,
        skip_null_block: bool = True,
        hash_len: int | None = None,
    ) -> tuple[list[str], list[tuple[int, ...]], list[int]]:
        """A send thread's candidates in one native call: the walk (``chunk_mask`` relative to its first
        chunk, this rank's ``put_step`` stripe) without chunks past ``block_ids`` and (``skip_null_block``)
        those on block 0, each expanded to one entry per local shard: ``(keys, chunks, block ids)`` with
        ``(start, end, shard id)`` chunks (``(start, end)`` under the seed-era rules)."""
        result: tuple[list[str], list[tuple[int, ...]], list[int]] = self._engine.plan_store(
            self._shard_prefixes(), block_hashes, hash_len, token_len, mask_num, chunk_mask, put_step,
            put_step_rank, block_ids, skip_null_block,
        )
        return result

    @property
    def immutable_rows(self) -> bool:
        """When True, ``prepare_values``/``plan_load`` return each row as a tuple of ints shared with the row
        cache (no per-call copy: the warm path's floor) instead of a fresh list. A tuple never changes, so no
        returned row can change later; callers that only read rows (vLLM's worker, Mooncake) accept both."""
        return bool(self._engine.immutable_rows)

    @immutable_rows.setter
    def immutable_rows(self, value: bool) -> None:
        self._engine.immutable_rows = bool(value)

    @property
    def row_cache_bytes(self) -> int:
        """Capacity of the per-(shard, block id) address-row cache; 0 turns caching off."""
        return int(self._engine.cache_capacity)

    @row_cache_bytes.setter
    def row_cache_bytes(self, value: int) -> None:
        self._engine.cache_capacity = value

    def row_cache_info(self) -> dict[str, int]:
        """Entries, bytes, capacity, hits and misses of the row cache."""
        info: dict[str, int] = self._engine.cache_info()
        return info

    def clear_row_cache(self) -> None:
        """Drop every cached row (never needed for correctness: re-registration invalidates the cache)."""
        self._engine.clear_cache()
