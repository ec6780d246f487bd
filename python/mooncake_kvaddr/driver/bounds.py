"""What ``KVTransfer.register_kv_caches`` registered, and the checks that keep every address inside it.

A block id outside ``[0, num_blocks)`` would hand Mooncake an address outside the KV cache; these checks screen
each request's block ids and the databases' regions before any Mooncake call, in every transfer mode
(docs/transfer-modes.md, "Safety").
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.database import ChunkedTokenDatabase

__all__ = ["RegisteredCaches", "Screened"]


def _exact_ints(values: object) -> bool:
    """``values`` is a ``list`` (not a subclass) of ``int`` objects (not subclasses, not bools)."""
    return type(values) is list and all(type(v) is int for v in values)


@dataclass(frozen=True)
class Screened:
    """A snapshot of one group's block ids and which positions hold an invalid id (position -> reason)."""

    ids: list[int]
    bad: dict[int, str]


@dataclass(frozen=True)
class RegisteredCaches:
    """The registered KV-cache regions: ``num_blocks`` blocks of ``block_lens[r]`` bytes from ``bases[r]``."""

    num_blocks: int
    bases: tuple[int, ...]
    block_lens: tuple[int, ...]
    #: Distinct buffers as ``(ptr, nbytes)`` (a region listed twice counts once).
    buffers: tuple[tuple[int, int], ...]
    #: ``buffers`` as the native module's range set, converted once (not per check).
    ranges: _native.MemoryRanges = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", _native.memory_ranges(self.buffers))

    @classmethod
    def from_regions(cls, regions: Sequence[np.ndarray[Any, Any]], num_blocks: int) -> RegisteredCaches:
        """Validate host regions (C-contiguous arrays, a whole number of blocks each) and describe them."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise TypeError(f"num_blocks: expected an int, got {type(num_blocks).__name__}")
        num_blocks = int(num_blocks)
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if len(regions) == 0:
            # Refused here, not at the first store ("key 0: no regions") or load: every key needs a region.
            raise ValueError("regions: no KV-cache regions to register; pass at least one array")
        bases: list[int] = []
        lens: list[int] = []
        buffers: dict[int, int] = {}
        for i, region in enumerate(regions):
            if not isinstance(region, np.ndarray) or not region.flags.c_contiguous:
                raise TypeError(f"regions[{i}]: expected a C-contiguous numpy array")
            if region.dtype.hasobject:
                # Its bytes are object pointers: a store would put process addresses into the shared pool.
                raise TypeError(f"regions[{i}]: an array of Python objects is not KV-cache memory")
            if not region.flags.writeable:
                # A load writes into every registered region (read-only memory: corrupted or a fault in Mooncake).
                raise ValueError(f"regions[{i}]: read-only array: loads write into the registered KV caches")
            if region.nbytes == 0 or region.nbytes % num_blocks:
                raise ValueError(f"regions[{i}]: {region.nbytes} bytes is not a multiple of {num_blocks} blocks")
            base = int(region.ctypes.data)
            bases.append(base)
            lens.append(region.nbytes // num_blocks)
            buffers[base] = max(buffers.get(base, 0), int(region.nbytes))
        return cls(num_blocks, tuple(bases), tuple(lens), tuple(buffers.items()))

    @property
    def regions_per_key(self) -> int:
        """Regions (segments) each key moves."""
        return len(self.bases)

    def problem(self, block_id: int) -> str:
        """Why ``block_id`` is not a registered block."""
        return f"block id {block_id} is outside the registered blocks [0, {self.num_blocks})"

    def screen(self, block_ids: Sequence[int]) -> Screened:
        """Copy ``block_ids`` (later edits by the caller change nothing) and find the out-of-range ids.

        Non-integer ids, and containers that are not sequences of ids (a dict, a set, a string), raise
        ``TypeError`` (a caller bug, not a block to report).
        """
        if isinstance(block_ids, (dict, set, frozenset, str, bytes, bytearray)):
            raise TypeError(f"block_ids: expected a sequence of ints, got {type(block_ids).__name__}")
        # Each id becomes an exact int once, here, and only that value is checked and planned with: an int
        # subclass whose comparisons lie, or an __index__ that answers differently the next time, must not
        # pass the range check with one value and reach Mooncake with another. An integer array's tolist()
        # already gives exact ints. (A bool counts as the int it is, as in the native entry points and in
        # vLLM's list indexing.)
        ids: list[int]
        if isinstance(block_ids, np.ndarray) and block_ids.dtype.kind in "iu":
            ids = block_ids.tolist()
        else:
            raw: Any = block_ids
            if isinstance(block_ids, np.ndarray):
                raw = block_ids.tolist()
            elif type(block_ids) not in (list, tuple):
                raw = list(block_ids)  # one pass over the caller's object: a snapshot
            try:
                ids = list(map(operator.index, raw))
            except TypeError:
                for i, value in enumerate(raw):
                    if not hasattr(type(value), "__index__"):
                        raise TypeError(f"block_ids[{i}]: expected an int, got {type(value).__name__}") from None
                raise  # an __index__ of the caller's raised it: unchanged
        # The common case: none, or two C-level passes over exact ints find every id in range.
        if not ids or (min(ids) >= 0 and max(ids) < self.num_blocks):
            return Screened(ids, {})
        bad: dict[int, str] = {}
        for i, value in enumerate(ids):
            if not 0 <= value < self.num_blocks:
                bad[i] = self.problem(value)
        return Screened(ids, bad)

    def check_databases(self, databases: Sequence[ChunkedTokenDatabase]) -> None:
        """Raise ``ValueError`` unless every database holds exactly the registered regions."""
        bases, lens = list(self.bases), list(self.block_lens)
        for g, db in enumerate(databases):
            # Exact lists of exact ints only: a list or int subclass can make == say yes while the native code
            # reads other values (its stored items, an int's real value), which would then reach Mooncake.
            now_bases, now_lens = db.kv_caches_base_addr, db.block_len
            if not (_exact_ints(now_bases) and _exact_ints(now_lens)) or now_bases != bases or now_lens != lens:
                raise ValueError(
                    f"databases[{g}]: its regions changed after register_kv_caches; refusing to move bytes "
                    "outside the registered KV caches"
                )

    def check_templates(self, templates: Sequence[Sequence[Sequence[int]]], shard_ids: Sequence[int]) -> None:
        """Raise ``ValueError`` unless, per store shard, every ``(base, block stride, size)`` segment of a
        TP-shared layout's templates keeps the slices of every registered block (ids ``[0, num_blocks)``, which
        :meth:`screen` enforces) inside one registered buffer: a layout re-registered over other tensors would
        otherwise move process memory that was never registered."""
        last = self.num_blocks - 1
        for shard, (bases, strides, sizes) in zip(shard_ids, templates, strict=True):
            for segment, (base, stride, size) in enumerate(zip(bases, strides, sizes, strict=True)):
                if size == 0:
                    continue
                low = base + min(0, last * stride)
                high = base + max(0, last * stride) + size
                if size < 0 or not any(ptr <= low and high <= ptr + n for ptr, n in self.buffers):
                    raise ValueError(
                        f"store shard {shard} segment {segment}: its slices [{low:#x}, {high:#x}) lie outside the "
                        "KV caches registered with the transfer (was the layout re-registered after "
                        "register_kv_caches?); refusing to move bytes outside them"
                    )

    def slices_inside(self, addrs: np.ndarray[Any, Any], sizes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Per key (row of an ``(n, regions)`` int64 matrix): every slice lies inside a registered buffer (the
        native module's one range set, ``csrc/kvaddr/ranges.hpp``)."""
        if addrs.size == 0:
            return np.ones(addrs.shape[0], dtype=bool)
        cells = _native.slices_inside(addrs, sizes, self.ranges)
        inside: np.ndarray[Any, Any] = np.all(cells, axis=1)
        return inside
