"""The staged path: each key through a slot of a staging pool, with native gather and scatter, and Mooncake calls
that may be abandoned at the request's deadline (they touch only staging memory the driver owns).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final

import numpy as np

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver import per_key
from mooncake_kvaddr.driver.bounds import Screened
from mooncake_kvaddr.driver.config import DEFAULT_MAX_ABANDONED_CALLS
from mooncake_kvaddr.driver.path_base import (
    _NO_TAILS,
    NOT_TRIED,
    GetOutcome,
    PathContext,
    TransferPath,
    rows_bounded,
)
from mooncake_kvaddr.driver.results import Clock, StoreResult, count
from mooncake_kvaddr.driver.rules import rotate
from mooncake_kvaddr.driver.staging import (
    SLOT_ALIGNMENT,
    BoolArray,
    HostCopyBackend,
    Int64Array,
    SlotPlan,
    StagingLease,
    StagingPool,
    check_staging,
    plan_slots,
    run_staged,
)
from mooncake_kvaddr.driver.store import CODE_MASTER_UNREACHABLE, BatchResult, MooncakeStore, Outcome, RequestDeadline
from mooncake_kvaddr.driver.workers import CallAbandoned, CallRunner, PendingCall

__all__ = ["STAGING_WAIT_S", "StagedPath"]

# The logger of mooncake_kvaddr.driver.paths, where the paths are imported from (logging configuration
# names it).
logger = logging.getLogger("mooncake_kvaddr.driver.paths")

# How long a staged request waits for room in a shared staging pool before it fails (a transfer in flight
# holds its lease for at most Mooncake's 60 s timeout per call); never longer than the request's deadline.
STAGING_WAIT_S: Final = 300.0


def _sub_plan(slots: SlotPlan, start: int, end: int) -> SlotPlan:
    """Keys ``[start, end)`` of a layout, shifted to start at 0: equal to ``plan_slots`` of their sizes
    (every offset is aligned, so the keys keep their slots relative to the first)."""
    if start == 0 and end == len(slots.offsets):
        return slots
    if start >= end:
        return SlotPlan(slots.offsets[:0], slots.object_sizes[:0], 0)
    offsets = slots.offsets[start:end] - slots.offsets[start]
    object_sizes = slots.object_sizes[start:end]
    return SlotPlan(offsets, object_sizes, int(offsets[-1] + object_sizes[-1]))


class StagedPath(TransferPath):
    """Each key through one slot of a bounded, pre-faulted staging pool registered with Mooncake once.

    Put: native gather (GIL released), then ``batch_put_from``; a batch whose gather fails is never put.
    Get: ``batch_get_into``, then a native scatter of only the keys read whole (a failed key's slot holds
    stale bytes of an earlier request). The pool is leased per request: the whole request when it fits,
    else as much as is free (at least one key), and the request moves in as few batches as the lease allows.

    Each Mooncake call runs on a :class:`~mooncake_kvaddr.driver.workers.CallRunner` thread while the request
    waits for it until its deadline; a call still running then is abandoned (docs/transfer-modes.md,
    "Deadlines"): its keys fail, nothing is scattered from its slots, and the lease shrinks to the slots the
    call uses and stays held until Mooncake returns. Safe here only: a staged call touches staging memory
    the driver owns, never the KV cache. While ``max_abandoned_calls`` abandoned calls are in flight, staged
    requests fail at once (:attr:`calls`).
    """

    name = "staged"

    def __init__(
        self, ctx: PathContext, pool: StagingPool, copy: HostCopyBackend, *, max_abandoned_calls: int | None = None
    ) -> None:
        super().__init__(ctx)
        self.pool = pool
        self.copy = copy
        if max_abandoned_calls is None:
            # The store's config; a stand-in store (planning tests) gets the default.
            store = ctx.store
            if isinstance(store, MooncakeStore):
                max_abandoned_calls = store.config.max_abandoned_calls
            else:
                max_abandoned_calls = DEFAULT_MAX_ABANDONED_CALLS
        limit = int(max_abandoned_calls)
        #: Runs the staged Mooncake calls; counts the abandoned ones still in flight.
        self.calls = CallRunner(limit, name="KVTransferStagedCall")

    def close(self) -> None:
        """End the idle call threads (an abandoned call's thread ends when Mooncake returns)."""
        self.calls.close()

    def _refused(self, deadline: RequestDeadline) -> bool:
        """Whether too many abandoned calls are in flight to make another (then the request is stopped)."""
        return self.calls.refuse(deadline.stop, "staged Mooncake call(s)", "staged call")

    def _call(
        self,
        operation: str,
        call: Callable[[], BatchResult],
        lease: StagingLease,
        ptrs: list[int],
        object_sizes: list[int],
        deadline: RequestDeadline,
        made: list[PendingCall[BatchResult]],
    ) -> BatchResult | None:
        """Make one staged Mooncake call of the keys in the slots at ``ptrs`` (inside ``lease``), waiting for it at
        most until the deadline; appends it to ``made``.

        Returns its result, or ``None`` when the call was abandoned: the deadline is then stopped with the
        reason, the lease shrunk to the bytes the call uses (up to the end of its last slot's object), and the
        lease is the call's to release once Mooncake returns. The caller must neither release nor reuse a lease
        whose call in ``made`` is :attr:`~mooncake_kvaddr.driver.workers.PendingCall.abandoned` (also when this
        raised: an exception such as ``KeyboardInterrupt`` while waiting abandons the call too).
        """
        span = ptrs[-1] - lease.ptr + object_sizes[-1]
        num_keys, num_bytes = len(ptrs), sum(object_sizes)
        timeout = deadline.remaining()
        if deadline.expired():
            return None  # it passed since the caller's check: no call (nothing was handed over)
        t0 = time.perf_counter()
        pending = self.calls.submit(call, timeout, lambda _exc: lease.release())
        made.append(pending)
        try:
            got = pending.wait(timeout)
        except CallAbandoned:
            lease.shrink(span)  # the rest of the lease goes back to the pool now; these slots stay the call's
            self.ctx.metrics.record(operation, t0, num_keys, num_bytes, num_keys)
            deadline.stop(
                f"the request deadline of {deadline.timeout_s or 0:g} s passed during a staged Mooncake call: "
                f"its {num_keys} key(s) failed and the call was abandoned (it still runs; its staging slots "
                "stay leased until it returns)"
            )
            logger.warning("staged %s of %d key(s) abandoned after %.1f s: %s", operation, num_keys,
                           time.perf_counter() - t0, deadline.reason)  # fmt: skip
            return None
        except BaseException:
            if pending.abandoned:
                lease.shrink(span)
            self._record(operation, t0, num_keys, num_bytes, None)
            raise
        self._record(operation, t0, num_keys, num_bytes, got)
        return got

    def describe(self) -> str:
        return f"{super().describe()}, staging pool {self.pool.capacity / (1 << 20):.1f} MiB"

    def plan_get(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash],
        screened: Sequence[Screened],
        skip: int,
        tp_rank: int,
        tails: Mapping[int, int] = _NO_TAILS,
    ) -> KeyPlan:
        """The walk, keys, int64 rows and staging slots in one native call per group (``plan_load_arrays``).

        With the scatter after the get, a one-group load crosses into the native module twice; ``G`` groups
        take ``G`` planning calls (their arrays are joined with numpy), then one scatter per staging batch
        (docs/transfer-modes.md, "The staged load's crossings"). The keys, block ids and slots are rotated for
        the rank, the rows stay in walk order (:attr:`KeyPlan.row_shift`); the slot layout is the native one
        when nothing moved, else laid out again from the object sizes (numpy, the same layout as
        :func:`~mooncake_kvaddr.driver.staging.plan_slots`). A request with an invalid
        block id takes the shared walk-then-prepare plan, which drops the chunks on it before any row is built;
        so do databases of any other type (vLLM 0.33 layout databases, driver/groups.py; subclasses).
        """
        if (
            any(s.bad for s in screened)
            or not all(type(db) is ChunkedTokenDatabase for db in self.ctx.databases)
            or not rows_bounded(self.ctx.databases)
        ):
            # The fused plan's slot layout decides where Mooncake writes inside the lease: only a database whose
            # plan is ours is trusted with it; any other gets slots laid out here from its sizes.
            return super().plan_get(token_len, block_hashes, screened, skip, tp_rank, tails)
        parts = [
            db.plan_load_arrays(token_len, block_hashes, screened[g].ids, skip, slot_alignment=SLOT_ALIGNMENT)
            for g, db in enumerate(self.ctx.databases)
        ]
        if not rows_bounded(self.ctx.databases):  # changed while planning: lay the slots out here after all
            return super().plan_get(token_len, block_hashes, screened, skip, tp_rank, tails)
        parts = [p for p in parts if p.keys]
        if not parts:
            return KeyPlan([], [], [], [])
        if len(parts) == 1:
            only = parts[0]
            keys, addrs, sizes, ids = only.keys, only.addrs, only.sizes, only.block_ids
            object_sizes = only.object_sizes
        else:
            keys = [k for p in parts for k in p.keys]
            addrs = np.concatenate([p.addrs for p in parts])  # equal region counts: one registered layout
            sizes = np.concatenate([p.sizes for p in parts])
            ids = np.concatenate([p.block_ids for p in parts])
            object_sizes = np.concatenate([p.object_sizes for p in parts])
        shift = tp_rank % len(keys)
        if len(parts) == 1 and shift == 0:
            slots = only.slots
        else:
            # Each rank starts at a different key so that ranks spread over the pool's segments. The rows stay
            # in walk order (rotating two (n, R) matrices would cost more than planning them): the get finds
            # key i's row at (i + shift) % n.
            keys, ids, object_sizes = rotate(keys, shift), rotate(ids, shift), rotate(object_sizes, shift)
            bound = sum(p.total_bytes for p in parts) + SLOT_ALIGNMENT * len(keys)
            if bound >= 1 << 63:
                plan_slots(sizes)  # raises OverflowError: the layout does not fit in int64
            # plan_slots's layout from the object sizes alone (never negative: from a native plan): each slot at
            # the running end rounded up to SLOT_ALIGNMENT; total_bytes ends at the last slot's object.
            padded = (object_sizes + (SLOT_ALIGNMENT - 1)) & -SLOT_ALIGNMENT
            ends = np.cumsum(padded)
            offsets = ends - padded
            total = int(offsets[-1] + object_sizes[-1]) if len(offsets) else 0
            slots = SlotPlan(offsets, object_sizes, total)
        return KeyPlan(keys, addrs, sizes, ids, slots=slots, row_shift=shift)

    def _lease_unless_refused(self, plan: SlotPlan, deadline: RequestDeadline, clock: Clock) -> StagingLease | None:
        """A lease for the plan's keys, waiting at most until the deadline; ``None`` when too many abandoned calls
        are in flight or the deadline expired meanwhile."""
        if self._refused(deadline):
            return None
        lease = self._lease(plan, deadline)
        clock.lap("staging_wait")
        return lease

    def _lease(self, plan: SlotPlan, deadline: RequestDeadline) -> StagingLease | None:
        """A lease for the plan's keys, waiting at most until the deadline (``None`` if it expired meanwhile)."""
        remaining = deadline.remaining()
        largest = int(plan.object_sizes.max()) if len(plan.object_sizes) else 0
        timeout = STAGING_WAIT_S if remaining is None else min(STAGING_WAIT_S, remaining)
        try:
            lease = self.pool.acquire(largest, plan.total_bytes, timeout=timeout)
        except TimeoutError:
            if deadline.expired():
                return None
            raise
        try:
            # Mooncake writes (get) and reads (put) the slots at lease.ptr + offset: the lease must lie inside a
            # live staging buffer this package allocated, whatever pool object handed it out (SECURITY.md).
            check_staging(lease)
        except (TypeError, ValueError) as exc:
            # Not given back: a range outside the pool's buffer is not the pool's to reuse.
            raise ValueError(f"the staging pool handed out a lease that is not project-owned staging: {exc}") from exc
        return lease

    def _put_prepared(
        self, keys: list[str], rows: tuple[Any, ...], clock: Clock, result: StoreResult, deadline: RequestDeadline
    ) -> tuple[list[bool], list[int]]:
        addrs, sizes = rows
        plan = plan_slots(sizes)
        lease = self._lease_unless_refused(plan, deadline, clock)
        if lease is None:
            count(result.outcomes, NOT_TRIED, len(keys))
            return [False] * len(keys), plan.object_sizes.tolist()
        made: list[PendingCall[BatchResult]] = []
        stop = _Stop(len(keys), result.outcomes, deadline, self._refused)

        def fill(start: int, end: int, slots: Int64Array, _select: object) -> bool:
            try:
                self.copy.gather(addrs[start:end], sizes[start:end], lease.range, slots)
            except (ValueError, RuntimeError) as exc:
                logger.warning("store %s: gather of keys %d..%d failed: %s", result.req_id, start, end - 1, exc)
                count(result.outcomes, "gather_failed", end - start)
                return False
            finally:
                clock.lap("gather")
            return True

        def put(start: int, end: int, ptrs: list[int], object_sizes: list[int]) -> tuple[int, ...] | None:
            config = per_key.config_for(self.ctx.replicate_config, range(start, end), len(keys))  # per-key fields cut
            call = partial(self.ctx.store.batch_put_from, keys[start:end], ptrs, object_sizes, config,
                           check_values=False, deadline=deadline)  # fmt: skip
            got = self._call("save_put", call, lease, ptrs, object_sizes, deadline, made)
            clock.lap("put")
            if got is not None:
                result.back_pressure = result.back_pressure or got.back_pressure
            # Abandoned (None): Mooncake may still read these slots (the lease stays the call's), and whether it
            # stores the objects is unknown: they count as failed (a later store finds them, or not).
            return stop.answer(start, got)

        try:
            run = run_staged(False, plan, lease, put, fill, stop.proceed)
        finally:
            if not any(call.abandoned for call in made):
                lease.release()
        return run.done.tolist(), plan.object_sizes.tolist()

    def get(
        self, plan: KeyPlan, start: int, end: int, clock: Clock, outcomes: dict[str, int], deadline: RequestDeadline
    ) -> GetOutcome:
        if plan.row_shift:
            addrs, sizes = plan.addrs, plan.sizes  # whole, in walk order: the scatter selects the batch's rows
        else:
            addrs, sizes = plan.addrs[start:end], plan.sizes[start:end]
        keys = plan.keys[start:end]
        slots_plan = plan_slots(sizes) if plan.slots is None else _sub_plan(plan.slots, start, end)
        lease = self._lease_unless_refused(slots_plan, deadline, clock)
        if lease is None:
            count(outcomes, NOT_TRIED, len(keys))
            return GetOutcome(np.zeros(len(keys), dtype=bool), False, 0)
        made: list[PendingCall[BatchResult]] = []
        stop = _Stop(len(keys), outcomes, deadline, self._refused)

        def get(lo: int, hi: int, ptrs: list[int], expected: list[int]) -> tuple[int, ...] | None:
            call = partial(self.ctx.store.batch_get_into, keys[lo:hi], ptrs, expected, check_values=False,
                           deadline=deadline)  # fmt: skip
            got = self._call("load_get", call, lease, ptrs, expected, deadline, made)
            clock.lap("get")
            # Abandoned (None): Mooncake may still write these slots, so nothing is scattered from them.
            return stop.answer(lo, got)

        def put_back(lo: int, hi: int, slots: Int64Array, whole: BoolArray | None) -> bool:
            # Only keys read whole: a failed key's slot holds stale bytes of an earlier request.
            if whole is not None and whole.any():
                if plan.row_shift:
                    rows = (np.arange(start + lo, start + hi) + plan.row_shift) % len(plan.keys)
                    row_slots = np.zeros(len(plan.keys), dtype=np.int64)
                    row_slots[rows] = slots
                    select = np.zeros(len(plan.keys), dtype=bool)
                    select[rows] = whole
                    self.copy.scatter(addrs, sizes, lease.range, row_slots, select=select)
                else:
                    self.copy.scatter(addrs[lo:hi], sizes[lo:hi], lease.range, slots, select=whole)
            clock.lap("scatter")
            return True

        try:
            run = run_staged(True, slots_plan, lease, get, put_back, stop.proceed)
        finally:
            if not any(call.abandoned for call in made):
                lease.release()
        return GetOutcome(run.done, stop.unreachable, int(slots_plan.object_sizes[run.done].sum()))


class _Stop:
    """When a staged request stops between batches, and how its untried keys are counted: after an answer with
    ``CODE_MASTER_UNREACHABLE`` (every further batch would block only to report the same), at the deadline, or
    while too many abandoned calls are in flight; an abandoned call's keys and all after them are not tried."""

    def __init__(
        self, num_keys: int, outcomes: dict[str, int], deadline: RequestDeadline, refused: Callable[..., bool]
    ) -> None:
        self.num_keys = num_keys
        self.outcomes = outcomes
        self.deadline = deadline
        self.refused = refused
        self.unreachable = False

    def proceed(self, start: int) -> bool:
        if self.unreachable:
            count(self.outcomes, Outcome.MASTER_UNREACHABLE.value, self.num_keys - start)
            return False
        if self.deadline.expired() or self.refused(self.deadline):
            count(self.outcomes, NOT_TRIED, self.num_keys - start)
            return False
        return True

    def answer(self, start: int, got: BatchResult | None) -> tuple[int, ...] | None:
        """The codes of a batch's answer, its outcomes counted; ``None`` (the keys from ``start`` on counted as
        not tried) for an abandoned call."""
        if got is None:
            count(self.outcomes, NOT_TRIED, self.num_keys - start)
            return None
        for outcome, n in got.summary().items():
            count(self.outcomes, outcome, n)
        self.unreachable = self.unreachable or CODE_MASTER_UNREACHABLE in got.codes
        return got.codes
