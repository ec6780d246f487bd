"""The plugin's receive handler (docs/vllm-plugin.md, "The receive handler") against vLLM 0.33's own
``KVCacheStoreRecvingThread._handle_request``: both run on the same generated requests (several KV-cache groups,
rank-local and TP-shared layouts, groups that do not participate, load masks, unaligned ``mask_num``, tail-key
boundaries, ``tp_rank`` rotation, list and blob hashes, stores that fail keys, raise or answer the wrong count)
against recording stores, and must make the same store calls (keys, rows value-equal, list types where vLLM
passes lists) with the same error, record, finish and ``task_done`` side effects. Plus the fallback rules, the
switch, and the array entry points of the store wrappers."""

from __future__ import annotations

import importlib
import queue
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver.rules import estimate_staging_bytes, split_by_staging_budget
from mooncake_kvaddr.driver.staging import StagingBuffer
from mooncake_kvaddr.integrations.vllm import layouts as vllm_layouts
from mooncake_kvaddr.integrations.vllm import plans, plugin, receive, receive_check
from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
from mooncake_kvaddr.integrations.vllm.releases import for_version, v0_33
from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm() -> Iterator[tuple[Any, Any]]:
    """vLLM's data and worker modules, patched with the receive handler for the module's tests."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm==0.33.0)")
    data = pytest.importorskip(plugin.DATA_MODULE, reason="vLLM has no Mooncake store module")
    worker = pytest.importorskip(plugin.WORKER_MODULE, reason="vLLM has no Mooncake store worker module")
    plugin.unpatch()
    report = plugin.patch(receive=True)
    assert report.active and "KVCacheStoreRecvingThread._handle_request" in report.patched, report
    yield data, worker
    plugin.unpatch()


def _handlers(worker: Any) -> tuple[Any, Any]:
    ours = worker.KVCacheStoreRecvingThread.__dict__["_handle_request"]
    return ours.__wrapped__, ours


# --- recording stores -------------------------------------------------------------------------------------------


def _answer(behaviour: str, keys: list[str]) -> Any:
    if behaviour == "raise":
        raise RuntimeError("store down")
    if behaviour == "short":
        return [1] * (len(keys) - 1)
    if behaviour == "fail":
        return [-704 if sum(key.encode()) % 3 == 0 else 4096 for key in keys]
    return [4096] * len(keys)


class ListStore:
    """Records ``batch_get_into_multi_buffers`` calls with the row types it was given."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.calls: list[tuple[Any, ...]] = []

    def batch_get_into_multi_buffers(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        types = (type(keys), type(addrs), {type(r) for r in addrs}, {type(v) for r in addrs for v in r})
        self.calls.append((list(keys), [list(r) for r in addrs], [list(r) for r in sizes], types))
        return _answer(self.behaviour, list(keys))


#: Ragged calls the differential test's array stores received (hybrid widths on the fast path).
RAGGED = {"calls": 0}


class ArrayStore(ListStore, receive.ArrayStore):
    """Also offers the array entry point (as our store wrappers do; a ``receive.ArrayStore``, so the handler
    uses it); records those calls as lists."""

    def batch_get_into_multi_buffers_arrays(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        assert addrs.dtype == np.int64 and sizes.dtype == np.int64 and addrs.ndim == 2
        assert addrs.shape == sizes.shape == (len(keys), addrs.shape[1])
        rows = addrs.tolist()
        types = (type(keys), list, {list} if rows else set(), {int} if rows and rows[0] else set())
        self.calls.append((list(keys), rows, sizes.tolist(), types))
        return _answer(self.behaviour, list(keys))

    def batch_get_into_multi_buffers_ragged(self, keys: Any, addrs: Any, sizes: Any, widths: Any) -> Any:
        """Rows of different widths, recorded as the one call they stand for (padding cells must be zero)."""
        assert addrs.dtype == np.int64 and sizes.dtype == np.int64 and addrs.shape == sizes.shape
        assert widths.shape == (len(keys),) and len(set(widths.tolist())) > 1
        w = widths[:, None]
        columns = np.arange(addrs.shape[1])[None, :]
        assert not addrs[columns >= w].any() and not sizes[columns >= w].any()
        RAGGED["calls"] += 1
        rows = [r[:n] for r, n in zip(addrs.tolist(), widths.tolist())]
        size_rows = [r[:n] for r, n in zip(sizes.tolist(), widths.tolist())]
        self.calls.append((list(keys), rows, size_rows, (type(keys), list, {list}, {int})))
        return _answer(self.behaviour, list(keys))


class Coord:
    def __init__(self, masks: Any) -> None:
        self.masks = masks

    def load_mask(self, block_hashes: Any, token_len: int) -> Any:
        return self.masks


def run_handler(worker: Any, handler: Any, store: Any, case: dict[str, Any]) -> tuple[Any, ...]:
    """``handler`` on a fresh vLLM receive thread; every observable side effect."""
    records: list[tuple[Any, ...]] = []
    errors: list[tuple[Any, list[int]]] = []

    def record(**kwargs: Any) -> None:
        assert kwargs.pop("duration_seconds") >= 0
        records.append(tuple(sorted(kwargs.items())))

    q: queue.Queue[Any] = queue.Queue()
    q.put(case["meta"])
    q.get()
    thread = worker.KVCacheStoreRecvingThread(
        store, Coord(case["masks"]), case["dbs"], case["block_size"], case["tp_rank"], threading.Event(),
        disk_offload_buffer_budget_bytes=case.get("budget"), record_operation=record, request_queue=q,
        group_participates=case["participates"], is_hma_required=False,
    )  # fmt: skip
    thread._report_load_error = lambda req_id, block_ids: errors.append((req_id, list(block_ids)))
    try:
        handler(thread, case["meta"])
        outcome: Any = "ok"
    except Exception as exc:
        outcome = type(exc)
    return outcome, store.calls, records, errors, thread.get_and_clear_finished_requests(), q.unfinished_tasks


# --- generated requests ------------------------------------------------------------------------------------------


def build_case(data: Any, draw: Any) -> dict[str, Any]:
    rng = random.Random(draw(st.integers(0, 2**32)))
    hbs = 16
    n_groups = rng.randint(1, 3)
    metadata = data.KeyMetadata(rng.choice(["m/x", "modèle/ü"]), 1, 0, 0, 0)
    specs = []
    for _ in range(n_groups):
        kind = rng.choice(["rank_local", "rank_local", "lbhnc", "lbnhc"])
        block_size = rng.choice([16, 32, 64])
        specs.append((kind, block_size))
    lcm = int(np.lcm.reduce([bs for _, bs in specs]))
    blocks = rng.choice([0, 1, 2, 3, 4, 5, 6, 6, 7, 8])
    token_len = blocks * lcm
    if rng.randint(0, 3) == 0:
        token_len -= hbs * rng.randint(0, 3)  # a partial tail chunk (TP-shared groups refuse it)
    token_len = max(token_len, 0)
    if rng.randint(0, 40) == 0:
        token_len += 3  # not hash-block aligned: vLLM asserts
    n_hashes = token_len // hbs + rng.choice([0, 0, 0, 0, 0, 0, 1, 3, -1])
    hashes = [rng.randbytes(32) for _ in range(max(n_hashes, 0))]
    block_hashes: Any = hashes
    if rng.random() < 0.5:
        block_hashes = data.BlobBlockHashes(memoryview(b"".join(hashes)), 32)
    dbs, masks, block_ids = [], [], []
    widths = rng.choice(["same", "mixed"])
    for kind, block_size in specs:
        chunks = -(-token_len // block_size)
        if kind == "rank_local":
            layout = data.RankLocalStoreLayout(metadata, block_size, hbs)
            regions = 3 if widths == "same" else rng.randint(1, 5)
            layout.set_kv_caches_base_addr([rng.randrange(1 << 20, 1 << 40) for _ in range(regions)])
            layout.set_block_len([rng.choice([256, 4096]) for _ in range(rng.randint(1, regions))])
        else:
            local_tp, store_tp = rng.choice([(1, 1), (1, 2), (2, 4), (2, 2), (1, 4), (4, 2)])
            cls = data.LBHNCStoreLayout if kind == "lbhnc" else data.LBNHCStoreLayout
            layout = cls(metadata, block_size, hbs, local_tp, store_tp, rng.randrange(local_tp), 8)
            segments = 3 if widths == "same" else rng.randint(1, 4)
            layout._set_segment_templates(
                [
                    (
                        [rng.randrange(1 << 20, 1 << 40) for _ in range(segments)],
                        [rng.choice([4096, 65536]) for _ in range(segments)],
                        [rng.choice([128, 512]) for _ in range(segments)],
                    )
                    for _ in range(layout.shards_per_rank)
                ]
            )
        dbs.append(data.ChunkedTokenDatabase(metadata, block_size, hbs, layout))
        mask_len = max(0, chunks + rng.randint(-2, 2))
        masks.append([rng.random() < 0.8 for _ in range(mask_len)])
        ids_len = max(0, chunks - (1 if rng.randint(0, 30) == 0 else 0))
        block_ids.append([rng.randrange(0, 2000) for _ in range(ids_len)])
    participates = [rng.randint(0, 4) > 0 for _ in specs]
    tails = []
    for g in range(n_groups + 1):  # a boundary for a group that does not exist is ignored
        if token_len >= hbs and rng.randint(0, 2) == 0:
            tails.append(data.TailKeyBoundary(g, rng.randrange(0, token_len + 1, hbs)))
    thread_block_size = rng.choice([16, 32, 64])
    spec = data.LoadSpec(
        vllm_cached_tokens=rng.choice([0, 0, 0, 0, 8, 16, 17, 64, 100, token_len]),
        kvpool_cached_tokens=token_len,
        can_load=True, token_len=token_len, tail_key_boundaries=tuple(tails),
    )  # fmt: skip
    meta = data.ReqMeta(
        req_id=f"req-{rng.randrange(1000)}", token_len_chunk=token_len, block_ids=tuple(block_ids),
        block_hashes=block_hashes, load_spec=spec,
    )  # fmt: skip
    return {
        "dbs": dbs,
        "masks": tuple(masks),
        "participates": participates,
        "block_size": thread_block_size,
        "tp_rank": rng.randint(0, 7),
        "meta": meta,
        # A disk-offload staging budget (vLLM splits the load into sub-batches, or skips a request with a key
        # over it): none, one that holds everything, ones that split, one below a single key's estimate.
        "budget": rng.choice([None, None, None, 1 << 30, 13_000, 30_000, 60_000, 120_000, 5_000]),
    }


FAST = {"count": 0}
#: Differential cases with a budget that took the fast path: one batch, several, a request skipped.
OFFLOAD = {"one": 0, "split": 0, "skipped": 0}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draw=st.data(), behaviour=st.sampled_from(["ok", "ok", "fail", "raise", "short"]), arrays=st.booleans())
def test_receive_handler_matches_vllms(vllm: tuple[Any, Any], draw: Any, behaviour: str, arrays: bool) -> None:
    data, worker = vllm
    original, ours = _handlers(worker)
    case = build_case(data, draw.draw)
    expected = run_handler(worker, original, ListStore(behaviour), case)
    before = ours.stats.fast_requests
    actual = run_handler(worker, ours, (ArrayStore if arrays else ListStore)(behaviour), case)
    assert actual == expected
    FAST["count"] += ours.stats.fast_requests - before
    if case["budget"] is not None and ours.stats.fast_requests > before:
        calls = len(actual[1])
        OFFLOAD["skipped" if calls == 0 else "one" if calls == 1 else "split"] += 1


def test_hybrid_widths_reach_the_store_as_ragged_matrices_like_vllm(vllm: tuple[Any, Any]) -> None:
    """Seeded cases (not hypothesis's draw, so the count cannot fall short by chance): requests whose groups'
    rows differ in width go to the array store's ragged entry, and every one matches vLLM's handler."""
    data, worker = vllm
    original, ours = _handlers(worker)
    before, seen = RAGGED["calls"], 0
    for seed in range(5000):
        case = build_case(data, lambda _strategy, seed=seed: seed)
        expected = run_handler(worker, original, ListStore("ok"), case)
        calls = RAGGED["calls"]
        assert run_handler(worker, ours, ArrayStore("ok"), case) == expected, seed
        seen += RAGGED["calls"] > calls
        if seen >= 10:
            break
    assert RAGGED["calls"] - before >= 10, RAGGED


def test_the_differential_test_exercised_the_fast_path(vllm: tuple[Any, Any]) -> None:
    """Guard against a vacuous differential test (every request handed back to vLLM)."""
    if FAST["count"] == 0:
        pytest.skip("the differential test did not run in this session")
    assert FAST["count"] >= 100
    assert min(OFFLOAD.values()) >= 3, OFFLOAD
    assert RAGGED["calls"] >= 10, RAGGED  # rows of different widths reached the store as padded matrices


def _vllm_split(worker: Any, keys: list[str], addrs: Any, sizes: Any, usable: int, raw: int) -> Any:
    """What vLLM's handler does with a budget: one batch when the estimate fits, else its own split."""
    if sum(worker._estimate_disk_offload_staging_bytes(row) for row in sizes) <= usable:
        return [keys], None
    batches, oversized = worker._split_disk_offload_load_batches(keys, addrs, sizes, usable, raw)
    return [batch[0] for batch in batches], oversized


def test_offload_split_matches_vllms_at_every_edge(vllm: tuple[Any, Any]) -> None:
    """The handler's split (the driver's ``split_by_staging_budget`` with vLLM's constants, ``fits_first``) against
    vLLM's own split on budgets placed exactly at, and one byte around, every key's estimate and every running sum
    (usable above raw too: vLLM's usable ratio may exceed 1)."""
    _, worker = vllm
    direct_io = {"alignment": worker._DIRECT_IO_ALIGNMENT, "padding": worker._DIRECT_IO_PADDING_BYTES}
    rng = random.Random(17)
    for case in range(4000):
        n, w = rng.randint(1, 7), rng.randint(1, 3)
        sizes = [[rng.choice([0, 1, 4095, 4096, 4097, 8192, 20_000]) for _ in range(w)] for _ in range(n)]
        keys = [f"k{i}" for i in range(n)]
        addrs = [[(i + 1) << 20] * w for i in range(n)]
        need = [estimate_staging_bytes(sum(row), **direct_io) for row in sizes]
        edges = [sum(need[a:b]) for a in range(n) for b in range(a + 1, n + 1)]
        edges = sorted({e + d for e in edges for d in (-1, 0, 1)})
        usable, raw = rng.choice(edges), rng.choice(edges)
        arrays = case % 2 == 1
        plan = KeyPlan(
            keys, np.asarray(addrs, np.int64) if arrays else addrs, np.asarray(sizes, np.int64) if arrays else sizes,
            np.arange(n, dtype=np.int64) if arrays else list(range(n)),
        )  # fmt: skip
        assert plan.arrays == arrays
        ours = split_by_staging_budget(plan.key_bytes(), usable, raw, fits_first=True, **direct_io)
        theirs, oversized = _vllm_split(worker, keys, addrs, sizes, usable, raw)
        if oversized is not None:
            assert isinstance(ours, int) and keys[ours] == oversized, (sizes, usable, raw)
        else:
            assert not isinstance(ours, int), (sizes, usable, raw)
            assert [keys[a:b] for a, b in ours] == theirs, (sizes, usable, raw)


# --- fixed cases: fast path, fallbacks, the empty load -------------------------------------------------------------


def _simple_case(data: Any, blocks: int = 4, *, tp_rank: int = 0, budget: int | None = None) -> dict[str, Any]:
    metadata = data.KeyMetadata("m/simple", 1, 0, 0, 0)
    layout = data.RankLocalStoreLayout(metadata, 64, 16)
    layout.set_kv_caches_base_addr([1 << 30, 1 << 31])
    layout.set_block_len([4096])
    token_len = blocks * 64
    hashes = [bytes([i]) * 32 for i in range(token_len // 16)]
    spec = data.LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=token_len, can_load=True, token_len=token_len)
    meta = data.ReqMeta(req_id="simple", token_len_chunk=token_len, block_ids=(list(range(1, blocks + 1)),),
                        block_hashes=hashes, load_spec=spec)  # fmt: skip
    return {
        "dbs": [data.ChunkedTokenDatabase(metadata, 64, 16, layout)],
        "masks": ([True] * blocks,),
        "participates": [True],
        "block_size": 64,
        "tp_rank": tp_rank,
        "meta": meta,
        "budget": budget,
    }


def test_fast_path_taken_and_rotation(vllm: tuple[Any, Any]) -> None:
    data, worker = vllm
    original, ours = _handlers(worker)
    case = _simple_case(data, tp_rank=5)
    before = ours.stats.fast_requests
    expected = run_handler(worker, original, ListStore("ok"), case)
    actual = run_handler(worker, ours, ArrayStore("ok"), case)
    assert actual == expected and ours.stats.fast_requests == before + 1
    keys = actual[1][0][0]
    assert keys[0].endswith(bytes([5 % 4 * 4 + 3]).hex() * 32)  # rotated by tp_rank % 4 chunks


def test_two_groups_on_a_list_store_take_the_fast_path_like_vllm(vllm: tuple[Any, Any]) -> None:
    """A store without the array entry gets vLLM's lists: a two-group load is planned on the fast path (the
    groups' keys, rows and block ids joined, then rotated), not handed back to vLLM, with vLLM's exact call."""
    data, worker = vllm
    original, ours = _handlers(worker)
    case = _simple_case(data, tp_rank=5)
    meta = case["meta"]
    case["meta"] = data.ReqMeta(
        req_id=meta.req_id, token_len_chunk=meta.token_len_chunk, block_ids=(meta.block_ids[0], [9, 8, 7, 6]),
        block_hashes=meta.block_hashes, load_spec=meta.load_spec,
    )  # fmt: skip
    case.update(dbs=case["dbs"] * 2, masks=case["masks"] * 2, participates=[True, True])
    before, fallbacks = ours.stats.fast_requests, ours.stats.fallback_requests
    expected = run_handler(worker, original, ListStore("ok"), case)
    actual = run_handler(worker, ours, ListStore("ok"), case)
    assert actual == expected and expected[0] == "ok" and len(expected[1][0][0]) == 8
    assert ours.stats.fast_requests == before + 1 and ours.stats.fallback_requests == fallbacks


class AnswerStore(ListStore):
    """Records like ``ListStore`` and answers each call with ``reply(keys)`` (any iterable of codes)."""

    def __init__(self, reply: Any) -> None:
        super().__init__("ok")
        self.reply = reply

    def batch_get_into_multi_buffers(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        super().batch_get_into_multi_buffers(keys, addrs, sizes)
        return self.reply(list(keys))


@pytest.mark.parametrize(
    "reply",
    [
        lambda keys: [0] * len(keys),
        lambda keys: iter([4096] * len(keys)),
        lambda keys: tuple(-704 if i % 2 else 0 for i in range(len(keys))),
    ],
    ids=["zero-codes", "iterator", "tuple-with-failures"],
)
def test_store_answers_are_read_as_vllm_reads_them(vllm: tuple[Any, Any], reply: Any) -> None:
    """Only a negative code is a failed key (0 is not), and the answer may be any iterable of codes (an iterator,
    a tuple): records, load errors and finish as vLLM's handler, on the fast path."""
    data, worker = vllm
    original, ours = _handlers(worker)
    case = _simple_case(data, tp_rank=1)
    before = ours.stats.fast_requests
    expected = run_handler(worker, original, AnswerStore(reply), case)
    assert expected[0] == "ok"
    assert run_handler(worker, ours, AnswerStore(reply), case) == expected
    assert ours.stats.fast_requests == before + 1


def test_a_failed_load_warns_with_the_first_three_failures(vllm: tuple[Any, Any]) -> None:
    """A load whose keys fail logs one warning: how many of how many failed, and the first three failures (key,
    code) in call order, no more."""
    import logging

    data, worker = vllm
    _, ours = _handlers(worker)
    case = _simple_case(data, blocks=6, tp_rank=2)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    worker.logger.addHandler(handler)
    try:
        store = AnswerStore(lambda keys: [-(700 + i) for i in range(len(keys))])
        run_handler(worker, ours, store, case)
    finally:
        worker.logger.removeHandler(handler)
    keys = store.calls[0][0]
    assert len(keys) == 6
    warnings = [r for r in seen if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].args[1:] == (6, 6, [(keys[0], -700), (keys[1], -701), (keys[2], -702)])


def test_the_call_follows_the_store_it_reaches_not_the_plan() -> None:
    """The store is read again at the call: an array plan reaching a store without the array entry gets vLLM's
    lists of lists, and a list plan reaching an array store gets its list entry, the same values either way."""
    keys, addrs, sizes = ["a", "b"], [[1 << 20, 2 << 20], [3 << 20, 4 << 20]], [[64, 64], [32, 32]]
    as_arrays = KeyPlan(keys, np.asarray(addrs, np.int64), np.asarray(sizes, np.int64), np.arange(2, dtype=np.int64))
    as_lists = KeyPlan(keys, addrs, sizes, [0, 1])
    assert as_arrays.arrays and not as_lists.arrays
    for plan, store in ((as_arrays, ListStore("ok")), (as_lists, ArrayStore("ok"))):
        assert plans.multi_buffers_call(store, plan, "get_into") == [4096, 4096]
        assert store.calls == [(keys, addrs, sizes, (list, list, {list}, {int}))]


def test_empty_load_raises_like_vllm(vllm: tuple[Any, Any]) -> None:
    """No key at all: vLLM's rotation divides by zero; the request is neither finished nor marked done."""
    data, worker = vllm
    original, ours = _handlers(worker)
    case = _simple_case(data, blocks=0)
    expected = run_handler(worker, original, ListStore("ok"), case)
    assert expected[0] is ZeroDivisionError and expected[5] == 1
    assert run_handler(worker, ours, ArrayStore("ok"), case) == expected


def test_a_blob_that_is_not_whole_hashes_goes_to_vllm_as_another_type(vllm: tuple[Any, Any]) -> None:
    """A ``BlobBlockHashes`` whose blob ends in part of a hash (vLLM reads only the whole ones) is not a hash
    source for our engine: the request goes to vLLM's handler for that reason, not after planning raised
    (fresh mutant M11-13: the blob's length went unchecked and the engine refused it)."""
    data, worker = vllm
    original, ours = _handlers(worker)
    case = _simple_case(data)
    whole = b"".join(case["meta"].block_hashes)
    case["meta"].block_hashes = data.BlobBlockHashes(memoryview(whole + b"\x07" * 5), 32)
    assert len(case["meta"].block_hashes) == 16
    before = ours.stats.fallback_requests
    expected = run_handler(worker, original, ListStore("ok"), case)
    assert run_handler(worker, ours, ArrayStore("ok"), case) == expected and expected[0] == "ok"
    assert ours.stats.fallback_requests == before + 1
    assert ours.stats.last_fallback == "block hashes of another type"


def test_disk_offload_budgets_take_the_fast_path_and_tier_log_goes_to_vllm(
    vllm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    data, worker = vllm
    original, ours = _handlers(worker)
    # One batch, split batches (every key alone), one key over the budget (the request is skipped).
    for budget, calls in ((1 << 30, 1), (17_000, 4), (10_000, 0)):
        case = _simple_case(data, budget=budget)
        for store_cls in (ListStore, ArrayStore):
            before = ours.stats.fast_requests
            actual = run_handler(worker, ours, store_cls("ok"), case)
            assert actual == run_handler(worker, original, ListStore("ok"), case)
            assert ours.stats.fast_requests == before + 1
            assert len(actual[1]) == calls, budget
    monkeypatch.setenv("VLLM_MOONCAKE_STORE_TIER_LOG", "1")

    class TierStore(ListStore):
        def batch_get_replica_desc(self, keys: Any) -> dict[str, Any]:
            return {}

    case = _simple_case(data)
    before = ours.stats.fallback_requests
    assert run_handler(worker, ours, TierStore("ok"), case) == run_handler(worker, original, TierStore("ok"), case)
    assert ours.stats.fallback_requests == before + 1


def test_an_envs_without_the_tier_log_setting_is_refused_the_fast_path() -> None:
    """The tier-log check is conservative: an ``envs`` that does not say VLLM_MOONCAKE_STORE_TIER_LOG (another
    vLLM) sends requests to vLLM's handler, as the setting on does; only a false setting allows the fast path."""
    from types import SimpleNamespace

    thread = object()
    assert receive.fast_path_refusal(thread, SimpleNamespace()) == "VLLM_MOONCAKE_STORE_TIER_LOG on"
    assert receive.fast_path_refusal(thread, SimpleNamespace(VLLM_MOONCAKE_STORE_TIER_LOG=True)) != ""
    assert receive.fast_path_refusal(thread, SimpleNamespace(VLLM_MOONCAKE_STORE_TIER_LOG=False)) == ""


def test_a_layout_not_backed_by_our_engine_goes_to_vllm(vllm: tuple[Any, Any]) -> None:
    data, worker = vllm
    original, ours = _handlers(worker)
    case = _simple_case(data)
    layout = case["dbs"][0].store_layout
    calls: list[int] = []
    vllms = layout.prepare_values

    def counting(*args: Any) -> Any:
        calls.append(1)
        return vllms(*args)

    layout.prepare_values = counting  # an instance override: vLLM would call it
    before = ours.stats.fallback_requests
    assert run_handler(worker, ours, ArrayStore("ok"), case) == run_handler(worker, original, ListStore("ok"), case)
    assert ours.stats.fallback_requests == before + 1 and len(calls) == 2

    class Subclass(data.RankLocalStoreLayout):
        def key_for(self, shard_id: int, chunk_hash: Any) -> str:
            return "custom@" + chunk_hash.hex()

    other = Subclass(data.KeyMetadata("m/sub", 1, 0, 0, 0), 64, 16)
    other.set_kv_caches_base_addr([1 << 30])
    other.set_block_len([4096])
    case["dbs"] = [data.ChunkedTokenDatabase(other.metadata, 64, 16, other)]
    result = run_handler(worker, ours, ArrayStore("ok"), case)
    assert result == run_handler(worker, original, ListStore("ok"), case)
    assert all(key.startswith("custom@") for key in result[1][0][0])

    # An instance override of key_for on our own layout class: vLLM calls it, so the handler must too.
    keyed = data.RankLocalStoreLayout(data.KeyMetadata("m/inst", 1, 0, 0, 0), 64, 16)
    keyed.set_kv_caches_base_addr([1 << 30])
    keyed.set_block_len([4096])
    keyed.key_for = lambda shard_id, chunk_hash: "inst@" + chunk_hash.hex()
    case["dbs"] = [data.ChunkedTokenDatabase(keyed.metadata, 64, 16, keyed)]
    result = run_handler(worker, ours, ArrayStore("ok"), case)
    assert result == run_handler(worker, original, ListStore("ok"), case)
    assert result[1][0][0] and all(key.startswith("inst@") for key in result[1][0][0])


# --- the switch ------------------------------------------------------------------------------------------------------


def test_switch_keeps_vllms_handler_and_unpatch_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    worker = pytest.importorskip(plugin.WORKER_MODULE, reason="vLLM has no Mooncake store worker module")
    cls = worker.KVCacheStoreRecvingThread
    was = plugin.is_patched()
    plugin.unpatch()
    vllms = cls.__dict__["_handle_request"]
    try:
        monkeypatch.setenv(plugin.ENV_RECV, "0")
        report = plugin.patch()
        assert report.active and "KVCacheStoreRecvingThread._handle_request" not in report.patched
        assert cls.__dict__["_handle_request"] is vllms
        plugin.unpatch()
        monkeypatch.delenv(plugin.ENV_RECV)
        report = plugin.patch()
        assert "KVCacheStoreRecvingThread._handle_request" in report.patched
        assert cls.__dict__["_handle_request"].__wrapped__ is vllms
        plugin.unpatch()
        assert cls.__dict__["_handle_request"] is vllms
    finally:
        plugin.unpatch()
        if was:
            plugin.patch(receive=True)


def test_a_worker_module_of_another_shape_keeps_vllms_receive_handler(
    vllm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receive part's shape check decides before anything is built: a worker module whose direct-I/O
    alignment is not a positive int keeps vLLM's handler, and the report says why (the fingerprints alone
    would pass: no fingerprinted function changed)."""
    _, worker = vllm
    cls = worker.KVCacheStoreRecvingThread
    plugin.unpatch()
    vllms = cls.__dict__["_handle_request"]
    try:
        monkeypatch.setattr(worker, "_DIRECT_IO_ALIGNMENT", 0)
        report = plugin.patch(receive=True)
        assert report.active and "KVCacheStoreRecvingThread._handle_request" not in report.patched, report
        why = f"{worker.__name__}._DIRECT_IO_ALIGNMENT is not a positive int"
        assert report.receive_reason == f"unexpected shape: {why}", report
        assert cls.__dict__["_handle_request"] is vllms
    finally:
        plugin.unpatch()
        monkeypatch.undo()
        plugin.patch(receive=True)
    assert plugin.is_receive_patched()


def test_receive_enabled_values() -> None:
    assert receive.receive_enabled({})
    assert receive.receive_enabled({receive.ENV_RECV: "1"})
    for off in ("0", "false", "OFF", " no "):
        assert not receive.receive_enabled({receive.ENV_RECV: off})


def test_self_check_catches_a_handler_that_differs(vllm: tuple[Any, Any]) -> None:
    data, worker = vllm
    _, ours = _handlers(worker)

    def wrong(self: Any, req_meta: Any) -> None:
        self.tp_rank += 1  # rotates differently
        try:
            ours(self, req_meta)
        finally:
            self.tp_rank -= 1

    wrong.stats = ours.stats  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="receive handler"):
        receive_check.self_check(data, worker, wrong)
    receive_check.self_check(data, worker, ours)


def test_self_check_compares_every_field_of_a_record(vllm: tuple[Any, Any]) -> None:
    """A handler whose records differ from vLLM's in one field only (the status it reports, last in sorted
    order) fails the self-check: each record is compared whole, less its duration."""
    data, worker = vllm
    _, ours = _handlers(worker)

    def misreports(self: Any, req_meta: Any) -> None:
        record = self._record_operation

        def off_by_one(operation: str, start: float, num_keys: int, **fields: Any) -> None:
            fields["status"] = f"{fields.get('status')}, misreported"
            record(operation, start, num_keys, **fields)

        self._record_operation = off_by_one
        ours(self, req_meta)

    misreports.stats = ours.stats  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="receive handler"):
        receive_check.self_check(data, worker, misreports)


def test_self_check_needs_stats_only_to_demand_the_fast_path(vllm: tuple[Any, Any]) -> None:
    """A handler without ``stats`` (vLLM's own) is checked for equality alone; one with ``stats`` must raise its
    fast-path count during the self-check, counted from where it stood before (not from zero)."""
    data, worker = vllm
    vllms, _ = _handlers(worker)
    receive_check.self_check(data, worker, vllms)

    def slow(self: Any, req_meta: Any) -> None:
        vllms(self, req_meta)

    slow.stats = type("Stats", (), {"fast_requests": 5})()  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="no self-check request took the fast path"):
        receive_check.self_check(data, worker, slow)


def test_shape_check_wants_positive_int_direct_io_constants(
    vllm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offload split divides by the alignment and adds the padding: 0, a negative value or a non-int is a
    worker this handler does not fit, named by the constant."""
    data, worker = vllm
    assert receive_check.check_shape(data, worker) == ""
    for name in ("_DIRECT_IO_ALIGNMENT", "_DIRECT_IO_PADDING_BYTES"):
        for value in (0, -4096, "4096", 4096.0, True):
            monkeypatch.setattr(worker, name, value)
            assert receive_check.check_shape(data, worker) == f"{worker.__name__}.{name} is not a positive int"
        monkeypatch.undo()
    assert receive_check.check_shape(data, worker) == ""


# --- array entry points of the store wrappers ------------------------------------------------------------------------


def _arrays(cache: StagingBuffer, keys: int, regions: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    addrs = np.array(
        [[cache.ptr + (r * keys + k) * size for r in range(regions)] for k in range(keys)], dtype=np.int64
    )
    return addrs, np.full((keys, regions), size, dtype=np.int64)


def test_staged_array_entry_equals_the_list_entry() -> None:
    from test_vllm_plugin import FakeMooncake

    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=4096)
    cache = StagingBuffer(16 * 2 * 1024)
    store.register_buffer(cache.ptr, cache.nbytes)
    cache.array[:] = np.random.default_rng(0).integers(0, 255, cache.nbytes, dtype=np.uint8)
    want = cache.array.copy()
    addrs, sizes = _arrays(cache, 16, 2, 1024)
    keys = [f"k{i}" for i in range(16)]
    assert store.batch_put_from_multi_buffers(keys, addrs.tolist(), sizes.tolist()) == [0] * 16
    del inner.objects["k3"]
    inner.objects["k5"] = inner.objects["k5"][:512]
    cache.array[:] = 0
    by_lists = store.batch_get_into_multi_buffers(keys, addrs.tolist(), sizes.tolist())
    got_lists = cache.array.copy()
    cache.array[:] = 0
    staged_before = store.stats.staged_gets
    by_arrays = store.batch_get_into_multi_buffers_arrays(keys, addrs, sizes)
    assert by_arrays == by_lists and by_arrays[3] == -704 and by_arrays[5] == -800
    assert store.stats.staged_gets == staged_before + 1
    assert (cache.array == got_lists).all()
    assert (cache.array[: 1024 * 3] == want[: 1024 * 3]).all()
    # Outside the registered buffers: refused by the registered-range guard, never sent to Mooncake.
    other = StagingBuffer(4096)
    outside, outside_sizes = _arrays(other, 2, 1, 64)
    inner.calls.clear()
    assert store.batch_get_into_multi_buffers_arrays(["k0", "k1"], outside, outside_sizes) == [-600, -600]
    assert inner.calls == [] and store.stats.passthrough_gets == 0


class _Client:
    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.calls: list[Any] = []

    def batch_get_into_multi_buffers(self, keys: Any, addrs: Any, sizes: Any) -> list[int]:
        if self.refuse:
            raise ValueError("refused")
        self.calls.append((keys, addrs, sizes))
        return [7] * len(keys)


@pytest.mark.parametrize("client", ["native", "refusing", "none"])
def test_native_array_entry_dispatch_and_fallback(client: str) -> None:
    bound = ListStore("ok")
    store = NativeMooncakeStore(bound)
    fake = None if client == "none" else _Client(client == "refusing")
    store._client = fake
    addrs = np.arange(6, dtype=np.int64).reshape(3, 2)
    sizes = np.ones((3, 2), dtype=np.int64)
    result = store.batch_get_into_multi_buffers_arrays(["a", "b", "c"], addrs, sizes)
    if client == "native":
        assert result == [7, 7, 7] and fake is not None and fake.calls[0][1] is addrs
        assert store.stats.native_calls == 1 and not bound.calls
    else:
        assert result == [4096] * 3 and store.stats.fallback_calls == 1
        _, rows, size_rows, types = bound.calls[0]
        assert rows == addrs.tolist() and size_rows == sizes.tolist() and types[1] is list


class _RowStore:
    """Keeps the very row lists Mooncake's bound method was handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, Any]] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def batch_get_into_multi_buffers(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        self.calls.append((list(keys), addrs, sizes))
        return [1] * len(keys)


@pytest.mark.parametrize("uniform", [True, False])
def test_native_array_entry_without_a_client_hands_mooncake_value_equal_rows(uniform: bool) -> None:
    """No native client (an unverified wheel): the arrays entry checks the matrices, then hands Mooncake's bound
    method lists of Python ints value-equal to the matrices; identical size rows may be one shared list. A key
    with a slice outside the registered buffers still gets -600 and is not handed on."""
    bound = _RowStore()
    store = NativeMooncakeStore(bound, armed=True)
    store._client = None
    cache = StagingBuffer(8 * 4 * 256)
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    addrs, sizes = _arrays(cache, 8, 4, 256)
    if not uniform:
        sizes[:, 1] = 128
        sizes[5, 2] = 64
    addrs[6, 3] = cache.ptr + cache.nbytes - 100  # past the end of the buffer
    keys = [f"k{i}" for i in range(8)]
    result = store.batch_get_into_multi_buffers_arrays(keys, addrs, sizes)
    assert result == [1, 1, 1, 1, 1, 1, -600, 1] and store.stats.fallback_calls == 1
    sent_keys, rows, size_rows = bound.calls[0]
    good = [i for i in range(8) if i != 6]
    assert sent_keys == [keys[i] for i in good]
    assert type(rows) is list and all(type(r) is list for r in rows + size_rows)
    assert all(type(v) is int for r in rows + size_rows for v in r)
    assert rows == addrs[good].tolist() and size_rows == sizes[good].tolist()
    assert (len({id(r) for r in size_rows}) == 1) == uniform


def test_staged_array_entry_passes_what_it_does_not_stage_through() -> None:
    """Other dtypes, shapes, duplicate or non-str keys: Mooncake's own call with the rows as lists, nothing
    staged (the receive handler never sends these; other callers may)."""
    from test_vllm_plugin import FakeMooncake

    inner = FakeMooncake()
    inner.record_only()
    seen: list[tuple[Any, Any]] = []
    get = inner.batch_get_into_multi_buffers

    def recording(keys: list[str], addrs: Any, sizes: Any, *args: Any) -> Any:
        seen.append((addrs, sizes))
        return get(keys, addrs, sizes, *args)

    inner.batch_get_into_multi_buffers = recording  # type: ignore[method-assign]
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16)
    cache = StagingBuffer(4096)
    store.register_buffer(cache.ptr, cache.nbytes)
    addrs, sizes = _arrays(cache, 2, 2, 64)
    cases = [
        (["a", "b"], addrs.astype(np.float64), sizes),
        (["a", "b"], addrs.astype(np.uint64), sizes),
        (["a", "b"], addrs[:, :1], sizes),
        (["a", "b"], addrs.ravel(), sizes.ravel()),
        (["a", "a"], addrs, sizes),
        (("a", "b"), addrs, sizes),
        ([b"a", b"b"], addrs, sizes),
        (["a", "b"], addrs, sizes * 0),
    ]
    # Rows that are not int addresses paired with sizes (floats, mismatched shapes, 1-D): refused by the
    # registered-range guard (-600), never sent; the others pass through as lists.
    refused = {0, 2, 3}
    for i, (keys, a, s) in enumerate(cases):
        got = store.batch_get_into_multi_buffers_arrays(keys, a, s)  # type: ignore[arg-type]
        assert got == ([-600] * 2 if i in refused else [-704] * 2)
        if i not in refused:
            assert seen[-1] == (np.asarray(a).tolist(), np.asarray(s).tolist())
            assert type(seen[-1][0]) is list
    passed = len(cases) - len(refused)
    assert store.stats.staged_gets == 0 and store.stats.passthrough_gets == passed
    assert inner.calls == ["get_multi"] * passed


# --- which store gets the int64 matrices: decided by type ------------------------------------------------------


def _small_case(data: Any) -> dict[str, Any]:
    metadata = data.KeyMetadata("m/typed", 1, 0, 0, 0)
    layout = data.RankLocalStoreLayout(metadata, 16, 16)
    layout.set_kv_caches_base_addr([1 << 30, 2 << 30])
    layout.set_block_len([4096])
    hashes = [bytes([i]) * 32 for i in range(3)]
    spec = data.LoadSpec(
        vllm_cached_tokens=0, kvpool_cached_tokens=48, can_load=True, token_len=48, tail_key_boundaries=()
    )
    meta = data.ReqMeta(
        req_id="typed", token_len_chunk=48, block_ids=([5, 6, 7],), block_hashes=hashes, load_spec=spec
    )
    return {
        "dbs": [data.ChunkedTokenDatabase(metadata, 16, 16, layout)],
        "masks": ([True, True, True],),
        "participates": [True],
        "block_size": 16,
        "tp_rank": 1,
        "meta": meta,
    }


def test_a_foreign_store_that_has_every_attribute_gets_vllms_lists(vllm: tuple[Any, Any]) -> None:
    """A mock store "has" the array entry too; the handler must not take that for our wrapper: it gets vLLM's
    own call, with lists of lists of ints, exactly as vLLM's handler makes it."""
    from unittest.mock import MagicMock

    data, worker = vllm
    original, ours = _handlers(worker)
    case = _small_case(data)
    expected = run_handler(worker, original, ListStore("ok"), case)
    store = MagicMock()
    store.batch_get_into_multi_buffers.side_effect = lambda keys, addrs, sizes: [4096] * len(keys)
    store.calls = []
    before = ours.stats.fast_requests
    actual = run_handler(worker, ours, store, case)
    assert ours.stats.fast_requests == before + 1
    assert not store.batch_get_into_multi_buffers_arrays.called
    (keys, addrs, sizes), kwargs = store.batch_get_into_multi_buffers.call_args
    assert kwargs == {}
    assert type(addrs) is list and all(type(row) is list for row in addrs)
    assert {type(v) for row in addrs for v in row} == {int}
    assert [keys, addrs, sizes] == [list(c) for c in expected[1][0][:3]]
    assert actual[2:] == expected[2:]


def test_the_array_entry_is_ours_or_registered(vllm: tuple[Any, Any]) -> None:
    """Our wrappers are array stores; a class with the method is one only when registered."""
    from test_vllm_plugin import FakeMooncake

    class Unregistered(ListStore):
        def batch_get_into_multi_buffers_arrays(self, keys: Any, addrs: Any, sizes: Any) -> Any:
            raise AssertionError("never called: not a registered array store")

    inner = FakeMooncake()
    assert isinstance(NativeMooncakeStore(inner), receive.ArrayStore)
    assert isinstance(StagedMooncakeStore(inner, staging_bytes=1 << 12), receive.ArrayStore)
    assert not isinstance(inner, receive.ArrayStore)
    data, worker = vllm
    original, ours = _handlers(worker)
    case = _small_case(data)
    expected = run_handler(worker, original, ListStore("ok"), case)
    assert run_handler(worker, ours, Unregistered("ok"), case) == expected
    assert run_handler(worker, ours, ArrayStore("ok"), case)[2:] == expected[2:]


# --- fingerprints ------------------------------------------------------------------------------------------------


def test_installed_release_matches_the_recorded_fingerprints(vllm: tuple[Any, Any]) -> None:
    import vllm as vllm_package

    data, worker = vllm
    version = vllm_package.__version__
    release = for_version(version)
    assert release is not None, version
    layout = importlib.import_module(release.layout_module)
    assert set(release.fingerprinted) <= {"layouts", *release.ported}
    for part, names in release.fingerprinted.items():
        functions = plugin.vllm_functions(names, data, worker, layout)
        assert set(functions) == set(names)
        assert plugin.fingerprint_problem(version, functions, release.fingerprints) == "", part
        if version in release.fingerprints:
            for name, func in functions.items():
                assert plugin.fingerprint(func) == release.fingerprints[version][name]


def test_fingerprint_ignores_layout_and_comments_but_not_code() -> None:
    base = "def f(x):\n    y = x + 1  # note\n\n    return y\n"
    same = "    def f(x):\n        # a comment line\n        y = x + 1\n\n\n        return y   \n"
    assert plugin.fingerprint_source(base) == plugin.fingerprint_source(same)
    for changed in (
        "def f(x):\n    y = x + 2\n    return y\n",
        "def f(x):\n    y = x + 1\n    return x\n",
        "def f(x):\n    y = x + 1\n    pass\n    return y\n",
    ):
        assert plugin.fingerprint_source(changed) != plugin.fingerprint_source(base)
    assert plugin.fingerprint(len) is None  # no Python source: never "the same"
    known = v0_33.FINGERPRINTS
    assert plugin.fingerprint_problem("0.33.0", {"RankLocalStoreLayout.key_for": len}, known).endswith("fingerprint")
    assert "is missing" in plugin.fingerprint_problem("0.33.0", {"RankLocalStoreLayout.key_for": None}, known)
    assert "none" in plugin.fingerprint_problem("0.35.0", {"RankLocalStoreLayout.key_for": plugin.fingerprint}, known)


def _with_one_more_statement(func: Any, module: Any, path: Any) -> Any:
    """``func`` compiled again from its own source (in a file, so it has source) plus one statement at the end
    of its body, in ``module``'s globals."""
    import ast
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(func))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    source += " " * body[0].col_offset + "pass\n"
    path.write_text(source)
    namespace = dict(vars(module))
    exec(compile(source, str(path), "exec"), namespace)
    return namespace[func.__name__]


def test_a_changed_handler_body_keeps_vllms_handler_with_one_warning(
    vllm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    """A point release whose ``_handle_request`` differs by one statement: vLLM's handler stays, the layouts are
    still patched, and one warning says why."""
    import logging

    data, worker = vllm
    cls = worker.KVCacheStoreRecvingThread
    plugin.unpatch()
    try:
        changed = _with_one_more_statement(cls.__dict__["_handle_request"], worker, tmp_path / "changed.py")
        assert plugin.fingerprint(changed) != plugin.fingerprint(cls.__dict__["_handle_request"])
        monkeypatch.setattr(cls, "_handle_request", changed)
        monkeypatch.delenv(plugin.ENV_PLUGIN, raising=False)
        monkeypatch.delenv(plugin.ENV_RECV, raising=False)
        with caplog.at_level(logging.INFO, logger="vllm.mooncake_kvaddr"):
            plugin.register()
            plugin.register()
        assert plugin.is_patched() and not plugin.is_receive_patched()
        assert cls.__dict__["_handle_request"] is changed
        assert data.RankLocalStoreLayout.__dict__["prepare_values"] is vllm_layouts._rank_local_prepare_values
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "receive handler kept" in warnings[0] and "KVCacheStoreRecvingThread._handle_request" in warnings[0]
        assert "not the function this plugin was checked against" in warnings[0]
    finally:
        plugin.unpatch()
        monkeypatch.undo()
        plugin.patch(receive=True)
    assert plugin.is_receive_patched()


def test_a_changed_layout_body_leaves_vllm_untouched(
    vllm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    data, _ = vllm
    cls = data.RankLocalStoreLayout
    plugin.unpatch()
    try:
        changed = _with_one_more_statement(cls.__dict__["key_for"], data, tmp_path / "changed_key_for.py")
        monkeypatch.setattr(cls, "key_for", changed)
        report = plugin.patch()
        assert not report.active and "RankLocalStoreLayout.key_for is not the function" in report.reason
        assert not plugin.is_patched() and cls.__dict__["key_for"] is changed
    finally:
        plugin.unpatch()
        monkeypatch.undo()
        plugin.patch(receive=True)


def test_ragged_calls_make_one_call_per_width_and_merge_in_order() -> None:
    """Rows of different widths reach an array store as one call per width (keys in their order, matrices
    trimmed to the width); the answers come back in the keys' order; a short answer list is an error."""
    from mooncake_kvaddr.integrations.vllm.native_store import ragged_calls

    widths = np.array([2, 3, 2, 1, 3], dtype=np.int64)
    addrs = np.array([[10 * i + j if j < w else 0 for j in range(3)] for i, w in enumerate(widths)], np.int64)
    sizes = np.where(addrs > 0, 64, 0).astype(np.int64)
    sizes[0, 0] = 64
    keys = ["a", "b", "c", "d", "e"]
    calls: list[tuple[list[str], list[list[int]], list[list[int]]]] = []

    def call(k: list[str], a: Any, s: Any) -> list[int]:
        calls.append((k, a.tolist(), s.tolist()))
        return [len(row) * 100 + i for i, row in enumerate(a.tolist())]

    result = ragged_calls(call, keys, addrs, sizes, widths)
    assert [c[0] for c in calls] == [["a", "c"], ["b", "e"], ["d"]]
    assert calls[0][1] == [[0, 1], [20, 21]] and calls[1][1] == [[10, 11, 12], [40, 41, 42]] and calls[2][1] == [[30]]
    assert result == [200, 300, 201, 100, 301]
    with pytest.raises(RuntimeError, match="results for"):
        ragged_calls(lambda k, a, s: [0], keys, addrs, sizes, widths)


def test_hybrid_rows_reach_the_native_wrapper_as_matrices_per_width() -> None:
    """A NativeMooncakeStore without a native client still takes ragged rows: one bound call per width, rows
    value-equal to each key's regions."""
    bound = _RowStore()
    store = NativeMooncakeStore(bound)
    store._client = None
    addrs = np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int64)
    sizes = np.array([[8, 8, 0], [8, 8, 8]], dtype=np.int64)
    assert store.batch_get_into_multi_buffers_ragged(["x", "y"], addrs, sizes, np.array([2, 3])) == [1, 1]
    assert [(k, a, s) for k, a, s in bound.calls] == [(["x"], [[1, 2]], [[8, 8]]), (["y"], [[3, 4, 5]], [[8, 8, 8]])]


def test_a_database_whose_block_sizes_are_not_its_layouts_is_left_to_vllm(vllm: tuple[Any, Any]) -> None:
    """vLLM walks with the token database's block sizes, our engine with its layout's: where they differ the
    group is not ours to plan (both handlers ask ``Kinds.engine_of``)."""
    from mooncake_kvaddr.integrations.vllm import plans
    from mooncake_kvaddr.integrations.vllm.layouts import OURS, PLAN_ENGINES

    data, _ = vllm
    kinds = plans.Kinds(data, OURS)
    metadata = data.KeyMetadata("m/sizes", 0, 0, 0, 0)
    layout = data.RankLocalStoreLayout(metadata, 32, 16)
    layout.set_kv_caches_base_addr([1 << 30])
    layout.set_block_len([4096])
    planner = kinds.engine_of(data.ChunkedTokenDatabase(metadata, 32, 16, layout), PLAN_ENGINES)
    assert not isinstance(planner, str) and len(planner[1]) == 1  # (engine, one key prefix)
    for block_size, hash_block_size in ((64, 16), (32, 32)):
        db = data.ChunkedTokenDatabase(metadata, block_size, hash_block_size, layout)
        assert kinds.engine_of(db, PLAN_ENGINES) == "a token database whose block sizes are not its layout's"


def test_a_database_that_is_not_vllms_is_left_to_vllm_with_its_reason(vllm: tuple[Any, Any]) -> None:
    """A token database whose chunk walk is not vLLM's (a subclass overriding ``process_tokens``, or another
    type) is not ours to plan: ``Kinds.engine_of`` answers the reason both handlers record, the same on a
    second ask (the answer is cached per type), while vLLM's own class still gets an engine."""
    from mooncake_kvaddr.integrations.vllm import plans
    from mooncake_kvaddr.integrations.vllm.layouts import OURS, PLAN_ENGINES

    data, _ = vllm
    kinds = plans.Kinds(data, OURS)
    metadata = data.KeyMetadata("m/own-walk", 0, 0, 0, 0)
    layout = data.RankLocalStoreLayout(metadata, 32, 16)
    layout.set_kv_caches_base_addr([1 << 30])
    layout.set_block_len([4096])

    class OwnWalk(data.ChunkedTokenDatabase):  # type: ignore[misc, name-defined]
        def process_tokens(self, *args: Any, **kwargs: Any) -> Any:
            return super().process_tokens(*args, **kwargs)

    class NotADatabase:
        store_layout = layout

    reason = "a token database that is not vLLM's"
    for db in (OwnWalk(metadata, 32, 16, layout), NotADatabase()):
        assert kinds.engine_of(db, PLAN_ENGINES) == reason
        assert kinds.engine_of(db, PLAN_ENGINES) == reason
    assert not isinstance(kinds.engine_of(data.ChunkedTokenDatabase(metadata, 32, 16, layout), PLAN_ENGINES), str)


def test_a_layout_not_backed_by_our_engine_is_left_to_vllm_with_its_reason(vllm: tuple[Any, Any]) -> None:
    """A layout vLLM would call its own way is not ours to plan, with the reason the handlers record: a subclass
    with its own ``local_shard_ids`` (our engine would not ask it), an instance override of ``prepare_values``."""
    from mooncake_kvaddr.integrations.vllm import plans
    from mooncake_kvaddr.integrations.vllm.layouts import OURS, PLAN_ENGINES

    data, _ = vllm
    kinds = plans.Kinds(data, OURS)
    metadata = data.KeyMetadata("m/own-layout", 0, 0, 0, 0)

    class OwnShards(data.RankLocalStoreLayout):  # type: ignore[misc, name-defined]
        def local_shard_ids(self, *args: Any, **kwargs: Any) -> Any:
            return super().local_shard_ids(*args, **kwargs)

    overridden = data.RankLocalStoreLayout(metadata, 32, 16)
    overridden.prepare_values = overridden.prepare_values
    keyed = data.RankLocalStoreLayout(metadata, 32, 16)
    keyed.key_for = lambda shard_id, chunk_hash: "inst@" + chunk_hash.hex()  # an instance override of key_for
    reason = "a layout not backed by our engine"
    for layout in (OwnShards(metadata, 32, 16), overridden, keyed):
        layout.set_kv_caches_base_addr([1 << 30])
        layout.set_block_len([4096])
        assert kinds.engine_of(data.ChunkedTokenDatabase(metadata, 32, 16, layout), PLAN_ENGINES) == reason
    assert kinds.layout_kind(keyed) == kinds.layout_kind(overridden) == ""
    plain = data.RankLocalStoreLayout(metadata, 32, 16)
    plain.set_kv_caches_base_addr([1 << 30])
    plain.set_block_len([4096])
    assert kinds.layout_kind(plain) == "rank_local"


def test_hash_source_reads_a_hash_blob_of_whole_hashes_and_nothing_else() -> None:
    """What the handlers' engine reads the block hashes from: a list or tuple itself; a blob-hash object's flat
    byte view with its hash length when the view holds whole hashes; None (vLLM's own path) otherwise."""
    from mooncake_kvaddr.integrations.vllm import plans

    class Blob:
        def __init__(self, blob: Any, hash_len: Any) -> None:
            self._blob, self._hash_len = blob, hash_len

    view = memoryview(bytes(range(32)))
    hashes = [b"a" * 16]
    assert plans.hash_source(hashes, Blob)[0] is hashes and plans.hash_source(tuple(hashes), Blob)[1] is None
    source = plans.hash_source(Blob(view, 16), Blob)
    assert source is not None and source[0] is view and source[1] == 16
    for odd in (Blob(view, 12), Blob(view, 0), Blob(bytes(32), 16), Blob(view, 16.0)):
        assert plans.hash_source(odd, Blob) is None
    assert plans.hash_source(Blob(view, 16), type(None)) is None


class _OwnHex(bytes):
    """A bytes subclass with its own ``.hex()``: vLLM keys it by that, not by its bytes."""

    def hex(self, *args: Any) -> str:  # type: ignore[override]
        return "own" + super().hex(*args)


@pytest.mark.parametrize("odd", ["numpy", "own_hex"])
def test_hash_types_vllm_keys_otherwise_go_to_vllms_handler(vllm: tuple[Any, Any], odd: str) -> None:
    """Numpy-array hashes (vLLM raises AttributeError: no ``.hex()``) and a bytes subclass with its own
    ``.hex()`` (vLLM's keys differ from its bytes' hex): vLLM's handler decides, with its exception and its
    keys (issue 39 item 2: our engine read any buffer and loaded under other keys)."""
    data, worker = vllm
    original, ours = _handlers(worker)
    case = _simple_case(data)
    convert = {"numpy": lambda h: np.frombuffer(h, dtype=np.uint8), "own_hex": _OwnHex}[odd]
    case["meta"].block_hashes = [convert(h) for h in case["meta"].block_hashes]
    before = ours.stats.fallback_requests
    expected = run_handler(worker, original, ListStore("ok"), case)
    assert run_handler(worker, ours, ArrayStore("ok"), case) == expected
    assert (expected[0] is AttributeError) == (odd == "numpy")
    assert ours.stats.fallback_requests == before + 1
