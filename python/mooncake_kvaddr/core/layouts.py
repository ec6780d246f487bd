"""Store layouts of vLLM 0.32+'s Mooncake store connector, on one native engine (docs/vllm.md).

A store layout decides, for one KV-cache group on one local TP rank, which store objects (shards) the rank
writes and reads, how they are keyed, and where each object's bytes live. Every layout here is a set of
*segment templates* — one per local shard: segment ``s`` of a key whose chunk starts in block ``b`` lives at
``base[s] + b * stride[s]`` and spans ``size[s]`` bytes (times the chunk's block count for the rank-local
layout) — computed by the native ``LayoutEngine``:

- :class:`RankLocalStoreLayout`: the historical format, one shard (``0``), regions from
  ``kv_caches_base_addr``/``block_len``.
- :class:`LBHNCStoreLayout` / :class:`LBNHCStoreLayout`: TP-shared formats (``TPShardedStoreLayout``) whose
  objects are readable by any TP size dividing the store's.

Names, signatures, strings and exception types follow vLLM 0.33.0 (checked against it by
``tests/test_vllm_conformance.py``); where vLLM's numpy code would silently wrap a 64-bit value, these raise
``OverflowError``. The package never imports torch: ``register_kv_caches`` reads tensors through their
methods (``shape``, ``stride()``, ``element_size()``, ``data_ptr()``, ``untyped_storage()``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.metadata import KeyMetadata, PoolKey
from mooncake_kvaddr.core.walk import walk_windows

StoreShardId = int
#: Physical ranks encoded in a rank-local key: (TP, PCP, DCP, PP).
RankNamespace = tuple[int, int, int, int]
Int64Array = npt.NDArray[np.int64]

#: Default bytes of address rows a layout keeps per (shard, block id) for repeated block ids.
DEFAULT_ROW_CACHE_BYTES = 64 << 20


def make_mooncake_group_id(metadata: KeyMetadata, chunk_hash: str) -> str:
    """vLLM 0.33's Mooncake group id of a chunk: ``vllm-mooncake-store:[cache_prefix@]model[namespace]@hash``.

    The lifecycle unit is the prefix chunk, so no rank, group or shard fields (docs/vllm.md, "Keys").
    """
    head = f"{metadata.cache_prefix}@" if metadata.cache_prefix else ""
    return f"vllm-mooncake-store:{head}{metadata.model_name}{metadata.store_namespace}@{chunk_hash}"


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
        self, chunks: Sequence[tuple[int, int]], block_ids: list[int], shard_ids: Sequence[StoreShardId]
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Descriptors as vLLM returns them: fresh lists of Python ints (no row aliases another or a cache)."""
        result: tuple[list[list[int]], list[list[int]], list[int]] = self._engine.prepare_values(
            chunks, block_ids, shard_ids
        )
        return result

    def prepare_values_array(
        self, chunks: Sequence[tuple[int, int]] | Int64Array, block_ids: Any, shard_ids: Any
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
    ) -> tuple[list[str], Any, Any, Any]:
        """One group's whole load preparation in one native call (docs/vllm.md, "Fused plan").

        Walks ``[mask_num, token_len)`` with vLLM 0.33's start rule (``ceil(mask_num / block_size)``), keeps
        the chunks ``load_mask`` (indexed by absolute chunk id; ``None`` keeps all) keeps, keys the chunk that
        ends at ``token_len`` by ``block_hashes[tail_tokens // hash_block_size - 1]`` when a tail-key boundary
        is given, expands every kept chunk to one key per local shard id, and returns
        ``(keys, addr rows, size rows, block ids)`` — exactly what vLLM's receive thread builds with
        ``process_tokens``, ``key_for`` and ``prepare_values`` (int64 arrays for the rows when ``arrays``).
        ``block_hashes`` may be one flat blob of ``n * hash_len`` bytes.
        """
        result: tuple[list[str], Any, Any, Any] = self._engine.plan_load(
            self._shard_prefixes(), block_hashes, hash_len, token_len, mask_num, load_mask, tail_tokens,
            block_ids, arrays,
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


class RankLocalStoreLayout(_EngineLayout):
    """The historical rank-local payload layout: one store object per chunk, keyed by this rank's ranks."""

    def __init__(self, metadata: KeyMetadata, block_size: int, hash_block_size: int) -> None:
        super().__init__(metadata, block_size, hash_block_size)
        self._key_prefix = PoolKey.build_prefix(metadata)
        self._engine = _native.LayoutEngine(block_size, hash_block_size, False, 0, 1, DEFAULT_ROW_CACHE_BYTES)
        self._base_addrs: list[int] = []
        self._block_lens: list[int] = []
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
        self._engine.set_region_sources(value, self._block_lens)  # TypeError for a non-sequence: kept nothing
        self._base_addrs = value

    @property
    def block_len(self) -> list[int]:
        """Block lengths in bytes; region ``r`` uses ``block_len[r % len(block_len)]``."""
        return self._block_lens

    @block_len.setter
    def block_len(self, value: list[int]) -> None:
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
        # computed came from the templates it read; see driver/layout_adapter.py).
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
