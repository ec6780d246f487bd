"""One object per transfer mode behind one put/get interface (docs/transfer-modes.md, "The three paths").

:class:`~mooncake_kvaddr.driver.transfer.KVTransfer` owns the request logic; a :class:`TransferPath` owns how the
bytes of its keys move. The paths are imported from here: the base in ``path_base``, multi-buffer and direct in
``path_direct``, staged in ``path_staged``.
"""

from __future__ import annotations

from mooncake_kvaddr.driver.path_base import NOT_TRIED as NOT_TRIED
from mooncake_kvaddr.driver.path_base import GetOutcome as GetOutcome
from mooncake_kvaddr.driver.path_base import (
    PathContext,
    TransferPath,
    check_rows_inside,
    register_bounded_rows,
    rows_bounded,
)
from mooncake_kvaddr.driver.path_direct import DirectPath, MultiBufferPath
from mooncake_kvaddr.driver.path_staged import STAGING_WAIT_S as STAGING_WAIT_S
from mooncake_kvaddr.driver.path_staged import StagedPath
from mooncake_kvaddr.driver.path_staged import _sub_plan as _sub_plan
from mooncake_kvaddr.driver.staging import BoolArray as BoolArray
from mooncake_kvaddr.driver.staging import Int64Array as Int64Array

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
