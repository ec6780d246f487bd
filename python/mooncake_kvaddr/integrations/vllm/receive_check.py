"""The receive handler's start-up checks, run by the plugin before it replaces vLLM's ``_handle_request``
(docs/vllm-plugin.md, "What ``register()`` does"): the shape of vLLM's receive thread and token database, and a
self-check of vLLM's handler and ours on small generated requests. Kept apart from the handler so that its
module holds only what runs per request.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import queue
import random
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from mooncake_kvaddr.driver.outcomes import CODE_INVALID_PARAMS as INVALID_PARAMS
from mooncake_kvaddr.integrations.vllm.receive import ArrayStore
from mooncake_kvaddr.integrations.vllm.registry import params_after_self, signature_problem

__all__ = [
    "RECEIVE_FUNCTIONS", "ArrayRecordingStore", "DropThread", "RecordingStore", "Records", "check_shape", "outcome_of",
    "quiet_thread", "self_check",
]  # fmt: skip

#: The vLLM functions the receive handler was checked against, alike in every release (a release's
#: ``FINGERPRINTED["receive"]``): the handler it replaces, the chunk walk it reproduces, the disk-offload split.
RECEIVE_FUNCTIONS = (
    "KVCacheStoreRecvingThread._handle_request",
    "ChunkedTokenDatabase.process_tokens",
    "_estimate_disk_offload_staging_bytes",
    "_split_disk_offload_load_batches",
)

# Parameters (after self) of what this module relies on, as vLLM 0.32/0.33 declare them.
_EXPECTED_THREAD: dict[str, tuple[str, ...]] = {
    "_handle_request": ("req_meta",),
    "_report_load_error": ("req_id", "block_ids"),
    "_record_operation": ("operation", "start_time", "num_keys", "num_bytes", "status", "num_failed_keys"),
    "set_finished_request": ("req_id",),
    "__init__": (
        "store", "coord", "token_databases", "block_size", "tp_rank", "ready_event",
        "disk_offload_buffer_budget_bytes", "record_operation", "request_queue", "group_participates",
        "is_hma_required",
    ),
}  # fmt: skip
_EXPECTED_PROCESS_TOKENS = ("token_len", "block_hashes", "mask_num", "chunk_mask", "put_step", "put_step_rank")


def check_shape(
    data: ModuleType, worker: ModuleType, process_tokens: tuple[str, ...] = _EXPECTED_PROCESS_TOKENS
) -> str:
    """Empty string when vLLM's receive thread and token database have the shape this module relies on
    (``process_tokens``: the walk's parameters after self, as the release declares them); otherwise the first
    mismatch."""
    cls = getattr(worker, "KVCacheStoreRecvingThread", None)
    if not isinstance(cls, type):
        return "KVCacheStoreRecvingThread is missing"
    for method, params in _EXPECTED_THREAD.items():
        problem = signature_problem(cls, method, params)
        if problem:
            return problem
    db = getattr(data, "ChunkedTokenDatabase", None)
    func = inspect.getattr_static(db, "process_tokens", None) if isinstance(db, type) else None
    if not callable(func) or params_after_self(func) != process_tokens:
        return "ChunkedTokenDatabase.process_tokens is missing or has another signature"
    for name in ("envs", "logger"):
        if getattr(worker, name, None) is None:
            return f"{worker.__name__}.{name} is missing"
    for name in ("_DIRECT_IO_ALIGNMENT", "_DIRECT_IO_PADDING_BYTES"):
        value = worker.__dict__.get(name)
        if type(value) is not int or value <= 0:
            return f"{worker.__name__}.{name} is not a positive int"
    for name in ("BlobBlockHashes", "LoadSpec", "ReqMeta", "TailKeyBoundary"):
        if not isinstance(getattr(data, name, None), type):
            return f"{data.__name__}.{name} is missing"
    return ""


class RecordingStore:
    """A store that records ``batch_is_exist`` and the multi-buffer gets and puts (rows as plain lists, a put with
    the replicate config's group ids at the call) and answers from ``answer(call, keys)``: a list, or an
    exception to raise (``call``: ``"exist"``, ``"get"`` or ``"put"``). A put whose group ids are set but not one
    per key is answered as Mooncake answers it: -600 for every key. ``puts`` holds every put Mooncake would get:
    its keys and group ids (None: unset). Both self-checks and the differential tests record with it."""

    def __init__(self, answer: Callable[[str, list[str]], Any]) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.puts: list[tuple[list[str], list[str] | None]] = []
        self._answer = answer
        self.ragged = 0  # calls of rows of different widths (the array store's ragged entries)

    def _reply(self, call: str, keys: list[str]) -> Any:
        result = self._answer(call, keys)
        if isinstance(result, Exception):
            raise result
        return result

    def batch_is_exist(self, keys: Any) -> Any:
        self.calls.append(("exist", list(keys)))
        return self._reply("exist", list(keys))

    def batch_get_into_multi_buffers(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        keys = list(keys)
        self.calls.append(("get", keys, [list(map(int, r)) for r in addrs], [list(map(int, r)) for r in sizes]))
        return self._reply("get", keys)

    def batch_put_from_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, config: Any) -> Any:
        keys = list(keys)
        rows = [list(map(int, r)) for r in addrs], [list(map(int, r)) for r in sizes]
        ids = _group_ids(config)
        self.puts.append((keys, ids))
        self.calls.append(("put", keys, *rows, list(ids or ())))
        return _as_mooncake(self._reply("put", keys), keys, ids)


class ArrayRecordingStore(RecordingStore, ArrayStore):
    """The same, with the array entries our store wrappers offer (matrices recorded as lists). A ragged call is
    split as the wrappers split it (the inherited :class:`ArrayStore` entries: one array call per width, a put
    with its config cut to its keys; each put part in ``puts`` and answered as Mooncake answers it), and recorded
    in ``calls`` as the one call vLLM makes: rows trimmed to their widths, a put's group id per key as its part
    carried it (None where the part's group ids were not one per key). A short answer of the script to that one
    call comes back short, as vLLM's one call would get it."""

    def __init__(self, answer: Callable[[str, list[str]], Any]) -> None:
        super().__init__(answer)
        self._parts: list[tuple[list[str], list[str] | None]] | None = None  # set while a ragged call is split

    def batch_get_into_multi_buffers_arrays(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        return self._arrays(self.batch_get_into_multi_buffers, keys, addrs, sizes)

    def batch_put_from_multi_buffers_arrays(self, keys: Any, addrs: Any, sizes: Any, config: Any) -> Any:
        return self._arrays(self.batch_put_from_multi_buffers, keys, addrs, sizes, config)

    def _arrays(self, plain: Callable[..., Any], keys: Any, addrs: Any, sizes: Any, *config: Any) -> Any:
        """An array get or put (a put's one ``config`` after the rows): the plain entry ``plain`` with the rows as
        lists, or, while a ragged call is split, one part of it (a put's part in ``puts`` too)."""
        assert addrs.dtype.kind == "i" and sizes.dtype.kind == "i", "rows must come as integer matrices"
        if self._parts is None:
            return plain(keys, addrs.tolist(), sizes.tolist(), *config)
        ids = _group_ids(config[0]) if config else None
        if config:
            self.puts.append((list(keys), ids))
        self._parts.append((list(keys), ids))
        return [None] * len(keys)  # answered by the ragged call, once every part is known

    def batch_get_into_multi_buffers_ragged(self, keys: Any, addrs: Any, sizes: Any, widths: Any) -> Any:
        return self._ragged("get", ArrayStore.batch_get_into_multi_buffers_ragged, keys, addrs, sizes, widths)

    def batch_put_from_multi_buffers_ragged(self, keys: Any, addrs: Any, sizes: Any, widths: Any, config: Any) -> Any:
        return self._ragged("put", ArrayStore.batch_put_from_multi_buffers_ragged, keys, addrs, sizes, widths, config)

    def _ragged(self, call: str, split: Callable[..., Any], keys: Any, addrs: Any, sizes: Any, widths: Any,
                *config: Any) -> Any:  # fmt: skip
        self.ragged += 1
        keys = list(keys)
        parts: list[tuple[list[str], list[str] | None]] = []
        self._parts = parts
        try:
            split(self, keys, addrs, sizes, widths, *config)
        finally:
            self._parts = None
        at: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            at.setdefault(key, []).append(i)
        where: list[tuple[int, bool]] = []  # (index in the call, whether its part's group ids fit) per part key
        key_ids: list[Any] = [None] * len(keys)
        for part_keys, ids in parts:
            fits = ids is None or len(ids) == len(part_keys)
            for j, key in enumerate(part_keys):
                i = at[key].pop(0)
                where.append((i, fits))
                key_ids[i] = ids[j] if ids is not None and fits else None
        trimmed = [(a[:w], s[:w]) for a, s, w in zip(addrs.tolist(), sizes.tolist(), widths.tolist(), strict=True)]
        record: tuple[Any, ...] = ([a for a, _ in trimmed], [s for _, s in trimmed])
        if call == "put":
            record += ([] if all(ids is None for _, ids in parts) else key_ids,)
        self.calls.append((call, keys, *record))
        codes = self._reply(call, keys)  # the script answers the one call vLLM makes (or raises, as vLLM's does)
        answers: list[Any] = [None] * len(keys)
        for i, fits in where:
            answers[i] = INVALID_PARAMS if not fits else codes[i] if i < len(codes) else None
        # A script that answers the one call short leaves its last keys unanswered, as vLLM's one call would.
        while answers and answers[-1] is None:
            answers.pop()
        return answers


def _group_ids(config: Any) -> list[str] | None:
    ids = getattr(config, "group_ids", None)
    return None if ids is None else list(ids)


def _as_mooncake(codes: Any, keys: list[str], ids: list[str] | None) -> Any:
    """Mooncake's answer to a put: -600 for every key when its group ids are set but not one per key."""
    return codes if ids is None or len(ids) == len(keys) else [INVALID_PARAMS] * len(keys)


class _Coord:
    def __init__(self, masks: tuple[list[bool], ...]) -> None:
        self.masks = masks

    def load_mask(self, block_hashes: Any, token_len: int) -> tuple[list[bool], ...]:
        return self.masks


def _run_once(
    worker: ModuleType, handler: Callable[[Any, Any], Any], store: Any, coord: Any, dbs: list[Any],
    block_size: int, tp_rank: int, participates: list[bool], req_meta: Any, budget: int | None,
) -> tuple[Any, ...]:  # fmt: skip
    records = Records()
    q: queue.Queue[Any] = queue.Queue()
    q.put(req_meta)
    q.get()
    thread = worker.KVCacheStoreRecvingThread(
        store, coord, dbs, block_size, tp_rank, threading.Event(), disk_offload_buffer_budget_bytes=budget,
        record_operation=records, request_queue=q, group_participates=participates, is_hma_required=False,
    )  # fmt: skip
    return (
        outcome_of(handler, thread, req_meta),
        store.calls,
        records,
        sorted(thread.get_and_clear_block_ids_with_load_errors()),
        sorted(thread.get_and_clear_finished_requests()),
        q.unfinished_tasks,
    )


#: ``(layouts module, metadata, rng, case, block_size) -> (rank-local layout, TP-shared layout, its database's
#: chunk size)``: the self-check's two layouts, as a release builds them without tensors.
SampleLayouts = Callable[[ModuleType, Any, random.Random, int, int], tuple[Any, Any, int]]


def sample_layouts_033(data: ModuleType, metadata: Any, rng: random.Random, case: int, block_size: int) -> Any:
    """vLLM 0.32/0.33's layouts for the self-check: cycling region lengths, LBHNC with two local shards."""
    rank_local = data.RankLocalStoreLayout(metadata, block_size, 16)
    rank_local.set_kv_caches_base_addr([rng.randrange(1 << 20, 1 << 40) for _ in range(3)])
    rank_local.set_block_len([4096])
    sharded = data.LBHNCStoreLayout(metadata, block_size, block_size, 2, 4, case % 2, 8)
    sharded._set_segment_templates(
        [([rng.randrange(1 << 20, 1 << 40)] * 2, [65536, 65536], [512, 512]) for _ in range(2)]
    )
    return rank_local, sharded, block_size


def self_check(
    data: ModuleType, worker: ModuleType, handler: Callable[[Any, Any], Any], *, seed: int = 0, cases: int = 8,
    layouts: ModuleType | None = None, sample: SampleLayouts = sample_layouts_033,
) -> None:  # fmt: skip
    """vLLM's own handler and ``handler`` on small generated requests (two groups, masks, tail keys, rotation,
    failing and raising stores, plain and array stores): identical store calls and side effects, else
    ``AssertionError``. ``layouts``/``sample``: where the release keeps its layouts and how it builds them."""
    with quiet_thread(worker.logger):  # the failing-store cases log vLLM's warnings: not at start-up
        original = worker.KVCacheStoreRecvingThread._handle_request
        original = getattr(original, "__wrapped__", original)
        stats = getattr(handler, "stats", None)
        fast_before = stats.fast_requests if stats is not None else 0
        metadata = data.KeyMetadata("self-check/recv", 1, 0, 0, 0)
        rng = random.Random(seed)
        for case in range(cases):
            block_size = 64
            rank_local, sharded, sharded_chunk = sample(layouts or data, metadata, rng, case, block_size)
            dbs = [
                data.ChunkedTokenDatabase(metadata, block_size, 16, rank_local),
                data.ChunkedTokenDatabase(metadata, sharded_chunk, sharded.hash_block_size, sharded),
            ]
            blocks = rng.randint(1, 6)
            token_len = blocks * block_size - 16 * rng.randrange(0, 3 if case % 2 == 0 else 1)
            hashes = [rng.randbytes(32) for _ in range(blocks * 4)]
            masks = tuple([rng.random() < 0.8 for _ in range(blocks + 1)] for _ in dbs)
            tails = (data.TailKeyBoundary(0, rng.randrange(16, token_len + 1, 16)),) if case % 3 == 0 else ()
            spec = data.LoadSpec(
                vllm_cached_tokens=rng.randrange(0, token_len), kvpool_cached_tokens=token_len, can_load=True,
                token_len=token_len, tail_key_boundaries=tails,
            )  # fmt: skip
            block_ids = ([rng.randrange(1, 500) for _ in range(blocks)], [rng.randrange(1, 500) for _ in range(blocks)])
            meta = data.ReqMeta(
                req_id=f"self-check-{case}", token_len_chunk=token_len, block_ids=block_ids, block_hashes=hashes,
                load_spec=spec,
            )  # fmt: skip
            mode = case % 4

            def answer(call: str, keys: list[str], mode: int = mode) -> Any:
                if mode == 3:
                    raise RuntimeError("store down")
                return [-704 if mode == 2 and i % 2 else 4096 for i in range(len(keys))]

            participates = [True, case % 5 != 4]
            store_cls = ArrayRecordingStore if case % 2 else RecordingStore
            # Disk-offload budgets: one that holds the load, one that splits it, one a single key exceeds.
            budget = (None, 1 << 30, 40_000, 9_000)[case % 4] if case % 3 != 1 else None
            args = (_Coord(masks), dbs, block_size, case % 3, participates, meta, budget)
            expected = _run_once(worker, original, RecordingStore(answer), *args)
            actual = _run_once(worker, handler, store_cls(answer), *args)
            if expected != actual:
                raise AssertionError(f"receive handler, case {case}: vLLM gives {expected!r}, ours {actual!r}")
        if stats is not None and stats.fast_requests == fast_before:
            raise AssertionError("receive handler: no self-check request took the fast path")


class DropThread(logging.Filter):
    """Drops the log records of one thread (a self-check's expected warnings are not start-up noise)."""

    def __init__(self, ident: int) -> None:
        super().__init__()
        self.ident = ident

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.ident


@contextlib.contextmanager
def quiet_thread(log: logging.Logger) -> Iterator[None]:
    """While open, ``log`` drops this thread's records (:class:`DropThread`)."""
    quiet = DropThread(threading.get_ident())
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


class Records(list[tuple[Any, ...]]):
    """A thread's ``record_operation``: each call's keywords, sorted, less the duration (a self-check compares
    them)."""

    def __call__(self, **kwargs: Any) -> None:
        kwargs.pop("duration_seconds")
        self.append(tuple(sorted(kwargs.items())))


def outcome_of(handler: Callable[[Any, Any], Any], thread: Any, meta: Any) -> Any:
    """``"ok"``, or the type of the exception ``handler(thread, meta)`` raised (a self-check compares types)."""
    try:
        handler(thread, meta)
    except Exception as exc:
        return type(exc)
    return "ok"
