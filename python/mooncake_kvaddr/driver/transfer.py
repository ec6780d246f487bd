"""KV-cache transfer between a worker's KV cache and the Mooncake store (docs/transfer-modes.md).

:class:`KVTransfer` is the worker side of vLLM's Mooncake store connector, reduced to what moves bytes: register,
store, load, lookup and the transfer threads. Registration and release are in ``transfer_register``, the request
logic in ``transfer_requests``; each transfer mode is a path of :mod:`~mooncake_kvaddr.driver.paths`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar

import numpy as np

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.layouts import LayoutTokenDatabase
from mooncake_kvaddr.driver.config import TRANSFER_MODES
from mooncake_kvaddr.driver.gate import CallGate, GateState
from mooncake_kvaddr.driver.groups import LayoutGroup, group_databases
from mooncake_kvaddr.driver.lookup import GroupSpecLike, LookupResult, ParallelLayout, StoreLookup
from mooncake_kvaddr.driver.paths import TransferPath
from mooncake_kvaddr.driver.probe import PeerProbe
from mooncake_kvaddr.driver.results import LoadResult, StoreResult, TransferRequest
from mooncake_kvaddr.driver.rules import OperationRecorder, RecordOperation
from mooncake_kvaddr.driver.staging import StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore, StoreClosedError
from mooncake_kvaddr.driver.transfer_requests import TransferRequests
from mooncake_kvaddr.driver.values import as_index, check_bool
from mooncake_kvaddr.driver.workers import TransferThreads

__all__ = ["KVTransfer", "LoadResult", "StoreResult", "TransferRequest"]

_T = TypeVar("_T")


class KVTransfer(TransferRequests):
    """Moves one worker's KV-cache chunks to and from a :class:`MooncakeStore`.

    Args:
        store: a ready store (the caller owns and closes it).
        databases: one database per KV-cache group, in group order: each a :class:`ChunkedTokenDatabase`, or
            each a vLLM 0.33-style one (``integrations.vllm.data.ChunkedTokenDatabase``, any ``store_layout``;
            docs/vllm.md, "Driver"), whose keys are one per chunk and local shard id.
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
            ``store.config.transfer_mode``; ``"multi_buffer"``, and nothing else, with a TP-shared layout.
            Resolved by :meth:`register_kv_caches` (see :attr:`mode`).
        staging_pool: a :class:`~mooncake_kvaddr.driver.staging.StagingPool` to share with other transfers (the
            caller owns it); default: a staged transfer makes its own of ``store.config.staging_buffer_size``
            bytes, capped at what one request over these caches can need.
        record_operation: optional metrics callback with vLLM's ``record_operation`` keywords (``operation``,
            ``duration_seconds``, ``num_keys``, ``num_bytes``, ``status``, ``num_failed_keys``), called once per
            Mooncake call: ``"save_exists"``, ``"save_put"``, ``"load_get"`` (see
            :class:`~mooncake_kvaddr.driver.rules.OperationRecorder`). vLLM's
            ``MooncakeStoreConnectorStats().record_operation`` fits as is.
        disk_offload_buffer_budget_bytes: when the store offloads to disk, the bytes of its staging buffer: a
            load is then split into sub-batches whose estimated staging bytes fit
            ``disk_offload_usable_ratio`` of it, and a single key that exceeds the whole budget fails the whole
            request (see :func:`~mooncake_kvaddr.driver.rules.split_by_staging_budget`). ``None``: no splitting.
        disk_offload_usable_ratio: the share of the budget one sub-batch may use (vLLM's default 0.9).
        local_copy: for ``"auto"``: whether Mooncake moves this transfer's bytes by an in-process copy (the
            only segment is in this process) rather than over the network; ``None`` (default) infers it from
            the store's configuration (:func:`~mooncake_kvaddr.driver.rules.copies_in_memory`).
        probe_peers: whether a multi-buffer or direct load first asks the master where its keys live and
            proves each peer it has not read from yet responsive with a small read it can abandon at the
            request's deadline (:mod:`~mooncake_kvaddr.driver.probe`): a hung peer then costs the load its
            deadline, not ~61 s per key. ``None`` (default): on unless Mooncake copies in memory (see
            ``local_copy``). Staged loads need no probe: their calls are abandoned at the deadline themselves.
    """

    def __init__(
        self,
        store: MooncakeStore,
        databases: Sequence[ChunkedTokenDatabase] | Sequence[LayoutTokenDatabase],
        *,
        tp_rank: int = 0,
        num_recv_threads: int = 1,
        replicate_config: Any = None,
        start_threads: bool = True,
        layout: ParallelLayout | None = None,
        group_specs: Sequence[GroupSpecLike] | None = None,
        transfer_mode: str | None = None,
        staging_pool: StagingPool | None = None,
        record_operation: RecordOperation | Callable[..., None] | None = None,
        disk_offload_buffer_budget_bytes: int | None = None,
        disk_offload_usable_ratio: float = 0.9,
        local_copy: bool | None = None,
        probe_peers: bool | None = None,
    ) -> None:
        if not databases:
            raise ValueError("databases: need one ChunkedTokenDatabase per KV-cache group (at least one)")
        tp_rank = as_index("tp_rank", tp_rank)
        if tp_rank < 0:
            raise ValueError(f"tp_rank: must be >= 0, got {tp_rank}")
        groups, transfer_mode = group_databases(databases, transfer_mode)
        requested = store.config.transfer_mode if transfer_mode is None else transfer_mode
        if requested not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode: must be one of {TRANSFER_MODES}, got {requested!r}")
        if disk_offload_buffer_budget_bytes is not None:
            disk_offload_buffer_budget_bytes = as_index("disk_offload_buffer_budget_bytes",
                                                        disk_offload_buffer_budget_bytes)
        if disk_offload_buffer_budget_bytes is not None and disk_offload_buffer_budget_bytes <= 0:
            raise ValueError(f"disk_offload_buffer_budget_bytes: must be > 0, got {disk_offload_buffer_budget_bytes}")
        ratio_kind = type(disk_offload_usable_ratio)
        if ratio_kind is bool or not issubclass(ratio_kind, (int, float, np.integer, np.floating)):
            raise TypeError(f"disk_offload_usable_ratio: expected a number, got {ratio_kind.__name__}")
        if not 0 < disk_offload_usable_ratio <= 1:
            raise ValueError(f"disk_offload_usable_ratio: must be in (0, 1], got {disk_offload_usable_ratio}")
        self.transfer_mode = requested
        self.disk_offload_buffer_budget_bytes = disk_offload_buffer_budget_bytes
        self.disk_offload_usable_ratio = disk_offload_usable_ratio
        self._store = store
        #: Per group, the database the paths plan with (a layout database's :class:`LayoutGroup`).
        self.databases: list[Any] = groups
        self.tp_rank = tp_rank
        self.replicate_config = replicate_config
        # Stores and lookups use whole scheduler blocks: the lcm of the groups' block sizes.
        self.lcm_block_size = math.lcm(*(db.block_size for db in self.databases))
        #: Lookup over every rank namespace (key prefixes built once, here).
        layouts = [g.layout for g in groups if isinstance(g, LayoutGroup)]
        self.store_lookup = (
            StoreLookup.from_prefix_sources(groups, layouts, group_specs, layout)
            if layouts else StoreLookup(groups, group_specs, layout)
        )
        self._metrics = OperationRecorder(record_operation)
        self._regions: list[np.ndarray[Any, Any]] = []
        self._registered: list[int] = []
        self._local_copy = None if local_copy is None else check_bool("local_copy", local_copy)
        self._probe_peers = None if probe_peers is None else check_bool("probe_peers", probe_peers)
        self._probe: PeerProbe | None = None
        self._pinned: list[Any] = []  # databases whose regions this transfer pinned (unpinned by close)
        # No path until register_kv_caches: every block id is checked against the registered caches.
        self._get_path: TransferPath | None = None
        self._put_path: TransferPath | None = None
        self._pool = staging_pool
        self._owns_pool = staging_pool is None
        self._pool_registered = False
        self._back_pressure = threading.Event()
        self._workers: TransferThreads[TransferRequest, StoreResult, LoadResult] = TransferThreads(
            partial(self._admitted, self._store_request, queued=True),
            partial(self._admitted, self._load_request, queued=True),
            num_recv_threads,
        )
        self._gate = CallGate("KVTransfer")
        # Orders queueing against close(): a job queued before close() began runs, one after it is refused.
        self._queue_lock = threading.Lock()
        if check_bool("start_threads", start_threads):
            self.start()

    @property
    def mooncake_store(self) -> MooncakeStore:
        """The store this transfer drives."""
        return self._store

    # ------------------------------------------------------------------ regions

    def register_kv_caches(self, regions: Sequence[Any], num_blocks: int) -> None:
        """Register host KV-cache regions: each a C-contiguous array whose first axis is the block index.

        Over layout databases, ``regions`` are the KV caches as CPU tensors (numpy arrays too for rank-local
        layouts): every TP-shared layout first derives its segment templates from them (``register_kv_caches``
        of the layout, with its packed-shape checks), and each cache is registered as its host memory, in its
        physical order (docs/vllm.md, "Driver").

        Region ``i`` gets base address ``regions[i].ctypes.data`` and block length
        ``regions[i].nbytes // num_blocks``; every group's database receives the same two lists. The arrays
        are kept alive until :meth:`close`.

        Resolves :attr:`transfer_mode` into :attr:`mode` and logs the choice. What Mooncake must reach is
        registered with it once (needed for RDMA, harmless on TCP): the KV-cache buffers in the
        ``"multi_buffer"`` and ``"direct"`` modes, only the staging pool in the ``"staged"`` mode (the KV
        caches are then touched by the native copy alone, bounds-checked against these buffers).
        """
        self._admitted(self._register, regions, num_blocks)

    # ------------------------------------------------------------------ the three operations

    @property
    def back_pressure(self) -> bool:
        """True after a put hit a full pool (-200), until a later put fully succeeds."""
        return self._back_pressure.is_set()

    def store(self, request: TransferRequest) -> StoreResult:
        """Put the request's chunks that the store does not already hold.

        Within the request's deadline (``StoreConfig.request_timeout_s``): keys not tried once it passed, or
        after a call waited out Mooncake's transfer timeout, are in ``failed_keys`` and ``stopped`` says why.
        """
        return self._admitted(self._store_request, request)

    def load(self, request: TransferRequest) -> LoadResult:
        """Get the request's chunks into their blocks; report which block ids failed.

        Never raises for store trouble (the error policy of :data:`~mooncake_kvaddr.driver.rules.LOAD_ERRORS`):
        a failed get (or staged scatter) is reported in ``error`` and every block id of the chunks it covered
        is in ``failed_block_ids``; no failed chunk's blocks are written from staging. The request has a
        deadline (``StoreConfig.request_timeout_s``, from when it starts running): keys not tried before it
        passed, or after a call waited out Mooncake's transfer timeout, fail too, and ``stopped`` says why.
        Raises :class:`~mooncake_kvaddr.driver.store.StoreClosedError` after :meth:`close`, and
        ``TypeError``/``ValueError`` for ``tail_key_boundaries`` that are malformed or name no group (on a
        transfer over seed-era databases any boundary is refused).
        """
        return self._admitted(self._load_request, request)

    def lookup(
        self,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        *,
        lookup_masks: Sequence[Sequence[bool] | None] | None = None,
    ) -> int:
        """Leading tokens of a ``num_tokens`` prompt that every group can load from the store.

        Every rank namespace of the layout must hold a chunk; all candidate keys go to the store in one
        ``batch_is_exist``. Groups combine as in vLLM's hybrid coordinator (full attention: the leading run of
        present chunks; sliding window: the window before the hit; Mamba: the state at the hit). A hit
        covering the whole prompt is re-derived one token shorter, which the model must recompute, without
        another RPC. ``lookup_masks`` optionally replaces the per-group chunk masks (absolute chunk ids; a
        masked chunk is neither read nor probed). Store errors count as a miss (returns 0).
        """
        return self._admitted(
            self.store_lookup.lookup, self._store, num_tokens, block_hashes, lookup_masks=lookup_masks
        )

    def lookup_with_boundaries(
        self,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        *,
        lookup_masks: Sequence[Sequence[bool] | None] | None = None,
    ) -> LookupResult:
        """vLLM 0.33's lookup: :meth:`lookup`'s hit and, for a non-zero hit, every group's tail-key boundary
        (docs/lookup.md, "Tail key boundaries"; a load honours them with
        ``TransferRequest.tail_key_boundaries``). Store errors count as a miss."""
        return self._admitted(
            self.store_lookup.lookup_with_boundaries, self._store, num_tokens, block_hashes, lookup_masks=lookup_masks
        )

    # ------------------------------------------------------------------ threads and lifecycle

    @property
    def threads(self) -> list[threading.Thread]:
        """The send and receive threads (empty until started)."""
        return self._workers.threads

    def start(self) -> None:
        """Start the send thread and the receive threads (idempotent)."""
        self._unless_closed(self._workers.start)

    def submit_store(self, request: TransferRequest) -> Future[StoreResult]:
        """Queue a store on the send thread."""
        return self._unless_closed(self._workers.submit_store, request)

    def submit_load(self, request: TransferRequest) -> Future[LoadResult]:
        """Queue a load; the first free receive thread takes it."""
        return self._unless_closed(self._workers.submit_load, request)

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued work, stop the threads, wait for calls in flight, unregister the buffers.

        From the moment ``close`` begins every new call (``store``, ``load``, ``lookup``, ``submit_*``,
        ``register_kv_caches``) raises :class:`~mooncake_kvaddr.driver.store.StoreClosedError`; work already
        queued still runs. Raises ``TimeoutError`` (keeping the caches registered and alive) if threads or
        calls are still running after ``timeout`` seconds; call ``close`` again later. The store stays open.

        Staged Mooncake calls abandoned at a request's deadline (docs/transfer-modes.md, "Deadlines") are
        waited for within the same ``timeout``; those still running then do not make ``close`` fail: it
        finishes, and the staging pool stays registered with the store and allocated (each such call's lease
        holds it) until the last of them returns, which unregisters it.
        """
        with self._queue_lock:
            if self._gate.state is GateState.CLOSED:
                return
            self._gate.begin_close()
        deadline = time.monotonic() + timeout
        stuck = self._workers.stop(deadline)
        if stuck:
            raise TimeoutError(f"KVTransfer.close: threads still running after {timeout} s: {stuck}")
        if not self._gate.wait_idle(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"KVTransfer.close: {self._gate.in_flight} call(s) still running after {timeout} s")
        if not self._gate.release():
            return  # another thread's close() got here first and releases everything (once)
        self._release_registered(deadline, timeout)

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _admitted(self, work: Callable[..., _T], *args: Any, queued: bool = False, **kwargs: Any) -> _T:
        """``work(*args, **kwargs)`` counted as a call in flight so that :meth:`close` releases nothing under it;
        refused once closing began (``queued``: a job accepted before ``close``, which still runs)."""
        with self._gate.admitted(queued=queued):
            return work(*args, **kwargs)

    def _unless_closed(self, action: Callable[..., _T], *args: Any) -> _T:
        """``action(*args)`` under the queue lock, or ``StoreClosedError`` once the transfer is closed: close()
        marks it closed under this lock before it stops the threads, so a job is queued before that (and
        runs) or refused."""
        with self._queue_lock:
            if self._gate.closed:
                raise StoreClosedError("KVTransfer is closed: no calls after close()")
            return action(*args)
