"""The transfer rules that every path shares, each written once (see ``docs/transfer-modes.md``).

* :func:`rotate` - a load starts at key ``tp_rank % n`` so that ranks spread over the pool's segments;
* :func:`floor_to` - stores, lookups and a load's skipped prefix use whole scheduler blocks (the lcm of the
  groups' block sizes);
* :func:`group_runs` - keys are group-major; one database call per run of a group;
* :data:`LOAD_ERRORS` and :func:`describe` - the one error policy: a load never raises for these, it
  reports every block it could not prove loaded as failed, with the reason;
* :class:`OperationRecorder` - the optional metrics callback in vLLM's ``record_operation`` shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr.driver.store import StoreError

__all__ = [
    "LOAD_ERRORS",
    "OperationRecorder",
    "RecordOperation",
    "describe",
    "floor_to",
    "group_runs",
    "rotate",
]

logger = logging.getLogger(__name__)

_S = TypeVar("_S", list[Any], npt.NDArray[Any])

#: What a load turns into a failed-block report instead of raising: store trouble (incl. a store closed
#: underneath it), rejected arguments, a staging pool that stayed full, and planning errors (a block id that
#: is not an int, an address that overflows). Anything else is a bug and propagates.
LOAD_ERRORS: Final = (StoreError, ValueError, TypeError, OverflowError, IndexError, TimeoutError, RuntimeError)


def describe(exc: BaseException) -> str:
    """The reason string a result carries for an absorbed exception."""
    return f"{type(exc).__name__}: {exc}"


def rotate(items: _S, tp_rank: int) -> _S:
    """``items`` rotated left by ``tp_rank % len(items)`` (the same object when that is 0).

    Works for lists and numpy arrays alike (slicing and concatenation by type).
    """
    n = len(items)
    r = tp_rank % n if n else 0
    if not r:
        return items
    if isinstance(items, list):
        return items[r:] + items[:r]
    return np.concatenate((items[r:], items[:r]))


def floor_to(value: int, multiple: int) -> int:
    """``value`` rounded down to a multiple of ``multiple`` (> 0)."""
    return value // multiple * multiple


def group_runs(groups: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` of each maximal run of equal group ids, in order."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(groups) + 1):
        if i == len(groups) or groups[i] != groups[start]:
            runs.append((groups[start], start, i))
            start = i
    return runs


class RecordOperation(Protocol):
    """vLLM's ``record_operation`` callback (``MooncakeStoreConnectorStats.record_operation`` fits)."""

    def __call__(
        self,
        operation: str,
        duration_seconds: float,
        num_keys: int,
        *,
        num_bytes: int = 0,
        status: str = "ok",
        num_failed_keys: int = 0,
    ) -> None: ...


class OperationRecorder:
    """Reports each Mooncake call of a transfer to an optional callback, as vLLM's worker threads do.

    Operations: ``"save_exists"`` (the store's ``batch_is_exist``), ``"save_put"`` and ``"load_get"`` (one per
    Mooncake call, so a split request reports each sub-batch). ``status`` is ``"ok"``,
    ``"partial_failure"`` (some keys failed) or ``"error"`` (the call raised: every key counts as failed).
    ``num_bytes`` is the bytes the call was asked to move. A callback that raises is logged, never
    propagated: metrics must not fail a transfer.
    """

    def __init__(self, callback: RecordOperation | Callable[..., None] | None) -> None:
        self.callback = callback

    def record(self, operation: str, start: float, num_keys: int, num_bytes: int, failed: int | None) -> None:
        """Report one call that began at ``start`` (``time.perf_counter()``); ``failed=None`` means it raised."""
        if self.callback is None:
            return
        if failed is None:
            status, failed = "error", num_keys
        else:
            status = "partial_failure" if failed else "ok"
        try:
            self.callback(
                operation=operation,
                duration_seconds=time.perf_counter() - start,
                num_keys=num_keys,
                num_bytes=num_bytes,
                status=status,
                num_failed_keys=failed,
            )
        except Exception:  # a metrics bug must not break the transfer
            logger.exception("record_operation callback failed for %s", operation)
