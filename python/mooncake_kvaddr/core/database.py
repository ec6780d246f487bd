"""The chunk database: drop-in for vLLM's ``ChunkedTokenDatabase``, a face over the rank-local store layout
built with the seed-era rules (one engine, one ``plan_load`` for every layout). Results equal
:mod:`mooncake_kvaddr.core.oracle`'s value for value and type for type (docs/address-rows.md); what differs is
speed and strictness (docs/errors.md). Results are fresh, and one database may be shared by any number of
threads (docs/address-rows.md, "Results and the row cache", "Thread safety").
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr._native import build_key, chunk_walk
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.keys import Hashes, _unwrap, build_keys
from mooncake_kvaddr.core.layouts import RankLocalStoreLayout
from mooncake_kvaddr.core.metadata import KeyMetadata, PoolKey
from mooncake_kvaddr.core.plan import KeyPlan, SlotPlan
from mooncake_kvaddr.core.walk import walk_windows

#: Default memory cap of the per-block-id address-row cache, per database: 64 MiB. A cached row costs about
#: ``64 + 40 * R`` bytes for ``R`` regions, so the default holds ~16K blocks at 100 regions (~4K at 400);
#: size it as ``num_blocks * (64 + 40 * R)`` to cache every block (docs/address-rows.md).
DEFAULT_ADDRESS_CACHE_BYTES = 64 << 20

Chunk = Sequence[int]
Int64Array = npt.NDArray[np.int64]


class LoadWalk(NamedTuple):
    """One group's load chunks without rows: index-aligned keys and an ``(n, 2)`` int64 ``(start, end)`` array
    (the input of :meth:`ChunkedTokenDatabase.prepare_values_array`)."""

    keys: list[str]
    chunks: Int64Array


class StorePlan(NamedTuple):
    """One group's store candidates: index-aligned keys, ``(start, end)`` chunks and block ids."""

    keys: list[str]
    chunks: list[tuple[int, int]]
    block_ids: list[int]


class ChunkedTokenDatabase:
    """Maps token ranges of one KV-cache group to pool keys and to the memory regions Mooncake moves.

    ``address_cache_bytes`` caps the per-block-id cache of address rows (0 disables it; default
    :data:`DEFAULT_ADDRESS_CACHE_BYTES`, 64 MiB per database); the cache is dropped whenever the registered
    regions or block lengths change, in place or by a setter.

    Thread-safe: one instance may be shared by a send thread and several receive threads (see the module
    docstring). Inputs are validated strictly (docs/errors.md): ``block_ids`` is a list, tuple, 1-D integer
    array or another sequence of ints; a dict, set or str raises ``TypeError``.
    """

    def __init__(
        self,
        metadata: KeyMetadata,
        block_size: int,
        hash_block_size: int | None = None,
        *,
        address_cache_bytes: int = DEFAULT_ADDRESS_CACHE_BYTES,
    ) -> None:
        self.metadata = metadata
        # Exact ints (TypeError for a float such as 32.0 or np.float32(16)): every walk and row uses them.
        block_size = operator.index(block_size)
        self.block_size = block_size
        self.hash_block_size = operator.index(hash_block_size or block_size)
        if block_size <= 0 or self.hash_block_size <= 0 or block_size % self.hash_block_size != 0:
            raise ValueError(
                f"block_size ({block_size}) must be a positive multiple of "
                f"hash_block_size ({self.hash_block_size})"
            )
        address_cache_bytes = operator.index(address_cache_bytes)
        if address_cache_bytes < 0:
            raise ValueError(f"address_cache_bytes must be >= 0, got {address_cache_bytes}")
        # A face over the rank-local layout under the seed-era rules: one engine, one plan_load for every layout
        # (docs/address-rows.md).
        self._layout = RankLocalStoreLayout(
            metadata, block_size, self.hash_block_size, row_cache_bytes=address_cache_bytes, seed_rules=True
        )
        self._key_prefix = PoolKey.build_prefix(metadata)

    # Region registration: the layout's lists, kept by reference like the reference implementation; the engine
    # re-reads them on every call, so in-place edits are seen too (and drop the address cache).
    @property
    def kv_caches_base_addr(self) -> list[int]:
        """Base address of every registered KV-cache region, in region order."""
        return self._layout.kv_caches_base_addr

    @kv_caches_base_addr.setter
    def kv_caches_base_addr(self, value: list[int]) -> None:
        self._layout.kv_caches_base_addr = value

    @property
    def block_len(self) -> list[int]:
        """Bytes per block of each region; region ``i`` uses ``block_len[i % len(block_len)]``."""
        return self._layout.block_len

    @block_len.setter
    def block_len(self, value: list[int]) -> None:
        self._layout.block_len = value

    def set_kv_caches_base_addr(self, kv_caches_base_addr: list[int]) -> None:
        """Register the regions' base addresses (all groups share the same list)."""
        self._layout.kv_caches_base_addr = kv_caches_base_addr

    def set_block_len(self, block_len: list[int]) -> None:
        """Register the per-region block lengths in bytes."""
        self._layout.block_len = block_len

    @property
    def address_cache_bytes(self) -> int:
        """Memory cap of the address-row cache in bytes (settable; 0 disables and frees it)."""
        return self._layout.row_cache_bytes

    @address_cache_bytes.setter
    def address_cache_bytes(self, value: int) -> None:
        value = operator.index(value)  # TypeError for floats; a caller's __index__ exception unchanged
        if value < 0:
            raise ValueError(f"address_cache_bytes must be >= 0, got {value}")
        self._layout.row_cache_bytes = value

    @property
    def immutable_rows(self) -> bool:
        """When True, ``prepare_values``, ``prepare_value`` and ``plan_load`` return each address and size row
        as a tuple of ints (a cached row's own tuple: no per-call copy) instead of a fresh list. Values are
        those of the list form; a tuple never changes, so no returned row can change later. Mooncake's batch
        calls and vLLM's worker accept both (they only read rows); code that appends to a row needs the lists
        (the default, type for type with vLLM)."""
        return self._layout.immutable_rows

    @immutable_rows.setter
    def immutable_rows(self, value: bool) -> None:
        self._layout.immutable_rows = value

    def address_cache_info(self) -> dict[str, int]:
        """Entries, bytes, capacity, hits and misses of the address-row cache."""
        return dict(self._layout.row_cache_info())

    def clear_address_cache(self) -> None:
        """Drop every cached address row."""
        self._layout.clear_row_cache()

    def _pin_regions(self, kv_caches_base_addr: list[int], block_len: list[int]) -> None:
        """Driver hook (``KVTransfer.register_kv_caches``): until :meth:`_unpin_regions`, every call whose
        region lists hold other values raises ``ValueError`` inside the call (SECURITY.md)."""
        self._layout._pin_regions(kv_caches_base_addr, block_len)

    def _unpin_regions(self) -> None:
        """Drop one pin of :meth:`_pin_regions`."""
        self._layout._unpin_regions()

    # Keys.
    @property
    def key_prefix(self) -> str:
        """The key prefix of this group (everything before ``@<hash hex>``), built once."""
        return self._key_prefix

    def key_for(self, chunk_hash: BlockHash) -> str:
        """The pool key of a chunk: the cached prefix, ``@``, and the hash in lowercase hex."""
        return build_key(self._key_prefix, chunk_hash)

    def keys_for(self, hashes: Hashes, hash_len: int | None = None) -> list[str]:
        """``[key_for(h) for h in hashes]`` in one native call; ``hashes`` may be one flat blob."""
        return build_keys(self._key_prefix, hashes, hash_len)

    # Fused per-request plans: the walk, the keys and the rows in one native pass.
    def plan_load(
        self,
        token_len: int,
        block_hashes: Hashes,
        block_ids: Sequence[int],
        mask_num: int = 0,
        load_mask: Sequence[bool] | None = None,
        *,
        hash_len: int | None = None,
    ) -> KeyPlan:
        """Everything a receive thread needs for this group before Mooncake (docs/address-rows.md), in one call.

        Equals walking ``process_tokens(token_len, block_hashes, mask_num)``, keeping chunks whose absolute
        index is inside ``load_mask`` and true there (all when None), then ``key_for`` each hash and
        ``prepare_values`` on the kept chunks.
        """
        data, length = _unwrap(block_hashes, hash_len)
        keys, addrs, sizes, ids = self._layout.plan_load(
            token_len, data, mask_num, load_mask, block_ids, hash_len=length
        )
        return KeyPlan(keys, addrs, sizes, ids)

    def plan_load_arrays(
        self,
        token_len: int,
        block_hashes: Hashes,
        block_ids: Sequence[int] | Int64Array,
        mask_num: int = 0,
        load_mask: Sequence[bool] | None = None,
        *,
        hash_len: int | None = None,
        slot_alignment: int = 64,
    ) -> KeyPlan:
        """:meth:`plan_load` with array output and the staging slot layout, in one native call.

        The staged transfer path's whole preparation of one group: the same walk, keys and order as
        :meth:`plan_load`; ``addrs``/``sizes`` as fresh ``(n, R)`` int64 arrays, ``block_ids`` as ``(n,)``, and
        ``offsets``/``object_sizes``/``total_bytes`` as :func:`mooncake_kvaddr.driver.staging.plan_slots`
        would lay them out with ``slot_alignment`` (a power of two). With the gather or scatter that follows,
        a staged load crosses from Python to C++ twice.
        """
        data, length = _unwrap(block_hashes, hash_len)
        keys, addrs, sizes, ids, offsets, object_sizes, total = self._layout.plan_load(
            token_len, data, mask_num, load_mask, block_ids, hash_len=length, slot_alignment=slot_alignment
        )
        return KeyPlan(keys, addrs, sizes, ids, slots=SlotPlan(offsets, object_sizes, total))

    def walk_load(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash],
        mask_num: int = 0,
        load_mask: Sequence[bool] | None = None,
    ) -> LoadWalk:
        """The chunks and keys of :meth:`plan_load`, with the chunks as an array and no rows.

        Same walk, same keys, same order as :meth:`plan_load` with the same arguments. Prefer
        :meth:`plan_load_arrays`, which also returns the rows and the staging layout in the same call.
        """
        starts, ends, hash_indices = chunk_walk(
            token_len, len(block_hashes), self.block_size, self.hash_block_size, mask_num, load_mask, 1, 0,
            absolute_mask=True,
        )
        keys = self.keys_for([block_hashes[i] for i in hash_indices])
        chunks = np.empty((len(starts), 2), dtype=np.int64)
        chunks[:, 0] = starts
        chunks[:, 1] = ends
        return LoadWalk(keys, chunks)

    def plan_store(
        self,
        token_len: int,
        block_hashes: Hashes,
        block_ids: Sequence[int],
        mask_num: int = 0,
        chunk_mask: Sequence[bool] | None = None,
        *,
        put_step: int = 1,
        put_step_rank: int = 0,
        skip_null_block: bool = True,
        hash_len: int | None = None,
    ) -> StorePlan:
        """A send thread's candidate chunks for this group (docs/address-rows.md) with their keys.

        The walk with the relative ``chunk_mask`` and this rank's put stripe, without chunks past
        ``block_ids`` and (``skip_null_block``) those on the NULL block 0. Rows are left to
        :meth:`prepare_values` on the chunks that ``batch_is_exist`` reports missing.
        """
        data, length = _unwrap(block_hashes, hash_len)
        keys, chunks, ids = self._layout.plan_store(
            token_len, data, block_ids, mask_num, chunk_mask, put_step=put_step, put_step_rank=put_step_rank,
            skip_null_block=skip_null_block, hash_len=length,
        )
        return StorePlan(keys, cast(list[tuple[int, int]], chunks), ids)

    # Addresses and sizes.
    def prepare_values(
        self, chunks: Sequence[Chunk], block_ids: Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Address rows, size rows and first block id of every ``(start, end, ...)`` chunk.

        ``addr[c][r] = base[r] + block_ids[start // block_size] * blen[r]`` and
        ``size[c][r] = blen[r] * ceil((end - start) / block_size)``. Every row is a fresh list (see the module
        docstring). Raises :class:`~mooncake_kvaddr.core.errors.ChunkAlignmentError` for a span that is not a
        multiple of ``hash_block_size``, ``IndexError`` for a block index past ``block_ids``, ``TypeError``
        for non-integers and ``OverflowError`` when an address does not fit in 64 bits.
        """
        return self._layout.prepare_values(chunks, block_ids, None)

    def prepare_value(
        self, start: int, end: int, block_ids: Sequence[int]
    ) -> tuple[list[int], list[int], int]:
        """``prepare_values`` for one chunk, as an ``(addr_row, size_row, block_id)`` tuple."""
        addrs, sizes, ids = self._layout.prepare_values([(start, end)], block_ids, None)
        return addrs[0], sizes[0], ids[0]

    def prepare_values_array(
        self, chunks: Sequence[Chunk] | npt.NDArray[np.integer[Any]], block_ids: Sequence[int] | Int64Array
    ) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The same matrix as fresh int64 arrays ``(addrs (n, R), sizes (n, R), block_ids (n,))``.

        No Python object per element; ``chunks`` may also be an ``(n, 2)`` integer array. The GIL is released
        around the arithmetic of large requests (docs/gil-policy.md).
        """
        return self._layout.prepare_values_array(chunks, block_ids)

    def prepare_value_for_block(self, block_id: int) -> tuple[list[int], list[int]]:
        """Address and size (one block) of every region for one physical block (partial-tail offload)."""
        return self._layout.prepare_value_for_block(block_id)

    # The chunk walk.
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
        """Lazily yield ``(start, end, hash)`` for each chunk of ``[mask_num, token_len)`` (docs/address-rows.md).

        Chunks are ``block_size`` tokens (the last one may be shorter); ``chunk_mask`` (relative to the first
        chunk) skips chunks, ``put_step``/``put_step_rank`` stripe absolute chunk ids across ranks. Hashes are
        read only for yielded chunks. Nothing runs until the first iteration.
        """
        # In windows of core.walk.WINDOW chunks: memory stays bounded whatever len(block_hashes) claims.
        for starts, ends, hash_indices in walk_windows(
            token_len, len(block_hashes), self.block_size, self.hash_block_size, mask_num, chunk_mask,
            put_step, put_step_rank,
        ):
            for start, end, index in zip(starts, ends, hash_indices):
                yield start, end, block_hashes[index]
