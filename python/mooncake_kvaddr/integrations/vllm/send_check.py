"""The send handler's start-up checks (docs/vllm-plugin.md, "What ``register()`` does"): the shape of vLLM's send
thread and worker module, and a self-check of vLLM's handler and ours on small generated store jobs (the layouts
built by the release's ``sample_layouts``). The case generator and the recording store are shared with the
differential tests.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from mooncake_kvaddr.driver.outcomes import CODE_INVALID_PARAMS as INVALID_PARAMS
from mooncake_kvaddr.integrations.vllm.receive import ArrayStore
from mooncake_kvaddr.integrations.vllm.receive_check import DropThread, SampleLayouts, sample_layouts_033
from mooncake_kvaddr.integrations.vllm.registry import signature_problem

__all__ = [
    "SEND_FUNCTIONS", "THREAD_METHODS_033", "RecordingStore", "check_shape", "make_case", "run_once", "self_check",
]  # fmt: skip

#: The vLLM functions the send handler was checked against, alike in every release (a release's
#: ``FINGERPRINTED["send"]``): the handler it replaces, the walk and the byte sum it reproduces.
SEND_FUNCTIONS = (
    "KVCacheStoreSendingThread._handle_request",
    "ChunkedTokenDatabase.process_tokens",
    "_sum_batch_bytes",
)

#: Parameters (after self) of what the send handler relies on, as vLLM 0.32/0.33 declare them (a release's
#: ``SendRules.thread_methods``).
THREAD_METHODS_033: dict[str, tuple[str, ...]] = {
    "_handle_request": ("req_meta",),
    "_maybe_offload_boundary_states": ("req_meta",),
    "_record_saved": ("req_meta", "token_len"),
    "is_live_store_job": ("req_meta",),
    "_should_skip_request": ("req_id",),
    "finish_store_job": ("req_meta",),
    "_mark_request_skipped_for_pressure": ("req_meta",),
    "_clear_store_pressure": (),
    "_get_retry_token_ids": ("req_meta",),
    "_update_retry_token_ids": ("req_meta", "save_completed", "token_ids_start", "event_token_ids"),
    "update_kv_event": ("events",),
    "_record_operation": ("operation", "start_time", "num_keys", "num_bytes", "status", "num_failed_keys"),
    "__init__": (
        "store", "coord", "token_databases", "block_size", "tp_rank", "group_put_steps", "kv_role", "ready_event",
        "enable_kv_event", "replicate_config", "enable_group_semantics", "supports_group_ids", "record_operation",
        "group_participates",
    ),
}  # fmt: skip


def check_shape(data: ModuleType, worker: ModuleType, rules: Any = None) -> str:
    """Empty string when vLLM's send thread and worker module have the shape the send handler relies on (the
    methods and ``ReqMeta`` fields of ``rules``, a ``send.SendRules``; vLLM 0.33's when None); otherwise the
    first mismatch (the receive handler's check covers the token database and hashes)."""
    methods: Mapping[str, tuple[str, ...]] = THREAD_METHODS_033 if rules is None else rules.thread_methods
    cls = getattr(worker, "KVCacheStoreSendingThread", None)
    if not isinstance(cls, type):
        return "KVCacheStoreSendingThread is missing"
    for method, params in methods.items():
        problem = signature_problem(cls, method, params)
        if problem:
            return problem
    if type(worker.__dict__.get("MOONCAKE_NO_AVAILABLE_HANDLE")) is not int:
        return f"{worker.__name__}.MOONCAKE_NO_AVAILABLE_HANDLE is not an int"
    null = worker.__dict__.get("NULL_BLOCK_ID", 0)
    if type(null) is not int or null != 0:
        return f"{worker.__name__}.NULL_BLOCK_ID is not 0"
    for name in ("_make_mooncake_group_id", "maybe_convert_block_hash", "BlockStored"):
        if not callable(worker.__dict__.get(name)):
            return f"{worker.__name__}.{name} is missing"
    if getattr(worker, "logger", None) is None:
        return f"{worker.__name__}.logger is missing"
    for name in ("ReqMeta", "KeyMetadata", "ChunkedTokenDatabase"):
        if not isinstance(getattr(data, name, None), type):
            return f"{data.__name__}.{name} is missing"
    fields = {f.name for f in dataclasses.fields(data.ReqMeta)} if dataclasses.is_dataclass(data.ReqMeta) else set()
    for name in () if rules is None else rules.req_meta_fields:
        if name not in fields:
            return f"{data.__name__}.ReqMeta has no field {name}"
    return ""


class RecordingStore:
    """A store that records ``batch_is_exist`` and multi-buffer puts (rows as plain lists, with the replicate
    config's group ids at the call) and answers from ``answer(call, keys)``: a list, or an exception to raise. A
    put whose group ids are set but not one per key is answered as Mooncake answers it: -600 for every key.
    ``puts`` holds every put Mooncake would get: its keys and group ids (None: unset)."""

    def __init__(self, answer: Callable[[str, list[str]], Any]) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.puts: list[tuple[list[str], list[str] | None]] = []
        self._answer = answer
        self.ragged = 0  # puts of rows of different widths (the array store's ragged entry)

    def _reply(self, call: str, keys: list[str]) -> Any:
        result = self._answer(call, keys)
        if isinstance(result, Exception):
            raise result
        return result

    def batch_is_exist(self, keys: Any) -> Any:
        self.calls.append(("exist", list(keys)))
        return self._reply("exist", list(keys))

    def batch_put_from_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, config: Any) -> Any:
        keys = list(keys)
        rows = [list(map(int, r)) for r in addrs], [list(map(int, r)) for r in sizes]
        ids = _group_ids(config)
        self.puts.append((keys, ids))
        self.calls.append(("put", keys, *rows, list(ids or ())))
        return _as_mooncake(self._reply("put", keys), keys, ids)


class ArrayRecordingStore(RecordingStore, ArrayStore):
    """The same, with the array entries our store wrappers offer (the put's matrices recorded as lists). A ragged
    put is split as the wrappers split it (the inherited :meth:`ArrayStore.batch_put_from_multi_buffers_ragged`:
    one array put per width, each with the config cut to its keys; each part in ``puts`` and answered as Mooncake
    answers it), and recorded in ``calls`` as the one put vLLM makes: rows trimmed to their widths, each key's
    group id as its part carried it (None where the part's group ids were not one per key). A short answer of
    the script to that one put comes back short, as vLLM's one put would get it."""

    def __init__(self, answer: Callable[[str, list[str]], Any]) -> None:
        super().__init__(answer)
        self._parts: list[tuple[list[str], list[str] | None]] | None = None  # set while a ragged put is split

    def batch_get_into_multi_buffers_arrays(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        raise AssertionError("the send handler never loads")

    def batch_put_from_multi_buffers_arrays(self, keys: Any, addrs: Any, sizes: Any, config: Any) -> Any:
        assert addrs.dtype.kind == "i" and sizes.dtype.kind == "i", "rows must come as integer matrices"
        parts = self._parts
        if parts is None:
            return self.batch_put_from_multi_buffers(keys, addrs.tolist(), sizes.tolist(), config)
        ids = _group_ids(config)
        self.puts.append((list(keys), ids))
        parts.append((list(keys), ids))
        return [None] * len(keys)  # answered by the ragged put, once every part is known

    def batch_put_from_multi_buffers_ragged(self, keys: Any, addrs: Any, sizes: Any, widths: Any, config: Any) -> Any:
        self.ragged += 1
        keys = list(keys)
        parts: list[tuple[list[str], list[str] | None]] = []
        self._parts = parts
        try:
            ArrayStore.batch_put_from_multi_buffers_ragged(self, keys, addrs, sizes, widths, config)
        finally:
            self._parts = None
        at: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            at.setdefault(key, []).append(i)
        where: list[tuple[int, bool]] = []  # (index in the put, whether its part's group ids fit) per part key
        key_ids: list[Any] = [None] * len(keys)
        for part_keys, ids in parts:
            fits = ids is None or len(ids) == len(part_keys)
            for j, key in enumerate(part_keys):
                i = at[key].pop(0)
                where.append((i, fits))
                key_ids[i] = ids[j] if ids is not None and fits else None
        trimmed = [(a[:w], s[:w]) for a, s, w in zip(addrs.tolist(), sizes.tolist(), widths.tolist(), strict=True)]
        recorded = [] if all(ids is None for _, ids in parts) else key_ids
        self.calls.append(("put", keys, [a for a, _ in trimmed], [s for _, s in trimmed], recorded))
        codes = self._reply("put", keys)  # the script answers the one put vLLM makes (or raises, as vLLM's does)
        answers: list[Any] = [None] * len(keys)
        for i, fits in where:
            answers[i] = INVALID_PARAMS if not fits else codes[i] if i < len(codes) else None
        # A script that answers the one put short leaves its last keys unanswered, as vLLM's one put would.
        while answers and answers[-1] is None:
            answers.pop()
        return answers


def _group_ids(config: Any) -> list[str] | None:
    ids = getattr(config, "group_ids", None)
    return None if ids is None else list(ids)


def _as_mooncake(codes: Any, keys: list[str], ids: list[str] | None) -> Any:
    """Mooncake's answer to a put: -600 for every key when its group ids are set but not one per key."""
    return codes if ids is None or len(ids) == len(keys) else [INVALID_PARAMS] * len(keys)


class _Config:
    """A replicate config: vLLM sets ``group_ids`` on it before a put with group semantics (unset: None, as in
    Mooncake's ``ReplicateConfig``)."""

    def __init__(self) -> None:
        self.group_ids: list[str] | None = None


class _Coord:
    """vLLM's coordinator as the send thread reads it. With a ``seed``, the store masks depend on every argument
    of ``store_mask`` (each of the given masks with a few flags flipped, by a generator seeded with the
    arguments): a handler that asks for other masks than vLLM's stores other keys."""

    def __init__(self, masks: tuple[Any, ...], lcm_block_size: int, seed: int | None = None) -> None:
        self.masks = masks
        self.lcm_block_size = lcm_block_size
        self.hash_block_size = 16
        self.seed = seed

    def store_mask(self, token_len: int, start: int = 0, num_prompt_tokens: int | None = None) -> tuple[Any, ...]:
        if self.seed is None:
            return self.masks
        rng = random.Random(f"{self.seed}/{token_len}/{start}/{num_prompt_tokens}")
        return tuple(
            None if mask is None else [bool(flag) != (rng.random() < 0.15) for flag in mask] for mask in self.masks
        )


def make_case(
    data: ModuleType, rng: random.Random, case: int, layouts: ModuleType | None = None,
    sample: SampleLayouts = sample_layouts_033,
) -> dict[str, Any]:  # fmt: skip
    """One generated store job: two or three groups (rank-local and TP-shared as the release's ``sample`` builds
    them from ``layouts``, mixed widths, Store chunks below a block where the release has them), store masks
    (lists or None, depending on every argument vLLM passes), put steps, saved offsets, null and missing block
    ids, boundary puts, group semantics, kv roles, kv events (token ids past the job, lookahead where
    ``ReqMeta`` has it, retry ids adjacent, overlapping or apart), and a script of store answers (present keys,
    failed, short and raising calls, pressure codes)."""
    metadata = data.KeyMetadata(f"send/{case % 3}", 1, case % 2, 0, 0, cache_prefix="p" if case % 4 == 1 else "")
    # (vLLM's group ids name the model, prefix and namespace; the key's hash part is what differs.)
    block_size = rng.choice((16, 32))
    rank_local, sharded, sharded_chunk = sample(layouts or data, metadata, rng, case, block_size)
    dbs = [
        data.ChunkedTokenDatabase(metadata, block_size, 16, rank_local),
        data.ChunkedTokenDatabase(metadata, sharded_chunk, sharded.hash_block_size, sharded),
    ][: rng.randint(1, 2)]
    if rng.random() < 0.3:
        dbs.append(data.ChunkedTokenDatabase(metadata, block_size, 16, rank_local))
    tp_rank = rng.randrange(0, 4)
    blocks = rng.randint(1, 7)
    token_len = blocks * block_size - 16 * rng.randrange(0, block_size // 16)
    if any(db.store_layout is sharded for db in dbs) and rng.random() < 0.7:
        token_len = blocks * block_size  # TP-shared stores take full blocks only (else vLLM raises: also covered)
    step = min(16, *(db.hash_block_size for db in dbs))
    hashes = [rng.randbytes(rng.choice((8, 32))) for _ in range(token_len // step + rng.randrange(0, 3))]
    save_start = rng.choice((0, 0, 16 * rng.randrange(0, token_len // 16 + 1), rng.randrange(0, token_len + 1)))
    first = -(-save_start // block_size)
    masks = tuple(
        None if rng.random() < 0.3 else [rng.random() < 0.8 for _ in range(max(0, blocks - first + rng.randint(-1, 1)))]
        for _ in dbs
    )
    block_ids = tuple(
        [0 if rng.random() < 0.15 else rng.randrange(1, 400) for _ in range(blocks + rng.randint(-2, 0))] for _ in dbs
    )
    boundary = [(0, rng.randrange(1, 400), 16 * rng.randrange(1, token_len // 16 + 1))] if rng.random() < 0.2 else None
    # kv events: the step's token ids (none, all, or a suffix; some past the job), and a failed job's retry ids.
    ids_start = rng.choice((0, save_start, 16 * rng.randrange(0, token_len // 16 + 1)))
    past = rng.choice((0, 0, 3, 16))
    token_ids = None if rng.random() < 0.2 else [rng.randrange(50_000) for _ in range(token_len - ids_start + past)]
    retry_start = rng.randrange(0, ids_start + 1)
    retry_len = max(0, ids_start - retry_start + rng.choice((0, 0, 1, 5, -1)))
    retry = (retry_start, list(range(retry_len))) if rng.random() < 0.3 else None
    extra: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(data.ReqMeta)}
    if "num_hash_lookahead_tokens" in fields:
        extra["num_hash_lookahead_tokens"] = rng.choice((0, 0, 1, 4))
    meta = data.ReqMeta(
        req_id=f"req-{case % 5}", token_len_chunk=token_len + rng.randrange(0, 16), block_ids=block_ids,
        block_hashes=hashes, store_job_id=case, boundary_puts=boundary,
        prefill_end_tokens=rng.choice((token_len, token_len, None, 16 * rng.randrange(0, blocks + 1))),
        token_ids=token_ids, token_ids_start=ids_start, **extra,
    )  # fmt: skip
    present = rng.random()
    mode = rng.randrange(10)

    def answers(seed: int) -> Callable[[str, list[str]], Any]:
        """A fresh script of store answers (each run of the job gets the same one)."""
        script = random.Random(seed)

        def answer(call: str, keys: list[str]) -> Any:
            if call == "exist":
                if mode == 6:
                    return RuntimeError("exist down")
                codes = [1 if script.random() < present * 0.5 else 0 for _ in keys]
                return codes[: len(codes) // 2] if mode == 8 else codes  # short: the rest counts as present
            if mode == 5:
                return RuntimeError("put down")
            codes = [script.choice((0, -704, -200) if mode in (3, 4, 9) else (0,)) for _ in keys]
            return codes[: len(codes) // 2] if mode == 9 else codes  # short: the rest counts as stored

        return answer

    return {
        "dbs": dbs,
        "coord": _Coord(masks, rng.choice((16, 16, block_size, 2 * block_size)), rng.randrange(1 << 30)),
        "block_size": block_size,
        "tp_rank": tp_rank,
        "put_steps": tuple(rng.choice((1, 1, 2, 3)) for _ in dbs),
        "participates": [rng.random() < 0.9 for _ in dbs],
        "semantics": rng.random() < 0.3,
        "kv_role": rng.choice(("kv_both", "kv_both", "kv_producer", "kv_consumer")),
        "meta": meta,
        "save_start": save_start,
        "answers": answers,
        "answer_seed": rng.randrange(1 << 30),
        "live": rng.random() < 0.95,
        "kv_event": rng.random() < 0.3,
        "retry": retry,
        # Offload pressure on: this job's request skipped, or another request's (a success clears it).
        "pressure": rng.choice(("", "", "", "", "", "", "this", "other")),
    }


def run_once(
    worker: ModuleType, handler: Callable[[Any, Any], Any], store: Any, case: dict[str, Any]
) -> tuple[Any, ...]:
    """Run ``handler`` on one job from :func:`make_case` with a fresh send thread over ``store``; everything a
    caller can observe: outcome, store calls, records, saved offsets, completions, pressure state, queue, kv
    events and retry token ids."""
    records: list[tuple[Any, ...]] = []

    def record(**kwargs: Any) -> None:
        kwargs.pop("duration_seconds")
        records.append(tuple(sorted(kwargs.items())))

    meta = case["meta"]
    thread = worker.KVCacheStoreSendingThread(
        store, case["coord"], case["dbs"], case["block_size"], case["tp_rank"], case["put_steps"],
        case.get("kv_role", "kv_both"),
        threading.Event(), enable_kv_event=case.get("kv_event", False), replicate_config=_Config(),
        enable_group_semantics=case["semantics"], supports_group_ids=True, record_operation=record,
        group_participates=case["participates"],
    )  # fmt: skip
    q: queue.Queue[Any] = queue.Queue()
    thread.request_queue = q
    q.put(meta)
    q.get()
    if case["live"]:
        thread.stored_requests[meta.req_id] = {meta.store_job_id}
    if case["save_start"]:
        thread._saved_offset[meta.req_id] = case["save_start"]
    if case.get("retry") is not None:
        thread._retry_token_ids[meta.req_id] = case["retry"]
    if case["pressure"]:
        thread._store_pressure_active = True
        thread._skip_store_requests.add(meta.req_id if case["pressure"] == "this" else "another-request")
    try:
        handler(thread, meta)
        outcome: Any = "ok"
    except Exception as exc:  # the type is compared
        outcome = type(exc)
    return (
        outcome,
        store.calls,
        records,
        dict(thread._saved_offset),
        thread.take_completed_saves(),
        thread._store_pressure_active,
        sorted(thread._skip_store_requests),
        q.unfinished_tasks,
        thread.get_kv_events(),
        dict(thread._retry_token_ids),
    )


def self_check(
    data: ModuleType, worker: ModuleType, handler: Callable[[Any, Any], Any], *, cases: int = 24,
    layouts: ModuleType | None = None, sample: SampleLayouts = sample_layouts_033,
) -> None:  # fmt: skip
    """vLLM's own handler and ``handler`` on generated jobs (plain and array stores; ``layouts``/``sample``: where
    the release keeps its layouts and how it builds them): identical observable behaviour, else
    ``AssertionError``; at least one job must take the fast path."""
    quiet = DropThread(threading.get_ident())
    worker.logger.addFilter(quiet)  # the failing-store cases log vLLM's warnings: not at start-up
    try:
        compare(data, worker, handler, random.Random(0), cases, layouts=layouts, sample=sample)
    finally:
        worker.logger.removeFilter(quiet)


def compare(
    data: ModuleType,
    worker: ModuleType,
    handler: Any,
    rng: random.Random,
    cases: int,
    transform: Callable[[dict[str, Any]], None] | None = None,
    *,
    layouts: ModuleType | None = None,
    sample: SampleLayouts = sample_layouts_033,
) -> int:
    """:func:`self_check`'s loop (the differential tests run it with many cases, ``transform`` editing each
    generated job in place); returns how many jobs took the fast path."""
    original = worker.KVCacheStoreSendingThread._handle_request
    original = getattr(original, "__wrapped__", original)
    stats = getattr(handler, "stats", None)
    fast_before = stats.fast_requests if stats is not None else 0
    for number in range(cases):
        case = make_case(data, rng, number, layouts, sample)
        if transform is not None:
            transform(case)
        answers, seed = case["answers"], case["answer_seed"]
        ours_cls = (ArrayRecordingStore, RecordingStore)[number % 2]
        expected = run_once(worker, original, RecordingStore(answers(seed)), case)
        ours = ours_cls(answers(seed))
        actual = run_once(worker, handler, ours, case)
        if expected != actual:
            raise AssertionError(f"send handler, case {number}: vLLM gives {expected!r}, ours {actual!r}")
        for keys, ids in ours.puts:  # every put Mooncake would get carries one group id per key, or none
            if ids is not None and len(ids) != len(keys):
                raise AssertionError(f"send handler, case {number}: {len(ids)} group ids for a put of {len(keys)} keys")
    fast = stats.fast_requests - fast_before if stats is not None else 0
    if stats is not None and fast == 0:
        raise AssertionError("send handler: no self-check job took the fast path")
    return fast
