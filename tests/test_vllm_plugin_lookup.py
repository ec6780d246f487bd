"""The plugin's ``MooncakeStoreWorker.lookup`` against vLLM 0.33's own (imported, never copied).

Both run on twin stand-in workers (what the method reads: coordinator, databases, lookup prefixes, store, the
record callback) over generated group mixes, masks, coarse and fine-grained lookups and stores; every result,
every store call (the keys, in order), every recorded operation and every exception must be equal. Stores that
answer oddly (a MagicMock, short or long result lists, numpy codes, floats) and stores that raise are included.
With the native client, the keys reach Mooncake as one blob and the result is still vLLM's (a real master).
"""

from __future__ import annotations

import dataclasses
import random
import types
import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest

from test_lookup_model import DictStore, Group, Scenario, build, fill_store, hashes_for, random_scenario

pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as worker_module
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker

from mooncake_kvaddr.integrations.vllm import lookup as lookup_module
from mooncake_kvaddr.integrations.vllm import plugin
from mooncake_kvaddr.integrations.vllm.lookup import TRANSPORT_ATTR, make_lookup, plan_lookup
from mooncake_kvaddr.integrations.vllm.releases import v0_33
from test_lookup_vllm import vllm_worker

ORIGINAL = MooncakeStoreWorker.__dict__["lookup"]
ORIGINAL = getattr(ORIGINAL, "__wrapped__", ORIGINAL)


class OddStore:
    """A store whose ``batch_is_exist`` records the keys and answers in one of several forms."""

    def __init__(self, inner: DictStore, form: str) -> None:
        self.inner = inner
        self.form = form
        self.asked: list[list[str]] = []

    def batch_is_exist(self, keys: Any) -> Any:
        self.asked.append(list(keys))
        codes = self.inner.batch_is_exist(self.asked[-1])
        if self.form == "raise":
            raise RuntimeError("store down")
        if self.form == "mock":
            return mock.MagicMock()
        if self.form == "short":
            return codes[:-1]
        if self.form == "long":
            return [*codes, 1, 1]
        if self.form == "numpy":
            return np.asarray(codes, dtype=np.int32)
        if self.form == "tuple":
            return tuple(codes)
        if self.form == "floats":
            return [float(c) for c in codes]
        if self.form == "bools":
            return [c == 1 for c in codes]
        return codes


FORMS = ("list",) * 6 + ("raise", "mock", "short", "long", "numpy", "tuple", "floats", "bools")


def run(func: Any, stub: Any, num_tokens: int, hashes: Any) -> Any:
    try:
        return ("ok", func(stub, num_tokens, hashes))
    except Exception as exc:
        return ("raised", type(exc).__name__)


def twins(sc: Any, store_lookup: Any, inner: DictStore, form: str) -> list[tuple[Any, OddStore, list[Any]]]:
    out = []
    for _ in range(2):
        store = OddStore(inner, form)
        stub = vllm_worker(sc, store_lookup, store)  # type: ignore[arg-type]
        records: list[Any] = []
        stub._record_kv_connector_operation = lambda op, _s, n, _r=records, **kw: _r.append((op, n, sorted(kw.items())))
        out.append((stub, store, records))
    return out


def test_lookup_matches_vllms_on_generated_requests() -> None:
    ours = make_lookup(ORIGINAL, worker_module)
    rng = random.Random(2033)
    compared = 0
    forms_seen: set[str] = set()
    while compared < 10_000:
        sc = random_scenario(rng)
        sc.masks = None  # vLLM derives its own masks
        store_lookup = build(sc)
        hashes: Any = hashes_for(sc.n_hashes, rng.randrange(256))
        if rng.random() < 0.1:
            hashes = [memoryview(h) for h in hashes]  # any bytes-like hash
        inner, _ = fill_store(rng, sc, store_lookup, hashes)
        form = rng.choice(FORMS)
        forms_seen.add(form)
        (theirs_stub, theirs_store, theirs_records), (our_stub, our_store, our_records) = twins(
            sc, store_lookup, inner, form
        )
        if rng.random() < 0.03:
            theirs_stub._capacity_only = our_stub._capacity_only = True
        for num_tokens in sorted(rng.sample(range(sc.n_hashes * sc.hbs + sc.hbs), k=min(8, sc.n_hashes * sc.hbs + 1))):
            expected = run(ORIGINAL, theirs_stub, num_tokens, hashes)
            got = run(ours, our_stub, num_tokens, hashes)
            assert got == expected, (sc, form, num_tokens)
            assert our_store.asked == theirs_store.asked, (sc, form, num_tokens)
            assert our_records == theirs_records, (sc, form, num_tokens)
            compared += 1
    assert forms_seen == set(FORMS)
    assert ours.stats.fast > ours.stats.fallback  # type: ignore[attr-defined]


def test_prefixes_of_every_kind_and_empty_requests_match() -> None:
    ours = make_lookup(ORIGINAL, worker_module)
    rng = random.Random(7)
    sc = random_scenario(rng)
    sc.masks = None
    store_lookup = build(sc)
    hashes = hashes_for(sc.n_hashes, 3)
    inner, _ = fill_store(rng, sc, store_lookup, hashes)
    for prefixes in ((), ("ü/model/ß",), ("模型/tp0", "模型/tp1"), ("a" * 300,)):
        pair = twins(sc, store_lookup, inner, "list")
        for stub, _, _ in pair:
            stub._lookup_key_prefixes = tuple(prefixes for _ in sc.groups)
        for num_tokens, hs in ((0, hashes), (sc.hbs * 2, hashes), (sc.hbs * 2, []), (-5, hashes)):
            assert run(ours, pair[1][0], num_tokens, hs) == run(ORIGINAL, pair[0][0], num_tokens, hs)
            assert pair[1][1].asked == pair[0][1].asked
            assert pair[1][2] == pair[0][2]


def test_a_hash_vllm_refuses_goes_to_vllms_lookup() -> None:
    ours = make_lookup(ORIGINAL, worker_module)
    rng = random.Random(11)
    sc = Scenario(2, [Group("full", 4)], None, 8, None)
    store_lookup = build(sc)
    hashes: list[Any] = list(hashes_for(sc.n_hashes, 5))
    inner, _ = fill_store(rng, sc, store_lookup, hashes)
    hashes[1] = "not bytes"  # no buffer: vLLM's own method answers (here: str has no .hex())
    (theirs_stub, theirs_store, _), (our_stub, our_store, _) = twins(sc, store_lookup, inner, "list")
    before = ours.stats.fallback  # type: ignore[attr-defined]
    num_tokens = 12
    assert run(ours, our_stub, num_tokens, hashes) == run(ORIGINAL, theirs_stub, num_tokens, hashes)
    assert our_store.asked == theirs_store.asked
    assert ours.stats.fallback == before + 1  # type: ignore[attr-defined]


def test_plan_lists_exactly_vllms_candidate_keys() -> None:
    rng = random.Random(5)
    for _ in range(200):
        sc = random_scenario(rng)
        sc.masks = None
        store_lookup = build(sc)
        hashes = hashes_for(sc.n_hashes, rng.randrange(256))
        inner, _ = fill_store(rng, sc, store_lookup, hashes)
        (theirs, theirs_store, _), (stub, _, _) = twins(sc, store_lookup, inner, "list")
        num_tokens = rng.randint(1, sc.n_hashes * sc.hbs + sc.hbs)
        run(ORIGINAL, theirs, num_tokens, hashes)  # may raise after its store call (a prompt past the hashes)
        token_len = stub.coord.align_lookup_length(num_tokens)
        if not hashes or token_len <= 0:
            continue
        plan = plan_lookup(stub, token_len, hashes, worker_module.cdiv)
        keys = plan.key_list()
        assert [keys] == theirs_store.asked or (not keys and not theirs_store.asked)
        blob = plan.key_blob()
        assert [bytes(blob.data[blob.offsets[i] : blob.offsets[i + 1]]).decode() for i in range(len(blob))] == keys


def test_key_blob_of_several_groups_is_their_concatenation() -> None:
    hashes = [bytes([i, 7]) * 4 for i in range(5)]
    plan = lookup_module.LookupUnits([(0, hashes[:3], ("p/ä", "q")), (2, hashes[3:], ("r",)), (3, [], ("s",))])
    blob = plan.key_blob()
    keys = [bytes(blob.data[blob.offsets[i] : blob.offsets[i + 1]]).decode() for i in range(len(blob))]
    assert keys == plan.key_list() == [f"{p}@{h.hex()}" for h in hashes[:3] for p in ("p/ä", "q")] + [
        f"r@{h.hex()}" for h in hashes[3:]
    ]
    assert blob.offsets.dtype == np.int64 and blob.offsets[0] == 0 and blob.offsets[-1] == len(blob.data)


def test_patch_replaces_the_lookup_and_env_keeps_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.unpatch()
    try:
        report = plugin.patch()
        assert "MooncakeStoreWorker.lookup" in report.patched, report
        assert MooncakeStoreWorker.lookup.__wrapped__ is ORIGINAL  # type: ignore[attr-defined]
        plugin.unpatch()
        assert MooncakeStoreWorker.__dict__["lookup"] is ORIGINAL
        monkeypatch.setenv(lookup_module.ENV_LOOKUP, "0")
        report = plugin.patch()
        assert report.active and "MooncakeStoreWorker.lookup" not in report.patched
        assert MooncakeStoreWorker.__dict__["lookup"] is ORIGINAL
    finally:
        plugin.unpatch()


def test_a_changed_lookup_body_keeps_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.unpatch()
    table = {release: dict(prints) for release, prints in v0_33.FINGERPRINTS.items()}
    for prints in table.values():
        prints["MooncakeStoreWorker.lookup"] = "0" * 16
    monkeypatch.setattr(v0_33, "RELEASE", dataclasses.replace(v0_33.RELEASE, fingerprints=table))
    try:
        report = plugin.patch()
        assert report.active and "MooncakeStoreWorker.lookup" not in report.patched
        assert "MooncakeStoreWorker.lookup is not the function" in report.lookup_reason
        assert MooncakeStoreWorker.__dict__["lookup"] is ORIGINAL
    finally:
        plugin.unpatch()


# --- the native client: one key blob, the answers of vLLM's list call ---------------------------------------


@pytest.fixture(scope="module")
def raw_store(master: Any) -> Iterator[Any]:
    import mooncake.store as ms

    store = ms.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.rpc_address) == 0
    yield store
    store.close()


@pytest.mark.mooncake
@pytest.mark.parametrize("staged", [False, True])
def test_native_client_lookup_sends_one_blob_and_matches_vllm(raw_store: Any, staged: bool) -> None:
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
    from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

    native = NativeMooncakeStore(raw_store, armed=True)
    if native.native_client is None:
        pytest.skip("no native client for this Mooncake wheel")  # the wheel matrix covers the verified ones
    transport: Any = StagedMooncakeStore(native, staging_bytes=1 << 16, armed=True) if staged else native
    ours = make_lookup(ORIGINAL, worker_module)
    rng = random.Random(99 + staged)
    checked = 0
    for _ in range(12):
        sc = random_scenario(rng)
        sc.masks = None
        store_lookup = build(sc)
        tag = uuid.uuid4().hex[:8]
        store_lookup.prefixes = [[f"{p}-{tag}" for p in ps] for ps in store_lookup.prefixes]
        hashes = hashes_for(sc.n_hashes, rng.randrange(256))
        inner, _ = fill_store(rng, sc, store_lookup, hashes)
        for key, code in inner.codes.items():
            if code == 1:
                assert raw_store.put(key, b"x") == 0
        theirs = vllm_worker(sc, store_lookup, raw_store)  # type: ignore[arg-type]
        mine = vllm_worker(sc, store_lookup, raw_store)  # type: ignore[arg-type]
        mine.__dict__[TRANSPORT_ATTR] = (raw_store, transport)
        for num_tokens in range(1, sc.n_hashes * sc.hbs + sc.hbs, max(1, sc.hbs // 2)):
            calls, blobs = native.stats.native_calls, ours.stats.blob_calls  # type: ignore[attr-defined]
            assert ours(mine, num_tokens, hashes) == ORIGINAL(theirs, num_tokens, hashes)
            if ours.stats.blob_calls > blobs:  # type: ignore[attr-defined]
                assert native.stats.native_calls == calls + 1
                checked += 1
    assert checked > 20
    # A worker whose transport wraps another store than the one it holds: vLLM's store, str keys.
    other = vllm_worker(sc, store_lookup, raw_store)  # type: ignore[arg-type]
    other.__dict__[TRANSPORT_ATTR] = (object(), transport)
    blobs = ours.stats.blob_calls  # type: ignore[attr-defined]
    ours(other, sc.n_hashes * sc.hbs, hashes)
    assert ours.stats.blob_calls == blobs  # type: ignore[attr-defined]


def test_a_worker_without_our_transport_uses_its_own_store() -> None:
    stub = types.SimpleNamespace(store=object())
    assert lookup_module._native_transport(stub) is None


@pytest.mark.mooncake
def test_the_lookup_bench_section_runs_and_agrees() -> None:
    from mooncake_kvaddr.bench import vllm_lookup

    rows = vllm_lookup.run(quick=True, reps=1)
    assert [row["variant"] for row in rows] == list(vllm_lookup.VARIANTS)
    assert all(row["hit_ok"] and row["cpu_gil_ms"] > 0 and row["wall_ms"] > 0 for row in rows)


@pytest.mark.parametrize("token_len", [6, 7])
def test_a_fine_grained_plan_never_probes_a_partly_covered_hash_unit(token_len: int) -> None:
    """Fine-grained (partial-hash) plans probe ``token_len // hash_block_size`` hash units per group, as vLLM's
    lookup does: a unit the tokens only partly cover is never asked for (fresh mutant M11-14 rounded up). The
    lookup itself always plans an aligned length; ``plan_lookup`` is given the unaligned one here."""
    sc = Scenario(2, [Group("full", 2), Group("mamba", 4)], None, 8, None)
    store_lookup = build(sc)
    hashes = hashes_for(sc.n_hashes, 9)
    inner, _ = fill_store(random.Random(3), sc, store_lookup, hashes)
    (stub, _, _), _ = twins(sc, store_lookup, inner, "list")
    assert stub.coord.enable_partial_hash_hits
    plan = plan_lookup(stub, token_len, hashes, worker_module.cdiv)
    expected = [f"{p}@{h.hex()}" for g in range(2) for h in hashes[:3] for p in stub._lookup_key_prefixes[g]]
    assert plan.key_list() == expected and len(expected) == 6


def test_a_transport_without_a_live_native_client_leaves_the_lookup_to_vllms_store() -> None:
    """Our transport pair around the worker's own store, but its native-client wrapper has no native client
    (a store that is not Mooncake's): vLLM's store answers, not the wrapper."""
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    class NotMooncake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

    store = NotMooncake()
    native = NativeMooncakeStore(store)
    assert native.native_client is None
    worker = types.SimpleNamespace(store=store)
    worker.__dict__[TRANSPORT_ATTR] = (store, native)
    assert lookup_module._native_transport(worker) is None


def test_each_fallback_to_vllms_lookup_is_counted_under_its_reason() -> None:
    """``stats.reasons`` counts the lookups handed to vLLM's own method by reason, one per lookup."""
    asked: list[int] = []

    def original(self: Any, num_tokens: int, block_hashes: Any) -> str:
        asked.append(num_tokens)
        return "vllm's answer"

    ours = make_lookup(original, worker_module)
    stub = types.SimpleNamespace(_capacity_only=True)
    assert ours(stub, 16, [b"h"]) == ours(stub, 32, [b"h"]) == "vllm's answer"
    assert asked == [16, 32]
    assert ours.stats.fallback == 2 and ours.stats.reasons == {"capacity-only worker": 2}  # type: ignore[attr-defined]


def test_the_lookup_records_the_duration_of_its_existence_call_answered_or_raising() -> None:
    """``lookup_exists`` is recorded with the call's own duration (seconds since it started, not a clock
    reading), both when the store answers and when it raises."""
    ours = make_lookup(ORIGINAL, worker_module)
    rng = random.Random(13)
    sc = Scenario(2, [Group("full", 4)], None, 8, None)
    store_lookup = build(sc)
    hashes = hashes_for(sc.n_hashes, 5)
    inner, _ = fill_store(rng, sc, store_lookup, hashes)
    (_, (stub, store, _)) = twins(sc, store_lookup, inner, "list")
    durations: list[tuple[str, float, dict[str, Any]]] = []
    stub._record_kv_connector_operation = lambda op, seconds, n, **kw: durations.append((op, seconds, kw))
    assert run(ours, stub, 12, hashes)[0] == "ok"

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("master gone")

    store.batch_is_exist = broken
    assert run(ours, stub, 12, hashes)[0] == "ok"
    assert [(op, kw.get("status")) for op, _, kw in durations] == [("lookup_exists", None), ("lookup_exists", "error")]
    assert all(0.0 <= seconds < 60.0 for _, seconds, _ in durations), durations


class _OwnHex(bytes):
    """A bytes subclass with its own ``.hex()``: vLLM keys it by that, not by its bytes."""

    def hex(self, *args: Any) -> str:  # type: ignore[override]
        return "own" + super().hex(*args)


@pytest.mark.parametrize("odd", ["numpy", "own_hex", "bytearray"])
def test_hash_types_vllm_keys_otherwise_get_vllms_answer(odd: str) -> None:
    """A numpy-array hash (vLLM: AttributeError, no ``.hex()``), a bytes subclass with its own ``.hex()`` (vLLM:
    other keys) and a bytearray: the same result, store calls and exception as vLLM's lookup (issue 39 item 2;
    our native keys read any buffer before). Exact bytes and memoryviews stay on the fast path."""
    ours = make_lookup(ORIGINAL, worker_module)
    rng = random.Random(39)
    sc = Scenario(2, [Group("full", 4)], None, 8, None)
    store_lookup = build(sc)
    hashes: list[Any] = list(hashes_for(sc.n_hashes, 6))
    inner, _ = fill_store(rng, sc, store_lookup, hashes)
    convert = {"numpy": lambda h: np.frombuffer(h, dtype=np.uint8), "own_hex": _OwnHex, "bytearray": bytearray}[odd]
    hashes = [convert(h) for h in hashes]
    (theirs_stub, theirs_store, theirs_records), (our_stub, our_store, our_records) = twins(
        sc, store_lookup, inner, "list"
    )
    before = ours.stats.fallback  # type: ignore[attr-defined]
    expected = run(ORIGINAL, theirs_stub, 12, hashes)
    assert run(ours, our_stub, 12, hashes) == expected
    assert expected[0] == ("raised" if odd == "numpy" else "ok")
    assert our_store.asked == theirs_store.asked and our_records == theirs_records
    assert ours.stats.fallback == before + 1  # type: ignore[attr-defined]
    fast = ours.stats.fast  # type: ignore[attr-defined]
    hashes = [memoryview(bytes(h)) for h in hashes]
    assert run(ours, our_stub, 12, hashes) == run(ORIGINAL, theirs_stub, 12, hashes)
    assert ours.stats.fast == fast + 1  # type: ignore[attr-defined]
