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

This module is where the paths are imported from: the shared base lives in :mod:`.path_base`, the
multi-buffer and direct paths (Mooncake on the KV cache itself) in :mod:`.path_direct`, the staged path in
:mod:`.path_staged`; a new path belongs in a module of its own.
"""

from __future__ import annotations

import logging

from mooncake_kvaddr.driver.path_base import _BOUNDED_ROWS as _BOUNDED_ROWS
from mooncake_kvaddr.driver.path_base import _ROW_METHODS as _ROW_METHODS
from mooncake_kvaddr.driver.path_base import NOT_TRIED as NOT_TRIED
from mooncake_kvaddr.driver.path_base import BoolArray as BoolArray
from mooncake_kvaddr.driver.path_base import GetOutcome as GetOutcome
from mooncake_kvaddr.driver.path_base import Int64Array as Int64Array
from mooncake_kvaddr.driver.path_base import (
    PathContext,
    TransferPath,
    check_rows_inside,
    register_bounded_rows,
    rows_bounded,
)
from mooncake_kvaddr.driver.path_base import _no_instance_overrides as _no_instance_overrides
from mooncake_kvaddr.driver.path_direct import DirectPath, MultiBufferPath
from mooncake_kvaddr.driver.path_direct import _after_peers as _after_peers
from mooncake_kvaddr.driver.path_direct import _screen_peers as _screen_peers
from mooncake_kvaddr.driver.path_direct import _spread as _spread
from mooncake_kvaddr.driver.path_direct import _take as _take
from mooncake_kvaddr.driver.path_staged import STAGING_WAIT_S as STAGING_WAIT_S
from mooncake_kvaddr.driver.path_staged import StagedPath
from mooncake_kvaddr.driver.path_staged import _lay_out as _lay_out
from mooncake_kvaddr.driver.path_staged import _sub_plan as _sub_plan

__all__ = [
    "DirectPath",
    "MultiBufferPath",
    "PathContext",
    "StagedPath",
    "TransferPath",
    "check_rows_inside",
    "register_bounded_rows",
    "rows_bounded",
]

logger = logging.getLogger(__name__)
