"""A replacement for vLLM's ``KVCacheStoreSendingThread._handle_request`` (docs/vllm-plugin.md, "The send handler").

Each group is planned in one native call and its rows go to our store wrappers as int64 matrices. What every
release does alike (the walk, the put, its records, pressure, group ids, ``BlockStored`` events, the job's control
flow) is here; what a release does its own way (lengths, store masks, retry ids, when a save is complete) is its
:class:`SendRules`, in its release module. Any other job runs vLLM's own handler (the rules' ``prepare`` and
:func:`plan_store` say why).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.integrations.vllm.plans import (
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
    "ENV_SEND",
    "Job",
    "SendPlan",
    "SendRules",
    "SendStats",
    "group_walk",
    "make_handler",
    "plan_store",
    "run_job",
    "send_enabled",
    "stored_events",
]

#: Set to ``0``/``false``/``off``/``no`` to keep vLLM's own send handler (the rest stays patched).
ENV_SEND = "MOONCAKE_KVADDR_VLLM_SEND"


def send_enabled(environ: Mapping[str, str]) -> bool:
    """False when :data:`ENV_SEND` turns the replacement send handler off (on by default with the plugin), or
    spells neither on nor off (one warning naming it)."""
    return flag(environ.get(ENV_SEND), True, ENV_SEND, or_off="vllm.mooncake_kvaddr")


#: The send handler's counters (updated under a lock: several send threads may share the handler).
SendStats = HandlerStats


@dataclass(frozen=True)
class Job:
    """What a release's ``prepare`` read from a store job before planning: the walk's token length, the saved
    offset it starts at, the store masks, the length vLLM's ``finally`` tests (``available``), and ``stale``:
    nothing past the saved offset (vLLM returns after the boundary puts; nothing is planned)."""

    token_len: int
    save_start: int
    masks: tuple[Any, ...] = ()
    available: int = 0
    stale: bool = False


@dataclass(frozen=True)
class SendRules:
    """What one vLLM release's send handler does its own way; its release module fills one in."""

    #: ``(thread, req_meta) -> Job``, or why vLLM's handler must run the job. Reads only (no side effects).
    prepare: Callable[[Any, Any], Job | str]
    #: ``(retry_start, retry_ids, start, ids)``: a failed job's retry ids merged in front (:class:`EventIds`).
    merge_retry: Callable[[int, list[int], int, list[int]], tuple[int, Any] | None]
    #: The send thread's methods the handler relies on, with their parameters after self (the shape check).
    thread_methods: Mapping[str, tuple[str, ...]]
    #: ``ReqMeta`` fields the handler reads besides the 0.32 ones (the shape check).
    req_meta_fields: tuple[str, ...] = ()
    #: A token database's chunk-size attribute (the walk's step; ``BlockStored.block_size`` is read from it).
    db_chunk: str = "block_size"
    #: Whether ``BlockStored`` events carry the lookahead token ids (``ReqMeta.num_hash_lookahead_tokens``).
    lookahead: bool = False
    #: vLLM 0.34's checkpoint rule: a save with an unavailable source block is incomplete, and a complete one
    #: records the job's length (``_record_saved_offset``) in the ``finally``; else (0.33) every success records it
    #: at once (``_record_saved``).
    checkpoint: bool = False
    #: Other rules, by name, for a release module's own use.
    extra: Mapping[str, Any] = field(default_factory=dict)


class SendPlan:
    """One store job's keys and rows (a :class:`KeyPlan`) with each key's group index."""

    __slots__ = ("chunks", "groups", "missing", "rows", "skipped")

    def __init__(
        self, rows: KeyPlan, groups: list[int], skipped: list[tuple[int, int]], chunks: list[tuple[int, int]]
    ) -> None:
        self.rows = rows
        self.groups = groups
        #: (group, block index) of every walked chunk vLLM skips as an unavailable source block (its debug log).
        self.skipped = skipped
        #: Whether any was skipped (vLLM 0.34: the save is then incomplete).
        self.missing = bool(skipped)
        #: Each key's chunk ``(start, end)`` in tokens (kv events only; empty otherwise).
        self.chunks = chunks


# --- planning ---------------------------------------------------------------------------------------------------


def group_walk(
    chunk: int, block: int, token_len: int, save_start: int, store_mask: Any, put_step: int, rank: int, blocks: Any
) -> tuple[list[bool], list[int], Any] | str:
    """vLLM's send walk of one group as an absolute per-block mask for the engine's ``plan_load``.

    The walk: Store chunks of ``chunk`` tokens from ``ceil(save_start / chunk)`` to ``ceil(token_len / chunk)``,
    chunk ids striped by ``put_step`` (``rank`` kept), the store mask read per physical block of ``block``
    tokens relative to ``ceil(save_start / block)`` (an index outside it drops the chunk), then the chunks whose
    block id is past the list or the null block (0) skipped. With ``chunk == block`` this is vLLM 0.32/0.33's
    ``chunk_mask``. Returns (mask per block, block index of each skipped chunk, kept chunk starts), or why the
    engine cannot plan it: striping by chunks smaller than a block keeps part of a block.
    """
    first = max(0, -(-save_start // chunk))
    stop = -(-token_len // chunk)
    if stop <= first:
        return [], [], np.empty(0, dtype=np.int64)
    if chunk != block and put_step != 1:
        return "put striping by Store chunks smaller than a block"
    ids = np.arange(first, stop, dtype=np.int64)
    keep = ids % put_step == rank
    index = ids * chunk // block
    if store_mask is not None:
        rel = index - (-(-save_start // block))
        inside = (rel >= 0) & (rel < len(store_mask))
        flags = np.fromiter(map(bool, store_mask), dtype=bool, count=len(store_mask))
        keep &= inside
        keep[inside] &= flags[rel[inside]]
    low, high = int(index[0]), int(index[-1]) + 1
    present = np.zeros(high - low, dtype=bool)
    listed = max(0, min(high, len(blocks)) - low)
    if listed:
        values = np.asarray(blocks[low : low + listed])
        if values.dtype.kind not in "iub" or values.shape != (listed,):
            raise TypeError("block ids that are not integers")
        present[:listed] = values != 0
    available = present[index - low]
    skipped = index[keep & ~available].tolist()
    keep &= available
    mask = np.zeros(high, dtype=bool)
    mask[index[keep]] = True
    return mask.tolist(), skipped, ids[keep] * chunk


def plan_store(
    thread: Any,
    req_meta: Any,
    job: Job,
    arrays: bool,
    kinds: Kinds,
    engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]],
    blob_type: type,
    db_chunk: str = "block_size",
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
    token_len, save_start, masks = job.token_len, job.save_start, job.masks
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
        chunk, block, hash_block_size = getattr(db, db_chunk), db.store_layout.block_size, db.hash_block_size
        if not n_hashes:
            continue  # vLLM's walk yields nothing without hashes
        if token_len % hash_block_size or token_len // hash_block_size > n_hashes:
            return "a token length vLLM's walk refuses"
        if type(block) is not int or block <= 0 or block % chunk:
            return "a layout block that is not a whole number of chunks"
        store_mask = masks[g]
        if store_mask is not None and type(store_mask) is not list and type(store_mask) is not tuple:
            return "a store mask that is not a list"
        blocks = req_meta.block_ids[g]
        if type(blocks) is not list and type(blocks) is not tuple and not isinstance(blocks, np.ndarray):
            return "block ids that are not a list"
        rank = (thread.tp_rank + g) % put_step
        walked = group_walk(chunk, block, token_len, save_start, store_mask, put_step, rank, blocks)
        if isinstance(walked, str):
            return walked
        mask, unavailable, starts = walked
        skipped.extend((g, index) for index in unavailable)
        part = engine.plan_load(prefixes, hashes, hash_len, token_len, save_start, mask, None, blocks, arrays)
        if len(part[0]):
            parts.append(part)
            groups.extend([g] * len(part[0]))
            if events:  # the walk keeps the chunks the mask keeps, in order, one key per local shard each
                for start in starts.tolist():
                    chunks.extend([(start, min(start + chunk, token_len))] * len(prefixes))
                if len(chunks) != len(groups):
                    raise RuntimeError("the plan's keys do not match the walk")
    rows = join_groups(parts, arrays) if parts else KeyPlan([], [], [], [])
    return SendPlan(rows, groups, skipped, chunks)


# --- the steps of a job (:func:`run_job` calls them in vLLM's order) ----------------------------------------------


class EventIds:
    """vLLM's kv-event token ids of one job: the step's ids with a failed job's retry ids merged in front by the
    release's ``merge(retry_start, retry_ids, start, ids)`` rule (None: not merged), and where they start."""

    __slots__ = ("on", "start", "token_ids")

    def __init__(
        self, thread: Any, req_meta: Any, merge: Callable[[int, list[int], int, list[int]], tuple[int, Any] | None]
    ) -> None:
        self.on = bool(thread.enable_kv_event)
        self.token_ids = req_meta.token_ids
        self.start = req_meta.token_ids_start
        if self.on:
            retry = thread._get_retry_token_ids(req_meta)
            if retry is not None and self.token_ids is not None:
                merged = merge(retry[0], retry[1], self.start, self.token_ids)
                if merged is not None:
                    self.start, self.token_ids = merged


def log_skipped(worker: ModuleType, req_id: Any, plan: SendPlan) -> None:
    """vLLM's debug line for each walked chunk whose source block is unavailable, in walk order."""
    logger = worker.logger
    if logger.isEnabledFor(logging.DEBUG):
        for g, index in plan.skipped:
            logger.debug(
                "Skipping unavailable Mooncake store source block (req=%s, group=%d, block=%d)", req_id, g, index
            )


def missing_keys(thread: Any, keys: list[str]) -> list[int]:
    """vLLM's existence check of a job's keys and its record; the indices of the keys not present (only 1
    means present). Raises what the store raises, after its error record."""
    exists_start = time.perf_counter()
    try:
        exists_states = thread.store.batch_is_exist(keys)
    except Exception:
        thread._record_operation("save_exists", exists_start, len(keys), status="error", num_failed_keys=len(keys))
        raise
    thread._record_operation("save_exists", exists_start, len(keys))
    return [i for i, exists in enumerate(exists_states) if exists != 1]


def narrow(plan: SendPlan, missing: list[int], events: bool) -> tuple[KeyPlan, list[int], list[tuple[int, int]]]:
    """The plan's rows, group indices and (for ``events``) chunks of the missing keys only."""
    rows, groups, chunks = plan.rows, plan.groups, plan.chunks
    if len(missing) != len(rows.keys):
        rows = rows.take(missing)
        groups = [groups[i] for i in missing]
        if events:
            chunks = [chunks[i] for i in missing]
    return rows, groups, chunks


def before_put(thread: Any, req_meta: Any, keys: list[str], groups: list[int], worker: ModuleType) -> None:
    """What vLLM does between the existence check and the put: each key's Mooncake group id (with group
    semantics), the debug line, the copy fence, then the group ids set on the replicate config."""
    group_ids = (
        [
            worker._make_mooncake_group_id(thread.token_databases[g].metadata, key.rsplit("@", 1)[-1])
            for key, g in zip(keys, groups, strict=True)
        ]
        if thread.enable_group_semantics and thread.supports_group_ids
        else None
    )
    worker.logger.debug(
        "Storing KV cache for %d blocks (groups=%s) for request %s", len(keys), set(groups), req_meta.req_id
    )
    if req_meta.current_event is not None:
        req_meta.current_event.synchronize()
    if group_ids is not None:
        thread.replicate_config.group_ids = group_ids


def put_and_record(thread: Any, req_meta: Any, rows: KeyPlan, worker: ModuleType) -> set[int] | None:
    """The put and vLLM's bookkeeping of its outcome (records, warnings, pressure marked); the indices of the
    failed keys, or None when the put raised."""
    logger = worker.logger
    keys = rows.keys
    batch_bytes = rows.num_bytes()
    put_start = time.perf_counter()
    try:
        res = multi_buffers_call(thread.store, rows, "put_from", thread.replicate_config)
    except Exception as e:
        record_batch(thread, "save_put", put_start, len(keys), batch_bytes, None)
        logger.error("Failed to put key %s, error: %s", keys, e)
        return None
    failed_indices = {i for i, value in enumerate(res) if value < 0}
    record_batch(thread, "save_put", put_start, len(keys), batch_bytes, len(failed_indices))
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
    if worker.MOONCAKE_NO_AVAILABLE_HANDLE in failed_codes and not thread._mark_request_skipped_for_pressure(req_meta):
        logger.warning(
            "Detected Mooncake CPU/disk offloading pressure (NO_AVAILABLE_HANDLE); skipping future store "
            "batches for request %s until a later store batch succeeds",
            req_meta.req_id,
        )
    return failed_indices


def stored_events(
    thread: Any,
    req_meta: Any,
    groups: list[int],
    chunks: list[tuple[int, int]],
    failed: set[int],
    ids: EventIds,
    worker: ModuleType,
    rules: SendRules,
) -> list[Any]:
    """vLLM's ``BlockStored`` events: one per chunk whose every missing shard was stored, in vLLM's order, with
    its parent hash and token ids as vLLM derives them (and the lookahead ids where the release has them)."""
    hashes = req_meta.block_hashes
    by_event: dict[tuple[Any, ...], list[int]] = {}
    for index, ((start, end), g) in enumerate(zip(chunks, groups, strict=True)):
        db = thread.token_databases[g]
        by_event.setdefault((start, end, g, hashes[end // db.hash_block_size - 1]), []).append(index)
    token_ids, first = ids.token_ids, ids.start
    last = first + len(token_ids or ())
    lookahead = req_meta.num_hash_lookahead_tokens if rules.lookahead else 0
    convert = worker.maybe_convert_block_hash
    stored = []
    for (start, end, g, block_hash), indices in by_event.items():
        if any(index in failed for index in indices):
            continue
        db = thread.token_databases[g]
        event_ids = (
            token_ids[start - first : end - first]
            if token_ids is not None and first <= start and end + lookahead <= last
            else []
        )
        extra: dict[str, Any] = {}
        if rules.lookahead:
            extra["lookahead_token_ids"] = (
                [token_ids[end - first : end - first + lookahead]]
                if event_ids and lookahead and token_ids is not None
                else None
            )
        stored.append(
            worker.BlockStored(
                block_hashes=[convert(block_hash)],
                parent_block_hash=convert(hashes[start // db.hash_block_size - 1]) if start > 0 else None,
                token_ids=event_ids,
                **extra,
                block_size=getattr(db, rules.db_chunk),
                lora_id=None,
                medium="cpu",
                lora_name=None,
                group_idx=g,
            )
        )
    return stored


def run_job(thread: Any, req_meta: Any, plan: SendPlan, job: Job, worker: ModuleType, rules: SendRules) -> None:
    """A planned job from the boundary-state puts on, in vLLM's control flow: nothing more for a stale job; no
    key or every key present, or a put with no failed key, completes the save (``rules.checkpoint``: unless a
    source block was unavailable); the kv events of the stored chunks; the retry ids and the completion in the
    ``finally``."""
    ids = EventIds(thread, req_meta, rules.merge_retry)
    complete = not (rules.checkpoint and plan.missing)
    save_completed = False
    try:
        if not thread._maybe_offload_boundary_states(req_meta) or job.stale:
            return
        log_skipped(worker, req_meta.req_id, plan)
        missing = missing_keys(thread, plan.rows.keys) if plan.rows.keys else []
        if not missing:  # no key, or every key present
            save_completed = complete and _saved(thread, req_meta, job, rules)
            return
        rows, groups, chunks = narrow(plan, missing, ids.on)
        before_put(thread, req_meta, rows.keys, groups, worker)
        failed = put_and_record(thread, req_meta, rows, worker)
        if failed is not None and not failed and complete:
            save_completed = _saved(thread, req_meta, job, rules)
            if thread._clear_store_pressure():  # vLLM's pressure clearing after a successful batch, with its line
                worker.logger.info("Mooncake CPU/disk offloading pressure cleared after a successful store batch")
        if ids.on and failed is not None:
            stored = stored_events(thread, req_meta, groups, chunks, failed, ids, worker, rules)
            if stored:
                thread.update_kv_event(stored)
    finally:
        if save_completed and rules.checkpoint:
            thread._record_saved_offset(req_meta, job.token_len)
        if ids.on and job.available:
            thread._update_retry_token_ids(req_meta, save_completed, ids.start, ids.token_ids)
        thread.finish_store_job(req_meta)
        thread.request_queue.task_done()


def _saved(thread: Any, req_meta: Any, job: Job, rules: SendRules) -> bool:
    """A complete save: recorded at once without the checkpoint rule (vLLM 0.33), in the ``finally`` with it."""
    if not rules.checkpoint:
        thread._record_saved(req_meta, job.token_len)
    return True


# --- the handler -------------------------------------------------------------------------------------------------


def make_handler(
    original: Callable[[Any, Any], Any],
    data: ModuleType,
    worker: ModuleType,
    ours: Mapping[str, Any],
    engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]],
    kinds: Kinds | None,
    rules: SendRules,
) -> Callable[[Any, Any], Any]:
    """The replacement ``_handle_request``; ``original`` is vLLM's (run for everything off the fast path).
    ``ours`` and ``engines`` as for the receive handler's :func:`~.receive.make_handler`; ``rules``: the
    release module's (``SEND`` in ``releases/v0_33.py``, ``v0_34.py``)."""
    kinds = kinds if kinds is not None else Kinds(data, ours)
    blob_type = data.BlobBlockHashes
    stats = SendStats()
    lock = threading.Lock()

    def _plan(self: Any, req_meta: Any) -> tuple[SendPlan, Job] | str:
        # What refuses a job without reading it comes first: the release's prepare asks vLLM's coordinator for
        # the store masks, and vLLM's own handler (where we hand the job) asks again.
        if hash_source(req_meta.block_hashes, blob_type) is None:
            return "block hashes of another type"
        for g, db in enumerate(self.token_databases):
            if self.group_participates[g]:
                planner = kinds.engine_of(db, engines)
                if isinstance(planner, str):
                    return planner
        job = rules.prepare(self, req_meta)
        if isinstance(job, str):
            return job
        if job.stale:
            return SendPlan(KeyPlan([], [], [], []), [], [], []), job
        arrays = isinstance(self.store, ArrayStore)
        events = bool(self.enable_kv_event)
        plan = plan_store(self, req_meta, job, arrays, kinds, engines, blob_type, rules.db_chunk, events)
        return plan if isinstance(plan, str) else (plan, job)

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
        run_job(self, req_meta, planned[0], planned[1], worker, rules)
        return None

    return finish_handler(_handle_request, original, "KVCacheStoreSendingThread._handle_request", stats)
