"""mooncake_kvaddr: native KV-chunk keys and transfer addresses for Mooncake-backed KV-cache offload.

Drop-in for vLLM's Mooncake store connector data classes (``KeyMetadata``, ``PoolKey``,
``ChunkedTokenDatabase``), with the per-request address matrix and key strings computed in C++.
"""

from mooncake_kvaddr.database import DEFAULT_ADDRESS_CACHE_BYTES, ChunkedTokenDatabase
from mooncake_kvaddr.errors import BlockLenError, ChunkAlignmentError
from mooncake_kvaddr.hashes import BlobBlockHashes, BlockHash, CompactChunkHashes, chunk_hashes_for_block_size
from mooncake_kvaddr.metadata import KeyMetadata, PoolKey, model_name_from_path

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ADDRESS_CACHE_BYTES",
    "BlobBlockHashes",
    "BlockHash",
    "BlockLenError",
    "ChunkAlignmentError",
    "ChunkedTokenDatabase",
    "CompactChunkHashes",
    "KeyMetadata",
    "PoolKey",
    "__version__",
    "chunk_hashes_for_block_size",
    "model_name_from_path",
]
