"""KV-cache transfer between a worker's KV cache and the Mooncake store (SPEC.md §3).

:class:`KVTransfer` is the worker side of vLLM's Mooncake store connector, reduced to what moves bytes:

* :meth:`KVTransfer.register_kv_caches` registers the KV-cache regions (shared by every group),
* :meth:`KVTransfer.store` - the send thread's per-request work (§3.2): walk chunks, build keys, ask which
  exist, and put only the missing ones, with one ``prepare_values`` per group;
* :meth:`KVTransfer.load` - the receive thread's per-request work (§3.3): keys and regions per group,
  tp-rank rotation, one get, and the block ids of every chunk that failed;
* :meth:`KVTransfer.lookup` - how many leading tokens the store holds (§3.5, full attention);
* :meth:`KVTransfer.submit_store` / :meth:`KVTransfer.submit_load` hand requests to one send thread and
  ``num_recv_threads`` receive threads that share one queue; each returns a ``Future``.

The caches here are host buffers (numpy arrays); on a GPU host they would be device tensors registered the
same way (a base address and a per-block length per region).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .database import ChunkedTokenDatabase
from .hashes import BlockHash
from .store import BatchResult, MooncakeStore, Outcome, StoreError

__all__ = ["KVTransfer", "LoadResult", "StoreResult", "TransferRequest"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class TransferRequest:
    """One request's view of the KV cache.

    Attributes:
        req_id: the caller's request id (echoed in results).
        token_len: tokens to store or load (floored to the block size for stores and lookups).
        block_hashes: prefix-chained hashes, one per ``hash_block_size`` tokens.
        block_ids: per KV-cache group, the physical block id of each ``block_size`` block of the request
            (block 0 is vLLM's null block: chunks on it are never stored).
        skip_tokens: tokens at the start that need no transfer (store: already saved; load: computed
            locally), floored to the block size.
    """

    req_id: str
    token_len: int
    block_hashes: Sequence[BlockHash]
    block_ids: Sequence[Sequence[int]]
    skip_tokens: int = 0


@dataclass
class StoreResult:
    """What :meth:`KVTransfer.store` did for one request."""

    req_id: str
    chunks: int = 0  # chunks considered (after masking and NULL filtering)
    already_present: int = 0  # of those, found in the store and skipped
    stored: int = 0  # put successfully now
    failed_keys: list[str] = field(default_factory=list)
    back_pressure: bool = False  # the pool was full (-200): the caller should pause storing
    saved_tokens: int = 0  # tokens known to be in the store after this call (all or nothing)
    bytes: int = 0  # bytes put successfully
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase

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
    error: str | None = None  # set when the whole get raised
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every chunk was loaded."""
        return not self.failed_block_ids and self.error is None


class _Clock:
    """Accumulates wall time per phase (seconds)."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + (now - self._last)
        self._last = now


class KVTransfer:
    """Moves one worker's KV-cache chunks to and from a :class:`MooncakeStore`.

    Args:
        store: a ready store (the caller owns and closes it).
        databases: one :class:`ChunkedTokenDatabase` per KV-cache group, in group order.
        tp_rank: rotates each load's key order so that ranks do not hit the same segment at once.
        num_recv_threads: receive threads sharing one load queue (vLLM's ``VLLM_MOONCAKE_LOAD_RECV_THREADS``).
        replicate_config: Mooncake ``ReplicateConfig`` for puts (default: Mooncake's).
        start_threads: start the send/receive threads now (they are only needed by ``submit_*``).
    """

    def __init__(
        self,
        store: MooncakeStore,
        databases: Sequence[ChunkedTokenDatabase],
        *,
        tp_rank: int = 0,
        num_recv_threads: int = 1,
        replicate_config: Any = None,
        start_threads: bool = True,
    ) -> None:
        if not databases:
            raise ValueError("databases: need one ChunkedTokenDatabase per KV-cache group (at least one)")
        if tp_rank < 0:
            raise ValueError(f"tp_rank: must be >= 0, got {tp_rank}")
        if num_recv_threads < 1:
            raise ValueError(f"num_recv_threads: must be >= 1, got {num_recv_threads}")
        self._store = store
        self.databases = list(databases)
        self.tp_rank = tp_rank
        self.replicate_config = replicate_config
        # Stores and lookups use whole scheduler blocks: the lcm of the groups' block sizes.
        self.lcm_block_size = math.lcm(*(db.block_size for db in self.databases))
        self._regions: list[np.ndarray[Any, Any]] = []
        self._registered: list[int] = []
        self._back_pressure = threading.Event()
        self._send_queue: queue.Queue[tuple[TransferRequest, Future[StoreResult]] | None] = queue.Queue()
        self._recv_queue: queue.Queue[tuple[TransferRequest, Future[LoadResult]] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._num_recv_threads = num_recv_threads
        self._closed = False
        if start_threads:
            self.start()

    @property
    def mooncake_store(self) -> MooncakeStore:
        """The store this transfer drives."""
        return self._store

    # ------------------------------------------------------------------ regions

    def register_kv_caches(self, regions: Sequence[np.ndarray[Any, Any]], num_blocks: int) -> None:
        """Register host KV-cache regions: each a C-contiguous array whose first axis is the block index.

        Region ``i`` gets base address ``regions[i].ctypes.data`` and block length
        ``regions[i].nbytes // num_blocks``; every group's database receives the same two lists. Each
        buffer is registered with Mooncake once (needed for RDMA, harmless on TCP); the arrays are kept
        alive until :meth:`close`.
        """
        if self._regions:
            raise RuntimeError("register_kv_caches: regions are already registered")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        bases: list[int] = []
        block_lens: list[int] = []
        for i, region in enumerate(regions):
            if not isinstance(region, np.ndarray) or not region.flags.c_contiguous:
                raise TypeError(f"regions[{i}]: expected a C-contiguous numpy array")
            if region.nbytes == 0 or region.nbytes % num_blocks:
                raise ValueError(f"regions[{i}]: {region.nbytes} bytes is not a multiple of {num_blocks} blocks")
            bases.append(region.ctypes.data)
            block_lens.append(region.nbytes // num_blocks)
        for base, region in zip(bases, regions, strict=True):
            if base in self._registered:
                continue  # the same storage listed twice (a shared K/V buffer)
            self._store.register_buffer(base, region.nbytes)
            self._registered.append(base)
        self._regions = list(regions)
        for db in self.databases:
            db.set_kv_caches_base_addr(bases)
            db.set_block_len(block_lens)

    # ------------------------------------------------------------------ the three operations

    @property
    def back_pressure(self) -> bool:
        """True after a put hit a full pool (-200), until a later put fully succeeds."""
        return self._back_pressure.is_set()

    def store(self, request: TransferRequest) -> StoreResult:
        """Put the request's chunks that the store does not already hold (SPEC.md §3.2)."""
        clock = _Clock()
        result = StoreResult(request.req_id, timings=clock.timings)
        token_len = request.token_len // self.lcm_block_size * self.lcm_block_size
        if token_len <= 0:
            return result
        keys: list[str] = []
        chunks: list[tuple[int, int]] = []
        groups: list[int] = []
        for g, db in enumerate(self.databases):
            # The walk, the NULL-block and past-the-end filters and the keys, in one native pass.
            plan = db.plan_store(token_len, request.block_hashes, request.block_ids[g], request.skip_tokens)
            keys.extend(plan.keys)
            chunks.extend(plan.chunks)
            groups.extend([g] * len(plan.keys))
        result.chunks = len(keys)
        clock.lap("keys")
        if not keys:
            result.saved_tokens = token_len
            return result

        exists = self._store.batch_is_exist(keys)
        clock.lap("exist")
        missing = exists.failed  # absent or errored: put it (a duplicate put is harmless)
        result.already_present = len(keys) - len(missing)
        if not missing:
            result.saved_tokens = token_len
            return result

        put_keys = [keys[i] for i in missing]
        addrs, sizes, _ = self._prepare([chunks[i] for i in missing], [groups[i] for i in missing], request.block_ids)
        clock.lap("prepare")
        # Rows come from prepare_values, so the non-negativity scan would only cost time.
        put = self._store.batch_put_from_multi_buffers(
            put_keys, addrs, sizes, self.replicate_config, check_values=False
        )
        clock.lap("put")
        ok = put.present
        result.stored = sum(ok)
        result.failed_keys = [k for k, good in zip(put_keys, ok, strict=True) if not good]
        result.bytes = sum(sum(row) for row, good in zip(sizes, ok, strict=True) if good)
        result.back_pressure = put.back_pressure
        if put.back_pressure:
            self._back_pressure.set()
        elif put.ok:
            self._back_pressure.clear()
        if put.ok:
            result.saved_tokens = token_len
        else:
            logger.warning(
                "store %s: %d of %d puts failed: %s",
                request.req_id,
                len(result.failed_keys),
                len(put_keys),
                put.summary(),
            )
        return result

    def load(self, request: TransferRequest) -> LoadResult:
        """Get the request's chunks into their blocks; report which block ids failed (SPEC.md §3.3)."""
        clock = _Clock()
        result = LoadResult(request.req_id, timings=clock.timings)
        keys: list[str] = []
        addrs: list[Sequence[int]] = []
        sizes: list[Sequence[int]] = []
        block_ids: list[int] = []
        skip = request.skip_tokens // self.lcm_block_size * self.lcm_block_size
        for g, db in enumerate(self.databases):
            # The walk, the keys and the address/size rows, in one native pass per group.
            plan = db.plan_load(request.token_len, request.block_hashes, request.block_ids[g], skip)
            keys.extend(plan.keys)
            addrs.extend(plan.addrs)
            sizes.extend(plan.sizes)
            block_ids.extend(plan.block_ids)
        clock.lap("plan")
        if not keys:
            return result
        # Each rank starts at a different key so that ranks spread over the pool's segments.
        r = self.tp_rank % len(keys)
        if r:
            keys = keys[r:] + keys[:r]
            addrs = addrs[r:] + addrs[:r]
            sizes = sizes[r:] + sizes[:r]
            block_ids = block_ids[r:] + block_ids[:r]
        result.chunks = len(keys)
        clock.lap("rotate")
        try:
            got: BatchResult | None = self._store.batch_get_into_multi_buffers(keys, addrs, sizes, check_values=False)
        except (StoreError, ValueError, TypeError) as exc:
            got = None
            result.error = f"{type(exc).__name__}: {exc}"
            logger.warning("load %s: get failed: %s", request.req_id, result.error)
        clock.lap("get")
        if got is None:
            result.failed_block_ids = set(block_ids)
            return result
        result.outcomes = got.summary()
        result.bytes = got.bytes_transferred
        for block_id, outcome in zip(block_ids, got.outcomes, strict=True):
            if outcome is not Outcome.OK:
                result.failed_block_ids.add(block_id)
        result.loaded_block_ids = set(block_ids) - result.failed_block_ids
        return result

    def lookup(self, num_tokens: int, block_hashes: Sequence[BlockHash]) -> int:
        """Leading tokens of a ``num_tokens`` prompt that every group can load from the store (§3.5).

        Full attention: a group's hit is its longest run of present chunks from the start; the answer is
        the smallest over groups. A hit covering the whole prompt is cut back to the block boundary before
        its last token, which the model must recompute. Store errors count as a miss (returns 0).
        """
        token_len = num_tokens // self.lcm_block_size * self.lcm_block_size
        if not block_hashes or token_len <= 0:
            return 0
        keys: list[str] = []
        ends: list[list[int]] = []
        for db in self.databases:
            # Probe only chunks the hashes cover (process_tokens insists on it).
            covered = len(block_hashes) * db.hash_block_size // db.block_size * db.block_size
            group_ends = []
            for _start, end, chunk_hash in db.process_tokens(min(token_len, covered), block_hashes):
                keys.append(db.key_for(chunk_hash))
                group_ends.append(end)
            ends.append(group_ends)
        try:
            present = self._store.batch_is_exist(keys).present
        except (StoreError, ValueError, TypeError) as exc:
            logger.warning("lookup: batch_is_exist failed: %s", exc)
            return 0
        hit = token_len
        cursor = 0
        for group_ends in ends:
            group_hit = 0
            for offset, end in enumerate(group_ends):
                if not present[cursor + offset]:
                    break
                group_hit = end
            cursor += len(group_ends)
            hit = min(hit, group_hit)
        hit = hit // self.lcm_block_size * self.lcm_block_size  # loadable in whole scheduler blocks
        if hit >= num_tokens:
            # Full hit: recompute at least the last token (prefix chunks keep their hashes, no new RPC).
            hit = min(hit, (num_tokens - 1) // self.lcm_block_size * self.lcm_block_size)
        return max(hit, 0)

    # ------------------------------------------------------------------ threads

    def start(self) -> None:
        """Start the send thread and the receive threads (idempotent)."""
        if self._threads:
            return
        if self._closed:
            raise RuntimeError("KVTransfer is closed")
        self._threads.append(
            threading.Thread(
                target=self._serve,
                args=(self._send_queue, self.store),
                name="KVCacheStoreSendingThread",
                daemon=True,
            )
        )
        for i in range(self._num_recv_threads):
            self._threads.append(
                threading.Thread(
                    target=self._serve,
                    args=(self._recv_queue, self.load),
                    name=f"KVCacheStoreRecvingThread-{i}",
                    daemon=True,
                )
            )
        for thread in self._threads:
            thread.start()

    def submit_store(self, request: TransferRequest) -> Future[StoreResult]:
        """Queue a store on the send thread."""
        return self._submit(self._send_queue, request)

    def submit_load(self, request: TransferRequest) -> Future[LoadResult]:
        """Queue a load; the first free receive thread takes it."""
        return self._submit(self._recv_queue, request)

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued work, stop the threads, unregister the buffers. The store stays open."""
        if self._closed:
            return
        self._closed = True
        self._send_queue.put(None)
        for _ in range(self._num_recv_threads):
            self._recv_queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            raise TimeoutError(f"KVTransfer.close: threads still running after {timeout} s: {stuck}")
        if self._store.ready:
            for base in self._registered:
                try:
                    self._store.unregister_buffer(base)
                except StoreError as exc:
                    # Closing must not fail over bookkeeping; the registration dies with the client anyway.
                    logger.warning("KVTransfer.close: %s", exc)
        self._registered.clear()
        self._regions.clear()

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _submit(
        self, jobs: queue.Queue[tuple[TransferRequest, Future[_T]] | None], request: TransferRequest
    ) -> Future[_T]:
        if self._closed:
            raise RuntimeError("KVTransfer is closed")
        if not self._threads:
            raise RuntimeError("KVTransfer threads are not started (start_threads=False): call start()")
        future: Future[_T] = Future()
        jobs.put((request, future))
        return future

    @staticmethod
    def _serve(
        jobs: queue.Queue[tuple[TransferRequest, Future[_T]] | None], work: Callable[[TransferRequest], _T]
    ) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            request, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work(request))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def _prepare(
        self, chunks: list[tuple[int, int]], groups: list[int], block_ids: Sequence[Sequence[int]]
    ) -> tuple[list[Sequence[int]], list[Sequence[int]], list[int]]:
        """Address/size rows and first block ids of group-major chunks: one prepare_values per group."""
        addrs: list[Sequence[int]] = []
        sizes: list[Sequence[int]] = []
        ids: list[int] = []
        start = 0
        while start < len(chunks):
            g = groups[start]
            end = start
            while end < len(chunks) and groups[end] == g:
                end += 1
            a, s, b = self.databases[g].prepare_values(chunks[start:end], block_ids[g])
            addrs.extend(a)
            sizes.extend(s)
            ids.extend(b)
            start = end
        return addrs, sizes, ids
