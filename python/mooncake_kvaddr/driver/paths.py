"""One object per transfer mode behind one put/get interface (see ``docs/transfer-modes.md``).

:class:`KVTransfer <mooncake_kvaddr.driver.transfer.KVTransfer>` owns the request logic (which chunks,
which keys, existence checks, results); a :class:`TransferPath` owns how the bytes of those keys move:

* :class:`MultiBufferPath` - every key's regions to Mooncake's ``batch_*_multi_buffers`` calls;
* :class:`DirectPath` - one region per key: ``batch_put_from`` / ``batch_get_into`` on the cache itself;
* :class:`StagedPath` - each key through one contiguous slot of a staging pool (native gather/scatter).

Adding a path is one subclass: :meth:`TransferPath.prepare` (rows for chunks), :meth:`TransferPath.put` and
:meth:`TransferPath.get`; planning a load is shared (:meth:`TransferPath.plan_get`) and may be overridden
by a path with a fused plan (:class:`MultiBufferPath` does). Every put and get receives the request's
:class:`~mooncake_kvaddr.driver.store.RequestDeadline`: it passes it to each store call and checks it before
each batch of its own; keys it no longer tries are counted ``transfer_failed`` (``docs/transfer-modes.md``,
"Deadlines").

The three paths share one module so that their put and get can be compared side by side; a new path
belongs in a module of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.driver.bounds import RegisteredCaches, Screened
from mooncake_kvaddr.driver.config import DEFAULT_MAX_ABANDONED_CALLS
from mooncake_kvaddr.driver.probe import PeerProbe, PeerScreen
from mooncake_kvaddr.driver.results import Clock, StoreResult, count
from mooncake_kvaddr.driver.rules import OperationRecorder, group_runs, rotate
from mooncake_kvaddr.driver.staging import (
    SLOT_ALIGNMENT,
    CopyBackend,
    SlotPlan,
    StagingLease,
    StagingPool,
    check_staging,
    plan_batches,
    plan_slots,
)
from mooncake_kvaddr.driver.store import (
    CODE_MASTER_UNREACHABLE,
    BatchResult,
    MooncakeStore,
    Outcome,
    RequestDeadline,
)
from mooncake_kvaddr.driver.workers import CallAbandoned, CallRunner, PendingCall

__all__ = [
    "DirectPath",
    "GetPlan",
    "MultiBufferPath",
    "PathContext",
    "StagedPath",
    "TransferPath",
    "check_rows_inside",
    "register_bounded_rows",
    "rows_bounded",
]

logger = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# How long a staged request waits for room in a shared staging pool before it fails (a transfer in flight
# holds its lease for at most Mooncake's 60 s timeout per call); never longer than the request's deadline.
STAGING_WAIT_S: Final = 300.0
#: The outcome of keys a request no longer tries once its deadline has expired.
NOT_TRIED: Final = Outcome.TRANSFER_FAILED.value


#: The methods whose rows Mooncake is handed in the multi-buffer mode.
_ROW_METHODS: Final = ("prepare_values", "prepare_values_array", "plan_load", "plan_load_arrays")
#: Database types whose rows are bounded by construction (computed natively from the pinned, registered regions
#: and screened block ids): exact type -> a per-instance check (e.g. no row method overridden on the instance).
_BOUNDED_ROWS: dict[type, Callable[[Any], bool]] = {}


def _no_instance_overrides(obj: Any) -> bool:
    """No row method replaced on the instance itself."""
    own = getattr(obj, "__dict__", {})
    return not any(name in own for name in _ROW_METHODS)


def register_bounded_rows(cls: type, check: Callable[[Any], bool] = _no_instance_overrides) -> None:
    """Declare that databases of exactly ``cls`` (not subclasses) compute rows inside the registered caches
    whenever ``check(database)`` holds; the multi-buffer path then skips its own slice check for them."""
    _BOUNDED_ROWS[cls] = check


register_bounded_rows(ChunkedTokenDatabase)


def rows_bounded(databases: Sequence[Any]) -> bool:
    """Whether every database's rows are bounded by construction (see :func:`register_bounded_rows`). Anything
    else - a subclass overriding how rows are computed, a duck-typed planner - has every row checked against the
    registered caches before Mooncake sees it."""
    for db in databases:
        check = _BOUNDED_ROWS.get(type(db))
        if check is None or not check(db):
            return False
    return True


def check_rows_inside(caches: RegisteredCaches, addrs: Any, sizes: Any) -> tuple[Int64Array, Int64Array]:
    """Fresh int64 copies of the rows, every ``(address, size)`` slice of which lies inside its registered
    region; ``ValueError`` (naming the first bad key) otherwise.

    Hand Mooncake the copies, never the rows checked: whoever made the rows may still hold them and edit them
    after the check. Rows that are not integer rows of one length per registered region (or overflow int64)
    are refused from the first key."""
    try:
        a = np.array(addrs, dtype=np.int64, copy=True)
        s = np.array(sizes, dtype=np.int64, copy=True)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("key 0: its region lies outside the registered caches (rows are not int64 rows)") from None
    if len(a) == 0 and len(s) == 0:
        return a.reshape(0, caches.regions_per_key), s.reshape(0, caches.regions_per_key)
    if a.ndim != 2 or a.shape != s.shape or a.shape[1] != caches.regions_per_key:
        raise ValueError("key 0: its region lies outside the registered caches (rows of another shape)")
    inside = caches.slices_inside(a, s)
    if not inside.all():
        raise ValueError(f"key {int(np.flatnonzero(~inside)[0])}: its region lies outside the registered caches")
    return a, s


@dataclass
class PathContext:
    """What every path needs: the store, the group databases, the registered caches, put options, metrics."""

    store: MooncakeStore
    databases: list[ChunkedTokenDatabase]
    caches: RegisteredCaches
    replicate_config: Any
    metrics: OperationRecorder
    #: Proves new peers responsive before a get Mooncake writes into the KV cache itself (multi-buffer,
    #: direct); ``None``: no probing (docs/multihost.md, "Hung peer").
    probe: PeerProbe | None = None


@dataclass
class GetPlan:
    """A load's keys in transfer order with their rows (lists or int64 matrices, by path) and block ids."""

    keys: list[str]
    addrs: Any
    sizes: Any
    block_ids: Sequence[int] | Int64Array
    #: Block ids outside the registered blocks (id -> reason): their chunks were dropped from the plan.
    invalid: dict[int, str] = field(default_factory=dict)
    dropped: int = 0  # chunks dropped for an invalid block id
    #: The staging slot layout of every key in plan order, when the path planned it with the rows
    #: (:class:`StagedPath`'s fused plan); ``None``: lay slots out from ``sizes`` when needed.
    slots: SlotPlan | None = None
    #: 0: ``addrs``/``sizes`` rows are in transfer order. Else they are in walk order (the rank's rotation
    #: was applied to the keys, block ids and slots only, not to the large matrices): key ``i`` has row
    #: ``(i + row_shift) % len(keys)``. Only :class:`StagedPath` makes and reads such plans.
    row_shift: int = 0
    #: The databases' rows were bounded by construction when this plan was made (:func:`rows_bounded`);
    #: ``False`` (the default): the rows are checked against the registered caches before Mooncake sees them.
    bounded: bool = False

    def key_bytes(self) -> list[int]:
        """Each key's object size (the sum of its region sizes)."""
        if self.slots is not None:
            return [int(x) for x in self.slots.object_sizes.tolist()]
        if isinstance(self.sizes, np.ndarray):
            return [int(x) for x in self.sizes.sum(axis=1)] if len(self.keys) else []
        return [sum(row) for row in self.sizes]


@dataclass
class GetOutcome:
    """Per key of a sub-batch: read whole (``loaded``); ``unreachable``: later sub-batches are pointless."""

    loaded: BoolArray
    unreachable: bool
    nbytes: int  # bytes of the keys read whole


class TransferPath:
    """How the bytes of a batch of keys move between the KV cache and Mooncake (one subclass per mode)."""

    name: ClassVar[str] = ""

    def __init__(self, ctx: PathContext) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ planning

    def prepare(self, chunks: Any, groups: Sequence[int], block_ids: Sequence[Sequence[int]]) -> tuple[Any, Any, Any]:
        """Address rows, size rows and first block ids of group-major chunks, as this path wants them.

        Default: int64 matrices, one ``prepare_values_array`` per run of a group.
        """
        parts = [
            self.ctx.databases[g].prepare_values_array(chunks[start:end], block_ids[g])
            for g, start, end in group_runs(groups)
        ]
        if len(parts) == 1:
            return parts[0]
        addrs, sizes, ids = zip(*parts, strict=True)
        return np.concatenate(addrs), np.concatenate(sizes), np.concatenate(ids)

    def plan_get(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash],
        screened: Sequence[Screened],
        skip: int,
        tp_rank: int,
    ) -> GetPlan:
        """Keys and rows of a load in the rank's rotated order: the walk per group, then :meth:`prepare`.

        ``screened`` holds each group's block ids (a snapshot) and the positions of invalid ones: chunks on
        those are dropped before any row is computed and reported in :attr:`GetPlan.invalid`.
        """
        bounded = rows_bounded(self.ctx.databases)  # before any row is computed
        keys: list[str] = []
        parts: list[Int64Array] = []
        groups: list[int] = []
        for g, db in enumerate(self.ctx.databases):
            walk = db.walk_load(token_len, block_hashes, skip)
            keys.extend(walk.keys)
            parts.append(walk.chunks)
            groups.extend([g] * len(walk.keys))
        if not keys:
            return GetPlan([], [], [], [])
        chunks = parts[0] if len(parts) == 1 else np.concatenate(parts)
        # Rotate the chunks (two ints each), not the rows: the rows are then computed in the rotated order.
        keys, chunks, groups = rotate(keys, tp_rank), rotate(chunks, tp_rank), rotate(groups, tp_rank)
        invalid: dict[int, str] = {}
        if any(s.bad for s in screened):
            keep = np.ones(len(keys), dtype=bool)
            for i, (g, start) in enumerate(zip(groups, chunks[:, 0].tolist(), strict=True)):
                position = start // self.ctx.databases[g].block_size
                reason = screened[g].bad.get(position)
                if reason is not None:
                    keep[i] = False
                    invalid[screened[g].ids[position]] = reason
            keys = [k for k, good in zip(keys, keep.tolist(), strict=True) if good]
            groups = [x for x, good in zip(groups, keep.tolist(), strict=True) if good]
            chunks = chunks[keep]
            dropped = len(keep) - len(keys)
            if not keys:
                return GetPlan([], [], [], [], invalid, dropped)
        else:
            dropped = 0
        addrs, sizes, ids = self.prepare(chunks, groups, [s.ids for s in screened])
        return GetPlan(keys, addrs, sizes, ids, invalid, dropped, bounded=bounded)

    # ------------------------------------------------------------------ moving bytes

    def put(
        self,
        keys: list[str],
        chunks: Sequence[tuple[int, int]],
        groups: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        clock: Clock,
        result: StoreResult,
        deadline: RequestDeadline,
    ) -> tuple[list[bool], list[int]]:
        """Put these (missing) keys; per key: stored or not, and its object size. Counts into ``result``.

        Within ``deadline`` only: keys not tried once it expired are counted ``transfer_failed``.
        """
        raise NotImplementedError

    def get(
        self, plan: GetPlan, start: int, end: int, clock: Clock, outcomes: dict[str, int], deadline: RequestDeadline
    ) -> GetOutcome:
        """Get keys ``[start, end)`` of ``plan`` into the cache; counts their outcomes into ``outcomes``.

        Within ``deadline`` only: keys not tried once it expired are counted ``transfer_failed``, never loaded.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release what the path holds (default: nothing)."""

    def describe(self) -> str:
        """A short description for the log line that announces the mode."""
        return f"{self.ctx.caches.regions_per_key} regions per key, host memory"

    # ------------------------------------------------------------------ shared helpers

    def _record(self, operation: str, start: float, num_keys: int, num_bytes: int, got: BatchResult | None) -> None:
        failed = None if got is None else len(got) - got.count(Outcome.OK)
        self.ctx.metrics.record(operation, start, num_keys, num_bytes, failed)


def _read_whole(got: BatchResult, expected: Int64Array) -> BoolArray:
    """Per key: the get succeeded and read exactly the object size asked for."""
    codes = np.asarray(got.codes, dtype=np.int64)
    whole: BoolArray = (codes == expected) & (codes > 0)
    return whole


def _take(rows: Any, picks: npt.NDArray[np.intp]) -> Any:
    """The rows at ``picks`` of a list or an array."""
    if isinstance(rows, np.ndarray):
        return rows[picks]
    return [rows[int(i)] for i in picks]


def _spread(values: BoolArray, picks: npt.NDArray[np.intp], n: int) -> BoolArray:
    """``values`` of the keys at ``picks`` as a mask over all ``n`` keys (False elsewhere)."""
    out = np.zeros(n, dtype=bool)
    out[picks] = values
    return out


def _screen_peers(
    ctx: PathContext, keys: list[str], deadline: RequestDeadline, outcomes: dict[str, int], clock: Clock
) -> tuple[PeerScreen | None, npt.NDArray[np.intp] | None]:
    """Ask the probe which of ``keys`` may go to Mooncake: ``(screen, picks)``; ``picks`` is ``None`` for all
    of them, else the indices allowed (the others are counted not tried here). Its time is the "probe" phase."""
    if ctx.probe is None:
        return None, None
    screen = ctx.probe.screen(keys, deadline)
    clock.lap("probe")
    if screen.stop:
        count(outcomes, NOT_TRIED, len(keys))
        return screen, np.zeros(0, dtype=np.intp)
    if screen.allowed is None:
        return screen, None
    picks = np.flatnonzero(screen.allowed)
    count(outcomes, NOT_TRIED, len(keys) - len(picks))
    return screen, picks


def _after_peers(
    ctx: PathContext, screen: PeerScreen | None, picks: npt.NDArray[np.intp] | None, n: int, got: BatchResult
) -> BoolArray:
    """Per key of the whole sub-batch: read whole by ``got`` (made for ``picks``); the probe forgets the peers
    of the keys whose transfer failed."""
    loaded = np.fromiter((o is Outcome.OK for o in got.outcomes), dtype=bool, count=len(got.outcomes))
    failed = np.fromiter((o is Outcome.TRANSFER_FAILED for o in got.outcomes), dtype=bool, count=len(got.outcomes))
    if picks is not None:
        loaded, failed = _spread(loaded, picks, n), _spread(failed, picks, n)
    if ctx.probe is not None and screen is not None:
        ctx.probe.forget(screen.endpoints, failed)
    return loaded


class MultiBufferPath(TransferPath):
    """Every key's regions go to ``batch_*_multi_buffers``: as int64 matrices when the store's native client
    is on (no Python object per region), else as Python lists (one fused native plan per group)."""

    name = "multi_buffer"

    @property
    def _arrays(self) -> bool:
        """The store takes int64 matrices straight through (docs/native-client.md, "In the driver")."""
        return bool(getattr(self.ctx.store, "native_client_active", False))

    def prepare(self, chunks: Any, groups: Sequence[int], block_ids: Sequence[Sequence[int]]) -> tuple[Any, Any, Any]:
        """List rows: one ``prepare_values`` per run of a group (int64 matrices with the native client)."""
        if self._arrays:
            return super().prepare(chunks, groups, block_ids)
        addrs: list[Sequence[int]] = []
        sizes: list[Sequence[int]] = []
        ids: list[int] = []
        for g, start, end in group_runs(groups):
            part = chunks[start:end]
            if isinstance(part, np.ndarray):
                part = part.tolist()
            a, s, b = self.ctx.databases[g].prepare_values(part, block_ids[g])
            addrs.extend(a)
            sizes.extend(s)
            ids.extend(b)
        return addrs, sizes, ids

    def _check_unbounded(self, addrs: Any, sizes: Any, bounded: bool) -> tuple[Any, Any]:
        """The rows to hand Mooncake. Its multi-buffer calls read and write the slices with no check of their
        own: rows from a database whose rows are not bounded by construction (:func:`rows_bounded`, when the
        rows were computed and now) are replaced by checked copies (of the same kind: arrays or lists)."""
        if bounded and rows_bounded(self.ctx.databases):
            return addrs, sizes
        a, s = check_rows_inside(self.ctx.caches, addrs, sizes)
        if isinstance(addrs, np.ndarray):
            return a, s
        return a.tolist(), s.tolist()

    def plan_get(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash],
        screened: Sequence[Screened],
        skip: int,
        tp_rank: int,
    ) -> GetPlan:
        """The walk, the keys and the rows in one native pass per group (``plan_load``), then rotated.

        A request with an invalid block id takes the shared walk-then-prepare plan instead, which drops the
        chunks on it before any row is computed.
        """
        if self._arrays or any(s.bad for s in screened):
            return super().plan_get(token_len, block_hashes, screened, skip, tp_rank)
        bounded = rows_bounded(self.ctx.databases)  # before any row is computed
        keys: list[str] = []
        addrs: list[Sequence[int]] = []
        sizes: list[Sequence[int]] = []
        ids: list[int] = []
        for g, db in enumerate(self.ctx.databases):
            plan = db.plan_load(token_len, block_hashes, screened[g].ids, skip)
            keys.extend(plan.keys)
            addrs.extend(plan.addrs)
            sizes.extend(plan.sizes)
            ids.extend(plan.block_ids)
        # Each rank starts at a different key so that ranks spread over the pool's segments.
        return GetPlan(
            rotate(keys, tp_rank), rotate(addrs, tp_rank), rotate(sizes, tp_rank), rotate(ids, tp_rank), bounded=bounded
        )

    def put(
        self,
        keys: list[str],
        chunks: Sequence[tuple[int, int]],
        groups: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        clock: Clock,
        result: StoreResult,
        deadline: RequestDeadline,
    ) -> tuple[list[bool], list[int]]:
        bounded = rows_bounded(self.ctx.databases)  # before any row is computed
        addrs, sizes, _ = self.prepare(chunks, groups, block_ids)
        addrs, sizes = self._check_unbounded(addrs, sizes, bounded)
        if isinstance(sizes, np.ndarray):
            key_bytes = sizes.sum(axis=1).tolist()
        else:
            key_bytes = [sum(row) for row in sizes]
        clock.lap("prepare")
        start = time.perf_counter()
        try:
            # Rows come from prepare_values, so the non-negativity scan would only cost time.
            put = self.ctx.store.batch_put_from_multi_buffers(
                keys, addrs, sizes, self.ctx.replicate_config, check_values=False, deadline=deadline
            )
        except BaseException:
            self._record("save_put", start, len(keys), sum(key_bytes), None)
            raise
        self._record("save_put", start, len(keys), sum(key_bytes), put)
        clock.lap("put")
        for outcome, n in put.summary().items():
            count(result.outcomes, outcome, n)
        result.back_pressure = result.back_pressure or put.back_pressure
        return put.present, key_bytes

    def get(
        self, plan: GetPlan, start: int, end: int, clock: Clock, outcomes: dict[str, int], deadline: RequestDeadline
    ) -> GetOutcome:
        keys = plan.keys[start:end]
        addrs, sizes = plan.addrs[start:end], plan.sizes[start:end]
        addrs, sizes = self._check_unbounded(addrs, sizes, plan.bounded)
        n = len(keys)
        screen, picks = _screen_peers(self.ctx, keys, deadline, outcomes, clock)
        if picks is not None:
            if len(picks) == 0:
                return GetOutcome(np.zeros(n, dtype=bool), False, 0)
            keys, addrs, sizes = _take(keys, picks), _take(addrs, picks), _take(sizes, picks)
        if self.ctx.metrics.callback is None:
            nbytes = 0
        elif isinstance(sizes, np.ndarray):
            nbytes = int(sizes.sum())
        else:
            nbytes = sum(map(sum, sizes))
        t0 = time.perf_counter()
        try:
            got = self.ctx.store.batch_get_into_multi_buffers(keys, addrs, sizes, check_values=False, deadline=deadline)
        except BaseException:
            self._record("load_get", t0, len(keys), nbytes, None)
            raise
        finally:
            clock.lap("get")
        self._record("load_get", t0, len(keys), nbytes, got)
        for outcome, k in got.summary().items():
            count(outcomes, outcome, k)
        loaded = _after_peers(self.ctx, screen, picks, n, got)
        return GetOutcome(loaded, CODE_MASTER_UNREACHABLE in got.codes, got.bytes_transferred)


class DirectPath(TransferPath):
    """One contiguous region per key (cross-layer layouts): the contiguous calls on the KV cache itself."""

    name = "direct"

    def put(
        self,
        keys: list[str],
        chunks: Sequence[tuple[int, int]],
        groups: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        clock: Clock,
        result: StoreResult,
        deadline: RequestDeadline,
    ) -> tuple[list[bool], list[int]]:
        addrs, sizes, _ = self.prepare(chunks, groups, block_ids)
        addrs, sizes = check_rows_inside(self.ctx.caches, addrs, sizes)  # Mooncake gets the checked copies
        clock.lap("prepare")
        object_sizes = sizes[:, 0].tolist()
        t0 = time.perf_counter()
        try:
            put = self.ctx.store.batch_put_from(
                keys, addrs[:, 0].tolist(), object_sizes, self.ctx.replicate_config, check_values=False,
                deadline=deadline,
            )
        except BaseException:
            self._record("save_put", t0, len(keys), sum(object_sizes), None)
            raise
        self._record("save_put", t0, len(keys), sum(object_sizes), put)
        clock.lap("put")
        for outcome, n in put.summary().items():
            count(result.outcomes, outcome, n)
        result.back_pressure = result.back_pressure or put.back_pressure
        return put.present, object_sizes

    def get(
        self, plan: GetPlan, start: int, end: int, clock: Clock, outcomes: dict[str, int], deadline: RequestDeadline
    ) -> GetOutcome:
        # Mooncake's contiguous calls write these ranges with no check of their own: it gets the checked copies.
        addrs, sizes = check_rows_inside(self.ctx.caches, plan.addrs[start:end], plan.sizes[start:end])
        ptrs, expected = addrs[:, 0], sizes[:, 0]
        keys = plan.keys[start:end]
        n = len(keys)
        screen, picks = _screen_peers(self.ctx, keys, deadline, outcomes, clock)
        if picks is not None:
            if len(picks) == 0:
                return GetOutcome(np.zeros(n, dtype=bool), False, 0)
            keys, ptrs, expected = _take(keys, picks), ptrs[picks], expected[picks]
        t0 = time.perf_counter()
        try:
            got = self.ctx.store.batch_get_into(
                keys, ptrs.tolist(), expected.tolist(), check_values=False, deadline=deadline
            )
        except BaseException:
            self._record("load_get", t0, len(keys), int(expected.sum()), None)
            raise
        finally:
            clock.lap("get")
        self._record("load_get", t0, len(keys), int(expected.sum()), got)
        for outcome, k in got.summary().items():
            count(outcomes, outcome, k)
        whole = _read_whole(got, expected)
        nbytes = int(expected[whole].sum())
        if picks is not None:
            whole = _spread(whole, picks, n)
        _after_peers(self.ctx, screen, picks, n, got)
        return GetOutcome(whole, CODE_MASTER_UNREACHABLE in got.codes, nbytes)


def _lay_out(object_sizes: Int64Array) -> SlotPlan:
    """:func:`~mooncake_kvaddr.driver.staging.plan_slots`'s layout from the object sizes alone: each slot at the
    running end rounded up to :data:`SLOT_ALIGNMENT`; ``total_bytes`` ends at the last slot's object.

    The caller checks that the layout fits in int64 (the sizes come from a native plan: never negative).
    """
    padded = (object_sizes + (SLOT_ALIGNMENT - 1)) & -SLOT_ALIGNMENT
    ends = np.cumsum(padded)
    offsets = ends - padded
    total = int(offsets[-1] + object_sizes[-1]) if len(offsets) else 0
    return SlotPlan(offsets, object_sizes, total)


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
        self, ctx: PathContext, pool: StagingPool, copy: CopyBackend, *, max_abandoned_calls: int | None = None
    ) -> None:
        super().__init__(ctx)
        self.pool = pool
        self.copy = copy
        if max_abandoned_calls is None:
            # The store's config; a stand-in store without one (planning tests) gets the default.
            config = getattr(ctx.store, "config", None)
            max_abandoned_calls = getattr(config, "max_abandoned_calls", DEFAULT_MAX_ABANDONED_CALLS)
        limit = int(max_abandoned_calls)
        #: Runs the staged Mooncake calls; counts the abandoned ones still in flight.
        self.calls = CallRunner(limit, name="KVTransferStagedCall")

    def close(self) -> None:
        """End the idle call threads (an abandoned call's thread ends when Mooncake returns)."""
        self.calls.close()

    def _refused(self, deadline: RequestDeadline) -> bool:
        """Whether too many abandoned calls are in flight to make another (then the request is stopped)."""
        if not self.calls.saturated:
            return False
        deadline.stop(
            f"{self.calls.abandoned} staged Mooncake call(s) abandoned at their deadline are still in flight "
            f"(max_abandoned_calls={self.calls.max_abandoned}): a peer hangs; no new staged call until one returns"
        )
        return True

    def _call(
        self,
        operation: str,
        call: Callable[[], BatchResult],
        lease: StagingLease,
        span: int,
        num_keys: int,
        num_bytes: int,
        deadline: RequestDeadline,
        made: list[PendingCall[BatchResult]],
    ) -> BatchResult | None:
        """Make one staged Mooncake call, waiting for it at most until the deadline; appends it to ``made``.

        Returns its result, or ``None`` when the call was abandoned: the deadline is then stopped with the
        reason, the lease shrunk to the ``span`` bytes the call uses, and the lease is the call's to release
        once Mooncake returns. The caller must neither release nor reuse a lease whose call in ``made`` is
        :attr:`~mooncake_kvaddr.driver.workers.PendingCall.abandoned` (also when this raised: an exception
        such as ``KeyboardInterrupt`` while waiting abandons the call too).
        """
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
    ) -> GetPlan:
        """The walk, keys, int64 rows and staging slots in one native call per group (``plan_load_arrays``).

        With the scatter after the get, a one-group load crosses into the native module twice; ``G`` groups
        take ``G`` planning calls (their arrays are joined with numpy), then one scatter per staging batch
        (docs/transfer-modes.md, "The staged load's crossings"). The keys, block ids and slots are rotated for
        the rank, the rows stay in walk order (:attr:`GetPlan.row_shift`); the slot layout is the native one
        when nothing moved, else laid out again from the object sizes (numpy, the same layout as
        :func:`~mooncake_kvaddr.driver.staging.plan_slots`). A request with an invalid
        block id takes the shared walk-then-prepare plan, which drops the chunks on it before any row is built;
        so do databases without a fused array plan (vLLM 0.33 layout databases, driver/layout_adapter.py).
        """
        if (
            any(s.bad for s in screened)
            or not all(hasattr(db, "plan_load_arrays") for db in self.ctx.databases)
            or not rows_bounded(self.ctx.databases)
        ):
            # The fused plan's slot layout decides where Mooncake writes inside the lease: only a database whose
            # plan is ours is trusted with it; any other gets slots laid out here from its sizes.
            return super().plan_get(token_len, block_hashes, screened, skip, tp_rank)
        parts = [
            db.plan_load_arrays(token_len, block_hashes, screened[g].ids, skip, slot_alignment=SLOT_ALIGNMENT)
            for g, db in enumerate(self.ctx.databases)
        ]
        if not rows_bounded(self.ctx.databases):  # changed while planning: lay the slots out here after all
            return super().plan_get(token_len, block_hashes, screened, skip, tp_rank)
        parts = [p for p in parts if p.keys]
        if not parts:
            return GetPlan([], [], [], [])
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
            slots = SlotPlan(only.offsets, only.object_sizes, only.total_bytes)
        else:
            # Each rank starts at a different key so that ranks spread over the pool's segments. The rows stay
            # in walk order (rotating two (n, R) matrices would cost more than planning them): the get finds
            # key i's row at (i + shift) % n.
            keys, ids, object_sizes = rotate(keys, shift), rotate(ids, shift), rotate(object_sizes, shift)
            bound = sum(p.total_bytes for p in parts) + SLOT_ALIGNMENT * len(keys)
            if bound >= 1 << 63:
                plan_slots(sizes)  # raises OverflowError: the layout does not fit in int64
            slots = _lay_out(object_sizes)
        return GetPlan(keys, addrs, sizes, ids, slots=slots, row_shift=shift)

    def _lease(self, object_sizes: Int64Array, total_bytes: int, deadline: RequestDeadline) -> StagingLease | None:
        """A lease for these keys, waiting at most until the deadline (``None`` if it expired meanwhile)."""
        remaining = deadline.remaining()
        largest = int(object_sizes.max()) if len(object_sizes) else 0
        timeout = STAGING_WAIT_S if remaining is None else min(STAGING_WAIT_S, remaining)
        try:
            lease = self.pool.acquire(largest, total_bytes, timeout=timeout)
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

    def put(
        self,
        keys: list[str],
        chunks: Sequence[tuple[int, int]],
        groups: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        clock: Clock,
        result: StoreResult,
        deadline: RequestDeadline,
    ) -> tuple[list[bool], list[int]]:
        addrs, sizes, _ = self.prepare(chunks, groups, block_ids)
        clock.lap("prepare")
        plan = plan_slots(sizes)
        ok = [False] * len(keys)
        if self._refused(deadline):
            count(result.outcomes, NOT_TRIED, len(keys))
            return ok, plan.object_sizes.tolist()
        lease = self._lease(plan.object_sizes, plan.total_bytes, deadline)
        clock.lap("staging_wait")
        if lease is None:
            count(result.outcomes, NOT_TRIED, len(keys))
            return ok, plan.object_sizes.tolist()
        made: list[PendingCall[BatchResult]] = []
        try:
            for start, end in plan_batches(plan, lease.nbytes):
                if deadline.expired() or self._refused(deadline):
                    count(result.outcomes, NOT_TRIED, len(keys) - start)
                    break
                slots = plan.offsets[start:end] - plan.offsets[start]
                try:
                    self.copy.gather(addrs[start:end], sizes[start:end], lease.range, slots)
                except (ValueError, RuntimeError) as exc:
                    clock.lap("gather")
                    logger.warning("store %s: gather of keys %d..%d failed: %s", result.req_id, start, end - 1, exc)
                    count(result.outcomes, "gather_failed", end - start)
                    continue
                clock.lap("gather")
                object_sizes = plan.object_sizes[start:end]
                batch_keys, ptrs, batch_sizes = keys[start:end], (slots + lease.ptr).tolist(), object_sizes.tolist()
                put = self._call(
                    "save_put",
                    partial(self.ctx.store.batch_put_from, batch_keys, ptrs, batch_sizes, self.ctx.replicate_config,
                            check_values=False, deadline=deadline),
                    lease, int(slots[-1] + object_sizes[-1]), end - start, int(object_sizes.sum()), deadline,
                    made,
                )  # fmt: skip
                clock.lap("put")
                if put is None:
                    # Abandoned: Mooncake may still read these slots (the lease stays the call's), and whether
                    # it stores the objects is unknown: they count as failed (a later store finds them, or not).
                    count(result.outcomes, NOT_TRIED, len(keys) - start)
                    break
                ok[start:end] = put.present
                for outcome, n in put.summary().items():
                    count(result.outcomes, outcome, n)
                result.back_pressure = result.back_pressure or put.back_pressure
                if CODE_MASTER_UNREACHABLE in put.codes and end < len(keys):
                    # Every further batch would block only to report the same.
                    count(result.outcomes, Outcome.MASTER_UNREACHABLE.value, len(keys) - end)
                    break
        finally:
            if not any(call.abandoned for call in made):
                lease.release()
        return ok, plan.object_sizes.tolist()

    def get(
        self, plan: GetPlan, start: int, end: int, clock: Clock, outcomes: dict[str, int], deadline: RequestDeadline
    ) -> GetOutcome:
        if plan.row_shift:
            addrs, sizes = plan.addrs, plan.sizes  # whole, in walk order: the scatter selects the batch's rows
        else:
            addrs, sizes = plan.addrs[start:end], plan.sizes[start:end]
        keys = plan.keys[start:end]
        loaded = np.zeros(end - start, dtype=bool)
        slots_plan = plan_slots(sizes) if plan.slots is None else _sub_plan(plan.slots, start, end)
        if self._refused(deadline):
            count(outcomes, NOT_TRIED, len(keys))
            return GetOutcome(loaded, False, 0)
        lease = self._lease(slots_plan.object_sizes, slots_plan.total_bytes, deadline)
        clock.lap("staging_wait")
        if lease is None:
            count(outcomes, NOT_TRIED, len(keys))
            return GetOutcome(loaded, False, 0)
        made: list[PendingCall[BatchResult]] = []
        try:
            for lo, hi in plan_batches(slots_plan, lease.nbytes):
                if deadline.expired() or self._refused(deadline):
                    # Nothing of these keys reaches the cache: no get, no scatter.
                    count(outcomes, NOT_TRIED, len(keys) - lo)
                    break
                slots = slots_plan.offsets[lo:hi] - slots_plan.offsets[lo]
                expected = slots_plan.object_sizes[lo:hi]
                ptrs = (slots + lease.ptr).tolist()
                got = self._call(
                    "load_get",
                    partial(self.ctx.store.batch_get_into, keys[lo:hi], ptrs, expected.tolist(), check_values=False,
                            deadline=deadline),
                    lease, int(slots[-1] + expected[-1]), hi - lo, int(expected.sum()), deadline, made,
                )  # fmt: skip
                clock.lap("get")
                if got is None:
                    # Abandoned: Mooncake may still write these slots, so nothing is scattered from them.
                    count(outcomes, NOT_TRIED, len(keys) - lo)
                    break
                for outcome, n in got.summary().items():
                    count(outcomes, outcome, n)
                whole = _read_whole(got, expected)
                if whole.any():
                    # Only keys read whole: a failed key's slot holds stale bytes of an earlier request.
                    if plan.row_shift:
                        rows = (np.arange(start + lo, start + hi) + plan.row_shift) % len(plan.keys)
                        row_slots = np.zeros(len(plan.keys), dtype=np.int64)
                        row_slots[rows] = slots
                        select = np.zeros(len(plan.keys), dtype=bool)
                        select[rows] = whole
                        self.copy.scatter(addrs, sizes, lease.range, row_slots, select=select)
                    else:
                        self.copy.scatter(addrs[lo:hi], sizes[lo:hi], lease.range, slots, select=whole)
                loaded[lo:hi] = whole
                clock.lap("scatter")
                if CODE_MASTER_UNREACHABLE in got.codes:
                    if hi < len(keys):
                        count(outcomes, Outcome.MASTER_UNREACHABLE.value, len(keys) - hi)
                    return GetOutcome(loaded, True, int(slots_plan.object_sizes[loaded].sum()))
        finally:
            if not any(call.abandoned for call in made):
                lease.release()
        return GetOutcome(loaded, False, int(slots_plan.object_sizes[loaded].sum()))
