"""The shared half of the transfer paths: :class:`TransferPath` (the interface and the shared load plan), the
plan and context objects it passes around, and the checks that keep Mooncake's rows inside the registered caches.
Every path module builds on this one; :mod:`mooncake_kvaddr.driver.paths` re-exports it all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Final

import numpy as np

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver.bounds import RegisteredCaches, Screened
from mooncake_kvaddr.driver.probe import PeerProbe
from mooncake_kvaddr.driver.results import Clock, StoreResult, count
from mooncake_kvaddr.driver.rules import OperationRecorder, group_runs, rotate
from mooncake_kvaddr.driver.staging import BoolArray, Int64Array
from mooncake_kvaddr.driver.store import BatchResult, MooncakeStore, Outcome, RequestDeadline

__all__ = [
    "NOT_TRIED",
    "GetOutcome",
    "PathContext",
    "TransferPath",
    "check_rows_inside",
    "register_bounded_rows",
    "rows_bounded",
]


#: The outcome of keys a request no longer tries once its deadline has expired.
NOT_TRIED: Final = Outcome.TRANSFER_FAILED.value


#: The methods whose rows Mooncake is handed in the multi-buffer mode.
_ROW_METHODS: Final = ("prepare_values", "prepare_values_array", "plan_load", "plan_load_arrays")
#: Database types whose rows are bounded by construction (computed natively from the pinned, registered regions
#: and screened block ids): exact type -> a per-instance check (e.g. no row method overridden on the instance).
#: No tail-key boundary in any group (a load's default).
_NO_TAILS: Final[Mapping[int, int]] = MappingProxyType({})
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
        tails: Mapping[int, int] = _NO_TAILS,
    ) -> KeyPlan:
        """Keys and rows of a load in the rank's rotated order: the walk per group, then :meth:`prepare`.

        ``screened`` holds each group's block ids (a snapshot) and the positions of invalid ones: chunks on
        those are dropped before any row is computed and reported in :attr:`KeyPlan.invalid`. ``tails``: per
        group, a checked tail-key boundary (layout groups only, driver/groups.py).
        """
        bounded = rows_bounded(self.ctx.databases)  # before any row is computed
        keys: list[str] = []
        parts: list[Int64Array] = []
        groups: list[int] = []
        for g, db in enumerate(self.ctx.databases):
            tail = (tails[g],) if g in tails else ()  # layout groups only
            walk = db.walk_load(token_len, block_hashes, skip, *tail)
            keys.extend(walk.keys)
            parts.append(walk.chunks)
            groups.extend([g] * len(walk.keys))
        if not keys:
            return KeyPlan([], [], [], [])
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
                return KeyPlan([], [], [], [], invalid=invalid, dropped=dropped)
        else:
            dropped = 0
        addrs, sizes, ids = self.prepare(chunks, groups, [s.ids for s in screened])
        return KeyPlan(keys, addrs, sizes, ids, invalid=invalid, dropped=dropped, bounded=bounded)

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

        Within ``deadline`` only: keys not tried once it expired are counted ``transfer_failed``. The rows of
        :meth:`_put_rows` (the "prepare" phase), then :meth:`_put_prepared`.
        """
        rows = self._put_rows(chunks, groups, block_ids)
        clock.lap("prepare")
        return self._put_prepared(keys, rows, clock, result, deadline)

    def _put_rows(self, chunks: Any, groups: Sequence[int], block_ids: Sequence[Sequence[int]]) -> tuple[Any, ...]:
        """What a put hands on, computed in the "prepare" phase (default: :meth:`prepare`'s address and size rows,
        as they are)."""
        addrs, sizes, _ = self.prepare(chunks, groups, block_ids)
        return addrs, sizes

    def _put_prepared(
        self, keys: list[str], rows: tuple[Any, ...], clock: Clock, result: StoreResult, deadline: RequestDeadline
    ) -> tuple[list[bool], list[int]]:
        """:meth:`put` of the keys with what :meth:`_put_rows` computed."""
        raise NotImplementedError

    def get(
        self, plan: KeyPlan, start: int, end: int, clock: Clock, outcomes: dict[str, int], deadline: RequestDeadline
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

    def _call_inline(
        self,
        operation: str,
        num_keys: int,
        num_bytes: int,
        call: Callable[[], BatchResult],
        clock: Clock,
        lap: str,
        outcomes: dict[str, int],
    ) -> BatchResult:
        """One Mooncake call in the caller's thread: recorded (also when it raises), lapped, outcomes counted."""
        start = time.perf_counter()
        try:
            got = call()
        except BaseException:
            self._record(operation, start, num_keys, num_bytes, None)
            raise
        finally:
            clock.lap(lap)
        self._record(operation, start, num_keys, num_bytes, got)
        for outcome, n in got.summary().items():
            count(outcomes, outcome, n)
        return got
