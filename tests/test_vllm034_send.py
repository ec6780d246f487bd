"""The plugin's ``KVCacheStoreSendingThread._handle_request`` against vLLM 0.34's own (imported, never copied).

Both run vLLM 0.34's real send thread over generated store jobs built through the release's ``sample_layouts``
(Store chunks of a quarter, half or whole block, rank-local regions with strides), store masks that depend on
every argument vLLM passes (checkpoint, saved offset, replay boundary), put steps, saved offsets, null and
past-the-list source blocks (an incomplete save), kv roles, kv events with lookahead and retry ids, group
semantics, and stores that answer present, absent, failed, short, pressure (-200) or raise; every store call
(keys, rows, group ids), record, saved offset, completion, pressure state, queue count, event and exception
must be equal.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", minversion="0.34")  # (vllm_release deselects it on any other series)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as data_module
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as worker_module

from mooncake_kvaddr.integrations.vllm import plugin, send_check
from mooncake_kvaddr.integrations.vllm import send as send_module
from mooncake_kvaddr.integrations.vllm.registry import fingerprint
from mooncake_kvaddr.integrations.vllm.releases import v0_34

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_release("0.34")]

layout_module = importlib.import_module(v0_34.LAYOUT_MODULE)
SENDER = worker_module.KVCacheStoreSendingThread
ORIGINAL = SENDER.__dict__["_handle_request"]
ORIGINAL = getattr(ORIGINAL, "__wrapped__", ORIGINAL)
SAMPLE = {"layouts": layout_module, "sample": v0_34.sample_layouts}


@pytest.fixture(scope="module")
def handler() -> Iterator[Any]:
    plugin.unpatch()
    report = plugin.patch()
    assert "KVCacheStoreSendingThread._handle_request" in report.patched, report
    yield SENDER.__dict__["_handle_request"]
    plugin.unpatch()


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    # The failing-store jobs log vLLM's warnings twice each (vLLM's run and ours).
    was = worker_module.logger.disabled
    worker_module.logger.disabled = True
    yield
    worker_module.logger.disabled = was


class _Seen:
    """What the fast path met: jobs planned with Store chunks below a block, incomplete saves (an unavailable
    source block), stale jobs (nothing past the saved offset), ragged puts, events with lookahead ids."""

    def __init__(self) -> None:
        self.chunked = self.missing = self.stale = self.ragged = self.lookahead = 0


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, _Seen]]:
    """The plugin's handler made with counting wrappers around the shared steps and the release's ``prepare``."""
    seen = _Seen()
    plan_store, stored_events = send_module.plan_store, send_module.stored_events
    ragged = send_check.ArrayRecordingStore.batch_put_from_multi_buffers_ragged
    prepare = v0_34.SEND.prepare

    def planned(thread: Any, req_meta: Any, job: Any, *args: Any) -> Any:
        plan = plan_store(thread, req_meta, job, *args)
        if not isinstance(plan, str):
            seen.missing += plan.missing
            seen.chunked += any(db.chunk_size < db.store_layout.block_size for db in thread.token_databases)
        return plan

    def events(*args: Any) -> Any:
        stored = stored_events(*args)
        seen.lookahead += sum(event.lookahead_token_ids is not None for event in stored)
        return stored

    def split(store: Any, *args: Any) -> Any:
        seen.ragged += 1
        return ragged(store, *args)

    def prepared(thread: Any, req_meta: Any) -> Any:
        job = prepare(thread, req_meta)
        seen.stale += not isinstance(job, str) and job.stale
        return job

    monkeypatch.setattr(send_module, "plan_store", planned)
    monkeypatch.setattr(send_module, "stored_events", events)
    monkeypatch.setattr(send_check.ArrayRecordingStore, "batch_put_from_multi_buffers_ragged", split)
    rules = dataclasses.replace(v0_34.SEND, prepare=prepared)
    monkeypatch.setattr(v0_34, "RELEASE", dataclasses.replace(v0_34.RELEASE, send_rules=rules))
    plugin.unpatch()
    try:
        report = plugin.patch()
        assert "KVCacheStoreSendingThread._handle_request" in report.patched, report
        seen.__init__()  # the self-check's jobs are not counted
        yield SENDER.__dict__["_handle_request"], seen
    finally:
        plugin.unpatch()


def test_send_matches_vllms_on_ten_thousand_jobs(counted: tuple[Any, _Seen]) -> None:
    ours, seen = counted
    fast = send_check.compare(data_module, worker_module, ours, random.Random(2034), 10_000, **SAMPLE)
    # The rest: dead or pressure-skipped jobs, striping by chunks below a block, token lengths vLLM refuses.
    assert fast >= 6_500, fast
    assert seen.chunked >= 1_000 and seen.missing >= 1_000 and seen.stale >= 300, vars(seen)
    assert seen.ragged >= 100, vars(seen)


def test_kv_events_with_lookahead_match_vllms(counted: tuple[Any, _Seen]) -> None:
    """With kv events on, every job's BlockStored events (hashes, parents, token ids, lookahead ids, Store chunk
    sizes, groups) and retry token ids are vLLM's."""
    ours, seen = counted

    def with_events(case: dict[str, Any]) -> None:
        case["kv_event"] = True

    rng = random.Random(9)
    fast = send_check.compare(data_module, worker_module, ours, rng, 2_000, transform=with_events, **SAMPLE)
    assert fast >= 1_300, fast
    assert seen.lookahead >= 200, vars(seen)


def _blob_hashes_and_array_ids(case: dict[str, Any]) -> None:
    meta = case["meta"]
    hashes = meta.block_hashes
    if len({len(h) for h in hashes}) == 1:
        blob = memoryview(b"".join(hashes))
        meta.block_hashes = data_module.BlobBlockHashes(blob, len(hashes[0]))
    meta.block_ids = tuple(np.asarray(ids, dtype=np.int64) for ids in meta.block_ids)


def test_blob_hashes_and_array_block_ids_match(handler: Any) -> None:
    fast = send_check.compare(
        data_module, worker_module, handler, random.Random(5), 1_000, transform=_blob_hashes_and_array_ids, **SAMPLE
    )
    assert fast >= 600, fast


def test_striping_by_chunks_below_a_block_goes_to_vllms_handler(handler: Any) -> None:
    """A put step over 1 with Store chunks below a block stripes parts of a block: vLLM's handler runs it."""
    rng = random.Random(4)
    handed = 0
    for number in range(300):
        case = send_check.make_case(data_module, rng, number, **SAMPLE)
        case["put_steps"] = tuple(2 for _ in case["dbs"])
        case["participates"] = [True] * len(case["dbs"])
        case["live"], case["pressure"] = True, ""
        before = handler.stats.fallback_requests
        expected = send_check.run_once(worker_module, ORIGINAL, send_check.RecordingStore(case["answers"](1)), case)
        actual = send_check.run_once(worker_module, handler, send_check.ArrayRecordingStore(case["answers"](1)), case)
        assert expected == actual, number
        if handler.stats.fallback_requests > before:
            handed += handler.stats.last_fallback == "put striping by Store chunks smaller than a block"
    assert handed >= 50, handed


def test_debug_log_lines_match(handler: Any) -> None:
    """vLLM logs each skipped source chunk (its block index) and the stored groups at DEBUG; ours the same."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep(logging.DEBUG)
    logger = worker_module.logger
    level, logger.disabled = logger.level, False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(keep)
    try:
        rng = random.Random(3)
        skipped = 0
        for number in range(300):
            case = send_check.make_case(data_module, rng, number, **SAMPLE)
            runs = []
            for func in (ORIGINAL, handler):
                lines.clear()
                send_check.run_once(worker_module, func, send_check.RecordingStore(case["answers"](4)), case)
                runs.append(list(lines))
            assert runs[0] == runs[1], number
            skipped += sum("Skipping unavailable" in line for line in runs[0])
        assert skipped > 50
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)


def test_fingerprints_and_the_ported_part() -> None:
    """The send part's fingerprints are vLLM 0.34.0's functions; the release has the part ported."""
    prints = v0_34.FINGERPRINTS["0.34.0"]
    functions = {
        "KVCacheStoreSendingThread._handle_request": SENDER.__dict__["_handle_request"],
        "ChunkedTokenDatabase.process_tokens": data_module.ChunkedTokenDatabase.process_tokens,
        "_sum_batch_bytes": worker_module._sum_batch_bytes,
    }
    assert set(v0_34.FINGERPRINTED["send"]) == set(functions)
    for name, func in functions.items():
        assert fingerprint(getattr(func, "__wrapped__", func)) == prints[name], name
    assert "send" in v0_34.RELEASE.ported and v0_34.RELEASE.send_rules is v0_34.SEND


def test_shape_check_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert send_check.check_shape(data_module, worker_module, v0_34.SEND) == ""
    assert "_record_saved" in send_check.check_shape(data_module, worker_module)  # 0.33's names: not 0.34's
    fields = dataclasses.replace(v0_34.SEND, req_meta_fields=("no_such_field",))
    assert "no_such_field" in send_check.check_shape(data_module, worker_module, fields)
    monkeypatch.setattr(worker_module, "NULL_BLOCK_ID", 7)
    assert "NULL_BLOCK_ID" in send_check.check_shape(data_module, worker_module, v0_34.SEND)


def test_patch_replaces_the_send_handler_and_a_failing_self_check_keeps_vllms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugin.unpatch()
    try:
        report = plugin.patch()
        assert "KVCacheStoreSendingThread._handle_request" in report.patched and plugin.is_send_patched(), report
        assert not report.send_reason
        plugin.unpatch()
        assert SENDER.__dict__["_handle_request"] is ORIGINAL
        real = send_module.group_walk

        def off_by_one_stripe(*args: Any) -> Any:
            chunk, block, token_len, save_start, store_mask, put_step, rank, blocks = args
            return real(chunk, block, token_len, save_start, store_mask, put_step + 1, rank, blocks)

        monkeypatch.setattr(send_module, "group_walk", off_by_one_stripe)
        report = plugin.patch()
        assert report.active and "KVCacheStoreSendingThread._handle_request" not in report.patched
        assert report.send_reason.startswith("self-check failed"), report.send_reason
        assert SENDER.__dict__["_handle_request"] is ORIGINAL
    finally:
        plugin.unpatch()


@pytest.mark.mooncake
def test_the_send_bench_section_runs_and_stores(master: Any) -> None:
    """The bench's send section on vLLM 0.34 through a real master: every variant stores every key, the
    plugin's variants through our handler (both of the quick request's jobs on the fast path)."""
    from mooncake_kvaddr.bench import vllm_send

    rows = vllm_send.run(quick=True, reps=1, master_address=master.rpc_address)
    assert [row["variant"] for row in rows] == list(vllm_send.VARIANTS)
    assert all(row["stored_ok"] and row["cpu_gil_ms"] > 0 and row["wall_ms"] > 0 for row in rows)
    assert [row["fast_path"] for row in rows] == [0, 2, 2, 2]


def test_a_job_handed_to_vllm_asks_for_its_store_masks_once(handler: Any) -> None:
    """A layout class whose ``prepare_values`` someone else replaced is not ours to plan: the job goes to vLLM's
    handler before vLLM's coordinator is asked for the store masks, so they are asked for once (vLLM's own
    test_store_sending_thread_delta_saves_only_new_masked_chunks counts the calls)."""
    import threading
    from unittest.mock import MagicMock

    class Overridden(layout_module.TPShardedStoreLayout):  # type: ignore[misc, name-defined]
        def prepare_values(self, chunks: Any, block_ids: Any, shard_ids: Any) -> Any:
            return super().prepare_values(chunks, block_ids, shard_ids)

    metadata = layout_module.KeyMetadata("m", 0, 0, 0, 0)
    layout = Overridden(metadata, 16, 8, 1, 1, 0, 8)
    layout._set_segment_templates([[([1 << 20], [4096], [64])], [([1 << 21], [4096], [64])]])
    db = data_module.ChunkedTokenDatabase(metadata, 8, store_layout=layout)
    store = MagicMock()
    store.batch_is_exist.side_effect = lambda keys: [0] * len(keys)
    store.batch_put_from_multi_buffers.side_effect = lambda keys, addrs, sizes, config: [64] * len(keys)
    coord = MagicMock(lcm_block_size=16)
    coord.store_mask.side_effect = lambda token_len, start, num_prompt_tokens=None: (None,)
    thread = SENDER(store=store, token_databases=[db], block_size=16, coord=coord, tp_rank=0, group_put_steps=[1],
                    kv_role="kv_producer", ready_event=threading.Event(), enable_kv_event=False,
                    replicate_config=None, enable_group_semantics=False, supports_group_ids=False)  # fmt: skip
    thread.request_queue.task_done = MagicMock()
    meta = data_module.ReqMeta(req_id="r", token_len_chunk=32, block_ids=([1, 2],),
                               block_hashes=[f"h{i}".encode() for i in range(4)], can_save=True)  # fmt: skip
    meta.store_job_id = 1
    thread.add_request(meta)
    fallbacks = handler.stats.fallback_requests
    handler(thread, thread.request_queue.get())
    assert handler.stats.fallback_requests == fallbacks + 1
    assert handler.stats.last_fallback == "a layout not backed by our engine"
    assert coord.store_mask.call_count == 1
    assert store.batch_put_from_multi_buffers.call_count == 1
