"""Views over block hashes: the compact per-chunk view and the zero-copy blob view (docs/address-rows.md)."""

from __future__ import annotations

import operator
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import overload

#: A block hash: ``bytes``, or a ``memoryview`` slice of a lookup blob. Both hex identically.
BlockHash = bytes | memoryview


class _HashView(Sequence[BlockHash]):
    """Shared indexing rules: ints (negative wrap), slices give lists, out of range raises IndexError."""

    @abstractmethod
    def _item(self, index: int) -> BlockHash:
        """Item at a validated, non-negative index."""

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...
    @overload
    def __getitem__(self, index: slice) -> list[BlockHash]: ...
    def __getitem__(self, index: int | slice) -> BlockHash | list[BlockHash]:
        n = len(self)
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(n))]
        index = operator.index(index)  # an exact int: an int subclass's arithmetic and comparisons are not used
        position = index + n if index < 0 else index
        if not 0 <= position < n:
            raise IndexError(index)
        return self._item(position)

    def __iter__(self) -> Iterator[BlockHash]:
        for i in range(len(self)):
            yield self._item(i)


class CompactChunkHashes(_HashView):
    """One hash per ``block_size`` chunk: the chunk's last ``hash_block_size`` sub-hash.

    Hashes are prefix-chained, so the last sub-hash identifies the chunk and everything before it; keys stay
    one digest long whatever the ``block_size / hash_block_size`` ratio.
    """

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int) -> None:
        if hash_block_size <= 0 or block_size % hash_block_size != 0:
            raise ValueError(
                f"block_size ({block_size}) must be a multiple of hash_block_size ({hash_block_size})"
            )
        self.block_hashes = block_hashes
        self.scale_factor = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def _item(self, index: int) -> BlockHash:
        return self.block_hashes[(index + 1) * self.scale_factor - 1]


def chunk_hashes_for_block_size(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """One hash per ``block_size`` chunk; ``block_hashes`` itself when the two sizes are equal."""
    if block_size == hash_block_size:
        return block_hashes
    return CompactChunkHashes(block_hashes, hash_block_size, block_size)


class BlobBlockHashes(_HashView):
    """Zero-copy sequence over a flat buffer of ``hash_len``-byte hashes (the lookup wire format).

    Lengths count **bytes**, whatever the buffer's item format: a ``memoryview`` of ``'I'`` items is read as
    its bytes, exactly as the native key builders read it (docs/address-rows.md, "Hash views").

    The view's length can never disagree with its buffer: ``bytes`` are immutable and kept as they are (items
    are ``bytes`` slices); any other buffer (``bytearray``, ``memoryview``, numpy arrays...) is held through a
    read-only byte ``memoryview`` (items are ``memoryview`` slices of it), which *locks* a resizable buffer:
    a ``bytearray`` cannot change size while the view is alive, or until :meth:`release` is called. In-place
    writes to a mutable buffer are seen by later reads. Raises ``ValueError`` for a ``hash_len`` that is not
    positive (0 is accepted for an empty blob only), a buffer that is not C-contiguous, or a length that is
    not a multiple of ``hash_len``.
    """

    def __init__(self, blob: bytes | bytearray | memoryview, hash_len: int) -> None:
        if isinstance(hash_len, bool) or not isinstance(hash_len, int) or hash_len < 0:
            raise ValueError(f"hash_len must be a positive int, got {hash_len!r}")
        # An exact int from here on: an int subclass's own arithmetic (__rmod__, __rfloordiv__) would otherwise
        # decide the view's length, and a length that disagrees with the blob yields empty hashes.
        hash_len = operator.index(hash_len)
        if hash_len < 0:
            raise ValueError(f"hash_len must be a positive int, got {hash_len!r}")
        data: bytes | memoryview
        if type(blob) is bytes:
            data = blob
        else:
            try:
                view = memoryview(blob)
            except TypeError:
                raise TypeError(f"blob must be bytes-like, not {type(blob).__name__}") from None
            if not view.c_contiguous:
                raise ValueError("blob must be a C-contiguous buffer")
            data = view.cast("B").toreadonly() if view.ndim != 1 or view.format != "B" else view.toreadonly()
        if hash_len == 0 and len(data):
            raise ValueError("hash_len must be positive for a non-empty blob")
        if hash_len and len(data) % hash_len:
            raise ValueError(f"a blob of {len(data)} bytes is not a multiple of hash_len {hash_len}")
        self._blob = data
        self._hash_len = hash_len
        self._n = len(data) // hash_len if hash_len else 0

    @property
    def blob(self) -> bytes | memoryview:
        """The hashes as bytes: the ``bytes`` given, or a read-only byte ``memoryview`` of the buffer given."""
        return self._blob

    @property
    def hash_len(self) -> int:
        """Bytes per hash."""
        return self._hash_len

    def release(self) -> None:
        """Unlock the buffer (a ``bytearray`` may be resized again); the view is empty afterwards."""
        if isinstance(self._blob, memoryview):
            self._blob.release()
        self._blob = b""
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _item(self, index: int) -> BlockHash:
        offset = index * self._hash_len
        return self._blob[offset : offset + self._hash_len]
