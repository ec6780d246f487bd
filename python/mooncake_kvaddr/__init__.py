"""mooncake_kvaddr: native KV-chunk keys and transfer addresses for Mooncake-backed KV-cache offload.

Drop-in for vLLM's Mooncake store connector data classes, with the per-request address matrix and key strings
computed in C++. Layers ``core``, ``driver`` and ``integrations`` (docs/architecture.md); the core names are
imported eagerly, the driver's on first use.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from mooncake_kvaddr._version import __version__
from mooncake_kvaddr.core.database import DEFAULT_ADDRESS_CACHE_BYTES, ChunkedTokenDatabase
from mooncake_kvaddr.core.errors import BlockLenError, ChunkAlignmentError
from mooncake_kvaddr.core.hashes import BlobBlockHashes, BlockHash, CompactChunkHashes, chunk_hashes_for_block_size
from mooncake_kvaddr.core.metadata import KeyMetadata, PoolKey, model_name_from_path

# A library logs; the application decides where logs go. The NullHandler keeps Python's last-resort handler
# from printing our warnings when the application configured no logging (docs/configuration.md).
logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from mooncake_kvaddr.driver.config import StoreConfig
    from mooncake_kvaddr.driver.lookup import GroupSpec, ParallelLayout, StoreLookup
    from mooncake_kvaddr.driver.master import EmbeddedMaster, MasterError
    from mooncake_kvaddr.driver.staging import CopyBackend, HostCopyBackend, StagingBuffer, StagingPool
    from mooncake_kvaddr.driver.store import (
        BatchResult,
        Health,
        MooncakeStore,
        Outcome,
        StoreClosedError,
        StoreError,
        StoreSetupError,
    )
    from mooncake_kvaddr.driver.transfer import KVTransfer, LoadResult, StoreResult, TransferRequest

# Driver names, resolved by module-level __getattr__ on first access.
_LAZY: dict[str, str] = {
    "StoreConfig": "mooncake_kvaddr.driver.config",
    "GroupSpec": "mooncake_kvaddr.driver.lookup",
    "ParallelLayout": "mooncake_kvaddr.driver.lookup",
    "StoreLookup": "mooncake_kvaddr.driver.lookup",
    "EmbeddedMaster": "mooncake_kvaddr.driver.master",
    "MasterError": "mooncake_kvaddr.driver.master",
    "CopyBackend": "mooncake_kvaddr.driver.staging",
    "HostCopyBackend": "mooncake_kvaddr.driver.staging",
    "StagingBuffer": "mooncake_kvaddr.driver.staging",
    "StagingPool": "mooncake_kvaddr.driver.staging",
    "BatchResult": "mooncake_kvaddr.driver.store",
    "Health": "mooncake_kvaddr.driver.store",
    "MooncakeStore": "mooncake_kvaddr.driver.store",
    "Outcome": "mooncake_kvaddr.driver.store",
    "StoreClosedError": "mooncake_kvaddr.driver.store",
    "StoreError": "mooncake_kvaddr.driver.store",
    "StoreSetupError": "mooncake_kvaddr.driver.store",
    "KVTransfer": "mooncake_kvaddr.driver.transfer",
    "LoadResult": "mooncake_kvaddr.driver.transfer",
    "StoreResult": "mooncake_kvaddr.driver.transfer",
    "TransferRequest": "mooncake_kvaddr.driver.transfer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mooncake_kvaddr' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
