"""Type stubs of the native extension (csrc/bindings). Use the mooncake_kvaddr package, not this module."""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

_Int64Array = npt.NDArray[np.int64]
_Hashes = Any  # a sequence of bytes-like objects, or one bytes-like blob (with hash_len)

class ChunkAlignmentError(ValueError, AssertionError):
    """A chunk's span is not a multiple of hash_block_size (or a process_tokens assert failed)."""

class BlockLenError(ValueError, ZeroDivisionError):
    """block_len is empty while KV-cache regions are registered."""

def build_key(prefix: str, chunk_hash: Any) -> str: ...
def build_keys(prefix: str, hashes: _Hashes, hash_len: int | None = None) -> list[str]: ...
def build_lookup_keys(
    prefixes: Sequence[str], hashes: _Hashes, hash_len: int | None = None, *, any_buffer: bool = False
) -> list[str]: ...
def lookup_key_blob(
    prefixes: Sequence[str], hashes: _Hashes, hash_len: int | None = None
) -> tuple[bytes, npt.NDArray[np.int64]]: ...
def reduce_exists(results: Sequence[int], widths: int | Sequence[int]) -> list[bool]: ...
def chunk_walk(
    token_len: int,
    n_hashes: int,
    block_size: int,
    hash_block_size: int,
    mask_num: int,
    chunk_mask: Sequence[bool] | None,
    put_step: int,
    put_step_rank: int,
    absolute_mask: bool = False,
) -> tuple[list[int], list[int], list[int]]: ...
GIL_RELEASE_MIN_WORK_NS: int

def gil_release_min_work_ns() -> int: ...
def set_gil_release_min_work_ns(ns: int) -> None: ...

STAGING_SLOT_ALIGNMENT: int
STAGING_STREAMING_STORES: bool

class MemoryRanges:
    """Memory ranges converted once (made by memory_ranges)."""

    def __len__(self) -> int: ...

def memory_ranges(allowed_ranges: Sequence[tuple[int, int]]) -> MemoryRanges: ...
def staging_plan_slots(
    sizes: _Int64Array, alignment: int = 64
) -> tuple[_Int64Array, _Int64Array, int]: ...
def _staging_gather(
    addrs: _Int64Array,
    sizes: _Int64Array,
    staging_ptr: int,
    staging_len: int,
    offsets: _Int64Array,
    allowed_ranges: Sequence[tuple[int, int]] | MemoryRanges,
    *,
    select: npt.NDArray[np.bool_] | npt.NDArray[np.uint8] | None = None,
    threads: int = 0,
    streaming: bool = True,
) -> int: ...
def _staging_scatter(
    addrs: _Int64Array,
    sizes: _Int64Array,
    staging_ptr: int,
    staging_len: int,
    offsets: _Int64Array,
    allowed_ranges: Sequence[tuple[int, int]] | MemoryRanges,
    *,
    select: npt.NDArray[np.bool_] | npt.NDArray[np.uint8] | None = None,
    threads: int = 0,
    streaming: bool = True,
) -> int: ...
def slices_inside(
    addrs: _Int64Array, sizes: _Int64Array, allowed_ranges: Sequence[tuple[int, int]] | MemoryRanges
) -> npt.NDArray[np.bool_]: ...

def multi_buffer_arrays(
    addr_rows: Sequence[Sequence[int]], size_rows: Sequence[Sequence[int]]
) -> tuple[_Int64Array, _Int64Array]: ...

# ---------------------------------------------------------------------------------------------------------------
# Native Mooncake client (register_mooncake_client.cpp; docs/native-client.md). Use driver.native_client.

def mooncake_client_platform_reason() -> str: ...
def mooncake_client_call_count() -> int: ...
def mooncake_client_last_release_ns() -> int: ...

def mooncake_client_last_refused() -> int: ...

class MooncakeClient:
    def __init__(
        self,
        capsule: object,
        library_path: str,
        default_config: object,
        symbol_overrides: dict[str, str] | None = None,
        key_blob: type | None = None,
    ) -> None: ...
    def batch_get_into_multi_buffers(
        self,
        keys: object,
        addrs: object,
        sizes: object,
        prefer_alloc_in_same_node: bool = False,
        *,
        ranges: object = None,
    ) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: object, addrs: object, sizes: object, config: object = None, *, ranges: object = None
    ) -> list[int]: ...
    def batch_get_into(self, keys: object, ptrs: object, sizes: object, *, ranges: object = None) -> list[int]: ...
    def batch_put_from(
        self, keys: object, ptrs: object, sizes: object, config: object = None, *, ranges: object = None
    ) -> list[int]: ...
    def batch_is_exist(self, keys: object) -> list[int]: ...
    def same_client(self, capsule: object) -> bool: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def library(self) -> str: ...
    @property
    def slots(self) -> dict[str, int]: ...
    @property
    def abi_id(self) -> str: ...

# --- layout engine (csrc/bindings/register_layout.cpp; docs/vllm.md) ---------------------------------------


# One store shard's segments: (bases, strides, sizes). vLLM 0.33: one per owned shard; with store_chunk_size
# (vLLM 0.34): templates[chunk_index][local_shard].
_ShardTemplate = tuple[Sequence[int], Sequence[int], Sequence[int]]

class LayoutEngine:
    """Segment templates of one store layout → Mooncake descriptors."""

    cache_capacity: int
    immutable_rows: bool
    @property
    def segment_count(self) -> int: ...
    @property
    def store_chunk_size(self) -> int | None: ...
    @property
    def chunks_per_block(self) -> int: ...
    def __init__(
        self,
        block_size: int,
        hash_block_size: int,
        tp_shared: bool,
        first_shard: int,
        n_shards: int,
        cache_bytes: int,
        store_chunk_size: int | None = None,
        *,
        seed_rules: bool = False,
    ) -> None: ...
    def set_region_sources(
        self, kv_caches_base_addr: Sequence[int], block_len: Sequence[int], block_stride: Sequence[int] | None = None
    ) -> None: ...
    def set_templates(self, templates: Sequence[_ShardTemplate] | Sequence[Sequence[_ShardTemplate]]) -> None: ...
    def prepare_values(
        self, chunks: Any, block_ids: Sequence[int] | _Int64Array, shard_ids: Sequence[int] | _Int64Array | None = None
    ) -> tuple[list[Any], list[Any], list[int]]: ...
    def prepare_values_array(
        self, chunks: Any, block_ids: Sequence[int] | _Int64Array, shard_ids: Sequence[int] | _Int64Array | None = None
    ) -> tuple[_Int64Array, _Int64Array, _Int64Array]: ...
    def prepare_value_for_block(self, block_id: int) -> tuple[list[int], list[int]]: ...
    def plan_load(
        self,
        shard_prefixes: Sequence[str],
        hashes: _Hashes,
        hash_len: int | None,
        token_len: int,
        mask_num: int,
        load_mask: Sequence[bool] | None,
        tail_tokens: int | None,
        block_ids: Sequence[int] | _Int64Array,
        arrays: bool = False,
        slot_alignment: int | None = None,
    ) -> tuple[Any, ...]: ...
    def walk_load(
        self,
        shard_prefixes: Sequence[str],
        hashes: _Hashes,
        hash_len: int | None,
        token_len: int,
        mask_num: int,
        load_mask: Sequence[bool] | None,
        tail_tokens: int | None,
    ) -> tuple[list[str], _Int64Array]: ...
    def plan_store(
        self,
        shard_prefixes: Sequence[str],
        hashes: _Hashes,
        hash_len: int | None,
        token_len: int,
        mask_num: int,
        chunk_mask: Sequence[bool] | None,
        put_step: int,
        put_step_rank: int,
        block_ids: Sequence[int] | _Int64Array,
        skip_null: bool,
    ) -> tuple[list[str], list[tuple[int, ...]], list[int]]: ...
    def cache_info(self) -> dict[str, int]: ...
    def clear_cache(self) -> None: ...
    def pin_regions(
        self, kv_caches_base_addr: Sequence[int], block_len: Sequence[int], block_stride: Sequence[int] | None = None
    ) -> None: ...
    def unpin_regions(self) -> None: ...
    @property
    def region_pins(self) -> int: ...
