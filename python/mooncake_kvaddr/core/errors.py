"""Exception classes of mooncake_kvaddr (docs/errors.md lists what raises which).

The chunk-database errors keep the reference's exception types as bases, so code written against vLLM's
``ChunkedTokenDatabase`` (which asserts, and divides by ``len(block_len)``) keeps catching them.
"""

from mooncake_kvaddr._native import BlockLenError, ChunkAlignmentError

__all__ = ["BlockLenError", "ChunkAlignmentError"]
