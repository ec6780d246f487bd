"""The peer probe before loads that Mooncake writes into the KV cache itself (docs/multihost.md, "Hung peer").

A :class:`~mooncake_kvaddr.driver.transfer.KVTransfer` in the multi-buffer and direct paths runs on a real
:class:`MooncakeStore` whose client is the in-memory stand-in of ``tests/fake_mooncake.py``, given a replica
query that places every key on one of two peers. Checked, in real time where a call blocks on an Event:

* a new peer is probed once (one small ``batch_get_into`` into the probe's own buffer), then remembered;
  a failed get forgets it; with the probe off, or with Mooncake copying in memory, nothing is probed;
* a probe that hangs costs the load its deadline: it returns then, every chunk failed, no multi-buffer or
  direct call made, no block written; the abandoned probe ends when its call returns;
* a peer whose probe fails ``transfer_failed`` gets none of its keys handed to Mooncake; the other peer's
  keys load;
* a client without the replica query loads as before, unprobed.

The same rule across real network namespaces: ``tests/test_multihost.py`` (the never-contacted hung peer).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from fake_mooncake import FakeMooncake, fake_store
from kvaddr_testing import Cache, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr.driver import store_calls
from mooncake_kvaddr.driver.errors import StoreClosedError, StoreError
from mooncake_kvaddr.driver.outcomes import BatchResult, _Op
from mooncake_kvaddr.driver.probe import PROBE_MAX_BYTES, PeerProbe
from mooncake_kvaddr.driver.rules import estimate_staging_bytes
from mooncake_kvaddr.driver.store import MooncakeStore, RequestDeadline
from mooncake_kvaddr.driver.transfer import KVTransfer, LoadResult, TransferRequest

BS = 16
CHUNKS = 12
BLOCK_BYTES = 512
SENTINEL = 0xA5
IDS = list(range(1, CHUNKS + 1))
PEERS = ("10.0.0.1:15000", "10.0.0.2:15000")
#: Regions per key: the multi-buffer path needs several, the direct path exactly one.
MODES = {"multi_buffer": 2, "direct": 1}
PROBE_THREAD = "KVTransferPeerProbe"


def _side(key: str) -> int:
    """Which of the two peers holds ``key`` by default (deterministic, unlike ``hash``)."""
    return zlib.crc32(key.encode()) % 2


def _replica(endpoint: str, size: int) -> Any:
    """A stand-in for Mooncake's ReplicaDescriptor of a memory replica."""
    where = SimpleNamespace(transport_endpoint=endpoint, size=size, buffer_address=0)
    memory = SimpleNamespace(buffer_descriptor=where)
    return SimpleNamespace(is_memory_replica=lambda: True, get_memory_descriptor=lambda: memory)


def give_replica_query(client: FakeMooncake, place: Any = None) -> list[list[str]]:
    """Give the stand-in Mooncake's ``batch_get_replica_desc``: key -> peer by ``place(key)`` (default: by
    the key's hash, two peers). Returns the list its calls are recorded in."""
    queries: list[list[str]] = []

    def where(key: str) -> str:
        return place(key) if place is not None else PEERS[_side(key)]

    def batch_get_replica_desc(keys: list[str]) -> dict[str, list[Any]]:
        queries.append(list(keys))
        return {k: [_replica(where(k), len(client.objects[k]))] for k in keys if k in client.objects}

    client.batch_get_replica_desc = batch_get_replica_desc  # type: ignore[attr-defined]
    return queries


class Rig:
    def __init__(self, store: MooncakeStore, client: FakeMooncake, mode: str, model: str) -> None:
        self.store, self.client, self.mode, self.model = store, client, mode, model
        self.regions = MODES[mode]
        self.src = Cache(self.regions, CHUNKS + 1, BLOCK_BYTES, seed=1)

    def transfer(self, cache: Cache, **kwargs: Any) -> KVTransfer:
        mode = "auto" if self.mode == "direct" else self.mode
        xfer: KVTransfer = transfer(self.store, self.model, cache, BS, transfer_mode=mode, start_threads=False,
                                    **kwargs)  # fmt: skip
        assert xfer.mode == self.mode
        return xfer

    def request(self) -> TransferRequest:
        return TransferRequest("A", CHUNKS * BS, hashes(f"{self.model}-A", CHUNKS), [IDS])

    def stored(self) -> Rig:
        with self.transfer(self.src, probe_peers=False) as writer:
            assert writer.store(self.request()).ok
        self.client.calls.clear()
        return self

    def names(self) -> list[str]:
        return [name for name, _ in self.client.calls]

    def check(self, result: LoadResult, dst: Cache, loaded: list[int]) -> None:
        """Exactly ``loaded`` chunks loaded and right; every other block untouched (the sentinel)."""
        failed = [b for b in IDS if b not in loaded]
        assert result.loaded_block_ids == set(loaded) and result.failed_block_ids == set(failed), result
        assert sum(result.outcomes.values()) == CHUNKS, result.outcomes
        if loaded:
            assert_blocks_equal(self.src, loaded, dst, loaded)
        for block in dst.blocks(failed):
            assert (block == SENTINEL).all()


@contextmanager
def rig(monkeypatch: pytest.MonkeyPatch, mode: str, model: str, **config: Any) -> Iterator[Rig]:
    with fake_store(monkeypatch, **config) as (store, client):
        monkeypatch.setattr(store_calls, "_now", time.monotonic)
        yield Rig(store, client, mode, model).stored()
    for thread in threading.enumerate():
        if thread.name.startswith(PROBE_THREAD):
            thread.join(5)
    assert not [t for t in threading.enumerate() if t.name.startswith(PROBE_THREAD)], "probe threads outlived"


def _dst(r: Rig) -> Cache:
    return Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)


def _get_call(mode: str) -> str:
    return "batch_get_into_multi_buffers" if mode == "multi_buffer" else "batch_get_into"


@pytest.mark.parametrize("mode", MODES)
def test_a_new_peer_is_probed_once_then_remembered(monkeypatch: pytest.MonkeyPatch, mode: str, model: str) -> None:
    with rig(monkeypatch, mode, model) as r:
        queries = give_replica_query(r.client)
        dst = _dst(r)
        with r.transfer(dst) as reader:
            assert reader.probes_peers  # not copying in memory (an external master): on by default
            first = reader.load(r.request())
            r.check(first, dst, IDS)
            peers = {PEERS[_side(k)] for k in queries[0]}
            # One probe per peer (one key each), then the get of every key.
            assert r.client.calls[: len(peers)] == [("batch_get_into", 1)] * len(peers)
            assert r.client.calls[len(peers) :] == [(_get_call(mode), CHUNKS)]
            assert reader._probe is not None and reader._probe.known == peers
            assert "probe" in first.timings
            r.client.calls.clear()
            second = reader.load(r.request())
            assert second.ok and r.client.calls == [(_get_call(mode), CHUNKS)]  # known peers: no probe
            assert len(queries) == 2  # the master is still asked where the keys are


def test_a_failed_get_forgets_its_peers(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    with rig(monkeypatch, "multi_buffer", model) as r:
        give_replica_query(r.client, lambda key: PEERS[0])
        with r.transfer(_dst(r)) as reader:
            assert reader.load(r.request()).ok
            r.client.fail_fast = True  # every transfer fails -800 now
            assert not reader.load(r.request()).ok
            assert reader._probe is not None and reader._probe.known == frozenset()  # forgotten
            r.client.fail_fast = False
            r.client.calls.clear()
            assert reader.load(r.request()).ok
            assert r.names() == ["batch_get_into", "batch_get_into_multi_buffers"]  # probed again


@pytest.mark.parametrize("mode", MODES)
def test_a_hung_new_peer_costs_the_load_its_deadline(monkeypatch: pytest.MonkeyPatch, mode: str, model: str) -> None:
    with rig(monkeypatch, mode, model, request_timeout_s=0.4) as r:
        give_replica_query(r.client, lambda key: PEERS[0])
        opened, entered = threading.Event(), threading.Event()
        original = r.client.batch_get_into

        def hung_probe(keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            entered.set()
            assert opened.wait(30)
            return original(keys, ptrs, sizes)

        r.client.batch_get_into = hung_probe  # type: ignore[method-assign]
        dst = _dst(r)
        try:
            with r.transfer(dst) as reader:
                t0 = time.monotonic()
                result = reader.load(r.request())
                seconds = time.monotonic() - t0
                assert entered.is_set()
                assert 0.35 <= seconds < 2.5, seconds  # at the deadline, not when the probe returns
                assert result.stopped is not None and "probing peer" in result.stopped, result.stopped
                assert result.outcomes == {"transfer_failed": CHUNKS}, result.outcomes
                assert r.client.calls == []  # nothing reached the stand-in's store: no get wrote the cache
                r.check(result, dst, [])
                probe = reader._probe
                assert probe is not None and probe.calls.abandoned == 1
                opened.set()
                assert probe.calls.wait_settled(5) and probe.calls.abandoned == 0
                r.check(result, dst, [])  # the late probe wrote only its own buffer
                r.client.batch_get_into = original  # type: ignore[method-assign]
                later = reader.load(r.request())
                r.check(later, dst, IDS)
        finally:
            opened.set()


def test_new_loads_stop_at_once_while_abandoned_probes_are_at_their_bound(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    with rig(monkeypatch, "multi_buffer", model, request_timeout_s=0.3, max_abandoned_calls=1) as r:
        give_replica_query(r.client, lambda key: PEERS[0])
        opened = threading.Event()
        original = r.client.batch_get_into

        def hung_probe(*args: Any) -> list[int]:
            assert opened.wait(30)
            return original(*args)

        r.client.batch_get_into = hung_probe  # type: ignore[method-assign]
        try:
            with r.transfer(_dst(r)) as reader:
                assert "probing peer" in (reader.load(r.request()).stopped or "")
                t0 = time.monotonic()
                second = reader.load(r.request())
                assert time.monotonic() - t0 < 0.25  # no wait, no call
                assert second.stopped is not None and "max_abandoned_calls=1" in second.stopped
                assert second.outcomes == {"transfer_failed": CHUNKS}
        finally:
            opened.set()


def test_a_peer_whose_probe_fails_gets_none_of_its_keys(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    with rig(monkeypatch, "multi_buffer", model) as r:
        queries = give_replica_query(r.client)
        original = r.client.batch_get_into
        down = PEERS[1]
        probed: list[str] = []

        def probe(keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            probed.extend(keys)
            if PEERS[_side(keys[0])] == down:
                return [-800]  # the peer does not answer (connection refused)
            return original(keys, ptrs, sizes)

        r.client.batch_get_into = probe  # type: ignore[method-assign]
        dst = _dst(r)
        with r.transfer(dst) as reader:
            result = reader.load(r.request())
        keys = queries[0]
        on_down = [i for i, k in enumerate(keys) if PEERS[_side(k)] == down]
        assert on_down and len(on_down) < CHUNKS, "the hash split put every key on one peer: change the model"
        assert len(probed) == 2
        # The get names only the keys of the answering peer; the others fail untried.
        gets = [call for call in r.client.calls if call[0] != "batch_get_into"]  # the answering peer's probe
        assert gets == [("batch_get_into_multi_buffers", CHUNKS - len(on_down))]
        assert result.outcomes == {"ok": CHUNKS - len(on_down), "transfer_failed": len(on_down)}
        # A load's keys are in chunk order here (rank 0): key i is block i + 1.
        r.check(result, dst, [b for b in IDS if b - 1 not in on_down])


@pytest.mark.parametrize("mode", MODES)
def test_sub_batches_whose_peer_fails_its_probe_leave_the_others_to_load(
    monkeypatch: pytest.MonkeyPatch, mode: str, model: str
) -> None:
    """The disk-offload budget cuts the load into sub-batches of three keys (keys in chunk order at rank 0).
    Every key of the first lies on a peer whose probe fails, and all but one of the second: the first sends
    nothing to Mooncake and is no reason to give up the rest (it is no unreachable master); the second sends
    its one key alone; the later ones load whole."""
    with rig(monkeypatch, mode, model) as r:
        down, up = PEERS
        keys = list(r.client.objects)  # put in chunk order
        on_down = {0, 1, 2, 4, 5}
        place = {k: down if i in on_down else up for i, k in enumerate(keys)}
        give_replica_query(r.client, place.__getitem__)
        original = r.client.batch_get_into

        def probe(keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            if place[keys[0]] == down:
                return [-800]  # the peer does not answer
            return original(keys, ptrs, sizes)

        r.client.batch_get_into = probe  # type: ignore[method-assign]
        dst = _dst(r)
        budget = 3 * estimate_staging_bytes(r.regions * BLOCK_BYTES)
        with r.transfer(dst, disk_offload_buffer_budget_bytes=budget, disk_offload_usable_ratio=1) as reader:
            result = reader.load(r.request())
        gets = [n for name, n in r.client.calls if name == _get_call(mode)]
        # Direct mode: the up peer's one probe read (one key) comes first, then the data gets.
        assert gets[-3:] == [1, 3, 3], gets
        assert result.outcomes == {"ok": CHUNKS - len(on_down), "transfer_failed": len(on_down)}, result.outcomes
        r.check(result, dst, [b for b in IDS if b - 1 not in on_down])


def test_a_key_with_a_replica_on_an_answering_peer_goes_ahead(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    """Keys on the first peer alone, on the second alone, and on both. Each peer is probed with a key it holds
    alone (a key both hold could be read from the other peer, proving nothing); the second peer's probe fails
    ``transfer_failed``. Its own keys fail untried; the keys both hold go to Mooncake with the first peer's
    (Mooncake picks the replica)."""
    with rig(monkeypatch, "multi_buffer", model) as r:
        queries: list[list[str]] = []
        # The stored keys in chunk order, by thirds: the first peer alone, the second alone, both.
        holders = {k: PEERS if i % 3 == 2 else (PEERS[i % 3],) for i, k in enumerate(r.client.objects)}

        def batch_get_replica_desc(keys: list[str]) -> dict[str, list[Any]]:
            queries.append(list(keys))
            objects = r.client.objects
            return {k: [_replica(p, len(objects[k])) for p in holders[k]] for k in keys if k in objects}

        r.client.batch_get_replica_desc = batch_get_replica_desc  # type: ignore[attr-defined]
        original = r.client.batch_get_into
        probed: list[str] = []

        def probe(keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            probed.extend(keys)
            if holders[keys[0]] != (PEERS[0],):
                return [-800]  # only a key held by the first peer alone is read from an answering peer
            return original(keys, ptrs, sizes)

        r.client.batch_get_into = probe  # type: ignore[method-assign]
        dst = _dst(r)
        with r.transfer(dst) as reader:
            result = reader.load(r.request())
        keys = queries[0]
        down_only = [i for i, k in enumerate(keys) if holders[k] == (PEERS[1],)]
        both = [i for i, k in enumerate(keys) if len(holders[k]) == 2]
        assert len(down_only) == len(both) == CHUNKS // 3
        assert sorted(holders[k] for k in probed) == [(PEERS[0],), (PEERS[1],)]  # each peer with a key of its own
        gets = [call for call in r.client.calls if call[0] != "batch_get_into"]
        assert gets == [("batch_get_into_multi_buffers", CHUNKS - len(down_only))]
        assert result.outcomes == {"ok": CHUNKS - len(down_only), "transfer_failed": len(down_only)}
        r.check(result, dst, [b for b in IDS if b - 1 not in down_only])


def test_a_key_merely_not_found_keeps_its_peer_known(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    """Only a transfer failure forgets a peer: a key the master still places on a known peer but that the get
    no longer finds (evicted meanwhile) fails ``not_found`` and the peer stays known, unprobed next time."""
    with rig(monkeypatch, "multi_buffer", model) as r:
        # The master's answer may be stale: it places every key, present or not, on the first peer.
        r.client.batch_get_replica_desc = (  # type: ignore[attr-defined]
            lambda keys: {k: [_replica(PEERS[0], 2 * BLOCK_BYTES)] for k in keys}
        )
        with r.transfer(_dst(r)) as reader:
            assert reader.load(r.request()).ok
            assert reader._probe is not None and reader._probe.known == {PEERS[0]}
            del r.client.objects[sorted(r.client.objects)[0]]
            r.client.calls.clear()
            result = reader.load(r.request())
            assert result.outcomes == {"ok": CHUNKS - 1, "not_found": 1}, result.outcomes
            assert r.names() == ["batch_get_into_multi_buffers"]  # the peer is known: no probe
            assert reader._probe.known == {PEERS[0]}
            r.client.calls.clear()
            assert reader.load(r.request()).outcomes == {"ok": CHUNKS - 1, "not_found": 1}
            assert r.names() == ["batch_get_into_multi_buffers"]  # still known: still no probe


@pytest.mark.parametrize("setting", ["probe_peers=False", "local_copy=True"])
def test_no_probe_when_off_or_copying_in_memory(monkeypatch: pytest.MonkeyPatch, model: str, setting: str) -> None:
    name, _ = setting.split("=")
    with rig(monkeypatch, "multi_buffer", model) as r:
        queries = give_replica_query(r.client)
        with r.transfer(_dst(r), **{name: name == "local_copy"}) as reader:
            assert not reader.probes_peers
            assert reader.load(r.request()).ok
        assert queries == [] and r.names() == ["batch_get_into_multi_buffers"]


def test_staged_loads_are_not_probed(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    with rig(monkeypatch, "multi_buffer", model) as r:
        give_replica_query(r.client)
        dst = _dst(r)
        xfer = transfer(r.store, model, dst, BS, transfer_mode="staged", start_threads=False)
        with xfer:
            assert xfer.mode == "staged" and not xfer.probes_peers


def test_a_client_without_the_replica_query_loads_unprobed(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    with rig(monkeypatch, "multi_buffer", model) as r:
        assert r.store.replica_locations(["x"]) is None
        dst = _dst(r)
        with r.transfer(dst) as reader:
            assert reader.probes_peers
            r.check(reader.load(r.request()), dst, IDS)
            r.check(reader.load(r.request()), dst, IDS)
        assert r.names() == ["batch_get_into_multi_buffers"] * 2


def test_replica_locations_reads_mooncake_descriptors(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    with rig(monkeypatch, "multi_buffer", model) as r:
        give_replica_query(r.client, lambda key: PEERS[1])
        key = next(iter(r.client.objects))
        size = len(r.client.objects[key])
        assert r.store.replica_locations([key, "missing"]) == [((PEERS[1], size),), ()]
        assert r.store.replica_locations([]) == []
        with pytest.raises(TypeError):
            r.store.replica_locations("not a list of keys")  # type: ignore[arg-type]


def test_a_failing_replica_query_lets_the_get_go_ahead(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    with rig(monkeypatch, "multi_buffer", model) as r:

        def broken(keys: list[str]) -> dict[str, list[Any]]:
            raise RuntimeError("master hiccup")

        r.client.batch_get_replica_desc = broken  # type: ignore[attr-defined]
        dst = _dst(r)
        with r.transfer(dst) as reader:
            r.check(reader.load(r.request()), dst, IDS)
        assert r.names() == ["batch_get_into_multi_buffers"]


@pytest.mark.parametrize("name", ["probe_peers", "local_copy"])
def test_the_switches_take_booleans_only(monkeypatch: pytest.MonkeyPatch, model: str, name: str) -> None:
    with rig(monkeypatch, "multi_buffer", model) as r:
        with pytest.raises(TypeError, match=name):
            r.transfer(_dst(r), **{name: "false"})  # vLLM-style configs read "false" as true: refused


class _ProbeStore:
    """What :class:`PeerProbe` asks of a store, scripted: the replica answer, and the probe read's behaviour."""

    def __init__(self, located: list[tuple[tuple[str, int], ...]]) -> None:
        self.located = located
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.reads: list[str] = []
        self.read: Callable[[str, int, RequestDeadline], list[int]] = lambda key, n, deadline: [n]
        self.register_error: StoreError | None = None
        self.query_gate: threading.Event | None = None

    def replica_locations(self, keys: list[str]) -> list[tuple[tuple[str, int], ...]]:
        if self.query_gate is not None:
            self.query_gate.wait(10)
        return self.located

    def register_buffer(self, ptr: int, size: int) -> None:
        if self.register_error is not None:
            raise self.register_error
        self.registered.append(ptr)

    def unregister_buffer(self, ptr: int) -> None:
        self.unregistered.append(ptr)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int], **kw: Any) -> BatchResult:
        self.reads.append(keys[0])
        return BatchResult._build(_Op.GET, self.read(keys[0], sizes[0], kw["deadline"]))


def _probe_with(store: _ProbeStore) -> PeerProbe:
    return PeerProbe(store, max_abandoned=2)


def test_a_peer_holding_only_objects_too_large_to_probe_is_not_proven_and_its_keys_go_ahead() -> None:
    store = _ProbeStore([(("p1", PROBE_MAX_BYTES + 1),), (("p2", 64),)])
    probe = _probe_with(store)
    try:
        screen = probe.screen(["big", "small"], RequestDeadline(5.0))
    finally:
        probe.close()
    assert not screen.stop and screen.allowed is None and screen.endpoints == [("p1",), ("p2",)]
    assert store.reads == ["small"] and probe.probes == 1 and probe.known == {"p2"}


def test_an_object_of_exactly_the_probe_limit_is_probed() -> None:
    """PROBE_MAX_BYTES is the largest object a probe reads, itself included."""
    store = _ProbeStore([(("p1", PROBE_MAX_BYTES),)])
    probe = _probe_with(store)
    try:
        screen = probe.screen(["edge"], RequestDeadline(5.0))
    finally:
        probe.close()
    assert not screen.stop and screen.allowed is None
    assert store.reads == ["edge"] and probe.probes == 1 and probe.known == {"p1"}


def test_a_short_probe_read_does_not_prove_its_peer() -> None:
    """A probe read that answers fewer bytes than the object holds is no proof that the peer answers: the peer
    stays unknown (probed again next time) and is not found down (its keys go ahead and meet the get)."""
    store = _ProbeStore([(("p1", 64),)])
    store.read = lambda key, n, deadline: [n - 1]
    probe = _probe_with(store)
    try:
        first = probe.screen(["k"], RequestDeadline(5.0))
        assert probe.known == frozenset()
        second = probe.screen(["k"], RequestDeadline(5.0))
    finally:
        probe.close()
    for screen in (first, second):
        assert not screen.stop and screen.allowed is None and screen.endpoints == [("p1",)]
    assert store.reads == ["k", "k"] and probe.probes == 2 and probe.known == frozenset()


def test_a_probe_read_that_raises_store_error_lets_the_get_meet_it_and_releases_the_buffer() -> None:
    store = _ProbeStore([(("p1", 64),)])

    def fail(key: str, n: int, deadline: RequestDeadline) -> list[int]:
        raise StoreClosedError("closed meanwhile")

    store.read = fail
    probe = _probe_with(store)
    try:
        screen = probe.screen(["k"], RequestDeadline(5.0))
    finally:
        probe.close()
    # Not proven (so probed again next time), not found down (the get goes ahead and meets the error itself).
    assert not screen.stop and screen.allowed is None and probe.known == frozenset()
    assert len(store.registered) == 1 and store.unregistered == store.registered


def test_a_probe_buffer_mooncake_will_not_register_is_probed_anyway_and_never_unregistered() -> None:
    store = _ProbeStore([(("p1", 64),)])
    store.register_error = StoreError("overlaps a registered range", -600)
    probe = _probe_with(store)
    try:
        screen = probe.screen(["k"], RequestDeadline(5.0))
    finally:
        probe.close()
    assert not screen.stop and probe.known == {"p1"} and store.reads == ["k"]
    assert store.registered == store.unregistered == []


def test_a_deadline_passing_between_two_new_peers_stops_before_the_second_probe() -> None:
    store = _ProbeStore([(("p1", 64),), (("p2", 64),)])

    def read_then_expire(key: str, n: int, deadline: RequestDeadline) -> list[int]:
        deadline.stop("stopped by the test")
        return [n]

    store.read = read_then_expire
    probe = _probe_with(store)
    deadline = RequestDeadline(5.0)
    try:
        screen = probe.screen(["a", "b"], deadline)
    finally:
        probe.close()
    assert screen.stop and store.reads == ["a"] and deadline.reason == "stopped by the test"


def test_a_replica_query_past_the_deadline_stops_the_request_with_the_reason() -> None:
    store = _ProbeStore([(("p1", 64),)])
    store.query_gate = threading.Event()
    probe = _probe_with(store)
    deadline = RequestDeadline(0.2)
    try:
        screen = probe.screen(["k"], deadline)
        assert screen.stop and store.reads == []
        assert deadline.reason is not None and "asked where the keys live" in deadline.reason
    finally:
        store.query_gate.set()
        probe.close()
