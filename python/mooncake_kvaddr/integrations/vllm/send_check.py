"""The send handler's start-up checks (docs/vllm-plugin.md, "What ``register()`` does"): the shape of vLLM's send
thread and worker module, and a self-check of vLLM's handler and ours on small generated store jobs (the layouts
built by the release's ``sample_layouts``). The case generator is shared with the differential tests; the recording
store is ``receive_check``'s.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from mooncake_kvaddr.integrations.vllm.receive_check import (
    ArrayRecordingStore,
    RecordingStore,
    Records,
    SampleLayouts,
    outcome_of,
    quiet_thread,
    sample_layouts_033,
)
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
    records = Records()
    meta = case["meta"]
    thread = worker.KVCacheStoreSendingThread(
        store, case["coord"], case["dbs"], case["block_size"], case["tp_rank"], case["put_steps"],
        case.get("kv_role", "kv_both"),
        threading.Event(), enable_kv_event=case.get("kv_event", False), replicate_config=_Config(),
        enable_group_semantics=case["semantics"], supports_group_ids=True, record_operation=records,
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
    return (
        outcome_of(handler, thread, meta),
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
    with quiet_thread(worker.logger):  # the failing-store cases log vLLM's warnings: not at start-up
        compare(data, worker, handler, random.Random(0), cases, layouts=layouts, sample=sample)


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
