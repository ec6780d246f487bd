"""mooncake_kvaddr for vLLM's Mooncake store connector (docs/vllm.md).

``mooncake_kvaddr.integrations.vllm.data`` stands in for vLLM 0.32/0.33's
``vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data`` (its data model: keys, store layouts, the
token database), natively and without importing vLLM or torch. It is imported on first use: vLLM's plugin
entry point (``plugin.register``) lives in this package and must stay cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["data"]


def __getattr__(name: str) -> Any:
    if name == "data":
        return importlib.import_module(f"{__name__}.data")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
