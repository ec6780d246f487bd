"""What a transfer request carries in and what it reports back (see ``docs/transfer-modes.md``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_kvaddr.core.hashes import BlockHash

__all__ = ["Clock", "LoadResult", "StoreResult", "TransferRequest", "count"]


@dataclass(frozen=True)
class TransferRequest:
    """One request's view of the KV cache.

    Attributes:
        req_id: the caller's request id (echoed in results).
        token_len: tokens to store or load (floored to the block size for stores and lookups).
        block_hashes: prefix-chained hashes, one per ``hash_block_size`` tokens.
        block_ids: per KV-cache group, the physical block id of each ``block_size`` block of the request
            (block 0 is vLLM's null block: chunks on it are never stored). Ids outside the registered
            ``[0, num_blocks)`` are never transferred: their chunks are reported failed / not stored.
        skip_tokens: tokens at the start that need no transfer (store: already saved; load: computed
            locally), floored to the block size.
        tail_key_boundaries: loads of a transfer over vLLM 0.33-style layout databases only: per KV-cache
            group at most one
            ``(group_id, num_tokens)`` pair (or an object with those attributes, like the lookup's
            ``TailKeyBoundary``); that group's chunk ending at ``token_len`` is keyed by
            ``block_hashes[num_tokens // hash_block_size - 1]``, as vLLM 0.33's receive thread does
            (docs/vllm.md, "Driver"). Carried by ``submit_load`` to the receive thread like the rest of the
            request.
    """

    req_id: str
    token_len: int
    block_hashes: Sequence[BlockHash]
    block_ids: Sequence[Sequence[int]]
    skip_tokens: int = 0
    tail_key_boundaries: Sequence[Any] = ()


@dataclass
class StoreResult:
    """What :meth:`KVTransfer.store` did for one request."""

    req_id: str
    chunks: int = 0  # chunks considered (after masking and NULL filtering)
    already_present: int = 0  # of those, found in the store and skipped
    stored: int = 0  # put successfully now
    failed_keys: list[str] = field(default_factory=list)  # not in the store: failed puts and invalid block ids
    back_pressure: bool = False  # the pool was full (-200): the caller should pause storing
    saved_tokens: int = 0  # tokens known to be in the store after this call (all or nothing)
    bytes: int = 0  # bytes put successfully
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    mode: str = ""  # "multi_buffer", "staged" or "direct" (empty when nothing was put)
    outcomes: dict[str, int] = field(default_factory=dict)  # per put key: Outcome value (or "gather_failed") -> count
    #: Block ids outside the registered blocks, with the reason: their chunks were never put.
    invalid_block_ids: dict[int, str] = field(default_factory=dict)
    #: Why the request stopped before trying every key: its deadline passed, or a call waited out Mooncake's
    #: transfer timeout (a hung peer); the keys not tried are in ``failed_keys`` and counted
    #: ``transfer_failed`` (docs/transfer-modes.md, "Deadlines"). ``None`` when every key was tried.
    stopped: str | None = None

    @property
    def ok(self) -> bool:
        """Every chunk is in the store now."""
        return not self.failed_keys


@dataclass
class LoadResult:
    """What :meth:`KVTransfer.load` did for one request.

    ``loaded_block_ids`` holds only blocks whose every chunk transfer succeeded; any block id touched by a
    failed key is in ``failed_block_ids`` instead (vLLM recomputes those blocks).
    """

    req_id: str
    chunks: int = 0
    loaded_block_ids: set[int] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)
    bytes: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # Outcome value -> count
    error: str | None = None  # set when planning or a get raised: its keys all count as failed
    timings: dict[str, float] = field(default_factory=dict)
    mode: str = ""  # "multi_buffer", "staged" or "direct"
    #: Block ids outside the registered blocks, with the reason: never transferred, also in failed_block_ids.
    invalid_block_ids: dict[int, str] = field(default_factory=dict)
    #: Why the request stopped before trying every key: its deadline passed, or a call waited out Mooncake's
    #: transfer timeout (a hung peer); the blocks of the keys not tried are in ``failed_block_ids`` and the
    #: keys counted ``transfer_failed`` (docs/transfer-modes.md, "Deadlines"). ``None`` when every key was tried.
    stopped: str | None = None

    @property
    def ok(self) -> bool:
        """Every chunk was loaded."""
        return not self.failed_block_ids and self.error is None


class Clock:
    """Accumulates wall time per phase (seconds)."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + (now - self._last)
        self._last = now


def count(counts: dict[str, int], outcome: str, n: int) -> None:
    """Add ``n`` to ``counts[outcome]``."""
    if n:
        counts[outcome] = counts.get(outcome, 0) + n
