"""KV-cache transfer between a worker's KV cache and the Mooncake store (SPEC.md §3).

:class:`KVTransfer` is the worker side of vLLM's Mooncake store connector, reduced to what moves bytes:

* :meth:`KVTransfer.register_kv_caches` registers the KV-cache regions (shared by every group),
* :meth:`KVTransfer.store` - the send thread's per-request work (§3.2): walk chunks, build keys, ask which
  exist, and put only the missing ones, with one ``prepare_values`` per group;
* :meth:`KVTransfer.load` - the receive thread's per-request work (§3.3): keys and regions per group,
  tp-rank rotation, one get, and the block ids of every chunk that failed;
* :meth:`KVTransfer.lookup` - how many leading tokens every group can load from the store, probing every rank
  namespace of the parallel layout (§1.4, §3.5; see :mod:`mooncake_kvaddr.driver.lookup`);
* :meth:`KVTransfer.submit_store` / :meth:`KVTransfer.submit_load` hand requests to one send thread and
  ``num_recv_threads`` receive threads that share one queue; each returns a ``Future``.

The caches here are host buffers (numpy arrays); on a GPU host they would be device tensors registered the
same way (a base address and a per-block length per region).

Transfer modes (``transfer_mode``, default ``StoreConfig.transfer_mode`` = ``"auto"``), resolved once by
:meth:`KVTransfer.register_kv_caches` and logged once:

* ``"multi_buffer"``: every key's regions go to Mooncake's ``batch_*_multi_buffers`` calls, whose binding
  converts each ``(address, size)`` pair with the GIL held and whose TCP path pays per region.
* ``"staged"``: each key moves through one contiguous slot of a bounded, pre-faulted :class:`StagingPool`
  (registered with Mooncake once): a native gather (GIL released) then ``batch_put_from``, or
  ``batch_get_into`` then a native scatter of only the keys that succeeded. Objects are the concatenation
  of their regions in both modes, so the modes interoperate.
* ``"auto"``: staged for host-memory caches with more than one region per key.

With one region per key (cross-layer layouts) ``"staged"`` and ``"auto"`` call ``batch_get_into`` /
``batch_put_from`` on the KV cache directly (mode ``"direct"``): there is nothing to gather.
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
import numpy.typing as npt

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.driver.config import TRANSFER_MODES
from mooncake_kvaddr.driver.lookup import GroupSpecLike, ParallelLayout, StoreLookup
from mooncake_kvaddr.driver.staging import (
    SLOT_ALIGNMENT,
    CopyBackend,
    HostCopyBackend,
    StagingLease,
    StagingPool,
    plan_batches,
    plan_slots,
)
from mooncake_kvaddr.driver.store import CODE_MASTER_UNREACHABLE, BatchResult, MooncakeStore, Outcome, StoreError

__all__ = ["KVTransfer", "LoadResult", "StoreResult", "TransferRequest"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

Int64Array = np.ndarray[Any, np.dtype[np.int64]]

# How long a staged request waits for room in a shared staging pool before it fails (a transfer in flight
# holds its lease for at most Mooncake's 60 s timeout per call).
_STAGING_WAIT_S = 300.0


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
    mode: str = ""  # "multi_buffer", "staged" or "direct" (empty when nothing was put)
    outcomes: dict[str, int] = field(default_factory=dict)  # per put key: Outcome value (or "gather_failed") -> count

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
    error: str | None = None  # set when a get (or a staged scatter) raised: its keys all count as failed
    timings: dict[str, float] = field(default_factory=dict)
    mode: str = ""  # "multi_buffer", "staged" or "direct"

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
        layout: the parallel layout (tp/pcp/dcp/pp sizes, KV heads) whose rank namespaces a lookup must all
            find a chunk in; ``None`` (default) looks only in each group's own namespace (single rank).
        group_specs: per group, what it caches for lookup: a :class:`~mooncake_kvaddr.driver.lookup.GroupSpec` or a
            kind (``"attention"``, ``"mla"``, ``"mamba"``, or a list of kinds for a uniform group); default:
            full attention everywhere.
        transfer_mode: ``"auto"``, ``"staged"`` or ``"multi_buffer"`` (see the module docstring); default
            ``store.config.transfer_mode``. Resolved by :meth:`register_kv_caches` (see :attr:`mode`).
        staging_pool: a :class:`~mooncake_kvaddr.driver.staging.StagingPool` to share with other transfers (the
            caller owns it); default: a staged transfer makes its own of ``store.config.staging_buffer_size``
            bytes, capped at what one request over these caches can need.
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
        layout: ParallelLayout | None = None,
        group_specs: Sequence[GroupSpecLike] | None = None,
        transfer_mode: str | None = None,
        staging_pool: StagingPool | None = None,
    ) -> None:
        if not databases:
            raise ValueError("databases: need one ChunkedTokenDatabase per KV-cache group (at least one)")
        if tp_rank < 0:
            raise ValueError(f"tp_rank: must be >= 0, got {tp_rank}")
        if num_recv_threads < 1:
            raise ValueError(f"num_recv_threads: must be >= 1, got {num_recv_threads}")
        requested = store.config.transfer_mode if transfer_mode is None else transfer_mode
        if requested not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode: must be one of {TRANSFER_MODES}, got {requested!r}")
        self.transfer_mode = requested
        self._store = store
        self.databases = list(databases)
        self.tp_rank = tp_rank
        self.replicate_config = replicate_config
        # Stores and lookups use whole scheduler blocks: the lcm of the groups' block sizes.
        self.lcm_block_size = math.lcm(*(db.block_size for db in self.databases))
        #: Lookup over every rank namespace (key prefixes built once, here).
        self.store_lookup = StoreLookup(self.databases, group_specs, layout)
        self._regions: list[np.ndarray[Any, Any]] = []
        self._registered: list[int] = []
        # Until register_kv_caches says otherwise (rows set on the databases by hand): today's path.
        self._mode = "multi_buffer"
        self._pool = staging_pool
        self._owns_pool = staging_pool is None
        self._pool_registered = False
        self._copy: CopyBackend | None = None
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

    @property
    def mode(self) -> str:
        """How keys move: ``"multi_buffer"``, ``"staged"`` or ``"direct"`` (one region per key).

        ``"multi_buffer"`` until :meth:`register_kv_caches` resolves :attr:`transfer_mode`: staging needs to
        know the registered buffers (every copy is bounds-checked against them).
        """
        return self._mode

    @property
    def staging_pool(self) -> StagingPool | None:
        """The staging pool in use (``None`` unless the mode is ``"staged"``)."""
        return self._pool if self._mode == "staged" else None

    @property
    def copy_backend(self) -> CopyBackend | None:
        """The backend that gathers and scatters staged keys (``None`` unless the mode is ``"staged"``); a
        :class:`~mooncake_kvaddr.driver.staging.HostCopyBackend` whose ``threads``/``streaming`` may be tuned."""
        return self._copy if self._mode == "staged" else None

    # ------------------------------------------------------------------ regions

    def register_kv_caches(self, regions: Sequence[np.ndarray[Any, Any]], num_blocks: int) -> None:
        """Register host KV-cache regions: each a C-contiguous array whose first axis is the block index.

        Region ``i`` gets base address ``regions[i].ctypes.data`` and block length
        ``regions[i].nbytes // num_blocks``; every group's database receives the same two lists. The arrays
        are kept alive until :meth:`close`.

        Resolves :attr:`transfer_mode` into :attr:`mode` and logs the choice. What Mooncake must reach is
        registered with it once (needed for RDMA, harmless on TCP): the KV-cache buffers in the
        ``"multi_buffer"`` and ``"direct"`` modes, only the staging pool in the ``"staged"`` mode (the KV
        caches are then touched by the native copy alone, bounds-checked against these buffers).
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
        # The same storage may be listed twice (a shared K/V buffer): each buffer counts once.
        buffers = dict(zip(bases, (region.nbytes for region in regions), strict=True))
        mode = self._resolve_mode(len(bases))
        if mode == "staged":
            self._start_staging(buffers, num_blocks)
        else:
            for base, nbytes in buffers.items():
                self._store.register_buffer(base, nbytes)
                self._registered.append(base)
        self._mode = mode
        self._log_mode(len(bases))
        self._regions = list(regions)
        for db in self.databases:
            db.set_kv_caches_base_addr(bases)
            db.set_block_len(block_lens)

    def _resolve_mode(self, regions_per_key: int) -> str:
        if self.transfer_mode == "multi_buffer" or regions_per_key == 0:
            return "multi_buffer"
        if regions_per_key == 1:
            return "direct"  # one contiguous region per key: nothing to gather
        # "staged", or "auto" with host memory (the only kind register_kv_caches takes).
        return "staged"

    def _start_staging(self, buffers: dict[int, int], num_blocks: int) -> None:
        """Create (or adopt) the staging pool, register it with the store, set up the host copy backend."""
        if self._pool is None:
            # One request never stages more than every block of every group, plus one slot's padding per key.
            needed = sum(buffers.values()) + SLOT_ALIGNMENT * num_blocks * len(self.databases)
            self._pool = StagingPool(min(self._store.config.staging_buffer_size, needed))
        self._pool.register_with(self._store)
        self._pool_registered = True
        self._copy = HostCopyBackend(list(buffers.items()))

    def _log_mode(self, regions_per_key: int) -> None:
        detail = f"{regions_per_key} regions per key, host memory"
        if self._mode == "staged" and self._pool is not None:
            detail += f", staging pool {self._pool.capacity / (1 << 20):.1f} MiB"
        logger.info("KVTransfer: transfer mode %s -> %s (%s)", self.transfer_mode, self._mode, detail)

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
        put_chunks = [chunks[i] for i in missing]
        put_groups = [groups[i] for i in missing]
        result.mode = self._mode
        if self._mode == "multi_buffer":
            addrs, sizes, _ = self._prepare(put_chunks, put_groups, request.block_ids)
            clock.lap("prepare")
            # Rows come from prepare_values, so the non-negativity scan would only cost time.
            put = self._store.batch_put_from_multi_buffers(
                put_keys, addrs, sizes, self.replicate_config, check_values=False
            )
            clock.lap("put")
            ok = put.present
            key_bytes = [sum(row) for row in sizes]
            result.outcomes = put.summary()
            result.back_pressure = put.back_pressure
        else:
            ok, key_bytes = self._put_contiguous(put_keys, put_chunks, put_groups, request.block_ids, clock, result)
        result.stored = sum(ok)
        result.failed_keys = [k for k, good in zip(put_keys, ok, strict=True) if not good]
        result.bytes = sum(n for n, good in zip(key_bytes, ok, strict=True) if good)
        if result.back_pressure:
            self._back_pressure.set()
        elif not result.failed_keys:
            self._back_pressure.clear()
        if not result.failed_keys:
            result.saved_tokens = token_len
        else:
            logger.warning(
                "store %s: %d of %d puts failed: %s",
                request.req_id,
                len(result.failed_keys),
                len(put_keys),
                result.outcomes,
            )
        return result

    def load(self, request: TransferRequest) -> LoadResult:
        """Get the request's chunks into their blocks; report which block ids failed (SPEC.md §3.3).

        Never raises for store trouble: a failed get (or staged scatter) is reported in ``error`` and
        every block id of the chunks it covered is in ``failed_block_ids``; no failed chunk's blocks are
        written from staging.
        """
        if self._mode == "multi_buffer":
            return self._load_multi_buffer(request)
        return self._load_contiguous(request)

    def _load_multi_buffer(self, request: TransferRequest) -> LoadResult:
        clock = _Clock()
        result = LoadResult(request.req_id, timings=clock.timings, mode="multi_buffer")
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

    def lookup(
        self,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        *,
        lookup_masks: Sequence[Sequence[bool] | None] | None = None,
    ) -> int:
        """Leading tokens of a ``num_tokens`` prompt that every group can load from the store (§3.5).

        Every rank namespace of the layout must hold a chunk (§1.4); all candidate keys go to the store in
        one ``batch_is_exist``. Groups combine as in vLLM's hybrid coordinator (full attention: the leading
        run of present chunks; sliding window: the window before the hit; Mamba: the state at the hit). A
        hit covering the whole prompt is re-derived one token shorter, which the model must recompute,
        without another RPC. ``lookup_masks`` optionally replaces the per-group chunk masks (absolute chunk
        ids; a masked chunk is neither read nor probed). Store errors count as a miss (returns 0).
        """
        return self.store_lookup.lookup(self._store, num_tokens, block_hashes, lookup_masks=lookup_masks)

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
        if self._pool_registered and self._pool is not None:
            self._pool_registered = False
            try:
                self._pool.unregister_from(self._store)  # a shared pool stays registered for the others
            except StoreError as exc:
                logger.warning("KVTransfer.close: staging pool: %s", exc)
        if self._owns_pool:
            self._pool = None  # frees the buffer once no request holds a lease
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

    # ------------------------------------------------------------------ contiguous paths (staged, direct)

    def _prepare_arrays(
        self, chunks: Sequence[Sequence[int]] | Int64Array, groups: Sequence[int], block_ids: Sequence[Sequence[int]]
    ) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The address/size matrix and first block ids as int64 arrays: one native call per run of a group."""
        parts = [
            self.databases[g].prepare_values_array(chunks[start:end], block_ids[g])
            for g, start, end in _group_runs(groups)
        ]
        if len(parts) == 1:
            return parts[0]
        addrs, sizes, ids = zip(*parts, strict=True)
        return np.concatenate(addrs), np.concatenate(sizes), np.concatenate(ids)

    def _lease_for(self, object_sizes: Int64Array, total_bytes: int) -> StagingLease:
        """A lease of the staging pool: the whole request if it fits, else as much as is free (>= one key)."""
        assert self._pool is not None
        largest = int(object_sizes.max()) if len(object_sizes) else 0
        return self._pool.acquire(largest, total_bytes, timeout=_STAGING_WAIT_S)

    def _put_contiguous(
        self,
        keys: list[str],
        chunks: list[tuple[int, int]],
        groups: list[int],
        block_ids: Sequence[Sequence[int]],
        clock: _Clock,
        result: StoreResult,
    ) -> tuple[list[bool], list[int]]:
        """Put through staging slots (or straight from the cache with one region per key).

        Returns per key: stored or not, and its object size. A batch whose gather fails is never put.
        """
        addrs, sizes, _ = self._prepare_arrays(chunks, groups, block_ids)
        clock.lap("prepare")
        if self._mode == "direct":
            put = self._store.batch_put_from(
                keys, addrs[:, 0].tolist(), sizes[:, 0].tolist(), self.replicate_config, check_values=False
            )
            clock.lap("put")
            result.outcomes = put.summary()
            result.back_pressure = put.back_pressure
            return put.present, sizes[:, 0].tolist()

        assert self._copy is not None
        plan = plan_slots(sizes)
        ok = [False] * len(keys)
        with self._lease_for(plan.object_sizes, plan.total_bytes) as lease:
            clock.lap("staging_wait")
            for start, end in plan_batches(plan, lease.nbytes):
                slots = plan.offsets[start:end] - plan.offsets[start]
                try:
                    self._copy.gather(addrs[start:end], sizes[start:end], lease.range, slots)
                except (ValueError, RuntimeError) as exc:
                    clock.lap("gather")
                    logger.warning("store %s: gather of keys %d..%d failed: %s", result.req_id, start, end - 1, exc)
                    _count(result.outcomes, "gather_failed", end - start)
                    continue
                clock.lap("gather")
                put = self._store.batch_put_from(
                    keys[start:end],
                    (slots + lease.ptr).tolist(),
                    plan.object_sizes[start:end].tolist(),
                    self.replicate_config,
                    check_values=False,
                )
                clock.lap("put")
                ok[start:end] = put.present
                for outcome, count in put.summary().items():
                    _count(result.outcomes, outcome, count)
                result.back_pressure = result.back_pressure or put.back_pressure
                if CODE_MASTER_UNREACHABLE in put.codes and end < len(keys):
                    # Every further batch would block only to report the same.
                    _count(result.outcomes, Outcome.MASTER_UNREACHABLE.value, len(keys) - end)
                    break
        return ok, plan.object_sizes.tolist()

    def _plan_load_arrays(
        self, request: TransferRequest, skip: int
    ) -> tuple[list[str], Int64Array, Int64Array, Int64Array]:
        """Keys, address/size matrix and first block ids of a load, in the rank's rotated order."""
        keys: list[str] = []
        chunk_parts: list[Int64Array] = []
        groups: list[int] = []
        for g, db in enumerate(self.databases):
            walk = db.walk_load(request.token_len, request.block_hashes, skip)
            keys.extend(walk.keys)
            chunk_parts.append(walk.chunks)
            groups.extend([g] * len(walk.keys))
        if not keys:
            empty = np.zeros((0, 0), dtype=np.int64)
            return keys, empty, empty, np.zeros(0, dtype=np.int64)
        chunks = chunk_parts[0] if len(chunk_parts) == 1 else np.concatenate(chunk_parts)
        # Rotate the chunks (two ints each), not the rows: the rows are then computed in the rotated order.
        r = self.tp_rank % len(keys)
        if r:
            keys = keys[r:] + keys[:r]
            chunks = np.concatenate((chunks[r:], chunks[:r]))
            groups = groups[r:] + groups[:r]
        addrs, sizes, block_ids = self._prepare_arrays(chunks, groups, request.block_ids)
        return keys, addrs, sizes, block_ids

    def _load_contiguous(self, request: TransferRequest) -> LoadResult:
        clock = _Clock()
        result = LoadResult(request.req_id, timings=clock.timings, mode=self._mode)
        skip = request.skip_tokens // self.lcm_block_size * self.lcm_block_size
        keys, addrs, sizes, block_ids = self._plan_load_arrays(request, skip)
        clock.lap("plan")
        if not keys:
            return result
        result.chunks = len(keys)
        loaded = np.zeros(len(keys), dtype=bool)
        try:
            if self._mode == "direct":
                expected = sizes[:, 0]
                got = self._store.batch_get_into(keys, addrs[:, 0].tolist(), expected.tolist(), check_values=False)
                clock.lap("get")
                result.outcomes = got.summary()
                loaded = _read_whole(got, expected)
            else:
                self._get_staged(keys, addrs, sizes, clock, result, loaded)
        except (StoreError, ValueError, TypeError, TimeoutError, RuntimeError) as exc:
            # Keys not yet scattered stay unloaded; a staged get never writes the cache itself.
            result.error = f"{type(exc).__name__}: {exc}"
            logger.warning("load %s: %s", request.req_id, result.error)
            clock.lap("failed")
        result.bytes = int(sizes[loaded].sum())
        failed = set(block_ids[~loaded].tolist())
        result.failed_block_ids = failed
        result.loaded_block_ids = set(block_ids.tolist()) - failed
        return result

    def _get_staged(
        self,
        keys: list[str],
        addrs: Int64Array,
        sizes: Int64Array,
        clock: _Clock,
        result: LoadResult,
        loaded: npt.NDArray[np.bool_],
    ) -> None:
        """Get into staging slots, then scatter only the keys read whole; marks them in ``loaded``."""
        assert self._copy is not None
        plan = plan_slots(sizes)
        with self._lease_for(plan.object_sizes, plan.total_bytes) as lease:
            clock.lap("staging_wait")
            for start, end in plan_batches(plan, lease.nbytes):
                slots = plan.offsets[start:end] - plan.offsets[start]
                expected = plan.object_sizes[start:end]
                got = self._store.batch_get_into(
                    keys[start:end], (slots + lease.ptr).tolist(), expected.tolist(), check_values=False
                )
                clock.lap("get")
                for outcome, count in got.summary().items():
                    _count(result.outcomes, outcome, count)
                whole = _read_whole(got, expected)
                if whole.any():
                    # Only keys read whole: a failed key's slot holds stale bytes of an earlier request.
                    self._copy.scatter(addrs[start:end], sizes[start:end], lease.range, slots, select=whole)
                loaded[start:end] = whole
                clock.lap("scatter")
                if CODE_MASTER_UNREACHABLE in got.codes and end < len(keys):
                    _count(result.outcomes, Outcome.MASTER_UNREACHABLE.value, len(keys) - end)
                    break


def _group_runs(groups: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` of each maximal run of equal group ids, in order."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(groups) + 1):
        if i == len(groups) or groups[i] != groups[start]:
            runs.append((groups[start], start, i))
            start = i
    return runs


def _read_whole(got: BatchResult, expected: Int64Array) -> npt.NDArray[np.bool_]:
    """Per key: the get succeeded and read exactly the object size asked for."""
    codes = np.asarray(got.codes, dtype=np.int64)
    whole: npt.NDArray[np.bool_] = (codes == expected) & (codes > 0)
    return whole


def _count(counts: dict[str, int], outcome: str, n: int) -> None:
    counts[outcome] = counts.get(outcome, 0) + n
