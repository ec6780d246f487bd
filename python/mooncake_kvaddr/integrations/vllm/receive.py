"""A replacement for vLLM 0.32/0.33's ``KVCacheStoreRecvingThread._handle_request`` (docs/vllm-plugin.md,
"The receive handler").

vLLM's handler builds every load in Python: per participating KV-cache group it walks ``process_tokens``,
filters chunks by the group's load mask, keys the tail chunk by its tail-key boundary, calls ``key_for`` once
per chunk and shard and ``prepare_values`` once, concatenates the groups, rotates every list by ``tp_rank``,
and hands Mooncake ``list[list[int]]`` rows. Ours does each group in ONE native call (the layout engine's
``plan_load``, docs/vllm.md "Fused plan"), concatenates and rotates, and makes the one store call:

- with int64 matrices to ``batch_get_into_multi_buffers_arrays`` when the thread's store is one of our own
  wrappers (:class:`StagedMooncakeStore`, :class:`NativeMooncakeStore`; decided by type, never by probing
  a foreign store for the attribute: a mock "has" every attribute): no Python row is ever built;
- with lists of lists of ints, value-equal to vLLM's, for any other store (a plain Mooncake store).

The observable behaviour is vLLM's: the same keys in the same order, value-equal rows, the same
``_report_load_error``/``_record_operation`` calls, ``set_finished_request`` and ``request_queue.task_done()`` once;
a disk-offload budget splits the load as vLLM does (:func:`offload_batches`). Anything outside the fast path goes to
vLLM's own handler unchanged (:func:`fast_path_refusal`): ``VLLM_MOONCAKE_STORE_TIER_LOG`` on, a layout or token
database not backed by our engine (a subclass overriding a method, an instance override), hashes, masks or block ids
of a shape we do not take, an empty load (vLLM raises ``ZeroDivisionError`` from its rotation: its own handler
raises it), and any exception while planning (vLLM's handler then raises its own exception, or succeeds where our
engine is stricter). Planning has no side effects, so handing over after a refusal is safe.
"""

from __future__ import annotations

import abc
import inspect
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.integrations.vllm.plugin import ENV_RECV

__all__ = [
    "ARRAY_ENTRY",
    "ENV_RECV",
    "ArrayStore",
    "ReceiveStats",
    "RequestPlan",
    "fast_path_refusal",
    "make_handler",
    "plan_request",
    "receive_enabled",
]


#: The array entry point our store wrappers offer (keys, (n, w) int64 addrs, (n, w) int64 sizes).
ARRAY_ENTRY = "batch_get_into_multi_buffers_arrays"


class ArrayStore(abc.ABC):
    """The store types whose :data:`ARRAY_ENTRY` the receive handler calls: our own wrappers
    (:class:`NativeMooncakeStore`, :class:`StagedMooncakeStore`, registered by :func:`make_handler`) and
    whatever a caller registers explicitly (``ArrayStore.register(cls)``: a test's recording store, a
    benchmark's timing proxy). The choice is by type, never by probing the store for the attribute (a mock
    store "has" every attribute); any other store gets vLLM's list rows (docs/vllm-plugin.md)."""

    @abc.abstractmethod
    def batch_get_into_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any) -> Any:
        """``batch_get_into_multi_buffers`` with (keys x regions) int64 matrices; Mooncake's per-key codes."""

    def batch_get_into_multi_buffers_ragged(self, keys: list[str], addrs: Any, sizes: Any, widths: Any) -> Any:
        """The array entry for rows of different widths: (keys x max width) matrices, row ``i`` holding
        ``widths[i]`` regions; this default makes one array call per width and merges the answers."""
        from mooncake_kvaddr.integrations.vllm.native_store import ragged_calls

        return ragged_calls(self.batch_get_into_multi_buffers_arrays, keys, addrs, sizes, widths)

    def batch_put_from_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any, config: Any) -> Any:
        """``batch_put_from_multi_buffers(keys, addrs, sizes, config)`` with int64 matrices (the send handler's
        entry); this default hands the rows on as lists to the subclass's ``batch_put_from_multi_buffers``."""
        rows = np.asarray(addrs).tolist(), np.asarray(sizes).tolist()
        return self.batch_put_from_multi_buffers(keys, *rows, config)  # type: ignore[attr-defined]

    def batch_put_from_multi_buffers_ragged(
        self, keys: list[str], addrs: Any, sizes: Any, widths: Any, config: Any
    ) -> Any:
        """The array put for rows of different widths (as :meth:`batch_get_into_multi_buffers_ragged`)."""
        from mooncake_kvaddr.integrations.vllm.native_store import ragged_calls

        put = self.batch_put_from_multi_buffers_arrays
        return ragged_calls(lambda k, a, s: put(k, a, s, config), keys, addrs, sizes, widths)


def _register_wrappers() -> None:
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
    from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

    ArrayStore.register(NativeMooncakeStore)
    ArrayStore.register(StagedMooncakeStore)


_INT64_MAX = int(np.iinfo(np.int64).max)

def receive_enabled(environ: Mapping[str, str]) -> bool:
    """False when :data:`ENV_RECV` turns the replacement handler off (on by default with the plugin)."""
    return flag(environ.get(ENV_RECV), True)


# --- planning ----------------------------------------------------------------------------------------------


class RequestPlan:
    """One request's load, after concatenation and rotation: keys, rows and block ids, index-aligned.

    ``arrays``: rows are (n, w) int64 matrices and ``block_ids`` an int64 array; otherwise lists of lists of
    ints and a list of ints (vLLM's own types). ``widths`` (arrays only): each row's region count when rows
    differ in width (hybrid groups), the matrices then padded with zero cells to the widest row."""

    __slots__ = ("addrs", "arrays", "block_ids", "keys", "sizes", "widths")

    def __init__(
        self, keys: list[str], addrs: Any, sizes: Any, block_ids: Any, arrays: bool, widths: Any = None
    ) -> None:
        self.keys = keys
        self.addrs = addrs
        self.sizes = sizes
        self.block_ids = block_ids
        self.arrays = arrays
        self.widths = widths

    def total_bytes(self) -> int:
        """The sum of every size (vLLM's ``num_bytes`` of the load), exact."""
        if not self.arrays:
            return sum(map(sum, self.sizes))
        sizes = self.sizes
        if sizes.size == 0:
            return 0
        top = int(sizes.max())
        if int(sizes.min()) >= 0 and top <= _INT64_MAX // max(1, sizes.size):
            return int(sizes.sum())
        return sum(int(v) for v in sizes.ravel().tolist())

    def part(self, start: int, end: int) -> RequestPlan:
        """Keys ``start:end`` with their rows and block ids (views of the matrices, no copy)."""
        ids = self.block_ids[start:end]
        widths = None if self.widths is None else self.widths[start:end]
        return RequestPlan(self.keys[start:end], self.addrs[start:end], self.sizes[start:end], ids, self.arrays, widths)

    def key_bytes(self) -> list[int]:
        """Each key's byte count (the sum of its sizes), exact Python ints."""
        if not self.arrays:
            return [sum(row) for row in self.sizes]
        sizes = self.sizes
        if sizes.size and (int(sizes.min()) < 0 or int(sizes.max()) > _INT64_MAX // max(1, sizes.shape[1])):
            return [sum(row) for row in sizes.tolist()]
        result: list[int] = sizes.sum(axis=1).tolist()
        return result

    def take(self, indices: list[int]) -> RequestPlan:
        """The keys at ``indices`` (in that order) with their rows and block ids."""
        keys = [self.keys[i] for i in indices]
        if self.arrays:
            widths = None if self.widths is None else self.widths[indices]
            return RequestPlan(keys, self.addrs[indices], self.sizes[indices], self.block_ids[indices], True, widths)
        addrs, sizes, ids = ([m[i] for i in indices] for m in (self.addrs, self.sizes, self.block_ids))
        return RequestPlan(keys, addrs, sizes, ids, False)

    def row_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """The rows as lists of lists of ints (padding dropped), as vLLM builds them."""
        addrs, sizes = self.addrs.tolist(), self.sizes.tolist()
        if self.widths is None:
            return addrs, sizes
        widths = self.widths.tolist()
        return [r[:w] for r, w in zip(addrs, widths)], [r[:w] for r, w in zip(sizes, widths)]

    def block_id_list(self, indices: list[int] | None = None) -> list[int]:
        """Block ids (all, or those at ``indices``) as a list of Python ints."""
        ids = self.block_ids
        if indices is None:
            return list(ids.tolist()) if self.arrays else list(ids)
        if self.arrays:
            return [int(ids[i]) for i in indices]
        return [ids[i] for i in indices]


class _Kinds:
    """Which token databases and layouts are ours to plan, cached per type (vLLM's classes rarely change)."""

    def __init__(self, data: ModuleType, ours: Mapping[str, Any]) -> None:
        self._data = data
        self._ours = ours
        self._db_types: dict[type, bool] = {}
        self._layout_types: dict[type, str] = {}
        self._lock = threading.Lock()

    def db_ok(self, db: Any) -> bool:
        cls = type(db)
        known = self._db_types.get(cls)
        if known is None:
            base = self._data.ChunkedTokenDatabase
            known = isinstance(db, base) and inspect.getattr_static(cls, "process_tokens") is inspect.getattr_static(
                base, "process_tokens"
            )
            with self._lock:
                self._db_types[cls] = known
        return known

    def layout_kind(self, layout: Any) -> str:
        """``"rank_local"``, ``"sharded"`` or ``""`` (not ours: vLLM's handler)."""
        cls = type(layout)
        kind = self._layout_types.get(cls)
        if kind is None:
            kind = self._classify(cls)
            with self._lock:
                self._layout_types[cls] = kind
        if kind and ("prepare_values" in layout.__dict__ or "key_for" in layout.__dict__):
            return ""  # an instance override: vLLM would call it
        return kind

    def _classify(self, cls: type) -> str:
        data = self._data
        static = inspect.getattr_static
        for kind, base, prepare, key_for in (
            ("rank_local", data.RankLocalStoreLayout, "rank_local_prepare_values", "rank_local_key_for"),
            ("sharded", data.TPShardedStoreLayout, "sharded_prepare_values", "sharded_key_for"),
        ):
            if (
                issubclass(cls, base)
                and static(cls, "prepare_values") is self._ours[prepare]
                and static(cls, "key_for") is self._ours[key_for]
                and static(cls, "local_shard_ids") is static(base, "local_shard_ids")
            ):
                return kind
        return ""


def _hash_source(hashes: Any, blob_type: type) -> tuple[Any, int | None] | None:
    """What the engine reads the hashes from: the list itself, or a ``BlobBlockHashes``'s flat byte blob."""
    if type(hashes) is list or type(hashes) is tuple:
        return hashes, None
    if type(hashes) is blob_type:
        blob = getattr(hashes, "_blob", None)
        hash_len = getattr(hashes, "_hash_len", None)
        if (
            isinstance(blob, memoryview)
            and blob.ndim == 1
            and blob.itemsize == 1
            and type(hash_len) is int
            and hash_len > 0
            and len(blob) % hash_len == 0
        ):
            return blob, hash_len
    return None


def plan_request(
    thread: Any,
    req_meta: Any,
    arrays: bool,
    kinds: _Kinds,
    engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]],
    blob_type: type,
) -> RequestPlan | str:
    """The whole load of ``req_meta`` (vLLM's receive rules, docs/vllm-plugin.md), or why it is not ours to
    plan. May raise: the caller then hands the request to vLLM's own handler. No side effects."""
    load_spec = req_meta.load_spec
    token_len = load_spec.token_len
    mask_num = load_spec.vllm_cached_tokens // thread.block_size * thread.block_size
    source = _hash_source(req_meta.block_hashes, blob_type)
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
        if not kinds.db_ok(db):
            return "a token database that is not vLLM's"
        layout = db.store_layout
        kind = kinds.layout_kind(layout)
        if not kind:
            return "a layout not backed by our engine"
        engine, prefixes = engines[kind](layout)
        parts.append(
            engine.plan_load(
                prefixes, hashes, hash_len, token_len, mask_num, mask, tails.get(g), req_meta.block_ids[g], arrays
            )
        )
    n = sum(len(part[0]) for part in parts)
    if n == 0:
        return "no key (vLLM's handler raises ZeroDivisionError)"
    rotation = thread.tp_rank % n
    widths = None
    if len(parts) == 1:
        keys, addrs, sizes, ids = parts[0]
    elif arrays:
        kept = [p for p in parts if len(p[0])]
        keys = [key for p in kept for key in p[0]]
        ids = np.concatenate([p[3] for p in kept])
        addrs, sizes, widths = concat_rows([p[1] for p in kept], [p[2] for p in kept])
    else:
        keys, addrs, sizes, ids = ([item for p in parts for item in p[i]] for i in range(4))
    if rotation:
        keys = keys[rotation:] + keys[:rotation]
        if arrays:
            addrs, sizes, ids = (np.concatenate((m[rotation:], m[:rotation])) for m in (addrs, sizes, ids))
            if widths is not None:
                widths = np.concatenate((widths[rotation:], widths[:rotation]))
        else:
            addrs, sizes, ids = (m[rotation:] + m[:rotation] for m in (addrs, sizes, ids))
    return RequestPlan(keys, addrs, sizes, ids, arrays, widths)


def concat_rows(addr_parts: list[Any], size_parts: list[Any]) -> tuple[Any, Any, Any]:
    """Groups' (keys x regions) int64 matrices stacked; when their widths differ, padded with zero cells to the
    widest and returned with each row's width (else widths None)."""
    widest = max(m.shape[1] for m in addr_parts)
    if all(m.shape[1] == widest for m in addr_parts):
        return np.concatenate(addr_parts), np.concatenate(size_parts), None
    rows = sum(m.shape[0] for m in addr_parts)
    addrs = np.zeros((rows, widest), dtype=np.int64)
    sizes = np.zeros((rows, widest), dtype=np.int64)
    widths = np.empty(rows, dtype=np.int64)
    at = 0
    for a, s in zip(addr_parts, size_parts, strict=True):
        n, w = a.shape
        addrs[at : at + n, :w] = a
        sizes[at : at + n, :w] = s
        widths[at : at + n] = w
        at += n
    return addrs, sizes, widths


def fast_path_refusal(thread: Any, envs: Any) -> str:
    """Why this thread's requests go to vLLM's own handler ("" when they may take the fast path)."""
    if getattr(envs, "VLLM_MOONCAKE_STORE_TIER_LOG", True):
        return "VLLM_MOONCAKE_STORE_TIER_LOG on"
    return ""


# --- the handler --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadRule:
    """vLLM's disk-offload staging estimate of one key: its bytes rounded up to ``alignment`` plus ``padding``
    (the worker module's direct-I/O constants, read when the handler is made)."""

    alignment: int
    padding: int

    def staging_bytes(self, key_bytes: int) -> int:
        return -(-key_bytes // self.alignment) * self.alignment + self.padding


def offload_batches(plan: RequestPlan, usable: int, raw: int, rule: OffloadRule) -> list[tuple[int, int]] | int:
    """vLLM's disk-offload split of a load (docs/vllm-plugin.md, "The receive handler"): key ranges of at most
    ``usable`` staging bytes each (a key over ``usable`` alone), or the index of the first key over ``raw``
    (vLLM then skips the whole request). One range when the whole load fits."""
    need = [rule.staging_bytes(b) for b in plan.key_bytes()]
    if sum(need) <= usable:
        return [(0, len(need))]
    batches: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(need):
        if size > raw:
            return i
        if size > usable:
            if i > start:
                batches.append((start, i))
            batches.append((i, i + 1))
            start, total = i + 1, 0
            continue
        if i > start and total + size > usable:
            batches.append((start, i))
            start, total = i, 0
        total += size
    if len(need) > start:
        batches.append((start, len(need)))
    return batches


def _skip_oversized(thread: Any, req_id: Any, plan: RequestPlan, index: int, rule: OffloadRule, logger: Any) -> None:
    """vLLM's answer to a key over the raw staging budget: every block of the request fails, nothing is read."""
    thread._report_load_error(req_id, plan.block_id_list())
    logger.warning(
        "Skipping Mooncake load for request %s because key %s requires %d staging bytes, exceeding budget %d",
        req_id,
        plan.keys[index],
        rule.staging_bytes(plan.key_bytes()[index]),
        thread.disk_offload_buffer_budget_bytes,
    )
    thread.set_finished_request(req_id)
    thread.request_queue.task_done()


def _get(store: Any, batch: RequestPlan) -> Any:
    if batch.arrays and isinstance(store, ArrayStore):
        widths = batch.widths
        if widths is None:
            return store.batch_get_into_multi_buffers_arrays(batch.keys, batch.addrs, batch.sizes)
        if widths.size and bool((widths == widths[0]).all()):  # a batch of one width: one matrix
            width = int(widths[0])
            return store.batch_get_into_multi_buffers_arrays(batch.keys, batch.addrs[:, :width], batch.sizes[:, :width])
        return store.batch_get_into_multi_buffers_ragged(batch.keys, batch.addrs, batch.sizes, widths)
    if batch.arrays:
        return store.batch_get_into_multi_buffers(batch.keys, *batch.row_lists())
    return store.batch_get_into_multi_buffers(batch.keys, batch.addrs, batch.sizes)


def _execute(thread: Any, req_id: Any, plan: RequestPlan, batches: list[tuple[int, int]], logger: Any) -> None:
    """One store call per batch and vLLM's bookkeeping around each; the first batch with a failed key ends
    the load, and an exception fails the batch in flight (vLLM's rules)."""
    batch = plan
    batch_bytes = 0
    load_get_start = time.perf_counter()
    try:
        for start, end in batches:
            batch = plan if (start, end) == (0, len(plan.keys)) else plan.part(start, end)
            keys = batch.keys
            batch_bytes = batch.total_bytes()
            store = thread.store
            load_get_start = time.perf_counter()
            res = _get(store, batch)
            codes = res if type(res) is list else list(res)
            if len(codes) != len(keys):
                raise ValueError(f"the store returned {len(codes)} results for {len(keys)} keys")
            failed = [i for i, value in enumerate(codes) if value < 0]
            thread._record_operation(
                "load_get",
                load_get_start,
                len(keys),
                num_bytes=batch_bytes,
                status="partial_failure" if failed else "ok",
                num_failed_keys=len(failed),
            )
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
        thread._record_operation(
            "load_get",
            load_get_start,
            len(batch.keys),
            num_bytes=batch_bytes,
            status="error",
            num_failed_keys=len(batch.keys),
        )
        logger.warning("Mooncake load of request %s (keys %s...) raised: %s", req_id, batch.keys[:3], exc)
    thread.set_finished_request(req_id)
    thread.request_queue.task_done()


@dataclass
class ReceiveStats:
    """Requests the replacement handler planned itself, and those it handed to vLLM's own handler (with the
    last reason). Counters only: updated without a lock, exact enough to see which path runs."""

    fast_requests: int = 0
    fallback_requests: int = 0
    last_fallback: str = ""


def make_handler(
    original: Callable[[Any, Any], Any],
    data: ModuleType,
    worker: ModuleType,
    ours: Mapping[str, Any],
    engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]],
) -> Callable[[Any, Any], Any]:
    """The replacement ``_handle_request``; ``original`` is vLLM's (called for everything off the fast path).

    ``ours``: the plugin's layout methods (``rank_local_prepare_values``, ``rank_local_key_for``,
    ``sharded_prepare_values``, ``sharded_key_for``): a layout class whose methods are these is backed by our
    engine. ``engines``: per layout kind, ``layout -> (engine, key prefix per local shard)``.
    """
    kinds = _Kinds(data, ours)
    blob_type = data.BlobBlockHashes
    envs = worker.envs
    logger = worker.logger
    rule = OffloadRule(worker._DIRECT_IO_ALIGNMENT, worker._DIRECT_IO_PADDING_BYTES)
    stats = ReceiveStats()
    _register_wrappers()

    def _handle_request(self: Any, req_meta: Any) -> Any:
        """mooncake_kvaddr's receive handler (docs/vllm-plugin.md, "The receive handler")."""
        why = fast_path_refusal(self, envs)
        plan: RequestPlan | str = why
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
        split = [(0, len(plan.keys))] if usable is None else offload_batches(
            plan, usable, self.disk_offload_buffer_budget_bytes, rule
        )
        if isinstance(split, int):
            _skip_oversized(self, req_meta.req_id, plan, split, rule, logger)
            return None
        _execute(self, req_meta.req_id, plan, split, logger)
        return None

    handler: Any = _handle_request
    handler.__wrapped__ = original
    handler.__qualname__ = "KVCacheStoreRecvingThread._handle_request"
    handler.stats = stats
    result: Callable[[Any, Any], Any] = handler
    return result
