"""mooncake_kvaddr for vLLM's Mooncake store connector (docs/vllm.md).

``mooncake_kvaddr.integrations.vllm.data`` stands in for vLLM 0.32/0.33's
``vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data`` (its data model: keys, store layouts, the
token database), natively and without importing vLLM or torch.
"""

from mooncake_kvaddr.integrations.vllm import data

__all__ = ["data"]
