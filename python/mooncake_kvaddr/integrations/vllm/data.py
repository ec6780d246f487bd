"""Stand-in for vLLM 0.32/0.33's ``vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data``.

Same names, signatures, key strings and exception types for the connector's data model (docs/vllm.md, "The
mirror module"); the scheduler-side classes are not mirrored. Deliberate differences: 64-bit overflow raises
``OverflowError``, and ids and chunks must be ints in lists, tuples or integer arrays (``TypeError`` otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_kvaddr.core.hashes import BlobBlockHashes, BlockHash, chunk_hashes_for_block_size
from mooncake_kvaddr.core.layouts import LayoutTokenDatabase as ChunkedTokenDatabase
from mooncake_kvaddr.core.layouts import (
    LBHNCStoreLayout,
    LBNHCStoreLayout,
    RankLocalStoreLayout,
    RankNamespace,
    StoreLayout,
    StoreShardId,
    TPShardedStoreLayout,
    make_mooncake_group_id,
)
from mooncake_kvaddr.core.metadata import KeyMetadata, PoolKey, TailKeyBoundary

#: vLLM's private name for the group-id helper (``worker._make_mooncake_group_id``).
_make_mooncake_group_id = make_mooncake_group_id


@dataclass
class MooncakeLookupResult:
    """The reusable prefix length, and the tail-key boundary of every group for a nonzero hit."""

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


@dataclass
class LoadSpec:
    """What a load request asks for."""

    vllm_cached_tokens: int
    kvpool_cached_tokens: int
    can_load: bool
    token_len: int = 0
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


__all__ = [
    "BlobBlockHashes",
    "BlockHash",
    "ChunkedTokenDatabase",
    "KeyMetadata",
    "LBHNCStoreLayout",
    "LBNHCStoreLayout",
    "LoadSpec",
    "MooncakeLookupResult",
    "PoolKey",
    "RankLocalStoreLayout",
    "RankNamespace",
    "StoreLayout",
    "StoreShardId",
    "TPShardedStoreLayout",
    "TailKeyBoundary",
    "chunk_hashes_for_block_size",
    "make_mooncake_group_id",
]
