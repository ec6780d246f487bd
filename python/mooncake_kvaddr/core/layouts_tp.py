"""The TP-shared store layouts of vLLM 0.33 (``TPShardedStoreLayout`` and its two packed formats), whose
objects any TP size dividing the store's can read. Kept apart from the rank-local layout of
:mod:`mooncake_kvaddr.core.layouts`, which re-exports every name here.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.layout_base import (
    DEFAULT_ROW_CACHE_BYTES,
    RankNamespace,
    StoreShardId,
    _EngineLayout,
    _geometry,
)
from mooncake_kvaddr.core.metadata import KeyMetadata, PoolKey

__all__ = ["LBHNCStoreLayout", "LBNHCStoreLayout", "TPShardedStoreLayout"]


class TPShardedStoreLayout(_EngineLayout):
    """Store layout whose objects are shared by TP sizes dividing ``store_tp_size``: each store shard holds
    ``num_kv_heads // store_tp_size`` heads of one block and is keyed as if written by TP rank ``shard_id``."""

    store_format: ClassVar[str]

    @classmethod
    def shared_namespace(cls, store_tp_size: int, pp_size: int) -> str:
        """The ``store_namespace`` of this format: ``@store_tp:S@store_pp:P@store_format:F``."""
        return f"@store_tp:{store_tp_size}@store_pp:{pp_size}@store_format:{cls.store_format}"

    def __init__(
        self,
        metadata: KeyMetadata,
        block_size: int,
        hash_block_size: int,
        local_tp_size: int,
        store_tp_size: int,
        tp_rank: int,
        num_kv_heads: int,
    ) -> None:
        super().__init__(metadata, block_size, hash_block_size)
        self.shards_per_rank = store_tp_size // local_tp_size
        first = tp_rank * self.shards_per_rank
        self.store_shard_ids = tuple(range(first, first + self.shards_per_rank))
        self.store_tp_size = store_tp_size
        self.heads_per_store_shard = num_kv_heads // store_tp_size
        self.local_num_kv_heads = num_kv_heads // local_tp_size
        self._shard_key_prefixes = {
            shard: PoolKey.build_prefix(metadata, tp_rank=shard) for shard in self.store_shard_ids
        }
        self._engine = _native.LayoutEngine(
            block_size, hash_block_size, True, first, max(self.shards_per_rank, 0), DEFAULT_ROW_CACHE_BYTES
        )
        # The installed templates, one (bases, strides, sizes) per local shard, as the engine holds them, and a
        # version that is odd while an install is in progress (so a reader can tell whether the rows it just
        # computed came from the templates it read; see driver/groups.py).
        self._templates: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()
        self._templates_version = 0

    @property
    def local_shard_ids(self) -> tuple[StoreShardId, ...]:
        """The store shards this rank owns: ``tp_rank * shards_per_rank`` onwards."""
        return self.store_shard_ids

    def key_for(self, shard_id: StoreShardId, chunk_hash: BlockHash) -> str:
        """The key of an owned shard (KeyError for a shard this rank does not own)."""
        return f"{self._shard_key_prefixes[shard_id]}@{chunk_hash.hex()}"

    def lookup_key_prefixes(self, rank_namespaces: Sequence[RankNamespace]) -> tuple[str, ...]:
        """Every store shard under every distinct PP rank of ``rank_namespaces`` (sorted), shard-major."""
        pp_ranks = sorted({namespace[3] for namespace in rank_namespaces})
        return tuple(
            PoolKey.build_prefix(self.metadata, tp_rank=shard, pp_rank=pp)
            for shard in range(self.store_tp_size)
            for pp in pp_ranks
        )

    def _set_segment_templates(self, templates: Sequence[tuple[list[int], list[int], list[int]]]) -> None:
        """Install one ``(bases, block strides, sizes)`` template per local shard."""
        fresh = tuple(
            (tuple(map(operator.index, b)), tuple(map(operator.index, s)), tuple(map(operator.index, z)))
            for b, s, z in templates
        )
        self._templates_version += 1  # odd: an install is in progress
        try:
            self._engine.set_templates([(list(b), list(s), list(z)) for b, s, z in fresh])
            self._templates = fresh
        finally:
            self._templates_version += 1

    @property
    def segment_templates(self) -> tuple[int, tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]]:
        """``(version, templates)``: the installed ``(bases, strides, sizes)`` of every local shard and the
        install's version (odd while an install is in progress)."""
        return self._templates_version, self._templates

    def _has_packed_strides(self, head_stride: int, token_stride: int, content_bytes: int) -> bool:
        raise NotImplementedError

    def _shard_segments(
        self, head_start: int, head_stride: int, token_stride: int, content_bytes: int
    ) -> Iterable[tuple[int, int]]:
        raise NotImplementedError

    def register_kv_caches(self, kv_caches: Sequence[Any], num_blocks: int) -> None:
        """Validate packed caches of logical shape ``(num_blocks, local heads, block_size, content)`` and append
        each cache's segments to every local shard's template (docs/vllm.md, "Registering caches")."""
        templates: list[tuple[list[int], list[int], list[int]]] = [
            ([], [], []) for _ in range(self.shards_per_rank)
        ]
        for cache in kv_caches:
            shape, strides, element_size, data_ptr = _geometry(cache)
            if len(shape) != 4 or shape[:3] != (num_blocks, self.local_num_kv_heads, self.block_size):
                raise ValueError(
                    "TP-shared Mooncake store requires packed KV caches with "
                    "logical shape (num_blocks, local_kv_heads, block_size, content)"
                )
            block_stride, head_stride, token_stride, content_stride = (s * element_size for s in strides)
            content_bytes = shape[3] * element_size
            if content_stride != element_size or not self._has_packed_strides(
                head_stride, token_stride, content_bytes
            ):
                raise ValueError(f"TP-shared Mooncake store requires packed {self.store_format} KV layout")
            for local_shard, (bases, block_strides, sizes) in enumerate(templates):
                head_start = local_shard * self.heads_per_store_shard
                for offset, size in self._shard_segments(head_start, head_stride, token_stride, content_bytes):
                    bases.append(data_ptr + offset)
                    block_strides.append(block_stride)
                    sizes.append(size)
        self._set_segment_templates(templates)

    def _shard_prefixes(self) -> list[str]:
        return [self._shard_key_prefixes[shard] for shard in self.store_shard_ids]


class LBHNCStoreLayout(TPShardedStoreLayout):
    """Head-major TP-shared format: a shard's heads of one block are one contiguous segment per cache."""

    store_format = "tp_shared_lbhnc"

    def _has_packed_strides(self, head_stride: int, token_stride: int, content_bytes: int) -> bool:
        return token_stride == content_bytes and head_stride == self.block_size * content_bytes

    def _shard_segments(
        self, head_start: int, head_stride: int, token_stride: int, content_bytes: int
    ) -> Iterator[tuple[int, int]]:
        yield head_start * head_stride, self.heads_per_store_shard * head_stride


class LBNHCStoreLayout(TPShardedStoreLayout):
    """Token-major TP-shared format: one segment per token of a block (its shard's heads), per cache."""

    store_format = "tp_shared_lbnhc"

    def _has_packed_strides(self, head_stride: int, token_stride: int, content_bytes: int) -> bool:
        return head_stride == content_bytes and token_stride == self.local_num_kv_heads * content_bytes

    def _shard_segments(
        self, head_start: int, head_stride: int, token_stride: int, content_bytes: int
    ) -> Iterator[tuple[int, int]]:
        size = self.heads_per_store_shard * content_bytes
        for token in range(self.block_size):
            yield token * token_stride + head_start * head_stride, size
