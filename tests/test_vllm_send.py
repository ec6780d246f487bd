"""The plugin's ``KVCacheStoreSendingThread._handle_request`` against vLLM 0.33's own (imported, never copied).

Both run vLLM's real send thread over generated store jobs (rank-local and TP-shared groups, rows of mixed
widths, store masks or none, put steps, saved offsets, null and past-the-list block ids, boundary-state puts,
group semantics, dead and pressure-skipped jobs, token lengths vLLM refuses) and stores that answer present,
absent, failed, pressure (-200) or raise; every store call (keys, rows, group ids), record, saved offset,
completion, pressure state, queue count and exception must be equal. Plain stores get lists, our array stores
int64 matrices. The real-master path is in test_vllm_end_to_end.py.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as data_module
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as worker_module

from mooncake_kvaddr.integrations.vllm import plugin, send_check
from mooncake_kvaddr.integrations.vllm import send as send_module
from mooncake_kvaddr.integrations.vllm.releases import v0_33

pytestmark = [pytest.mark.vllm]

SENDER = worker_module.KVCacheStoreSendingThread
ORIGINAL = SENDER.__dict__["_handle_request"]
ORIGINAL = getattr(ORIGINAL, "__wrapped__", ORIGINAL)


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


def test_send_matches_vllms_on_ten_thousand_jobs(handler: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ragged = {"puts": 0}
    real = send_check.ArrayRecordingStore.batch_put_from_multi_buffers_ragged

    def counted(self: Any, *args: Any) -> Any:
        ragged["puts"] += 1
        return real(self, *args)

    monkeypatch.setattr(send_check.ArrayRecordingStore, "batch_put_from_multi_buffers_ragged", counted)
    fast = send_check.compare(data_module, worker_module, handler, random.Random(2026), 10_000)
    assert fast >= 7_500, fast  # the rest: dead or skipped jobs and token lengths vLLM's walk refuses
    assert ragged["puts"] >= 100, ragged  # hybrid rows of different widths reached the store as matrices


def _blob_hashes_and_array_ids(case: dict[str, Any]) -> None:
    meta = case["meta"]
    hashes = meta.block_hashes
    if len({len(h) for h in hashes}) == 1:
        blob = memoryview(b"".join(hashes))
        meta.block_hashes = data_module.BlobBlockHashes(blob, len(hashes[0]))
    meta.block_ids = tuple(np.asarray(ids, dtype=np.int64) for ids in meta.block_ids)


def test_blob_hashes_and_array_block_ids_match(handler: Any) -> None:
    fast = send_check.compare(
        data_module, worker_module, handler, random.Random(5), 1_500, transform=_blob_hashes_and_array_ids
    )
    assert fast >= 1_000, fast


def test_kv_events_match_vllms(handler: Any) -> None:
    """With kv events on, every job's BlockStored events (hashes, parents, token ids, groups) and retry token ids
    are vLLM's; the jobs take the fast path."""
    before = handler.stats.fast_requests

    def with_events(case: dict[str, Any]) -> None:
        case["kv_event"] = True

    fast = send_check.compare(data_module, worker_module, handler, random.Random(9), 2_000, transform=with_events)
    assert fast >= 1_500 and handler.stats.fast_requests == before + fast


def test_unusual_inputs_go_to_vllms_handler(handler: Any) -> None:
    """Put steps, masks and block ids of shapes the walk does not take: vLLM's handler decides (and raises)."""
    edits = [
        lambda case: case.update(put_steps=tuple(0 for _ in case["put_steps"])),
        lambda case: case.update(put_steps=tuple(2.0 for _ in case["put_steps"])),
        lambda case: case.update(coord=send_check._Coord(tuple(np.ones(4, bool) for _ in case["dbs"]), 16)),
        lambda case: setattr(case["meta"], "block_ids", tuple(["x"] * 9 for _ in case["dbs"])),
        lambda case: setattr(case["meta"], "block_ids", tuple([2**70] * 9 for _ in case["dbs"])),
        lambda case: setattr(case["meta"], "block_hashes", case["meta"].block_hashes[:1]),
    ]
    for number, edit in enumerate(edits):
        before = handler.stats.fallback_requests
        rng = random.Random(number)
        for _ in range(60):
            case = send_check.make_case(data_module, rng, number)
            edit(case)
            plain, arrays = send_check.RecordingStore, send_check.ArrayRecordingStore
            expected = send_check.run_once(worker_module, ORIGINAL, plain(case["answers"](1)), case)
            actual = send_check.run_once(worker_module, handler, arrays(case["answers"](1)), case)
            assert expected == actual, (number, expected, actual)
        # (A job whose groups all sit out never reads the odd input: it may take the fast path.)
        assert handler.stats.fallback_requests - before >= 45, number


def test_debug_log_lines_match(handler: Any) -> None:
    """vLLM logs each skipped source block and the stored groups at DEBUG; ours logs the same lines in order."""
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
            case = send_check.make_case(data_module, rng, number)
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


def test_keys_whose_existence_check_errs_are_stored(handler: Any) -> None:
    """Only 1 means present: a key ``batch_is_exist`` answers with a negative code (it could not check it) is
    stored by vLLM like an absent one, and by ours."""

    def answer(call: str, keys: list[str]) -> list[int]:
        if call == "exist":
            return [(-1, 1, 0, -704)[i % 4] for i in range(len(keys))]
        return [0] * len(keys)

    def erring(case: dict[str, Any]) -> None:
        case["answers"] = lambda seed: answer

    fast = send_check.compare(data_module, worker_module, handler, random.Random(12), 300, transform=erring)
    assert fast >= 200, fast


def test_patch_replaces_the_send_handler_and_env_keeps_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.unpatch()
    try:
        report = plugin.patch()
        assert "KVCacheStoreSendingThread._handle_request" in report.patched, report
        assert plugin.is_send_patched() and plugin.is_receive_patched()
        plugin.unpatch()
        assert SENDER.__dict__["_handle_request"] is ORIGINAL
        monkeypatch.setenv(send_module.ENV_SEND, "0")
        report = plugin.patch()
        assert report.active and "KVCacheStoreSendingThread._handle_request" not in report.patched
        assert not plugin.is_send_patched() and plugin.is_receive_patched()
        assert SENDER.__dict__["_handle_request"] is ORIGINAL
    finally:
        plugin.unpatch()


def test_a_changed_send_body_keeps_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.unpatch()
    table = {release: dict(prints) for release, prints in v0_33.FINGERPRINTS.items()}
    for prints in table.values():
        prints["KVCacheStoreSendingThread._handle_request"] = "0" * 16
    monkeypatch.setattr(v0_33, "RELEASE", dataclasses.replace(v0_33.RELEASE, fingerprints=table))
    try:
        report = plugin.patch()
        assert report.active and "KVCacheStoreSendingThread._handle_request" not in report.patched
        assert "KVCacheStoreSendingThread._handle_request is not the function" in report.send_reason
        assert SENDER.__dict__["_handle_request"] is ORIGINAL
    finally:
        plugin.unpatch()


def test_a_failing_self_check_keeps_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler that differs from vLLM's on one generated job is never installed."""
    plugin.unpatch()
    real = send_module.group_walk

    def off_by_one_stripe(*args: Any) -> Any:
        chunk, block, token_len, save_start, store_mask, put_step, rank, blocks = args
        return real(chunk, block, token_len, save_start, store_mask, put_step, (rank + 1) % put_step, blocks)

    monkeypatch.setattr(send_module, "group_walk", off_by_one_stripe)
    try:
        report = plugin.patch()
        assert report.active and "KVCacheStoreSendingThread._handle_request" not in report.patched
        assert report.send_reason.startswith("self-check failed"), report.send_reason
    finally:
        plugin.unpatch()


def test_shape_check_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert send_check.check_shape(data_module, worker_module) == ""
    monkeypatch.delattr(worker_module, "_make_mooncake_group_id")
    assert "_make_mooncake_group_id" in send_check.check_shape(data_module, worker_module)
    monkeypatch.undo()
    monkeypatch.setattr(worker_module, "MOONCAKE_NO_AVAILABLE_HANDLE", "-200")
    assert "MOONCAKE_NO_AVAILABLE_HANDLE" in send_check.check_shape(data_module, worker_module)


def test_recording_store_records_group_ids_trimmed_rows_and_ragged_puts() -> None:
    """The self-check's recording store keeps what a put hands Mooncake: keys, rows (a ragged put's rows trimmed
    to their widths, as the one put vLLM makes), the replicate config's group ids at the call (none: an empty
    list), and counts ragged puts only. A ragged put is split as our wrappers split it (one put per width, each
    with its keys' group ids: ``puts``), and a put whose group ids are not one per key gets -600 for every key,
    as from Mooncake."""
    store = send_check.ArrayRecordingStore(lambda call, keys: [0] * len(keys))
    assert store.ragged == 0
    config = send_check._Config()
    assert config.group_ids is None  # unset, as in Mooncake's ReplicateConfig
    config.group_ids = ["g1", "g2", "g3"]
    addrs = np.array([[11, 12], [13, 0], [14, 15]], np.int64)
    sizes = np.array([[4, 8], [16, 0], [32, 64]], np.int64)
    widths = np.array([2, 1, 2], np.int64)
    assert store.batch_put_from_multi_buffers_ragged(["a", "b", "e"], addrs, sizes, widths, config) == [0, 0, 0]
    assert store.ragged == 1 and config.group_ids == ["g1", "g2", "g3"]  # the caller's config unchanged
    assert store.puts == [(["a", "e"], ["g1", "g3"]), (["b"], ["g2"])]
    config.group_ids = None
    assert store.batch_put_from_multi_buffers_arrays(["c"], addrs[:1], sizes[:1], config) == [0]
    assert store.batch_put_from_multi_buffers(["d"], [[7]], [[9]], object()) == [0]
    config.group_ids = []
    assert store.batch_put_from_multi_buffers(["f"], [[7]], [[9]], config) == [-600]  # as Mooncake answers
    assert store.ragged == 1
    assert store.calls == [
        ("put", ["a", "b", "e"], [[11, 12], [13], [14, 15]], [[4, 8], [16], [32, 64]], ["g1", "g2", "g3"]),
        ("put", ["c"], [[11, 12]], [[4, 8]], []),
        ("put", ["d"], [[7]], [[9]], []),
        ("put", ["f"], [[7]], [[9]], []),
    ]


def test_recording_store_answers_a_ragged_put_whose_parts_lost_their_group_ids_as_mooncake_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A split that hands every part the whole list of group ids (the defect of issue #39) is seen: each part is
    answered -600 and the recorded put names no group id for its keys, so the comparison with vLLM's put fails."""
    from mooncake_kvaddr.integrations.vllm import plans

    whole = plans.ragged_calls

    def uncut(call: Any, keys: Any, addrs: Any, sizes: Any, widths: Any, *config: Any) -> Any:
        return whole(lambda k, a, s: call(k, a, s, *config), keys, addrs, sizes, widths)

    monkeypatch.setattr(plans, "ragged_calls", uncut)
    store = send_check.ArrayRecordingStore(lambda call, keys: [0] * len(keys))
    config = send_check._Config()
    config.group_ids = ["g1", "g2"]
    addrs, sizes = np.array([[11, 12], [13, 0]], np.int64), np.array([[4, 8], [16, 0]], np.int64)
    widths = np.array([2, 1], np.int64)
    assert store.batch_put_from_multi_buffers_ragged(["a", "b"], addrs, sizes, widths, config) == [-600, -600]
    assert store.calls == [("put", ["a", "b"], [[11, 12], [13]], [[4, 8], [16]], [None, None])]


# --- the store wrappers' array put ------------------------------------------------------------------------------


def _matrices(cache: Any, keys: int, regions: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    addrs = np.array([[cache.ptr + (r * keys + k) * size for r in range(regions)] for k in range(keys)], np.int64)
    return addrs, np.full((keys, regions), size, dtype=np.int64)


def test_staged_array_put_stores_what_the_list_put_stores() -> None:
    from mooncake_kvaddr.driver.staging import StagingBuffer
    from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore
    from test_vllm_plugin import FakeMooncake

    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=4096, armed=True)
    cache = StagingBuffer(16 * 2 * 1024)
    store.register_buffer(cache.ptr, cache.nbytes)
    cache.array[:] = np.random.default_rng(1).integers(0, 255, cache.nbytes, dtype=np.uint8)
    addrs, sizes = _matrices(cache, 16, 2, 1024)
    keys = [f"k{i}" for i in range(16)]
    assert store.batch_put_from_multi_buffers(keys, addrs.tolist(), sizes.tolist()) == [0] * 16
    by_lists = dict(inner.objects)
    inner.objects.clear()
    assert store.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, None) == [0] * 16
    assert inner.objects == by_lists and store.stats.staged_puts == 2
    # A key with a slice outside the registered buffers: -600, never stored; the others are.
    inner.objects.clear()
    addrs[4, 1] = cache.ptr + cache.nbytes - 10
    codes = store.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, None)
    assert codes == [0] * 4 + [-600] + [0] * 11
    assert sorted(inner.objects) == sorted(k for k in keys if k != "k4")
    # Rows staging does not take (uint64): the list put of the wrapped store, same bytes.
    inner.objects.clear()
    configs: list[Any] = []
    real_put = inner.batch_put_from_multi_buffers

    def put(keys: list[str], addrs: Any, sizes: Any, config: Any = None) -> list[int]:
        configs.append(config)
        return real_put(keys, addrs, sizes, config)

    inner.batch_put_from_multi_buffers = put  # type: ignore[method-assign]
    config = object()
    codes = store.batch_put_from_multi_buffers_arrays(keys[:4], addrs[:4].astype(np.uint64), sizes[:4], config)
    assert codes == [0] * 4
    assert inner.objects == {k: by_lists[k] for k in keys[:4]} and store.stats.passthrough_puts == 1
    assert configs == [config]  # the replicate config goes with the passed-through put


class _PutClient:
    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.calls: list[Any] = []

    def batch_put_from_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, config: Any) -> list[int]:
        if self.refuse:
            raise ValueError("refused")
        self.calls.append((keys, addrs, sizes, config))
        return [0] * len(keys)


class _PutRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def batch_put_from_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, config: Any) -> Any:
        self.calls.append((list(keys), addrs, sizes, config))
        return [0] * len(keys)


@pytest.mark.parametrize("client", ["native", "refusing", "none"])
def test_native_array_put_dispatch_and_fallback(client: str) -> None:
    """The native client gets the matrices and the config; without one (or when it refuses them) Mooncake's
    bound put gets value-equal rows of Python ints and the same config; -600 for a slice outside."""
    from mooncake_kvaddr.driver.staging import StagingBuffer
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    bound = _PutRecorder()
    store = NativeMooncakeStore(bound, armed=False)
    fake = None if client == "none" else _PutClient(client == "refusing")
    store._client = fake
    cache = StagingBuffer(4 * 3 * 256)
    addrs, sizes = _matrices(cache, 4, 3, 256)
    config = object()
    keys = ["a", "b", "c", "d"]
    assert store.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, config) == [0] * 4
    if client == "native":
        assert fake is not None and fake.calls[0][1] is addrs and fake.calls[0][3] is config and not bound.calls
    else:
        sent_keys, rows, size_rows, got_config = bound.calls[0]
        assert sent_keys == keys and got_config is config and rows == addrs.tolist() and size_rows == sizes.tolist()
        assert all(type(v) is int for r in rows + size_rows for v in r)
    armed = NativeMooncakeStore(_PutRecorder(), armed=True)
    armed._client = None
    assert armed.register_buffer(cache.ptr, cache.nbytes) == 0
    addrs[2, 0] = cache.ptr - 4096
    assert armed.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, config) == [0, 0, -600, 0]
    assert armed.wrapped.calls[0][0] == ["a", "b", "d"]


class _RangesClient:
    """A native client that records the ranges each array put gets (None: sent unguarded)."""

    def __init__(self) -> None:
        self.ranges: list[Any] = []

    def batch_put_from_multi_buffers(
        self, keys: Any, addrs: Any, sizes: Any, config: Any, ranges: Any = None
    ) -> list[int]:
        self.ranges.append(ranges)
        return [0] * len(keys)

    def last_refused(self) -> int:
        return 0


def test_armed_native_array_put_sends_the_guards_ranges() -> None:
    """Armed, the array put goes to the native client with the registered ranges: it checks every slice itself
    (a call without them would let a slice outside the registered buffers reach Mooncake)."""
    from mooncake_kvaddr.driver.staging import StagingBuffer
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    bound = _PutRecorder()
    store = NativeMooncakeStore(bound, armed=True)
    client = _RangesClient()
    store._client = client
    cache = StagingBuffer(4 * 3 * 256)
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    addrs, sizes = _matrices(cache, 4, 3, 256)
    assert store.batch_put_from_multi_buffers_arrays(["a", "b", "c", "d"], addrs, sizes, None) == [0] * 4
    assert len(client.ranges) == 1 and client.ranges[0] is not None and not bound.calls
    # The guard's one range set (converted once per registration): the registered buffer, and nothing else.
    from mooncake_kvaddr import _native

    sent = client.ranges[0]
    assert isinstance(sent, _native.MemoryRanges) and len(sent) == 1

    def inside(addr: int, size: int) -> bool:
        one = np.array([[addr]], dtype=np.int64), np.array([[size]], dtype=np.int64)
        return bool(_native.slices_inside(*one, sent).all())

    assert inside(cache.ptr, cache.nbytes) and not inside(cache.ptr - 1, 1) and not inside(cache.ptr, cache.nbytes + 1)


@pytest.mark.mooncake
def test_the_send_bench_section_runs_and_stores(master: Any) -> None:
    """The bench's send section on the quick request through a real master: every variant stores every key,
    the plugin's variants through our handler, the default one through the native client where it exists."""
    from mooncake_kvaddr.bench import vllm_send

    rows = vllm_send.run(quick=True, reps=1, master_address=master.rpc_address)
    assert [row["variant"] for row in rows] == list(vllm_send.VARIANTS)
    assert all(row["stored_ok"] and row["cpu_gil_ms"] > 0 and row["wall_ms"] > 0 for row in rows)
    assert [row["fast_path"] for row in rows] == [0, 2, 2, 2]
    assert not rows[2]["native_client"] and not rows[3]["native_client"]


class _OwnHex(bytes):
    """A bytes subclass with its own ``.hex()``: vLLM keys it by that, not by its bytes."""

    def hex(self, *args: Any) -> str:  # type: ignore[override]
        return "own" + super().hex(*args)


@pytest.mark.parametrize("odd", ["numpy", "own_hex"])
def test_hash_types_vllm_keys_otherwise_go_to_vllms_handler(handler: Any, odd: str) -> None:
    """Numpy-array hashes (vLLM raises AttributeError) and bytes subclasses with their own ``.hex()`` (vLLM
    stores under other keys): every store call, record and exception is vLLM's (issue 39 item 2)."""
    convert = {"numpy": lambda h: np.frombuffer(h, dtype=np.uint8), "own_hex": _OwnHex}[odd]
    rng = random.Random(39)
    raised = 0
    before = handler.stats.fallback_requests
    for number in range(40):
        case = send_check.make_case(data_module, rng, number)
        case["meta"].block_hashes = [convert(h) for h in case["meta"].block_hashes]
        plain, arrays = send_check.RecordingStore, send_check.ArrayRecordingStore
        expected = send_check.run_once(worker_module, ORIGINAL, plain(case["answers"](1)), case)
        actual = send_check.run_once(worker_module, handler, arrays(case["answers"](1)), case)
        assert expected == actual, (number, expected, actual)
        raised += "AttributeError" in repr(expected)
    assert (raised > 0) == (odd == "numpy")
    assert handler.stats.fallback_requests - before >= 20
