"""The two paths whose Mooncake calls read and write the KV cache itself: :class:`MultiBufferPath` and
:class:`DirectPath`, with the peer screening they share (such a call cannot be abandoned, so a new peer is proven
responsive first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver.bounds import Screened
from mooncake_kvaddr.driver.path_base import (
    _NO_TAILS,
    NOT_TRIED,
    GetOutcome,
    PathContext,
    TransferPath,
    check_rows_inside,
    rows_bounded,
)
from mooncake_kvaddr.driver.probe import PeerScreen
from mooncake_kvaddr.driver.results import Clock, StoreResult, count
from mooncake_kvaddr.driver.rules import group_runs, rotate
from mooncake_kvaddr.driver.staging import BoolArray, read_whole
from mooncake_kvaddr.driver.store import CODE_MASTER_UNREACHABLE, BatchResult, Outcome, RequestDeadline

__all__ = ["DirectPath", "MultiBufferPath"]


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
    ctx: PathContext, deadline: RequestDeadline, outcomes: dict[str, int], clock: Clock, keys: list[str], *rows: Any
) -> tuple[PeerScreen | None, npt.NDArray[np.intp] | None, tuple[Any, ...]]:
    """Ask the probe which of ``keys`` may go to Mooncake: ``(screen, picks, (keys, *rows))``; ``picks`` is
    ``None`` for all of them, else the indices allowed (the others are counted not tried here), and the keys and
    each of ``rows`` are then taken at ``picks`` (none: nothing to send). Its time is the "probe" phase."""
    if ctx.probe is None:
        return None, None, (keys, *rows)
    screen = ctx.probe.screen(keys, deadline)
    clock.lap("probe")
    if screen.stop:
        count(outcomes, NOT_TRIED, len(keys))
        return screen, np.zeros(0, dtype=np.intp), (keys, *rows)
    if screen.allowed is None:
        return screen, None, (keys, *rows)
    picks = np.flatnonzero(screen.allowed)
    count(outcomes, NOT_TRIED, len(keys) - len(picks))
    return screen, picks, tuple(_take(r, picks) for r in (keys, *rows))


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
        return self.ctx.store.native_client_active

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
        tails: Mapping[int, int] = _NO_TAILS,
    ) -> KeyPlan:
        """The walk, the keys and the rows in one native pass per group (``plan_load``), then rotated.

        A request with an invalid block id takes the shared walk-then-prepare plan instead, which drops the
        chunks on it before any row is computed.
        """
        if self._arrays or any(s.bad for s in screened):
            return super().plan_get(token_len, block_hashes, screened, skip, tp_rank, tails)
        bounded = rows_bounded(self.ctx.databases)  # before any row is computed
        keys: list[str] = []
        addrs: list[Sequence[int]] = []
        sizes: list[Sequence[int]] = []
        ids: list[int] = []
        for g, db in enumerate(self.ctx.databases):
            tail = (tails[g],) if g in tails else ()  # layout groups only
            plan = db.plan_load(token_len, block_hashes, screened[g].ids, skip, *tail)
            keys.extend(plan.keys)
            addrs.extend(plan.addrs)
            sizes.extend(plan.sizes)
            ids.extend(plan.block_ids)
        # Each rank starts at a different key so that ranks spread over the pool's segments.
        return KeyPlan(
            rotate(keys, tp_rank), rotate(addrs, tp_rank), rotate(sizes, tp_rank), rotate(ids, tp_rank), bounded=bounded
        )

    def _put_rows(self, chunks: Any, groups: Sequence[int], block_ids: Sequence[Sequence[int]]) -> tuple[Any, ...]:
        """The rows to hand Mooncake and each key's bytes."""
        bounded = rows_bounded(self.ctx.databases)  # before any row is computed
        addrs, sizes, _ = self.prepare(chunks, groups, block_ids)
        addrs, sizes = self._check_unbounded(addrs, sizes, bounded)
        if isinstance(sizes, np.ndarray):
            return addrs, sizes, sizes.sum(axis=1).tolist()
        return addrs, sizes, [sum(row) for row in sizes]

    def _put_prepared(
        self, keys: list[str], rows: tuple[Any, ...], clock: Clock, result: StoreResult, deadline: RequestDeadline
    ) -> tuple[list[bool], list[int]]:
        addrs, sizes, key_bytes = rows
        # Rows come from prepare_values, so the non-negativity scan would only cost time.
        store = self.ctx.store
        put = self._call_inline("save_put", len(keys), sum(key_bytes), lambda: store.batch_put_from_multi_buffers(
            keys, addrs, sizes, self.ctx.replicate_config, check_values=False, deadline=deadline
        ), clock, "put", result.outcomes)  # fmt: skip
        result.back_pressure = result.back_pressure or put.back_pressure
        return put.present, key_bytes

    def get(
        self, plan: KeyPlan, start: int, end: int, clock: Clock, outcomes: dict[str, int], deadline: RequestDeadline
    ) -> GetOutcome:
        keys = plan.keys[start:end]
        addrs, sizes = plan.addrs[start:end], plan.sizes[start:end]
        addrs, sizes = self._check_unbounded(addrs, sizes, plan.bounded)
        n = len(keys)
        screen, picks, (keys, addrs, sizes) = _screen_peers(self.ctx, deadline, outcomes, clock, keys, addrs, sizes)
        if picks is not None and len(picks) == 0:
            return GetOutcome(np.zeros(n, dtype=bool), False, 0)
        if self.ctx.metrics.callback is None:
            nbytes = 0
        elif isinstance(sizes, np.ndarray):
            nbytes = int(sizes.sum())
        else:
            nbytes = sum(map(sum, sizes))
        got = self._call_inline("load_get", len(keys), nbytes, lambda: self.ctx.store.batch_get_into_multi_buffers(
            keys, addrs, sizes, check_values=False, deadline=deadline
        ), clock, "get", outcomes)  # fmt: skip
        loaded = _after_peers(self.ctx, screen, picks, n, got)
        return GetOutcome(loaded, CODE_MASTER_UNREACHABLE in got.codes, got.bytes_transferred)


class DirectPath(TransferPath):
    """One contiguous region per key (cross-layer layouts): the contiguous calls on the KV cache itself."""

    name = "direct"

    def _put_rows(self, chunks: Any, groups: Sequence[int], block_ids: Sequence[Sequence[int]]) -> tuple[Any, ...]:
        return check_rows_inside(self.ctx.caches, *super()._put_rows(chunks, groups, block_ids))  # checked copies

    def _put_prepared(
        self, keys: list[str], rows: tuple[Any, ...], clock: Clock, result: StoreResult, deadline: RequestDeadline
    ) -> tuple[list[bool], list[int]]:
        addrs, sizes = rows
        object_sizes = sizes[:, 0].tolist()
        put = self._call_inline("save_put", len(keys), sum(object_sizes), lambda: self.ctx.store.batch_put_from(
            keys, addrs[:, 0].tolist(), object_sizes, self.ctx.replicate_config, check_values=False, deadline=deadline
        ), clock, "put", result.outcomes)  # fmt: skip
        result.back_pressure = result.back_pressure or put.back_pressure
        return put.present, object_sizes

    def get(
        self, plan: KeyPlan, start: int, end: int, clock: Clock, outcomes: dict[str, int], deadline: RequestDeadline
    ) -> GetOutcome:
        # Mooncake's contiguous calls write these ranges with no check of their own: it gets the checked copies.
        addrs, sizes = check_rows_inside(self.ctx.caches, plan.addrs[start:end], plan.sizes[start:end])
        ptrs, expected = addrs[:, 0], sizes[:, 0]
        keys = plan.keys[start:end]
        n = len(keys)
        screen, picks, (keys, ptrs, expected) = _screen_peers(self.ctx, deadline, outcomes, clock, keys, ptrs, expected)
        if picks is not None and len(picks) == 0:
            return GetOutcome(np.zeros(n, dtype=bool), False, 0)
        got = self._call_inline("load_get", len(keys), int(expected.sum()), lambda: self.ctx.store.batch_get_into(
            keys, ptrs.tolist(), expected.tolist(), check_values=False, deadline=deadline
        ), clock, "get", outcomes)  # fmt: skip
        whole = read_whole(got.codes, expected)
        nbytes = int(expected[whole].sum())
        if picks is not None:
            whole = _spread(whole, picks, n)
        _after_peers(self.ctx, screen, picks, n, got)
        return GetOutcome(whole, CODE_MASTER_UNREACHABLE in got.codes, nbytes)
