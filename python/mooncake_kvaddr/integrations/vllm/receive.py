"""vLLM 0.32/0.33's ``KVCacheStoreRecvingThread._handle_request``, ours (docs/vllm-plugin.md, "The receive handler").

vLLM builds every load's keys and rows chunk by chunk in Python; ours plans each KV-cache group in one native call
(the layout engine's ``plan_load``) and hands our store wrappers int64 matrices (any other store gets vLLM's lists),
with vLLM's records, errors and completion call for call. Anything off the fast path (:func:`fast_path_refusal`)
runs vLLM's own handler; planning has no side effects, so handing over is safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver import per_key
from mooncake_kvaddr.driver.rules import estimate_staging_bytes, floor_to, split_by_staging_budget
from mooncake_kvaddr.integrations.vllm.plans import (
    ARRAY_ENTRY,
    ArrayStore,
    HandlerStats,
    Kinds,
    finish_handler,
    hash_source,
    join_groups,
    multi_buffers_call,
    record_batch,
)

__all__ = [
    "ARRAY_ENTRY",
    "ENV_RECV",
    "ArrayStore",
    "ReceiveStats",
    "fast_path_refusal",
    "make_handler",
    "plan_request",
    "receive_enabled",
]


#: Set to ``0``/``false``/``off``/``no`` to keep vLLM's own receive handler (the layouts stay patched).
ENV_RECV = "MOONCAKE_KVADDR_VLLM_RECV"


def receive_enabled(environ: Mapping[str, str]) -> bool:
    """False when :data:`ENV_RECV` turns the replacement handler off (on by default with the plugin), or spells
    neither on nor off (one warning naming it)."""
    return flag(environ.get(ENV_RECV), True, ENV_RECV, or_off="vllm.mooncake_kvaddr")


# --- planning ----------------------------------------------------------------------------------------------


def plan_request(
    thread: Any,
    req_meta: Any,
    arrays: bool,
    kinds: Kinds,
    engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]],
    blob_type: type,
) -> KeyPlan | str:
    """The whole load of ``req_meta`` (vLLM's receive rules, docs/vllm-plugin.md), or why it is not ours to
    plan. May raise: the caller then hands the request to vLLM's own handler. No side effects."""
    load_spec = req_meta.load_spec
    token_len = load_spec.token_len
    mask_num = floor_to(load_spec.vllm_cached_tokens, thread.block_size)
    source = hash_source(req_meta.block_hashes, blob_type)
    if source is None:
        return "block hashes of another type"
    hashes, hash_len = source
    masks = thread.coord.load_mask(req_meta.block_hashes, token_len)
    tails = {boundary.group_id: boundary.num_tokens for boundary in load_spec.tail_key_boundaries}
    parts: list[tuple[Any, ...]] = []
    participates = thread.group_participates
    for g, db in enumerate(thread.token_databases):
        if not participates[g]:
            continue
        mask = masks[g]
        if type(mask) is not list and type(mask) is not tuple:
            return "a load mask that is not a list"
        planner = kinds.engine_of(db, engines)
        if isinstance(planner, str):
            return planner
        engine, prefixes = planner
        parts.append(
            engine.plan_load(
                prefixes, hashes, hash_len, token_len, mask_num, mask, tails.get(g), req_meta.block_ids[g], arrays
            )
        )
    if not any(len(part[0]) for part in parts):
        return "no key (vLLM's handler raises ZeroDivisionError)"
    return join_groups(parts, arrays, thread.tp_rank)


def fast_path_refusal(thread: Any, envs: Any) -> str:
    """Why this thread's requests go to vLLM's own handler ("" when they may take the fast path)."""
    if getattr(envs, "VLLM_MOONCAKE_STORE_TIER_LOG", True):
        return "VLLM_MOONCAKE_STORE_TIER_LOG on"
    return ""


# --- the handler --------------------------------------------------------------------------------------------


def _execute(thread: Any, req_id: Any, plan: KeyPlan, batches: list[tuple[int, int]], logger: Any) -> None:
    """One store call per batch and vLLM's bookkeeping around each; the first batch with a failed key ends
    the load, and an exception fails the batch in flight (vLLM's rules). The handler completes the request
    after it."""
    batch = plan
    batch_bytes = 0
    load_get_start = time.perf_counter()
    try:
        for start, end in batches:
            batch = plan if (start, end) == (0, len(plan.keys)) else plan.part(start, end)
            keys = batch.keys
            batch_bytes = batch.num_bytes()
            store = thread.store
            load_get_start = time.perf_counter()
            res = multi_buffers_call(store, batch, "get_into")
            codes = res if type(res) is list else list(res)
            per_key.check_count(codes, len(keys), "the store", ValueError)
            failed = [i for i, value in enumerate(codes) if value < 0]
            record_batch(thread, "load_get", load_get_start, len(keys), batch_bytes, len(failed))
            if failed:
                thread._report_load_error(req_id, batch.block_id_list(failed))
                logger.warning(
                    "Mooncake load of request %s: %d of %d keys failed (first: %s)",
                    req_id,
                    len(failed),
                    len(keys),
                    [(keys[i], codes[i]) for i in failed[:3]],
                )
                break
    except Exception as exc:
        thread._report_load_error(req_id, batch.block_id_list())
        record_batch(thread, "load_get", load_get_start, len(batch.keys), batch_bytes, None)
        logger.warning("Mooncake load of request %s (keys %s...) raised: %s", req_id, batch.keys[:3], exc)


#: The receive handler's counters (updated without a lock).
ReceiveStats = HandlerStats


def make_handler(
    original: Callable[[Any, Any], Any],
    data: ModuleType,
    worker: ModuleType,
    ours: Mapping[str, Any],
    engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]],
    kinds: Kinds | None = None,
) -> Callable[[Any, Any], Any]:
    """The replacement ``_handle_request``; ``original`` is vLLM's (called for everything off the fast path).

    ``ours``: the plugin's layout methods (``rank_local_prepare_values``, ``rank_local_key_for``,
    ``sharded_prepare_values``, ``sharded_key_for``): a layout class whose methods are these is backed by our
    engine. ``engines``: per layout kind, ``layout -> (engine, key prefix per local shard)``.
    """
    kinds = kinds if kinds is not None else Kinds(data, ours)
    blob_type = data.BlobBlockHashes
    envs = worker.envs
    logger = worker.logger
    # vLLM's disk-offload split is the driver's, with the worker module's direct-I/O constants (read here).
    direct_io = {"alignment": worker._DIRECT_IO_ALIGNMENT, "padding": worker._DIRECT_IO_PADDING_BYTES}
    stats = ReceiveStats()

    def _handle_request(self: Any, req_meta: Any) -> Any:
        """mooncake_kvaddr's receive handler (docs/vllm-plugin.md, "The receive handler")."""
        why = fast_path_refusal(self, envs)
        plan: KeyPlan | str = why
        if not why:
            # The store is read again inside the call's try (as vLLM reads it there): no error escapes here.
            arrays = isinstance(getattr(self, "store", None), ArrayStore)
            try:
                plan = plan_request(self, req_meta, arrays, kinds, engines, blob_type)
            except Exception as exc:  # vLLM's handler raises its own error (or accepts what our engine refuses)
                plan = why = f"planning raised {type(exc).__name__}"
        if isinstance(plan, str):
            why = plan
            stats.fallback_requests += 1
            stats.last_fallback = why
            return original(self, req_meta)
        stats.fast_requests += 1
        usable = self.usable_disk_offload_buffer_budget_bytes
        split = [(0, len(plan.keys))] if usable is None else split_by_staging_budget(
            plan.key_bytes(), usable, self.disk_offload_buffer_budget_bytes, fits_first=True, **direct_io
        )
        if isinstance(split, int):
            # vLLM's answer to a key over the raw staging budget: every block of the request fails, nothing is read.
            self._report_load_error(req_meta.req_id, plan.block_id_list())
            logger.warning(
                "Skipping Mooncake load for request %s because key %s requires %d staging bytes, exceeding budget %d",
                req_meta.req_id,
                plan.keys[split],
                estimate_staging_bytes(plan.key_bytes()[split], **direct_io),
                self.disk_offload_buffer_budget_bytes,
            )
        else:
            _execute(self, req_meta.req_id, plan, split, logger)
        self.set_finished_request(req_meta.req_id)
        self.request_queue.task_done()
        return None

    return finish_handler(_handle_request, original, "KVCacheStoreRecvingThread._handle_request", stats)
