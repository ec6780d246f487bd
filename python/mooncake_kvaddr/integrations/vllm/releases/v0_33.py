"""vLLM 0.32/0.33: the store layouts live in ``data.py``; every part of the plugin is ported.

0.32.0's Mooncake store ``data.py`` and ``worker.py`` are byte-identical to 0.33.0's (compared from the 0.32.0
wheel, not installed), so one table covers both.
"""

from __future__ import annotations

from typing import Any

from mooncake_kvaddr.driver.rules import floor_to
from mooncake_kvaddr.integrations.vllm import layouts, lookup, send
from mooncake_kvaddr.integrations.vllm.receive_check import RECEIVE_FUNCTIONS, sample_layouts_033
from mooncake_kvaddr.integrations.vllm.registry import DATA_MODULE
from mooncake_kvaddr.integrations.vllm.releases.base import PARTS, Release
from mooncake_kvaddr.integrations.vllm.send_check import SEND_FUNCTIONS, THREAD_METHODS_033

__all__ = ["FINGERPRINTED", "FINGERPRINTS", "RELEASE", "SEND"]

#: The vLLM functions each part was checked against: the layouts (replaced), the receive handler (replaced;
#: ``process_tokens`` is the chunk walk it reproduces), the worker's transport hook (``register_kv_caches``/
#: ``close`` run with the wrapper as the store), the lookup (replaced; the block pool's attributes are what its
#: faster pool reads), the send handler (replaced; the walk and the byte sum are what it reproduces).
FINGERPRINTED: dict[str, tuple[str, ...]] = {
    "layouts": (
        "RankLocalStoreLayout.prepare_values",
        "RankLocalStoreLayout.prepare_value_for_block",
        "RankLocalStoreLayout.key_for",
        "TPShardedStoreLayout.prepare_values",
        "TPShardedStoreLayout.key_for",
        "TPShardedStoreLayout._set_segment_templates",
    ),
    "receive": RECEIVE_FUNCTIONS,
    "send": SEND_FUNCTIONS,
    "worker": ("MooncakeStoreWorker.register_kv_caches", "MooncakeStoreWorker.close"),
    "lookup": ("MooncakeStoreWorker.lookup", *lookup.POOL_FUNCTIONS),
}

FINGERPRINTS: dict[str, dict[str, str]] = {
    release: {
        "RankLocalStoreLayout.prepare_values": "3aa2513fe91a14c4",
        "RankLocalStoreLayout.prepare_value_for_block": "d152372ee913685e",
        "RankLocalStoreLayout.key_for": "2c426949ec2ea759",
        "TPShardedStoreLayout.prepare_values": "c2254d3f4f8756ab",
        "TPShardedStoreLayout.key_for": "998e0f8942fb19c0",
        "TPShardedStoreLayout._set_segment_templates": "410b7150a8211070",
        "KVCacheStoreRecvingThread._handle_request": "67cd42f2dc3c5f11",
        "ChunkedTokenDatabase.process_tokens": "d7d54c491f37709b",
        "_estimate_disk_offload_staging_bytes": "1096992edcfb74ba",
        "_split_disk_offload_load_batches": "0f7a2f3f89d959dc",
        "MooncakeStoreWorker.register_kv_caches": "d61b0517475bfad8",
        "MooncakeStoreWorker.close": "b9b831fa3647518f",
        "MooncakeStoreWorker.lookup": "23da6e4e0684a1e0",
        "ExternalCachedBlockPool.__init__": "8812d6d330d5298f",
        "ExternalCachedBlockPool.get_cached_block": "58a17cb93531b829",
        "ExternalCachedBlockPool.contains": "84d038552e03ec9e",
        "KVCacheStoreSendingThread._handle_request": "9faeb2e256df39de",
        "_sum_batch_bytes": "3e69ccacfd52a5c3",
    }
    for release in ("0.32.0", "0.33.0")
}

# --- the send handler's rules (docs/vllm-plugin.md, "The send handler") -----------------------------------------


def _send_prepare(thread: Any, req_meta: Any) -> send.Job | str:
    """vLLM 0.33's lengths and masks: the token length floored to the lcm block size (none: vLLM's handler), a
    live job not skipped for pressure, the store masks from the saved offset with the prefill end."""
    lcm_block_size = thread.coord.lcm_block_size
    token_len = floor_to(req_meta.token_len_chunk, lcm_block_size)
    if type(token_len) is not int or token_len <= 0:
        return "no token to store"
    if not thread.is_live_store_job(req_meta) or thread._should_skip_request(req_meta.req_id):
        return "a job vLLM skips"
    save_start = thread._saved_offset.get(req_meta.req_id, 0)
    if type(save_start) is not int or save_start < 0:
        return "a saved offset that is not a non-negative int"
    masks = thread.coord.store_mask(token_len, save_start, num_prompt_tokens=req_meta.prefill_end_tokens)
    return send.Job(token_len, save_start, tuple(masks), available=token_len)


def _send_merge_retry(retry_start: int, retry_ids: list[int], start: int, ids: list[int]) -> tuple[int, Any] | None:
    """vLLM 0.33 puts a failed job's retry ids in front only when they end where this job's ids start."""
    return (retry_start, retry_ids + ids) if retry_start + len(retry_ids) == start else None


SEND = send.SendRules(prepare=_send_prepare, merge_retry=_send_merge_retry, thread_methods=THREAD_METHODS_033)

RELEASE = Release(
    series=("0.32.", "0.33."),
    layout_module=DATA_MODULE,
    replacements=layouts.REPLACEMENTS,
    check_shape=layouts.check_shape,
    self_check=layouts.self_check,
    fingerprinted=FINGERPRINTED,
    fingerprints=FINGERPRINTS,
    ported=frozenset(PARTS),
    worker_methods={"register_kv_caches": ("kv_caches",), "close": ()},
    lookup_rules=lookup.RULES_033,
    ours=layouts.OURS,
    plan_engines=layouts.PLAN_ENGINES,
    process_tokens=("token_len", "block_hashes", "mask_num", "chunk_mask", "put_step", "put_step_rank"),
    sample_layouts=sample_layouts_033,
    send_rules=SEND,
)
