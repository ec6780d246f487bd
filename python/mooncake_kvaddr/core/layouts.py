"""Store layouts of vLLM 0.32+'s Mooncake store connector, on one native engine (docs/vllm.md).

Each layout is a set of segment templates computed by the native ``LayoutEngine``: :class:`RankLocalStoreLayout`
(the historical format) here, the TP-shared :class:`LBHNCStoreLayout` / :class:`LBNHCStoreLayout` in
:mod:`~mooncake_kvaddr.core.layouts_tp`, the base in :mod:`~mooncake_kvaddr.core.layout_base`.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.layout_base import DEFAULT_ROW_CACHE_BYTES as DEFAULT_ROW_CACHE_BYTES
from mooncake_kvaddr.core.layout_base import Int64Array as Int64Array
from mooncake_kvaddr.core.layout_base import RankNamespace as RankNamespace
from mooncake_kvaddr.core.layout_base import StoreLayout as StoreLayout
from mooncake_kvaddr.core.layout_base import StoreShardId as StoreShardId
from mooncake_kvaddr.core.layout_base import _EngineLayout, _geometry, _is_dense
from mooncake_kvaddr.core.layouts_tp import LBHNCStoreLayout as LBHNCStoreLayout
from mooncake_kvaddr.core.layouts_tp import LBNHCStoreLayout as LBNHCStoreLayout
from mooncake_kvaddr.core.layouts_tp import TPShardedStoreLayout as TPShardedStoreLayout
from mooncake_kvaddr.core.metadata import KeyMetadata, PoolKey
from mooncake_kvaddr.core.walk import walk_windows


def make_mooncake_group_id(metadata: KeyMetadata, chunk_hash: str) -> str:
    """vLLM 0.33's Mooncake group id of a chunk: ``vllm-mooncake-store:[cache_prefix@]model[namespace]@hash``.

    The lifecycle unit is the prefix chunk, so no rank, group or shard fields (docs/vllm.md, "Keys").
    """
    head = f"{metadata.cache_prefix}@" if metadata.cache_prefix else ""
    return f"vllm-mooncake-store:{head}{metadata.model_name}{metadata.store_namespace}@{chunk_hash}"


# --- the rank-local layout -------------------------------------------------------------------------------


class RankLocalStoreLayout(_EngineLayout):
    """The historical rank-local payload layout: one store object per chunk, keyed by this rank's ranks.

    Our keywords: ``row_cache_bytes`` (see :attr:`row_cache_bytes`) and ``seed_rules``, the rules of the
    seed-era ``ChunkedTokenDatabase`` (:mod:`mooncake_kvaddr.core.database`, a face over this layout): walks
    from ``floor(mask_num / block_size)``, any hash buffer, ``(start, end, ...)`` chunks, errors naming chunks.
    """

    def __init__(
        self,
        metadata: KeyMetadata,
        block_size: int,
        hash_block_size: int,
        *,
        row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES,
        seed_rules: bool = False,
    ) -> None:
        super().__init__(metadata, block_size, hash_block_size)
        self._key_prefix = PoolKey.build_prefix(metadata)
        self._engine = _native.LayoutEngine(
            block_size, hash_block_size, False, 0, 1, row_cache_bytes, seed_rules=seed_rules
        )
        self._base_addrs: list[int] = []
        self._block_lens: list[int] = []
        self._regions_lock = threading.Lock()  # a setter updates an attribute and the engine's sources together
        self._engine.set_region_sources(self._base_addrs, self._block_lens)

    def _pin_regions(self, kv_caches_base_addr: list[int], block_len: list[int]) -> None:
        """Driver hook (``KVTransfer.register_kv_caches``): until :meth:`_unpin_regions`, every call whose
        region lists hold other values raises ``ValueError`` inside the call (SECURITY.md)."""
        self._engine.pin_regions(kv_caches_base_addr, block_len)

    def _unpin_regions(self) -> None:
        """Drop one pin of :meth:`_pin_regions`."""
        self._engine.unpin_regions()

    # The lists are kept by reference, as vLLM keeps them; the engine re-reads them on every call, so an
    # in-place edit takes effect (and drops cached rows) like in vLLM.
    @property
    def kv_caches_base_addr(self) -> list[int]:
        """Region base addresses (one per registered region)."""
        return self._base_addrs

    @kv_caches_base_addr.setter
    def kv_caches_base_addr(self, value: list[int]) -> None:
        with self._regions_lock:
            self._engine.set_region_sources(value, self._block_lens)  # TypeError for a non-sequence: kept nothing
            self._base_addrs = value

    @property
    def block_len(self) -> list[int]:
        """Block lengths in bytes; region ``r`` uses ``block_len[r % len(block_len)]``."""
        return self._block_lens

    @block_len.setter
    def block_len(self, value: list[int]) -> None:
        with self._regions_lock:
            self._engine.set_region_sources(self._base_addrs, value)
            self._block_lens = value

    @property
    def local_shard_ids(self) -> tuple[StoreShardId, ...]:
        """Always ``(0,)``."""
        return (0,)

    def key_for(self, shard_id: StoreShardId, chunk_hash: BlockHash) -> str:
        """``prefix@hash_hex``; the shard id must be 0 (AssertionError otherwise, as vLLM)."""
        assert shard_id == 0
        return f"{self._key_prefix}@{chunk_hash.hex()}"

    def lookup_key_prefixes(self, rank_namespaces: Sequence[RankNamespace]) -> tuple[str, ...]:
        """One prefix per ``(tp, pcp, dcp, pp)`` namespace, in order."""
        return tuple(
            PoolKey.build_prefix(self.metadata, tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp)
            for tp, pcp, dcp, pp in rank_namespaces
        )

    def set_kv_caches_base_addr(self, base_addrs: list[int]) -> None:
        """Store the region base addresses as given."""
        self.kv_caches_base_addr = base_addrs

    def set_block_len(self, block_lens: list[int]) -> None:
        """Store the block lengths as given."""
        self.block_len = block_lens

    def register_kv_caches(self, kv_caches: Sequence[Any], num_blocks: int) -> None:
        """Derive regions from KV-cache tensors (docs/vllm.md, "Registering caches"), skipping a region whose
        start address was already registered: one region per head when a block is not one dense range, one
        region over the whole storage when ``num_blocks`` blocks fill it, else one region at the tensor."""
        seen: set[int] = set()
        bases: list[int] = []
        lens: list[int] = []

        def add(address: int, length: int) -> None:
            if address not in seen:
                seen.add(address)
                bases.append(address)
                lens.append(length)

        for cache in kv_caches:
            shape, strides, element_size, data_ptr = _geometry(cache)
            if not shape:
                raise IndexError("invalid index of a 0-dim tensor: a KV cache needs a block dimension")
            if shape[0] == 0:  # vLLM reads block 0 (cache[0]) first: no region is derived from an empty cache
                raise IndexError("index 0 is out of bounds for dimension 0 with size 0")
            storage = cache.untyped_storage()
            storage_addr = operator.index(storage.data_ptr())
            storage_len = operator.index(storage.nbytes())
            if not _is_dense(shape[1:], strides[1:]):
                for head in range(shape[1]):
                    assert _is_dense(shape[2:], strides[2:]), "a head's block must be one dense range"
                    add(data_ptr + head * strides[1] * element_size, strides[0] * element_size)
            elif strides[0] * element_size * num_blocks == storage_len:
                add(storage_addr, storage_len // num_blocks)
            else:
                add(data_ptr, strides[0] * element_size)
        self.kv_caches_base_addr = bases
        self.block_len = lens

    def prepare_value_for_block(self, block_id: int) -> tuple[list[int], list[int]]:
        """``(addresses, sizes)`` of one block in every region (boundary puts)."""
        result: tuple[list[int], list[int]] = self._engine.prepare_value_for_block(block_id)
        return result

    def _shard_prefixes(self) -> list[str]:
        return [self._key_prefix]


# --- the 0.32+ token database ----------------------------------------------------------------------------


class LayoutTokenDatabase:
    """vLLM 0.32+'s ``ChunkedTokenDatabase``: enumerates chunks and their hashes; addresses live in the store
    layout (the rank-local one by default). Exported as ``ChunkedTokenDatabase`` by
    ``mooncake_kvaddr.integrations.vllm.data``; the seed-era class of ``mooncake_kvaddr.core.database`` is
    unchanged."""

    def __init__(
        self,
        metadata: KeyMetadata,
        block_size: int,
        hash_block_size: int | None = None,
        store_layout: StoreLayout | None = None,
    ) -> None:
        self.metadata = metadata
        self.block_size = block_size
        self.hash_block_size = hash_block_size or block_size
        if self.block_size % self.hash_block_size != 0:
            raise ValueError(
                f"block_size ({self.block_size}) must be a multiple of hash_block_size ({self.hash_block_size})"
            )
        self.store_layout = store_layout or RankLocalStoreLayout(metadata, block_size, self.hash_block_size)

    def _rank_local_layout(self) -> RankLocalStoreLayout:
        if not isinstance(self.store_layout, RankLocalStoreLayout):
            raise RuntimeError("This operation requires a rank-local Store layout")
        return self.store_layout

    @property
    def kv_caches_base_addr(self) -> list[int]:
        """The rank-local layout's region bases (RuntimeError for other layouts)."""
        return self._rank_local_layout().kv_caches_base_addr

    @property
    def block_len(self) -> list[int]:
        """The rank-local layout's block lengths (RuntimeError for other layouts)."""
        return self._rank_local_layout().block_len

    def key_for(self, chunk_hash: BlockHash) -> str:
        """The rank-local key of a chunk (RuntimeError for other layouts)."""
        return self._rank_local_layout().key_for(0, chunk_hash)

    def set_kv_caches_base_addr(self, kv_caches_base_addr: list[int]) -> None:
        """Forwarded to the rank-local layout."""
        self._rank_local_layout().set_kv_caches_base_addr(kv_caches_base_addr)

    def set_block_len(self, block_len: list[int]) -> None:
        """Forwarded to the rank-local layout."""
        self._rank_local_layout().set_block_len(block_len)

    def prepare_value_for_block(self, block_id: int) -> tuple[list[int], list[int]]:
        """Addresses and sizes of one block slot (rank-local layouts only)."""
        return self._rank_local_layout().prepare_value_for_block(block_id)

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
        """Lazily yield ``(start, end, hash)`` per chunk of ``[mask_num, token_len)``.

        vLLM 0.32+'s rule: the walk starts at chunk ``ceil(mask_num / block_size)``, so a partly masked chunk
        is skipped; ``chunk_mask`` is relative to that first chunk; ``put_step``/``put_step_rank`` stripe
        absolute chunk ids. Hashes are read only for yielded chunks; nothing runs until the first iteration.
        """
        if put_step <= 0:
            raise AssertionError(f"put_step must be positive, got {put_step}")
        if not block_hashes:
            return
        # The native walk starts at floor(mask / block_size): hand it the block-aligned ceiling. A ceiling past
        # int64 is an empty walk in vLLM; the largest block multiple in int64 gives the same empty walk (the
        # native walk needs token_len + block_size to fit, so every chunk starts below it) after the same asserts.
        mask_num = operator.index(mask_num)
        aligned = max(0, -(-mask_num // self.block_size)) * self.block_size
        aligned = min(aligned, (2**63 - 1) // self.block_size * self.block_size)
        # In windows of core.walk.WINDOW chunks: memory stays bounded whatever len(block_hashes) claims.
        for starts, ends, hash_indices in walk_windows(
            token_len, len(block_hashes), self.block_size, self.hash_block_size, aligned, chunk_mask,
            put_step, put_step_rank,
        ):
            for start, end, index in zip(starts, ends, hash_indices):
                yield start, end, block_hashes[index]
