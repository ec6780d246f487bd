"""KV-cache transfer between a worker's KV cache and the Mooncake store (see ``docs/transfer-modes.md``).

:class:`KVTransfer` is the worker side of vLLM's Mooncake store connector, reduced to what moves bytes:

* :meth:`KVTransfer.register_kv_caches` registers the KV-cache regions (shared by every group) and picks
  the transfer path (:mod:`mooncake_kvaddr.driver.paths`: multi-buffer, direct or staged);
* :meth:`KVTransfer.store` - the send thread's per-request work: walk chunks, build keys, ask which exist,
  and put only the missing ones;
* :meth:`KVTransfer.load` - the receive thread's per-request work: keys and regions per group, tp-rank
  rotation, the gets, and the block ids of every chunk that failed (a load never raises for store trouble);
* :meth:`KVTransfer.lookup` - how many leading tokens every group can load from the store, probing every rank
  namespace of the parallel layout (see :mod:`mooncake_kvaddr.driver.lookup`);
* :meth:`KVTransfer.submit_store` / :meth:`KVTransfer.submit_load` hand requests to one send thread and
  ``num_recv_threads`` receive threads that share one queue; each returns a ``Future``.

The caches here are host buffers (numpy arrays); on a GPU host they would be device tensors registered the
same way (a base address and a per-block length per region).

Transfer modes (``transfer_mode``, default ``StoreConfig.transfer_mode`` = ``"auto"``), resolved once by
:meth:`KVTransfer.register_kv_caches` and logged once: ``"multi_buffer"``, ``"staged"``, ``"auto"`` (staged
for host-memory caches with more than one region per key); with one region per key ``"staged"`` and
``"auto"`` use ``"direct"``. Objects are the concatenation of their regions in every mode, so the modes
interoperate.

This module is one class whose store and load request logic, registration and lifecycle are meant to be
read together; everything else it uses has its own module (paths, bounds, rules, results, workers).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from typing import Any, TypeVar

import numpy as np

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.driver.bounds import RegisteredCaches, Screened
from mooncake_kvaddr.driver.config import TRANSFER_MODES
from mooncake_kvaddr.driver.gate import CallGate, GateState
from mooncake_kvaddr.driver.lookup import GroupSpecLike, LookupResult, ParallelLayout, StoreLookup
from mooncake_kvaddr.driver.paths import (
    DirectPath,
    GetPlan,
    MultiBufferPath,
    PathContext,
    StagedPath,
    TransferPath,
)
from mooncake_kvaddr.driver.probe import PeerProbe
from mooncake_kvaddr.driver.results import Clock, LoadResult, StoreResult, TransferRequest, count
from mooncake_kvaddr.driver.rules import (
    LOAD_ERRORS,
    OperationRecorder,
    RecordOperation,
    choose_auto_mode,
    copies_in_memory,
    describe,
    estimate_staging_bytes,
    floor_to,
    split_by_staging_budget,
)
from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT, CopyBackend, HostCopyBackend, StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore, Outcome, RequestDeadline, StoreClosedError, StoreError
from mooncake_kvaddr.driver.values import check_bool
from mooncake_kvaddr.driver.workers import TransferThreads

__all__ = ["KVTransfer", "LoadResult", "StoreResult", "TransferRequest"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _plain_ids(block_ids: Any) -> list[int]:
    """Every id of every group of a request that reads as an integer without running user code (``int``,
    numpy integers and integer arrays); anything else is skipped. Never raises."""
    out: list[int] = []
    try:
        groups = list(block_ids) if isinstance(block_ids, (list, tuple)) else []
        for ids in groups:
            if isinstance(ids, np.ndarray):
                if ids.dtype.kind in "iu" and ids.ndim == 1:
                    out.extend(ids.tolist())
                continue
            if isinstance(ids, (list, tuple)):
                out.extend(int(b) for b in ids if isinstance(b, (int, np.integer)) and not isinstance(b, bool))
    except Exception:  # a list subclass's own methods may raise: report what was read
        logger.debug("load: block ids only partly readable for the failure report", exc_info=True)
    return out


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
        record_operation: RecordOperation | Callable[..., None] | None = None,
        disk_offload_buffer_budget_bytes: int | None = None,
        disk_offload_usable_ratio: float = 0.9,
        local_copy: bool | None = None,
        probe_peers: bool | None = None,
    ) -> None:
        if not databases:
            raise ValueError("databases: need one ChunkedTokenDatabase per KV-cache group (at least one)")
        if tp_rank < 0:
            raise ValueError(f"tp_rank: must be >= 0, got {tp_rank}")
        requested = store.config.transfer_mode if transfer_mode is None else transfer_mode
        if requested not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode: must be one of {TRANSFER_MODES}, got {requested!r}")
        if disk_offload_buffer_budget_bytes is not None and disk_offload_buffer_budget_bytes <= 0:
            raise ValueError(f"disk_offload_buffer_budget_bytes: must be > 0, got {disk_offload_buffer_budget_bytes}")
        if not 0 < disk_offload_usable_ratio <= 1:
            raise ValueError(f"disk_offload_usable_ratio: must be in (0, 1], got {disk_offload_usable_ratio}")
        self.transfer_mode = requested
        self.disk_offload_buffer_budget_bytes = disk_offload_buffer_budget_bytes
        self.disk_offload_usable_ratio = disk_offload_usable_ratio
        self._store = store
        self.databases = list(databases)
        self.tp_rank = tp_rank
        self.replicate_config = replicate_config
        # Stores and lookups use whole scheduler blocks: the lcm of the groups' block sizes.
        self.lcm_block_size = math.lcm(*(db.block_size for db in self.databases))
        #: Lookup over every rank namespace (key prefixes built once, here).
        self.store_lookup = StoreLookup(self.databases, group_specs, layout)
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
            partial(self._run_queued, self._store_request),
            partial(self._run_queued, self._load_request),
            num_recv_threads,
        )
        self._gate = CallGate("KVTransfer")
        # Orders queueing against close(): a job queued before close() began runs, one after it is refused.
        self._queue_lock = threading.Lock()
        if start_threads:
            self.start()

    def _context(self, caches: RegisteredCaches) -> PathContext:
        return PathContext(self._store, self.databases, caches, self.replicate_config, self._metrics)

    def _pin_regions(self, caches: RegisteredCaches) -> None:
        """Pin each database's regions to the registered ones (a database without the hook is checked by
        :meth:`~mooncake_kvaddr.driver.bounds.RegisteredCaches.check_databases` alone)."""
        try:
            for db in self.databases:
                pin = getattr(db, "_pin_regions", None)
                if pin is not None:
                    pin(list(caches.bases), list(caches.block_lens))
                    self._pinned.append(db)
        except BaseException:
            self._unpin_regions()
            raise

    def _unpin_regions(self) -> None:
        pinned, self._pinned = self._pinned, []
        for db in pinned:
            db._unpin_regions()

    def _copies_in_memory(self) -> bool:
        return copies_in_memory(self._store.config) if self._local_copy is None else self._local_copy

    @property
    def probes_peers(self) -> bool:
        """Whether loads that Mooncake writes into the KV cache itself (multi-buffer, direct) first prove new
        peers responsive (:mod:`~mooncake_kvaddr.driver.probe`); set by :meth:`register_kv_caches`."""
        return self._probe is not None

    @property
    def mooncake_store(self) -> MooncakeStore:
        """The store this transfer drives."""
        return self._store

    @property
    def mode(self) -> str:
        """How loads move keys: ``"multi_buffer"``, ``"staged"`` or ``"direct"`` (one region per key).

        ``"multi_buffer"`` until :meth:`register_kv_caches` resolves :attr:`transfer_mode` (nothing moves
        before that: every block id is checked against the registered caches). With ``"auto"`` stores may
        use another path (:attr:`store_mode`): the objects are the same bytes either way.
        """
        return "multi_buffer" if self._get_path is None else self._get_path.name

    @property
    def store_mode(self) -> str:
        """How stores move keys (see :attr:`mode`)."""
        return "multi_buffer" if self._put_path is None else self._put_path.name

    @property
    def path(self) -> TransferPath | None:
        """The load path object (see :mod:`mooncake_kvaddr.driver.paths`); ``None`` until
        :meth:`register_kv_caches`."""
        return self._get_path

    @property
    def store_path(self) -> TransferPath | None:
        """The store path object; ``None`` until :meth:`register_kv_caches`."""
        return self._put_path

    def _staged(self) -> StagedPath | None:
        for path in (self._get_path, self._put_path):
            if isinstance(path, StagedPath):
                return path
        return None

    @property
    def staging_pool(self) -> StagingPool | None:
        """The staging pool in use (``None`` unless a direction is ``"staged"``)."""
        staged = self._staged()
        return None if staged is None else staged.pool

    @property
    def copy_backend(self) -> CopyBackend | None:
        """The backend that gathers and scatters staged keys (``None`` unless a direction is ``"staged"``); a
        :class:`~mooncake_kvaddr.driver.staging.HostCopyBackend` whose ``threads``/``streaming`` may be tuned."""
        staged = self._staged()
        return None if staged is None else staged.copy

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
        with self._admitted():
            if self._get_path is not None:
                raise RuntimeError("register_kv_caches: regions are already registered")
            # One pass over the caller's container: the arrays validated are the arrays kept alive (an iterator
            # or a sequence whose iteration changes must not leave the registered memory unowned).
            if isinstance(regions, (str, bytes, dict)):
                raise TypeError(f"regions: expected a sequence of numpy arrays, got {type(regions).__name__}")
            arrays = list(regions)
            caches = RegisteredCaches.from_regions(arrays, num_blocks)
            # Pinned before anything changes: from now on each native call checks the regions it computes from
            # against these, inside the call (a thread editing a database's lists cannot slip others in).
            self._pin_regions(caches)
            with ExitStack() as undo:
                # A failure below undoes everything registered so far (in reverse order): nothing leaks, and a
                # later register_kv_caches starts from scratch.
                undo.callback(self._unpin_regions)
                ctx = self._context(caches)
                get_mode, put_mode = self._resolve_modes(caches)
                paths: dict[str, TransferPath] = {}
                undo.callback(self._undo_paths, paths)
                if "staged" in (get_mode, put_mode):
                    undo.callback(self._undo_staging)
                    paths["staged"] = self._start_staging(ctx, caches)
                if {get_mode, put_mode} - {"staged"}:
                    undo.callback(self._unregister_buffers)
                    for base, nbytes in caches.buffers:
                        self._store.register_buffer(base, nbytes)
                        self._registered.append(base)
                probe = self._probe_peers if self._probe_peers is not None else not self._copies_in_memory()
                if probe and get_mode != "staged":
                    # Mooncake writes this load path's bytes into the KV cache itself: such a call cannot be
                    # abandoned, so a new peer is proven responsive first (docs/multihost.md, "Hung peer").
                    undo.callback(self._close_probe, forget=True)
                    self._probe = ctx.probe = PeerProbe(self._store, self._store.config.max_abandoned_calls)
                for mode in (get_mode, put_mode):
                    if mode not in paths:
                        paths[mode] = DirectPath(ctx) if mode == "direct" else MultiBufferPath(ctx)
                self._regions = arrays
                undo.callback(self._regions.clear)
                for db in self.databases:
                    db.set_kv_caches_base_addr(list(caches.bases))
                    db.set_block_len(list(caches.block_lens))
                    bind = getattr(db, "bind_registered_caches", None)  # layout adapters check their own segments
                    if bind is not None:
                        bind(caches)
                # Published last: no request plans with a path before everything above succeeded.
                self._get_path, self._put_path = paths[get_mode], paths[put_mode]
                undo.pop_all()  # registered: the pins stay until close()
            chosen = get_mode if get_mode == put_mode else f"load {get_mode} / store {put_mode}"
            detail = "; ".join(dict.fromkeys(path.describe() for path in paths.values()))
            logger.info("KVTransfer: transfer mode %s -> %s (%s)", self.transfer_mode, chosen, detail)

    def _undo_paths(self, paths: dict[str, TransferPath]) -> None:
        """A failed registration: close the paths it built (their call threads)."""
        for path in paths.values():
            path.close()

    def _undo_staging(self) -> None:
        """A failed registration: unregister the staging pool it registered; forget a pool it made."""
        if self._pool_registered and self._pool is not None:
            self._pool_registered = False
            self._unregister_pool(self._pool)
        if self._owns_pool:
            self._pool = None

    def _unregister_buffers(self) -> None:
        """Unregister the KV-cache buffers this transfer registered (a failed registration, or close)."""
        registered, self._registered = self._registered, []
        if not self._store.ready:
            return  # the registrations died with the client
        for base in registered:
            try:
                self._store.unregister_buffer(base)
            except StoreError as exc:
                # Releasing must not fail over bookkeeping; the registration dies with the client anyway.
                logger.warning("KVTransfer: %s", exc)

    def _close_probe(self, *, forget: bool = False) -> None:
        """Close the peer probe (``forget``: a failed registration, which also drops it)."""
        probe = self._probe
        if forget:
            self._probe = None
        if probe is not None:
            probe.close()  # an abandoned probe keeps its own buffer until Mooncake returns

    def _resolve_modes(self, caches: RegisteredCaches) -> tuple[str, str]:
        """(load mode, store mode) for the registered layout (see ``docs/transfer-modes.md``)."""
        regions = caches.regions_per_key
        if self.transfer_mode == "multi_buffer" or regions == 0:
            return "multi_buffer", "multi_buffer"
        if regions == 1:
            return "direct", "direct"  # one contiguous region per key: nothing to gather
        if self.transfer_mode == "staged":
            return "staged", "staged"
        region_bytes = sum(caches.block_lens) // regions
        local = self._copies_in_memory()
        return (
            choose_auto_mode(regions, region_bytes, local_copy=local, direction="load"),
            choose_auto_mode(regions, region_bytes, local_copy=local, direction="store"),
        )

    def _start_staging(self, ctx: PathContext, caches: RegisteredCaches) -> StagedPath:
        """Create (or adopt) the staging pool, register it with the store, set up the host copy backend."""
        if self._pool is None:
            # One request never stages more than every block of every group, plus one slot's padding per key.
            needed = sum(n for _, n in caches.buffers) + SLOT_ALIGNMENT * caches.num_blocks * len(self.databases)
            self._pool = StagingPool(min(self._store.config.staging_buffer_size, needed))
        self._pool.register_with(self._store)
        self._pool_registered = True
        return StagedPath(ctx, self._pool, HostCopyBackend(list(caches.buffers)))

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
        with self._admitted():
            return self._store_request(request)

    def _store_request(self, request: TransferRequest) -> StoreResult:
        path = self._registered_path(self._put_path)
        deadline = self._store.deadline()  # from the moment the request runs (not when it was queued)
        clock = Clock()
        result = StoreResult(request.req_id, timings=clock.timings)
        token_len = floor_to(request.token_len, self.lcm_block_size)
        if token_len <= 0:
            return result
        block_ids, screened = self._screen(path, request)
        keys: list[str] = []
        chunks: list[tuple[int, int]] = []
        groups: list[int] = []
        invalid: list[str] = []
        for g, db in enumerate(self.databases):
            # The walk, the NULL-block and past-the-end filters and the keys, in one native pass.
            plan = db.plan_store(token_len, request.block_hashes, block_ids[g], request.skip_tokens)
            if not screened[g].bad:
                keys.extend(plan.keys)
                chunks.extend(plan.chunks)
                groups.extend([g] * len(plan.keys))
                continue
            for key, chunk, block_id in zip(plan.keys, plan.chunks, plan.block_ids, strict=True):
                if block_id < 0:  # a stand-in for an invalid id (see _screen): never put
                    position = -block_id - 1
                    result.invalid_block_ids[screened[g].ids[position]] = screened[g].bad[position]
                    invalid.append(key)
                else:
                    keys.append(key)
                    chunks.append(chunk)
                    groups.append(g)
        result.chunks = len(keys) + len(invalid)
        clock.lap("keys")
        if invalid:
            count(result.outcomes, "invalid_block_id", len(invalid))
            logger.warning("store %s: %d chunk(s) not stored: %s", request.req_id, len(invalid),
                           next(iter(result.invalid_block_ids.values())))
        if not keys:
            result.failed_keys = invalid
            result.saved_tokens = 0 if invalid else token_len
            return result

        t0 = time.perf_counter()
        try:
            exists = self._store.batch_is_exist(keys)
        except BaseException:
            self._metrics.record("save_exists", t0, len(keys), 0, None)
            raise
        self._metrics.record("save_exists", t0, len(keys), 0, 0)
        clock.lap("exist")
        missing = exists.failed  # absent or errored: put it (a duplicate put is harmless)
        result.already_present = len(keys) - len(missing)
        if not missing:
            result.failed_keys = invalid
            result.saved_tokens = 0 if invalid else token_len
            return result

        put_keys = [keys[i] for i in missing]
        result.mode = path.name
        ok, key_bytes = path.put(
            put_keys, [chunks[i] for i in missing], [groups[i] for i in missing], block_ids, clock, result, deadline
        )
        result.stopped = deadline.reason
        result.stored = sum(ok)
        result.failed_keys = invalid + [k for k, good in zip(put_keys, ok, strict=True) if not good]
        result.bytes = sum(n for n, good in zip(key_bytes, ok, strict=True) if good)
        if result.back_pressure:
            self._back_pressure.set()
        elif not result.failed_keys:
            self._back_pressure.clear()
        if not result.failed_keys:
            result.saved_tokens = token_len
        else:
            logger.warning(
                "store %s: %d of %d puts failed: %s%s",
                request.req_id,
                len(result.failed_keys),
                len(put_keys),
                result.outcomes,
                "" if result.stopped is None else f" (stopped: {result.stopped})",
            )
        return result

    def load(self, request: TransferRequest) -> LoadResult:
        """Get the request's chunks into their blocks; report which block ids failed.

        Never raises for store trouble (the error policy of :data:`~mooncake_kvaddr.driver.rules.LOAD_ERRORS`):
        a failed get (or staged scatter) is reported in ``error`` and every block id of the chunks it covered
        is in ``failed_block_ids``; no failed chunk's blocks are written from staging. The request has a
        deadline (``StoreConfig.request_timeout_s``, from when it starts running): keys not tried before it
        passed, or after a call waited out Mooncake's transfer timeout, fail too, and ``stopped`` says why.
        Raises :class:`~mooncake_kvaddr.driver.store.StoreClosedError` after :meth:`close`, and
        ``TypeError``/``ValueError`` for ``tail_key_boundaries`` that are malformed or name no group (on a
        transfer not built by ``layout_transfer`` any boundary is refused).
        """
        with self._admitted():
            return self._load_request(request)

    def _tail_boundaries(self, boundaries: Sequence[Any]) -> list[tuple[Any, int]]:
        """``(database, num_tokens)`` per boundary, checked (docs/vllm.md, "Driver")."""
        databases = self.databases
        if not all(hasattr(db, "tail_boundary") for db in databases):
            raise ValueError("tail_key_boundaries: only a transfer built by layout_transfer keys loads by a "
                             "tail-key boundary")
        tails: dict[int, int] = {}
        for boundary in boundaries:
            if isinstance(boundary, tuple) and len(boundary) == 2:
                group, tokens = boundary
            elif hasattr(boundary, "group_id") and hasattr(boundary, "num_tokens"):
                group, tokens = boundary.group_id, boundary.num_tokens
            else:
                raise TypeError(f"tail_key_boundaries: expected (group_id, num_tokens) or a TailKeyBoundary, "
                                f"got {boundary!r}")
            if type(group) is not int or not 0 <= group < len(databases):
                raise ValueError(f"tail boundary: group_id {group!r} is not one of the {len(databases)} "
                                 f"KV-cache groups")
            if group in tails:
                raise ValueError(f"tail boundary: group_id {group} is given twice")
            tails[group] = tokens
        return [(databases[group], tokens) for group, tokens in sorted(tails.items())]

    def _load_request(self, request: TransferRequest) -> LoadResult:
        if not request.tail_key_boundaries:
            return self._load_keyed(request)
        with ExitStack() as boundaries:  # this thread's loads key the tails by the request's boundaries
            for database, tokens in self._tail_boundaries(request.tail_key_boundaries):
                boundaries.enter_context(database.tail_boundary(tokens))
            return self._load_keyed(request)

    def _load_keyed(self, request: TransferRequest) -> LoadResult:
        deadline = self._store.deadline()  # from the moment the request runs (not when it was queued)
        clock = Clock()
        result = LoadResult(request.req_id, timings=clock.timings, mode=self.mode)
        screened: list[Screened] | None = None
        try:
            skip = floor_to(request.skip_tokens, self.lcm_block_size)
            path = self._registered_path(self._get_path)
            _, screened = self._screen(path, request)
            plan = path.plan_get(request.token_len, request.block_hashes, screened, skip, self.tp_rank)
        except LOAD_ERRORS as exc:
            # Nothing moved; every block the request names is reported failed.
            self._fail_request(request, result, exc, screened)
            clock.lap("plan")
            return result
        clock.lap("plan")
        if plan.invalid:
            result.invalid_block_ids = plan.invalid
            result.failed_block_ids.update(plan.invalid)
            count(result.outcomes, "invalid_block_id", plan.dropped)
            logger.warning("load %s: %d block id(s) not loaded: %s", request.req_id, len(plan.invalid),
                           next(iter(plan.invalid.values())))
        result.chunks = len(plan.keys) + plan.dropped
        if not plan.keys:
            return result
        loaded = np.zeros(len(plan.keys), dtype=bool)
        batches = self._budget_batches(plan, request, result)
        try:
            self._get_batches(path, plan, batches, loaded, clock, result, deadline)
        except LOAD_ERRORS as exc:
            # Keys not yet scattered stay unloaded; a staged get never writes the cache itself.
            result.error = describe(exc)
            logger.warning("load %s: %s", request.req_id, result.error)
            clock.lap("failed")
        if deadline.reason is not None:
            result.stopped = deadline.reason
            logger.warning("load %s: %d of %d key(s) not loaded, stopped: %s", request.req_id,
                           int((~loaded).sum()), len(loaded), deadline.reason)
        ids = np.asarray(plan.block_ids, dtype=np.int64)
        failed = set(ids[~loaded].tolist())
        result.failed_block_ids |= failed
        result.loaded_block_ids = set(ids.tolist()) - result.failed_block_ids
        return result

    def _budget_batches(self, plan: GetPlan, request: TransferRequest, result: LoadResult) -> list[tuple[int, int]]:
        """The load's sub-batches: one, or as many as the disk-offload staging budget needs (none at all
        when one key can never fit: the whole request fails, as nothing later could complete it)."""
        budget = self.disk_offload_buffer_budget_bytes
        if budget is None:
            return [(0, len(plan.keys))]
        usable = max(1, int(budget * self.disk_offload_usable_ratio))
        object_sizes = plan.key_bytes()
        batches = split_by_staging_budget(object_sizes, usable, budget)
        if isinstance(batches, int):
            need = estimate_staging_bytes(object_sizes[batches])
            result.error = (
                f"key {plan.keys[batches]} needs {need} staging bytes, more than the disk-offload staging budget "
                f"of {budget}: nothing was loaded"
            )
            count(result.outcomes, "staging_budget_exceeded", len(plan.keys))
            logger.warning("load %s: %s", request.req_id, result.error)
            return []
        return batches

    def _get_batches(
        self,
        path: TransferPath,
        plan: GetPlan,
        batches: list[tuple[int, int]],
        loaded: np.ndarray[Any, Any],
        clock: Clock,
        result: LoadResult,
        deadline: RequestDeadline,
    ) -> None:
        for start, end in batches:
            if deadline.expired():
                # Not tried: never loaded (the path counts what it skips itself; these never reach it).
                count(result.outcomes, Outcome.TRANSFER_FAILED.value, len(plan.keys) - start)
                return
            got = path.get(plan, start, end, clock, result.outcomes, deadline)
            loaded[start:end] = got.loaded
            result.bytes += got.nbytes
            if got.unreachable and end < len(plan.keys):
                # Each further sub-batch would block only to report the same.
                count(result.outcomes, Outcome.MASTER_UNREACHABLE.value, len(plan.keys) - end)
                return

    @staticmethod
    def _registered_path(path: TransferPath | None) -> TransferPath:
        if path is None:
            raise RuntimeError("no KV caches registered: call register_kv_caches() before transferring")
        return path

    def _screen(self, path: TransferPath, request: TransferRequest) -> tuple[list[list[int]], list[Screened]]:
        """Snapshot and check each group's block ids before anything is planned (see :mod:`.bounds`).

        Returns the ids to plan with, where each invalid id is replaced by the stand-in ``-(position + 1)``
        (the store walk passes it through, so the chunk on it is recognised and never put), and the screens.
        """
        caches = path.ctx.caches
        caches.check_databases(self.databases)
        if len(request.block_ids) < len(self.databases):
            raise ValueError(
                f"block_ids: {len(request.block_ids)} group(s) given, {len(self.databases)} KV-cache groups registered"
            )
        screened = [caches.screen(request.block_ids[g]) for g in range(len(self.databases))]
        plan_ids = []
        for s in screened:
            ids = s.ids
            if s.bad:
                ids = list(ids)
                for position in s.bad:
                    ids[position] = -(position + 1)
            plan_ids.append(ids)
        return plan_ids, screened

    @staticmethod
    def _fail_request(
        request: TransferRequest, result: LoadResult, exc: BaseException, screened: Sequence[Screened] | None
    ) -> None:
        """Report a load that moved nothing: the error, and every block id it names as failed (vLLM counts a
        block not reported failed as loaded). The ids come from the screen's snapshot when the request got that
        far, else from the request as far as it reads as integers (never raises: this is the error path)."""
        result.error = describe(exc)
        if screened is not None:
            for s in screened:
                result.failed_block_ids.update(s.ids)
        else:
            result.failed_block_ids.update(_plain_ids(request.block_ids))
        logger.warning("load %s: %s", request.req_id, result.error)

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
        with self._admitted():
            return self.store_lookup.lookup(self._store, num_tokens, block_hashes, lookup_masks=lookup_masks)

    def lookup_with_boundaries(
        self,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        *,
        lookup_masks: Sequence[Sequence[bool] | None] | None = None,
    ) -> LookupResult:
        """vLLM 0.33's lookup: :meth:`lookup`'s hit and, for a non-zero hit, every group's tail-key boundary
        (docs/lookup.md, "Tail key boundaries"; a load honours them with
        :func:`~mooncake_kvaddr.driver.layout_adapter.load_with_boundaries`). Store errors count as a miss."""
        with self._admitted():
            return self.store_lookup.lookup_with_boundaries(
                self._store, num_tokens, block_hashes, lookup_masks=lookup_masks
            )

    # ------------------------------------------------------------------ threads and lifecycle

    @property
    def threads(self) -> list[threading.Thread]:
        """The send and receive threads (empty until started)."""
        return self._workers.threads

    def start(self) -> None:
        """Start the send thread and the receive threads (idempotent)."""
        with self._queue_lock:  # close() marks the transfer closed under this lock before it stops the threads
            self._refuse_if_closed()
            self._workers.start()

    def submit_store(self, request: TransferRequest) -> Future[StoreResult]:
        """Queue a store on the send thread."""
        with self._queue_lock:  # queued before close() stops the threads (so it runs), or refused
            self._refuse_if_closed()
            return self._workers.submit_store(request)

    def submit_load(self, request: TransferRequest) -> Future[LoadResult]:
        """Queue a load; the first free receive thread takes it."""
        with self._queue_lock:  # queued before close() stops the threads (so it runs), or refused
            self._refuse_if_closed()
            return self._workers.submit_load(request)

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
        paths = {id(p): p for p in (self._get_path, self._put_path) if p is not None}
        self._get_path = self._put_path = None
        self._unregister_buffers()
        if self._pool_registered and self._pool is not None:
            self._pool_registered = False
            unregister = partial(self._unregister_pool, self._pool)
            staged = next((p for p in paths.values() if isinstance(p, StagedPath)), None)
            if staged is None or staged.calls.wait_settled(deadline - time.monotonic()):
                unregister()
            else:
                # Abandoned staged calls still run in Mooncake and write or read their slots: the pool stays
                # registered, and alive (each call's lease holds it), until the last one returns.
                logger.warning(
                    "KVTransfer.close: %d abandoned staged Mooncake call(s) still in flight after %s s; the staging "
                    "pool stays registered and allocated until they return", staged.calls.abandoned, timeout,
                )  # fmt: skip
                staged.calls.when_settled(unregister)
        for path in paths.values():
            path.close()
        self._close_probe()
        self._unpin_regions()
        if self._owns_pool:
            self._pool = None  # frees the buffer once no request holds a lease
        self._regions = []

    def _unregister_pool(self, pool: StagingPool) -> None:
        """Undo this transfer's registration of ``pool`` (a shared pool stays registered for the others)."""
        try:
            pool.unregister_from(self._store)
        except StoreError as exc:  # also a store closed meanwhile: the registration died with its client
            logger.warning("KVTransfer.close: staging pool: %s", exc)

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _admitted(self, *, queued: bool = False) -> AbstractContextManager[None]:
        """Count a call in flight so that :meth:`close` releases nothing under it; refuse new calls once
        closing began (``queued``: a job accepted before ``close``, which still runs)."""
        return self._gate.admitted(queued=queued)

    def _refuse_if_closed(self) -> None:
        if self._gate.closed:
            raise StoreClosedError("KVTransfer is closed: no calls after close()")

    def _run_queued(self, work: Callable[[TransferRequest], _T], request: TransferRequest) -> _T:
        with self._admitted(queued=True):
            return work(request)
