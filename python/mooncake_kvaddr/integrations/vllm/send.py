"""A replacement for vLLM 0.32/0.33's ``KVCacheStoreSendingThread._handle_request`` (docs/vllm-plugin.md,
"The send handler").

Each group is planned in one native call and its rows go to our store wrappers as int64 matrices; everything
around it stays vLLM's, call for call, and any other job runs vLLM's own handler (:func:`plan_store` says why).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.integrations.vllm.plans import (
    ArrayStore,
    HandlerStats,
    Kinds,
    concat_rows,
    finish_handler,
    hash_source,
)

__all__ = ["ENV_SEND", "SendStats", "make_handler", "plan_store", "send_enabled"]

#: Set to ``0``/``false``/``off``/``no`` to keep vLLM's own send handler (the rest stays patched).
ENV_SEND = "MOONCAKE_KVADDR_VLLM_SEND"


def send_enabled(environ: Mapping[str, str]) -> bool:
    """False when :data:`ENV_SEND` turns the replacement send handler off (on by default with the plugin), or
    spells neither on nor off (one warning naming it)."""
    return flag(environ.get(ENV_SEND), True, ENV_SEND, or_off="vllm.mooncake_kvaddr")


#: The send handler's counters (updated under a lock: several send threads may share the handler).
SendStats = HandlerStats


class SendPlan:
    """One store job's keys and rows (a :class:`KeyPlan`) with each key's group index."""

    __slots__ = ("chunks", "groups", "rows", "skipped")

    def __init__(
        self, rows: KeyPlan, groups: list[int], skipped: list[tuple[int, int]], chunks: list[tuple[int, int]]
    ) -> None:
        self.rows = rows
        self.groups = groups
        #: (group, block index) of every chunk vLLM skips as an unavailable source block (its debug log).
        self.skipped = skipped
        #: Each key's chunk ``(start, end)`` in tokens (kv events only; empty otherwise).
        self.chunks = chunks


def _group_mask(
    block_size: int, token_len: int, save_start: int, chunk_mask: Any, put_step: int, rank: int, blocks: Any
) -> tuple[list[bool], list[int]]:
    """vLLM's send walk as one absolute chunk mask: ``process_tokens``' start (``ceil(save_start / block_size)``),
    its relative ``chunk_mask`` and put striping, then the skip of block ids past the list or equal to the null
    block (0). Returns the mask and the chunk ids skipped for their block id."""
    first = max(0, -(-save_start // block_size))
    stop = -(-token_len // block_size)
    if chunk_mask is not None:
        stop = min(stop, first + len(chunk_mask))
    if stop <= first:
        return [], []
    ids = np.arange(first, stop, dtype=np.int64)
    keep = ids % put_step == rank
    if chunk_mask is not None:
        keep &= np.fromiter(map(bool, chunk_mask[: stop - first]), dtype=bool, count=stop - first)
    present = np.zeros(stop - first, dtype=bool)
    listed = max(0, min(stop, len(blocks)) - first)
    if listed:
        values = np.asarray(blocks[first : first + listed])
        if values.dtype.kind not in "iub" or values.shape != (listed,):
            raise TypeError("block ids that are not integers")
        present[:listed] = values != 0
    skipped = ids[keep & ~present].tolist()
    keep &= present
    return [False] * first + keep.tolist(), skipped


def plan_store(
    thread: Any,
    req_meta: Any,
    token_len: int,
    save_start: int,
    arrays: bool,
    kinds: Kinds,
    engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]],
    blob_type: type,
    events: bool = False,
) -> SendPlan | str:
    """Every key of a store job that vLLM would send to ``batch_is_exist``, with its rows (and, for ``events``,
    its chunk), or why the job is not ours to plan. May raise (the caller then hands the job to vLLM's
    handler). No side effects."""
    source = hash_source(req_meta.block_hashes, blob_type)
    if source is None:
        return "block hashes of another type"
    hashes, hash_len = source
    n_hashes = len(hashes) // hash_len if hash_len else len(hashes)
    masks = thread.coord.store_mask(token_len, save_start, num_prompt_tokens=req_meta.prefill_end_tokens)
    parts: list[tuple[Any, ...]] = []
    groups: list[int] = []
    skipped: list[tuple[int, int]] = []
    chunks: list[tuple[int, int]] = []
    for g, db in enumerate(thread.token_databases):
        if not thread.group_participates[g]:
            continue
        put_step = thread.group_put_steps[g]
        if type(put_step) is not int or put_step <= 0 or type(thread.tp_rank) is not int:
            return "a put step or TP rank that is not a positive int"
        planner = kinds.engine_of(db, engines)
        if isinstance(planner, str):
            return planner
        engine, prefixes = planner
        block_size, hash_block_size = db.block_size, db.hash_block_size
        if not n_hashes:
            continue  # vLLM's walk yields nothing without hashes
        if token_len % hash_block_size or token_len // hash_block_size > n_hashes:
            return "a token length vLLM's walk refuses"
        chunk_mask = masks[g]
        if chunk_mask is not None and type(chunk_mask) is not list and type(chunk_mask) is not tuple:
            return "a store mask that is not a list"
        blocks = req_meta.block_ids[g]
        if type(blocks) is not list and type(blocks) is not tuple and not isinstance(blocks, np.ndarray):
            return "block ids that are not a list"
        rank = (thread.tp_rank + g) % put_step
        mask, unavailable = _group_mask(block_size, token_len, save_start, chunk_mask, put_step, rank, blocks)
        skipped.extend((g, chunk) for chunk in unavailable)
        part = engine.plan_load(prefixes, hashes, hash_len, token_len, save_start, mask, None, blocks, arrays)
        if len(part[0]):
            parts.append(part)
            groups.extend([g] * len(part[0]))
            if events:  # the walk keeps the chunks the mask keeps, in order, one key per local shard each
                for chunk in np.flatnonzero(mask).tolist():
                    start = chunk * block_size
                    chunks.extend([(start, min(start + block_size, token_len))] * len(prefixes))
                if len(chunks) != len(groups):
                    raise RuntimeError("the plan's keys do not match the walk")
    if not parts:
        return SendPlan(KeyPlan([], [], [], []), groups, skipped, chunks)
    widths = None
    if len(parts) == 1:
        keys, addrs, sizes, ids = parts[0]
    elif arrays:  # rows of different widths (hybrid groups): padded matrices with each row's width
        keys = [key for p in parts for key in p[0]]
        ids = np.concatenate([p[3] for p in parts])
        addrs, sizes, widths = concat_rows([p[1] for p in parts], [p[2] for p in parts])
    else:
        keys, addrs, sizes, ids = ([item for p in parts for item in p[i]] for i in range(4))
    return SendPlan(KeyPlan(keys, addrs, sizes, ids, widths=widths), groups, skipped, chunks)


def _put(store: Any, rows: KeyPlan, config: Any) -> Any:
    if rows.arrays and isinstance(store, ArrayStore):
        widths = rows.widths
        if widths is None:
            return store.batch_put_from_multi_buffers_arrays(rows.keys, rows.addrs, rows.sizes, config)
        if widths.size and bool((widths == widths[0]).all()):  # the missing keys are of one width: one matrix
            width = int(widths[0])
            return store.batch_put_from_multi_buffers_arrays(
                rows.keys, rows.addrs[:, :width], rows.sizes[:, :width], config
            )
        return store.batch_put_from_multi_buffers_ragged(rows.keys, rows.addrs, rows.sizes, widths, config)
    if rows.arrays:
        return store.batch_put_from_multi_buffers(rows.keys, *rows.row_lists(), config)
    return store.batch_put_from_multi_buffers(rows.keys, rows.addrs, rows.sizes, config)


class _Events:
    """vLLM's kv-event state of one job: the event token ids (with a failed job's retry ids in front), where they
    start, and whether the save completed (read by vLLM's retry bookkeeping at the end)."""

    __slots__ = ("on", "save_completed", "start", "token_ids")

    def __init__(self, thread: Any, req_meta: Any) -> None:
        self.on = bool(thread.enable_kv_event)
        self.token_ids = req_meta.token_ids
        self.start = req_meta.token_ids_start
        self.save_completed = False
        if self.on:
            retry = thread._get_retry_token_ids(req_meta)
            if retry is not None and self.token_ids is not None:
                retry_start, retry_ids = retry
                if retry_start + len(retry_ids) == self.start:
                    self.token_ids = retry_ids + self.token_ids
                    self.start = retry_start


def _store_job(thread: Any, req_meta: Any, plan: SendPlan, token_len: int, worker: ModuleType) -> None:
    """vLLM's send handler from the boundary-state puts on, with ``plan`` for its walk and ``prepare_values``."""
    logger = worker.logger
    req_id = req_meta.req_id
    events = _Events(thread, req_meta)
    try:
        if not thread._maybe_offload_boundary_states(req_meta):
            return
        if logger.isEnabledFor(logging.DEBUG):
            for g, chunk in plan.skipped:
                logger.debug(
                    "Skipping unavailable Mooncake store source block (req=%s, group=%d, block=%d)", req_id, g, chunk
                )
        rows = plan.rows
        if not rows.keys:
            thread._record_saved(req_meta, token_len)
            events.save_completed = True
            return
        keys = rows.keys
        exists_start = time.perf_counter()
        try:
            exists_states = thread.store.batch_is_exist(keys)
        except Exception:
            thread._record_operation(
                "save_exists", exists_start, len(keys), status="error", num_failed_keys=len(keys)
            )
            raise
        thread._record_operation("save_exists", exists_start, len(keys))
        missing = [i for i, exists in enumerate(exists_states) if exists != 1]
        if not missing:
            thread._record_saved(req_meta, token_len)
            events.save_completed = True
            return
        groups, chunks = plan.groups, plan.chunks
        if len(missing) != len(keys):
            rows = rows.take(missing)
            keys = rows.keys
            groups = [groups[i] for i in missing]
            if events.on:
                chunks = [chunks[i] for i in missing]
        group_ids = (
            [
                worker._make_mooncake_group_id(thread.token_databases[g].metadata, key.rsplit("@", 1)[-1])
                for key, g in zip(keys, groups, strict=True)
            ]
            if thread.enable_group_semantics and thread.supports_group_ids
            else None
        )
        logger.debug("Storing KV cache for %d blocks (groups=%s) for request %s", len(keys), set(groups), req_id)
        if req_meta.current_event is not None:
            req_meta.current_event.synchronize()
        if group_ids is not None:
            thread.replicate_config.group_ids = group_ids
        failed = _put_and_record(thread, req_meta, rows, token_len, worker)
        events.save_completed = failed is not None and not failed
        if events.on and failed is not None:
            stored = _stored_events(thread, req_meta, groups, chunks, failed, events, worker)
            if stored:
                thread.update_kv_event(stored)
    finally:
        if events.on and token_len:
            thread._update_retry_token_ids(req_meta, events.save_completed, events.start, events.token_ids)
        thread.finish_store_job(req_meta)
        thread.request_queue.task_done()


def _stored_events(
    thread: Any,
    req_meta: Any,
    groups: list[int],
    chunks: list[tuple[int, int]],
    failed: set[int],
    events: _Events,
    worker: ModuleType,
) -> list[Any]:
    """vLLM's ``BlockStored`` events: one per logical block whose every missing shard was stored, in vLLM's
    order, with its parent hash and token ids as vLLM derives them."""
    hashes = req_meta.block_hashes
    by_event: dict[tuple[Any, ...], list[int]] = {}
    for index, ((start, end), g) in enumerate(zip(chunks, groups, strict=True)):
        db = thread.token_databases[g]
        by_event.setdefault((start, end, g, hashes[end // db.hash_block_size - 1]), []).append(index)
    token_ids, first = events.token_ids, events.start
    last = first + len(token_ids or ())
    convert = worker.maybe_convert_block_hash
    stored = []
    for (start, end, g, block_hash), indices in by_event.items():
        if any(index in failed for index in indices):
            continue
        db = thread.token_databases[g]
        stored.append(
            worker.BlockStored(
                block_hashes=[convert(block_hash)],
                parent_block_hash=convert(hashes[start // db.hash_block_size - 1]) if start > 0 else None,
                token_ids=(
                    token_ids[start - first : end - first]
                    if token_ids is not None and first <= start and end <= last
                    else []
                ),
                block_size=db.block_size,
                lora_id=None,
                medium="cpu",
                lora_name=None,
                group_idx=g,
            )
        )
    return stored


def _put_and_record(
    thread: Any, req_meta: Any, rows: KeyPlan, token_len: int, worker: ModuleType
) -> set[int] | None:
    """The put and vLLM's bookkeeping of its outcome (records, pressure, saved offset); the indices of the
    failed keys, or None when the put raised."""
    logger = worker.logger
    keys = rows.keys
    failed_indices: set[int] = set()
    put_had_exception = False
    batch_bytes = rows.num_bytes()
    put_start = time.perf_counter()
    try:
        res = _put(thread.store, rows, thread.replicate_config)
    except Exception as e:
        thread._record_operation(
            "save_put", put_start, len(keys), num_bytes=batch_bytes, status="error", num_failed_keys=len(keys)
        )
        logger.error("Failed to put key %s, error: %s", keys, e)
        put_had_exception = True
    else:
        failed_indices = {i for i, value in enumerate(res) if value < 0}
        thread._record_operation(
            "save_put",
            put_start,
            len(keys),
            num_bytes=batch_bytes,
            status="partial_failure" if failed_indices else "ok",
            num_failed_keys=len(failed_indices),
        )
        failed_codes = {res[i] for i in failed_indices}
        if failed_indices:
            logger.warning(
                "batch_put failed: %d/%d keys failed (codes=%s, batch_bytes=%d), first_key=%s",
                len(failed_indices),
                len(keys),
                failed_codes,
                batch_bytes,
                keys[0],
            )
        if worker.MOONCAKE_NO_AVAILABLE_HANDLE in failed_codes and not thread._mark_request_skipped_for_pressure(
            req_meta
        ):
            logger.warning(
                "Detected Mooncake CPU/disk offloading pressure (NO_AVAILABLE_HANDLE); skipping future store "
                "batches for request %s until a later store batch succeeds",
                req_meta.req_id,
            )
    if not put_had_exception and not failed_indices:
        thread._record_saved(req_meta, token_len)
        if thread._clear_store_pressure():
            logger.info("Mooncake CPU/disk offloading pressure cleared after a successful store batch")
    return None if put_had_exception else failed_indices


def make_handler(
    original: Callable[[Any, Any], Any],
    data: ModuleType,
    worker: ModuleType,
    ours: Mapping[str, Any],
    engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]],
    kinds: Kinds | None = None,
) -> Callable[[Any, Any], Any]:
    """The replacement ``_handle_request``; ``original`` is vLLM's (run for everything off the fast path).
    ``ours`` and ``engines`` as for the receive handler's :func:`~.receive.make_handler`."""
    kinds = kinds if kinds is not None else Kinds(data, ours)
    blob_type = data.BlobBlockHashes
    stats = SendStats()
    lock = threading.Lock()

    def _plan(self: Any, req_meta: Any) -> tuple[SendPlan, int] | str:
        lcm_block_size = self.coord.lcm_block_size
        token_len = req_meta.token_len_chunk // lcm_block_size * lcm_block_size
        if type(token_len) is not int or token_len <= 0:
            return "no token to store"
        if not self.is_live_store_job(req_meta) or self._should_skip_request(req_meta.req_id):
            return "a job vLLM skips"
        save_start = self._saved_offset.get(req_meta.req_id, 0)
        if type(save_start) is not int:
            return "a saved offset that is not an int"
        arrays = isinstance(self.store, ArrayStore)
        events = bool(self.enable_kv_event)
        plan = plan_store(self, req_meta, token_len, save_start, arrays, kinds, engines, blob_type, events)
        return plan if isinstance(plan, str) else (plan, token_len)

    def _handle_request(self: Any, req_meta: Any) -> Any:
        """mooncake_kvaddr's send handler (docs/vllm-plugin.md, "The send handler")."""
        try:
            planned = _plan(self, req_meta)
        except Exception as exc:  # vLLM's handler raises its own error (or accepts what our engine refuses)
            planned = f"planning raised {type(exc).__name__}"
        if isinstance(planned, str):
            with lock:
                stats.fallback_requests += 1
                stats.last_fallback = planned
            return original(self, req_meta)
        with lock:
            stats.fast_requests += 1
        _store_job(self, req_meta, planned[0], planned[1], worker)
        return None

    return finish_handler(_handle_request, original, "KVCacheStoreSendingThread._handle_request", stats)
