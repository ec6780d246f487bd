"""What :meth:`KVTransfer.register_kv_caches <mooncake_kvaddr.driver.transfer.KVTransfer.register_kv_caches>`
sets up and :meth:`~mooncake_kvaddr.driver.transfer.KVTransfer.close` releases: the registered buffers, the
transfer paths, the staging pool, the peer probe and the region pins, kept together so that every undo sits next
to what it undoes. :class:`TransferRegistration` is a base of ``KVTransfer``, which sets its attributes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from typing import Any

import numpy as np

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.driver.bounds import RegisteredCaches
from mooncake_kvaddr.driver.groups import LayoutGroup, host_regions, install_segments
from mooncake_kvaddr.driver.paths import DirectPath, MultiBufferPath, PathContext, StagedPath, TransferPath
from mooncake_kvaddr.driver.probe import PeerProbe
from mooncake_kvaddr.driver.rules import OperationRecorder, choose_auto_mode, copies_in_memory
from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT, HostCopyBackend, StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore, StoreError

__all__ = ["TransferRegistration"]

# The logger of mooncake_kvaddr.driver.transfer, KVTransfer's module (logging configuration names it).
logger = logging.getLogger("mooncake_kvaddr.driver.transfer")


class TransferRegistration:
    """The registered state of a :class:`~mooncake_kvaddr.driver.transfer.KVTransfer`: how it is set up, read and
    released (the attributes are set by ``KVTransfer.__init__``)."""

    transfer_mode: str
    databases: list[Any]
    replicate_config: Any
    _store: MooncakeStore
    _metrics: OperationRecorder
    _regions: list[np.ndarray[Any, Any]]
    _registered: list[int]
    _local_copy: bool | None
    _probe_peers: bool | None
    _probe: PeerProbe | None
    _pinned: list[Any]
    _get_path: TransferPath | None
    _put_path: TransferPath | None
    _pool: StagingPool | None
    _owns_pool: bool
    _pool_registered: bool

    def _pin_regions(self, caches: RegisteredCaches) -> None:
        """Pin each database's regions to the registered ones (ours: a database of another type is checked by
        :meth:`~mooncake_kvaddr.driver.bounds.RegisteredCaches.check_databases` alone)."""
        try:
            for db in self.databases:
                if isinstance(db, (ChunkedTokenDatabase, LayoutGroup)):
                    db._pin_regions(list(caches.bases), list(caches.block_lens))
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
    def copy_backend(self) -> HostCopyBackend | None:
        """The backend that gathers and scatters staged keys (``None`` unless a direction is ``"staged"``); a
        :class:`~mooncake_kvaddr.driver.staging.HostCopyBackend` whose ``threads``/``streaming`` may be tuned."""
        staged = self._staged()
        return None if staged is None else staged.copy

    # ------------------------------------------------------------------ regions

    def _register(self, regions: Sequence[Any], num_blocks: int) -> None:
        """:meth:`~mooncake_kvaddr.driver.transfer.KVTransfer.register_kv_caches` once admitted."""
        if self._get_path is not None:
            raise RuntimeError("register_kv_caches: regions are already registered")
        # One pass over the caller's container: the arrays validated are the arrays kept alive (an iterator
        # or a sequence whose iteration changes must not leave the registered memory unowned).
        if isinstance(regions, (str, bytes, dict)):
            raise TypeError(f"regions: expected a sequence of numpy arrays, got {type(regions).__name__}")
        given = list(regions)
        arrays = host_regions(self.databases, given)
        caches = RegisteredCaches.from_regions(arrays, num_blocks)
        install_segments(self.databases, given, num_blocks)  # proven inside `caches` at each plan (groups.py)
        # Pinned before anything changes: from now on each native call checks the regions it computes from
        # against these, inside the call (a thread editing a database's lists cannot slip others in).
        self._pin_regions(caches)
        with ExitStack() as undo:
            # A failure below undoes everything registered so far (in reverse order): nothing leaks, and a
            # later register_kv_caches starts from scratch.
            undo.callback(self._unpin_regions)
            ctx = PathContext(self._store, self.databases, caches, self.replicate_config, self._metrics)
            # (load mode, store mode) for the registered layout (see docs/transfer-modes.md).
            num_regions = caches.regions_per_key
            if self.transfer_mode == "multi_buffer" or num_regions == 0:
                get_mode, put_mode = "multi_buffer", "multi_buffer"
            elif num_regions == 1:
                get_mode, put_mode = "direct", "direct"  # one contiguous region per key: nothing to gather
            elif self.transfer_mode == "staged":
                get_mode, put_mode = "staged", "staged"
            else:
                region_bytes = sum(caches.block_lens) // num_regions
                local = self._copies_in_memory()
                get_mode = choose_auto_mode(num_regions, region_bytes, local_copy=local, direction="load")
                put_mode = choose_auto_mode(num_regions, region_bytes, local_copy=local, direction="store")
            paths: dict[str, TransferPath] = {}
            undo.callback(self._close_paths, paths)
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
                if isinstance(db, LayoutGroup):  # a TP-shared layout's segments are checked against them
                    db.bind_registered_caches(caches)
            # Published last: no request plans with a path before everything above succeeded.
            self._get_path, self._put_path = paths[get_mode], paths[put_mode]
            undo.pop_all()  # registered: the pins stay until close()
        chosen = get_mode if get_mode == put_mode else f"load {get_mode} / store {put_mode}"
        detail = "; ".join(dict.fromkeys(path.describe() for path in paths.values()))
        logger.info("KVTransfer: transfer mode %s -> %s (%s)", self.transfer_mode, chosen, detail)

    def _close_paths(self, paths: dict[Any, TransferPath]) -> None:
        """Close the paths (their call threads): those a failed registration built, or all of them at close."""
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

    def _start_staging(self, ctx: PathContext, caches: RegisteredCaches) -> StagedPath:
        """Create (or adopt) the staging pool, register it with the store, set up the host copy backend."""
        if self._pool is None:
            # One request never stages more than every block of every group, plus one slot's padding per key.
            needed = sum(n for _, n in caches.buffers) + SLOT_ALIGNMENT * caches.num_blocks * len(self.databases)
            self._pool = StagingPool(min(self._store.config.staging_buffer_size, needed))
        self._pool.register_with(self._store)
        self._pool_registered = True
        return StagedPath(ctx, self._pool, HostCopyBackend(list(caches.buffers)))

    def _release_registered(self, deadline: float, timeout: float) -> None:
        """Release everything :meth:`_register` set up (``close``, once no call is in flight); staged calls
        abandoned at a request's deadline are waited for until ``deadline`` (``time.monotonic``; the log names
        ``timeout``)."""
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
        self._close_paths(paths)
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
