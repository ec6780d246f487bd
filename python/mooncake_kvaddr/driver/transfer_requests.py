"""The store and load request logic of :class:`~mooncake_kvaddr.driver.transfer.KVTransfer`: which chunks and
keys a request names, the screen of its block ids, the existence check, the sub-batches and the per-block report.
:class:`TransferRequests` is a base of ``KVTransfer``; the bytes themselves move in the transfer paths.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver.bounds import Screened
from mooncake_kvaddr.driver.groups import LayoutGroup
from mooncake_kvaddr.driver.paths import TransferPath
from mooncake_kvaddr.driver.results import Clock, LoadResult, StoreResult, TransferRequest, count
from mooncake_kvaddr.driver.rules import (
    LOAD_ERRORS,
    describe,
    estimate_staging_bytes,
    floor_to,
    split_by_staging_budget,
)
from mooncake_kvaddr.driver.store import Outcome
from mooncake_kvaddr.driver.transfer_register import TransferRegistration
from mooncake_kvaddr.driver.values import as_index

__all__ = ["TransferRequests"]

# The logger of mooncake_kvaddr.driver.transfer, KVTransfer's module (logging configuration names it).
logger = logging.getLogger("mooncake_kvaddr.driver.transfer")


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


class TransferRequests(TransferRegistration):
    """Runs one store or load request on the registered paths (the attributes are set by
    ``KVTransfer.__init__``)."""

    tp_rank: int
    lcm_block_size: int
    disk_offload_buffer_budget_bytes: int | None
    disk_offload_usable_ratio: float
    _back_pressure: threading.Event

    def _store_request(self, request: TransferRequest) -> StoreResult:
        path = self._registered_path(self._put_path)
        deadline = self._store.deadline()  # from the moment the request runs (not when it was queued)
        clock = Clock()
        result = StoreResult(request.req_id, timings=clock.timings)
        token_len = floor_to(as_index("token_len", request.token_len), self.lcm_block_size)
        if token_len <= 0:
            return result
        block_ids, screened = self._screen(path, request)
        skip_tokens = as_index("skip_tokens", request.skip_tokens)
        keys: list[str] = []
        chunks: list[tuple[int, int]] = []
        groups: list[int] = []
        invalid: list[str] = []
        for g, db in enumerate(self.databases):
            # The walk, the NULL-block and past-the-end filters and the keys, in one native pass.
            plan = db.plan_store(token_len, request.block_hashes, block_ids[g], skip_tokens)
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

        missing: list[int] = []  # no key: nothing to ask the store, nothing to put
        if keys:
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

    def _tail_boundaries(self, boundaries: Sequence[Any]) -> dict[int, int]:
        """The tail-key boundaries of a load, ``{group: num_tokens}``, checked (docs/vllm.md, "Driver")."""
        databases = self.databases
        if not all(isinstance(db, LayoutGroup) for db in databases):
            raise ValueError("tail_key_boundaries: only a transfer over layout databases (integrations.vllm.data) "
                             "keys loads by a tail-key boundary")
        tails: dict[int, int] = {}
        for boundary in boundaries:
            if isinstance(boundary, tuple) and len(boundary) == 2:
                group, tokens = boundary
            elif hasattr(boundary, "group_id") and hasattr(boundary, "num_tokens"):
                group, tokens = boundary.group_id, boundary.num_tokens
            else:
                raise TypeError(f"tail_key_boundaries: expected (group_id, num_tokens) or a TailKeyBoundary, "
                                f"got {boundary!r}")
            if isinstance(group, np.integer):
                group = int(group)  # a numpy group id is that group (as a numpy num_tokens is that count)
            if type(group) is not int or not 0 <= group < len(databases):
                raise ValueError(f"tail boundary: group_id {group!r} is not one of the {len(databases)} "
                                 f"KV-cache groups")
            if group in tails:
                raise ValueError(f"tail boundary: group_id {group} is given twice")
            tails[group] = tokens
        return {group: databases[group].tail_tokens(tokens) for group, tokens in sorted(tails.items())}

    def _load_request(self, request: TransferRequest) -> LoadResult:
        tails = self._tail_boundaries(request.tail_key_boundaries) if request.tail_key_boundaries else {}
        deadline = self._store.deadline()  # from the moment the request runs (not when it was queued)
        clock = Clock()
        result = LoadResult(request.req_id, timings=clock.timings, mode=self.mode)
        screened: list[Screened] | None = None
        try:
            skip = floor_to(as_index("skip_tokens", request.skip_tokens), self.lcm_block_size)
            path = self._registered_path(self._get_path)
            _, screened = self._screen(path, request)
            token_len = as_index("token_len", request.token_len)
            plan = path.plan_get(token_len, request.block_hashes, screened, skip, self.tp_rank, tails)
        except LOAD_ERRORS as exc:
            # Nothing moved: the error, and every block id the request names is reported failed (vLLM counts a
            # block not reported failed as loaded). The ids come from the screen's snapshot when the request got
            # that far, else from the request as far as it reads as integers (never raises: the error path).
            result.error = describe(exc)
            if screened is not None:
                for s in screened:
                    result.failed_block_ids.update(s.ids)
            else:
                result.failed_block_ids.update(_plain_ids(request.block_ids))
            logger.warning("load %s: %s", request.req_id, result.error)
            clock.lap("plan")
            return result
        clock.lap("plan")
        if plan.invalid:
            result.invalid_block_ids = dict(plan.invalid)
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
            for start, end in batches:
                if deadline.expired():
                    # Not tried: never loaded (the path counts what it skips itself; these never reach it).
                    count(result.outcomes, Outcome.TRANSFER_FAILED.value, len(plan.keys) - start)
                    break
                got = path.get(plan, start, end, clock, result.outcomes, deadline)
                loaded[start:end] = got.loaded
                result.bytes += got.nbytes
                if got.unreachable and end < len(plan.keys):
                    # Each further sub-batch would block only to report the same.
                    count(result.outcomes, Outcome.MASTER_UNREACHABLE.value, len(plan.keys) - end)
                    break
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

    def _budget_batches(self, plan: KeyPlan, request: TransferRequest, result: LoadResult) -> list[tuple[int, int]]:
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
        if isinstance(request.block_ids, (str, bytes)) or not isinstance(request.block_ids, (Sequence, np.ndarray)):
            raise TypeError(f"block_ids: expected one sequence of block ids per KV-cache group, got "
                            f"{type(request.block_ids).__name__}")
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
