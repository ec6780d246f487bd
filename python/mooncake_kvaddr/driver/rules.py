"""The transfer rules that every path shares, each written once (docs/transfer-modes.md).

Rotation, flooring to scheduler blocks, group runs, the load error policy, the disk-offload staging-budget split,
the ``auto`` mode rule and the metrics recorder.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr.driver.errors import StoreError
from mooncake_kvaddr.driver.store_args import _plan

if TYPE_CHECKING:  # the plugin's handlers import these rules: no store modules at their start-up
    from mooncake_kvaddr.driver.config import StoreConfig

__all__ = [
    "AUTO_MEMORY_LOAD_STAGED_BELOW",
    "AUTO_MEMORY_LOAD_STAGED_MAX_REGIONS",
    "AUTO_NETWORK_STAGED_BELOW",
    "AUTO_NETWORK_STAGED_OBJECT_MAX",
    "DIRECT_IO_ALIGNMENT",
    "DIRECT_IO_PADDING",
    "LOAD_ERRORS",
    "OperationRecorder",
    "RecordOperation",
    "choose_auto_mode",
    "copies_in_memory",
    "describe",
    "estimate_staging_bytes",
    "floor_to",
    "group_runs",
    "rotate",
    "split_by_staging_budget",
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


#: A disk-offloading store reads each object into its staging buffer with direct I/O: object sizes are
#: rounded up to this alignment, and each object costs this much padding on top.
DIRECT_IO_ALIGNMENT: Final = 4096
DIRECT_IO_PADDING: Final = 2 * DIRECT_IO_ALIGNMENT


def estimate_staging_bytes(
    object_size: int, alignment: int = DIRECT_IO_ALIGNMENT, padding: int = DIRECT_IO_PADDING
) -> int:
    """Staging bytes a disk-offloading store needs to read one object of ``object_size`` bytes (``alignment``
    and ``padding``: the direct-I/O constants, vLLM's worker module's where the plugin reads them)."""
    return -(-object_size // alignment) * alignment + padding


def split_by_staging_budget(
    object_sizes: Sequence[int],
    usable_bytes: int,
    budget_bytes: int,
    *,
    alignment: int = DIRECT_IO_ALIGNMENT,
    padding: int = DIRECT_IO_PADDING,
    fits_first: bool = False,
) -> list[tuple[int, int]] | int:
    """Consecutive ``[start, end)`` sub-batches of a load whose estimated staging bytes fit ``usable_bytes``.

    Keys are packed greedily in order; a key whose estimate exceeds ``usable_bytes`` (but not
    ``budget_bytes``) goes alone. If any key's estimate exceeds ``budget_bytes`` it can never be read:
    returns that key's index instead, and the whole request must fail (a partial load of a prefix is useless
    when a later chunk can never arrive). One batch when everything fits (none for no key). ``fits_first``:
    vLLM's receive handler, which takes a load that fits ``usable_bytes`` as one batch (``(0, 0)`` for no key)
    before it checks any key against ``budget_bytes`` (docs/vllm-plugin.md, "The receive handler").
    """
    estimates = [estimate_staging_bytes(n, alignment, padding) for n in object_sizes]
    fits = sum(estimates) <= usable_bytes
    if fits and fits_first:
        return [(0, len(estimates))]
    for i, need in enumerate(estimates):
        if need > budget_bytes:
            return i
    # The store's region-budget packing: one span when everything fits, a key over usable_bytes alone.
    return _plan(estimates, usable_bytes) if estimates else []


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


#: Over the network ``auto`` stages keys whose regions are smaller than this many bytes, or whose whole
#: object is at most :data:`AUTO_NETWORK_STAGED_OBJECT_MAX`. Mooncake pays per region there, so one contiguous
#: object per key wins at small regions; from ~32 KiB regions a large staged object (1 MiB and up) moves slower
#: than its regions do in parallel, a small one still does not (docs/transfer-modes.md, "The measurements
#: behind the rule").
AUTO_NETWORK_STAGED_BELOW: Final = 32 << 10
AUTO_NETWORK_STAGED_OBJECT_MAX: Final = 512 << 10
#: In memory ``auto`` stages *loads* of keys with at most this many regions, each smaller than
#: :data:`AUTO_MEMORY_LOAD_STAGED_BELOW` (many keys of a few 2 KiB regions: there the staged get was the faster,
#: at 4 and 8 KiB regions multi-buffer; docs/transfer-modes.md, "How auto chooses"); every other in-memory
#: load, and every in-memory store, is multi-buffer.
AUTO_MEMORY_LOAD_STAGED_MAX_REGIONS: Final = 8
AUTO_MEMORY_LOAD_STAGED_BELOW: Final = 4 << 10


def choose_auto_mode(
    regions_per_key: int, region_bytes: int, *, local_copy: bool = False, direction: str = "load"
) -> str:
    """The path ``"auto"`` resolves to for a layout of ``regions_per_key`` regions of ``region_bytes`` (mean)
    each; ``local_copy``: Mooncake copies in memory (the only segment is in this process) rather than over
    the network; ``direction``: ``"load"`` or ``"store"``. See ``docs/transfer-modes.md``, "How auto
    chooses"."""
    if direction not in ("load", "store"):
        raise ValueError(f"direction must be 'load' or 'store', got {direction!r}")
    if regions_per_key <= 0:
        return "multi_buffer"
    if regions_per_key == 1:
        return "direct"  # one contiguous region per key: nothing to gather
    small_regions = region_bytes < AUTO_NETWORK_STAGED_BELOW
    if local_copy:
        # In memory there is no per-region network cost to save, and staging adds a copy of every byte; only
        # loads of many keys with a few small regions each came out ahead staged.
        few_small = (
            regions_per_key <= AUTO_MEMORY_LOAD_STAGED_MAX_REGIONS and region_bytes < AUTO_MEMORY_LOAD_STAGED_BELOW
        )
        return "staged" if direction == "load" and few_small else "multi_buffer"
    small_object = regions_per_key * region_bytes <= AUTO_NETWORK_STAGED_OBJECT_MAX
    return "staged" if small_regions or small_object else "multi_buffer"


def copies_in_memory(config: StoreConfig) -> bool:
    """Whether Mooncake will move a client's objects by an in-process copy rather than over the network.

    Mooncake copies in memory when the object's segment is in the same process (TCP protocol, unless
    ``MC_STORE_MEMCPY=0``). That is known only when this client holds a segment and started its own master,
    so that no other client can hold one; anything else (an external master, a pure client, RDMA) counts as
    network.
    """
    return (
        config.protocol == "tcp"
        and os.environ.get("MC_STORE_MEMCPY", "") != "0"
        and config.global_segment_size > 0
        and config.embedded_master
    )
