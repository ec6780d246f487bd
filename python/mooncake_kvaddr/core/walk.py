"""The chunk walk of ``process_tokens`` in bounded windows (docs/address-rows.md, "The chunk walk").

``process_tokens`` is a generator, like the reference's: it reads a hash only when it yields its chunk. The native
walk (``_native.chunk_walk``) computes a walk's positions at once, so a walk is cut into windows of :data:`WINDOW`
chunks: memory stays bounded whatever the request (and a sequence's ``__len__`` claims), and a walk costs nothing
once the caller stops iterating. The first native call validates the arguments as one call over the whole walk.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any

from mooncake_kvaddr._native import chunk_walk

#: Chunks per native call.
WINDOW = 1 << 16

_ALL = (True,) * WINDOW


class _MaskWindow:
    """``mask[offset : offset + length]`` read item by item (a caller's ``__getitem__`` need not take slices)."""

    __slots__ = ("_length", "_mask", "_offset")

    def __init__(self, mask: Sequence[Any], offset: int, length: int) -> None:
        self._mask, self._offset, self._length = mask, offset, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self._length:
            raise IndexError(index)
        return self._mask[self._offset + index]


def walk_windows(
    token_len: int,
    n_hashes: int,
    block_size: int,
    hash_block_size: int,
    mask_num: int,
    chunk_mask: Sequence[Any] | None,
    put_step: int,
    put_step_rank: int,
) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """The ``(starts, ends, hash indices)`` lists of ``chunk_walk(...)`` (first chunk
    ``max(0, mask_num // block_size)``, ``chunk_mask`` relative to it), one triple per window of at most
    ``WINDOW`` chunks."""
    token_len = operator.index(token_len)
    mask_num = operator.index(mask_num)
    first = max(0, mask_num // block_size)
    stop = -(-token_len // block_size)
    mask_len = None if chunk_mask is None else len(chunk_mask)
    if mask_len is not None:
        stop = min(stop, first + mask_len)
    if stop - first <= WINDOW or n_hashes == 0:  # the common case: one call with the caller's own arguments
        yield chunk_walk(token_len, n_hashes, block_size, hash_block_size, mask_num, chunk_mask, put_step,
                         put_step_rank)
        return
    window_first = first
    window_mask_num = mask_num  # the first call gets the caller's value: it validates everything
    while window_first < stop:
        length = min(WINDOW, stop - window_first)
        window: Any  # a tuple, a list slice or a _MaskWindow
        if chunk_mask is None:
            window = _ALL[:length]
        elif type(chunk_mask) in (list, tuple):
            window = chunk_mask[window_first - first : window_first - first + length]
        else:
            window = _MaskWindow(chunk_mask, window_first - first, length)
        yield chunk_walk(token_len, n_hashes, block_size, hash_block_size, window_mask_num, window, put_step,
                         put_step_rank)
        window_first += length
        window_mask_num = window_first * block_size  # an exact multiple: the next window starts there
