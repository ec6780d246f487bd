"""mooncake_kvaddr: native KV-chunk keys and transfer addresses for Mooncake-backed KV-cache offload.

Drop-in for vLLM's Mooncake store connector data classes (``KeyMetadata``, ``PoolKey``,
``ChunkedTokenDatabase``), with the per-request address matrix and key strings computed in C++.
"""

from mooncake_kvaddr.config import StoreConfig
from mooncake_kvaddr.database import DEFAULT_ADDRESS_CACHE_BYTES, ChunkedTokenDatabase
from mooncake_kvaddr.errors import BlockLenError, ChunkAlignmentError
from mooncake_kvaddr.hashes import BlobBlockHashes, BlockHash, CompactChunkHashes, chunk_hashes_for_block_size
from mooncake_kvaddr.lookup import GroupSpec, ParallelLayout, StoreLookup
from mooncake_kvaddr.master import EmbeddedMaster, MasterError
from mooncake_kvaddr.metadata import KeyMetadata, PoolKey, model_name_from_path
from mooncake_kvaddr.staging import CopyBackend, HostCopyBackend, StagingBuffer, StagingPool
from mooncake_kvaddr.store import (
    BatchResult,
    Health,
    MooncakeStore,
    Outcome,
    StoreClosedError,
    StoreError,
    StoreSetupError,
)
from mooncake_kvaddr.transfer import KVTransfer, LoadResult, StoreResult, TransferRequest

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ADDRESS_CACHE_BYTES",
    "BatchResult",
    "BlobBlockHashes",
    "BlockHash",
    "BlockLenError",
    "ChunkAlignmentError",
    "ChunkedTokenDatabase",
    "CompactChunkHashes",
    "CopyBackend",
    "EmbeddedMaster",
    "GroupSpec",
    "Health",
    "HostCopyBackend",
    "KVTransfer",
    "KeyMetadata",
    "LoadResult",
    "MasterError",
    "MooncakeStore",
    "Outcome",
    "ParallelLayout",
    "PoolKey",
    "StagingBuffer",
    "StagingPool",
    "StoreClosedError",
    "StoreConfig",
    "StoreError",
    "StoreLookup",
    "StoreResult",
    "StoreSetupError",
    "TransferRequest",
    "__version__",
    "chunk_hashes_for_block_size",
    "model_name_from_path",
]
