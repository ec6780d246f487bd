"""Request deadlines and the hung-peer rule in every transfer path (docs/transfer-modes.md, "Deadlines").

A :class:`~mooncake_kvaddr.driver.transfer.KVTransfer` runs on a real :class:`MooncakeStore` whose Mooncake
client is the in-memory stand-in of ``tests/fake_mooncake.py`` with a fake clock: a hung peer's call "takes"
Mooncake's 60 s transfer timeout and a slow call 10 s, in no real time. In every path (multi-buffer, staged,
direct), for loads and stores:

* after a call that waited out the transfer timeout, the request makes no further Mooncake call;
* past the request's deadline, no further call either;
* the keys not tried are failed (``transfer_failed``), never reported loaded or stored; the outcome counts
  add up to the request's keys; ``stopped`` says why;
* no failed chunk's blocks are written (a staged load's slots hold the previous request's bytes: never
  scattered), and loads never raise.

Then, in real time with a call that blocks on an Event: a staged call still running at the deadline is
abandoned (the request returns at its deadline, the call's keys fail), its staging slots stay leased until it
returns (checked by the pool's free bytes, and by a late put that must still read its own bytes), later loads
are right, the ``max_abandoned_calls`` bound makes new staged requests fail fast, ``close()`` keeps the pool
registered and alive until the call returns, and no call thread outlives its transfer.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import pytest

from fake_mooncake import HUNG_CALL_S, FakeMooncake, fake_store
from kvaddr_testing import Cache, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr.driver import store_calls
from mooncake_kvaddr.driver.paths import StagedPath
from mooncake_kvaddr.driver.rules import estimate_staging_bytes
from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT, StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore, StoreClosedError
from mooncake_kvaddr.driver.transfer import KVTransfer, LoadResult, TransferRequest
from mooncake_kvaddr.driver.workers import CallAbandoned, CallRunner

BS = 16  # tokens per block; one block per chunk
CHUNKS = 40
BLOCK_BYTES = 1024
SENTINEL = 0xA5
#: Regions per key of each path, and keys per Mooncake call (region budget 8; staging pool of 4 slots).
MODES = {"multi_buffer": (2, 4), "staged": (2, 4), "direct": (1, 8)}
IDS = list(range(1, CHUNKS + 1))


def _pool(regions: int) -> StagingPool:
    slot = -(-regions * BLOCK_BYTES // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    return StagingPool(4 * slot)


class Rig:
    """A store on the stand-in client, a source cache per data set (stored under tags A and B), and
    transfers in one mode."""

    def __init__(self, store: MooncakeStore, client: FakeMooncake, mode: str, model: str) -> None:
        self.store, self.client, self.mode, self.model = store, client, mode, model
        self.regions, self.per_call = MODES[mode]
        self.src = {"A": Cache(self.regions, CHUNKS + 1, BLOCK_BYTES, seed=1),
                    "B": Cache(self.regions, CHUNKS + 1, BLOCK_BYTES, seed=2)}  # fmt: skip
        self.pool = _pool(self.regions) if mode == "staged" else None

    def transfer(self, cache: Cache, **kwargs: Any) -> KVTransfer:
        mode = "auto" if self.mode == "direct" else self.mode
        return transfer(self.store, self.model, cache, BS, transfer_mode=mode, start_threads=False,
                        staging_pool=self.pool, **kwargs)  # fmt: skip

    def request(self, tag: str) -> TransferRequest:
        return TransferRequest(tag, CHUNKS * BS, hashes(f"{self.model}-{tag}", CHUNKS), [IDS])

    def store_both(self) -> None:
        for tag, cache in self.src.items():
            with self.transfer(cache) as writer:
                assert writer.store(self.request(tag)).ok
        self.client.calls.clear()

    def check_load(self, result: LoadResult, dst: Cache, tag: str, loaded_keys: int) -> None:
        """The first ``loaded_keys`` chunks loaded and right; the rest failed, their blocks untouched."""
        good, bad = IDS[:loaded_keys], IDS[loaded_keys:]
        assert result.loaded_block_ids == set(good) and result.failed_block_ids == set(bad)
        assert sum(result.outcomes.values()) == CHUNKS, result.outcomes
        assert result.outcomes.get("ok", 0) == loaded_keys
        assert result.outcomes.get("transfer_failed", 0) == CHUNKS - loaded_keys
        assert result.bytes == loaded_keys * self.regions * BLOCK_BYTES
        if good:
            assert_blocks_equal(self.src[tag], good, dst, good)
        for block in dst.blocks(bad):
            assert (block == SENTINEL).all()  # never written: no stale staging bytes, no partial object


@contextmanager
def rig(monkeypatch: pytest.MonkeyPatch, mode: str, model: str, **config: Any) -> Iterator[Rig]:
    config.setdefault("max_regions_per_batch", 8)
    with fake_store(monkeypatch, **config) as (store, client):
        yield Rig(store, client, mode, model)


def _load(
    r: Rig, tag: str, fault: Callable[[], None], spy: list[str] | None = None, **kwargs: Any
) -> tuple[LoadResult, Cache]:
    """Load data set ``tag`` into a sentinel-filled cache with ``fault`` injected just before; ``spy``
    records each ``path.get`` call of the reader."""
    dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
    with r.transfer(dst, **kwargs) as reader:
        if spy is not None:
            _spy(reader.path, "get", spy)
        idle_calls = _spy_idle_store_calls(r, ("batch_get_into", "batch_get_into_multi_buffers"))
        assert reader.mode == r.mode
        if r.mode == "staged":
            # Fill every staging slot with the other data set's bytes first: a failed key's slot then holds
            # another request's bytes, which must never be scattered.
            other = "B" if tag == "A" else "A"
            warm = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
            with r.transfer(warm) as warmer:
                assert warmer.load(r.request(other)).ok
            r.client.calls.clear()
        fault()
        result = reader.load(r.request(tag))
    for name in ("batch_get_into", "batch_get_into_multi_buffers"):
        del r.store.__dict__[name]
    # Every store call reached Mooncake: the paths never make one only to have it refused for the deadline.
    assert idle_calls == [], idle_calls
    return result, dst


# ------------------------------------------------------------------------------------------- loads


@pytest.mark.parametrize("mode", MODES)
def test_a_load_stops_after_a_call_waited_out_the_transfer_timeout(
    monkeypatch: pytest.MonkeyPatch, mode: str, model: str
) -> None:
    with rig(monkeypatch, mode, model) as r:
        r.store_both()
        started: list[float] = []

        def hang_after_the_first_call() -> None:
            r.client.hang_from = 2
            started.append(r.client.clock.now)

        result, dst = _load(r, "A", hang_after_the_first_call)
        assert r.client.transfer_calls() == [r.per_call, r.per_call]  # one hung call, not one per batch
        assert r.client.clock.now - started[0] == HUNG_CALL_S
        assert result.stopped is not None and "transfer timeout" in result.stopped
        r.check_load(result, dst, "A", r.per_call)


@pytest.mark.parametrize("mode", MODES)
def test_a_load_stops_at_its_deadline(monkeypatch: pytest.MonkeyPatch, mode: str, model: str) -> None:
    with rig(monkeypatch, mode, model, request_timeout_s=25.0) as r:
        r.store_both()
        # Calls start at 0, 10 and 20 s; at 30 s the 25 s deadline has passed.
        result, dst = _load(r, "A", partial(setattr, r.client, "call_seconds", 10.0))
        assert r.client.transfer_calls() == [r.per_call] * 3
        assert result.stopped == "the request deadline of 25 s passed"
        r.check_load(result, dst, "A", 3 * r.per_call)


@pytest.mark.parametrize("mode", ["multi_buffer", "staged"])
def test_the_deadline_is_checked_between_disk_offload_batches(
    monkeypatch: pytest.MonkeyPatch, mode: str, model: str
) -> None:
    with rig(monkeypatch, mode, model, request_timeout_s=25.0, max_regions_per_batch=1000) as r:
        r.store_both()
        budget = 5 * estimate_staging_bytes(r.regions * BLOCK_BYTES)  # usable 90 %: four keys per sub-batch
        slow = partial(setattr, r.client, "call_seconds", 10.0)
        gets: list[str] = []
        result, dst = _load(r, "A", slow, gets, disk_offload_buffer_budget_bytes=budget)
        assert r.client.transfer_calls() == [4, 4, 4]
        assert len(gets) == 3  # the path is not even asked for the sub-batches past the deadline
        assert result.stopped == "the request deadline of 25 s passed"
        r.check_load(result, dst, "A", 12)


@pytest.mark.parametrize("mode", MODES)
def test_a_healthy_load_is_not_stopped(monkeypatch: pytest.MonkeyPatch, mode: str, model: str) -> None:
    with rig(monkeypatch, mode, model, request_timeout_s=25.0) as r:
        r.store_both()
        result, dst = _load(r, "B", partial(setattr, r.client, "call_seconds", 2.0))  # well within the deadline
        assert result.ok and result.stopped is None
        r.check_load(result, dst, "B", CHUNKS)


# ------------------------------------------------------------------------------------------- stores


def _spy_idle_store_calls(r: Rig, names: tuple[str, ...]) -> list[str]:
    """Record the store calls (of ``names``) that made no Mooncake call at all."""
    idle: list[str] = []
    for name in names:
        method = getattr(r.store, name)

        def recorded(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            before = len(r.client.calls)
            got = _method(*args, **kwargs)
            if len(r.client.calls) == before:
                idle.append(_name)
            return got

        setattr(r.store, name, recorded)
    return idle


def _spy(target: Any, name: str, calls: list[str]) -> None:
    """Record every call of ``target.name`` (an instance attribute shadows the method)."""
    method = getattr(target, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return method(*args, **kwargs)

    setattr(target, name, recorded)


def _store(r: Rig) -> Any:
    with r.transfer(r.src["A"]) as writer:
        gathers: list[str] = []
        if r.mode == "staged":
            _spy(writer.copy_backend, "gather", gathers)
        result = writer.store(r.request("A"))
    if r.mode == "staged":  # nothing gathered for a batch that is never put
        assert len(gathers) == len(r.client.calls), (gathers, r.client.calls)
    return result


@pytest.mark.parametrize("mode", MODES)
def test_a_store_stops_after_a_call_waited_out_the_transfer_timeout(
    monkeypatch: pytest.MonkeyPatch, mode: str, model: str
) -> None:
    with rig(monkeypatch, mode, model) as r:
        r.client.hang_from = 2
        result = _store(r)
        assert r.client.transfer_calls() == [r.per_call, r.per_call]
        assert result.stopped is not None and "transfer timeout" in result.stopped
        _check_store(r, result, r.per_call)


@pytest.mark.parametrize("mode", MODES)
def test_a_store_stops_at_its_deadline(monkeypatch: pytest.MonkeyPatch, mode: str, model: str) -> None:
    with rig(monkeypatch, mode, model, request_timeout_s=25.0) as r:
        r.client.call_seconds = 10.0
        result = _store(r)
        assert r.client.transfer_calls() == [r.per_call] * 3
        assert result.stopped == "the request deadline of 25 s passed"
        _check_store(r, result, 3 * r.per_call)


def _check_store(r: Rig, result: Any, stored: int) -> None:
    keys = list(r.client.objects)
    assert result.stored == len(keys) == stored and not result.ok and result.saved_tokens == 0
    assert len(result.failed_keys) == CHUNKS - stored and not set(result.failed_keys) & set(keys)
    assert sum(result.outcomes.values()) == CHUNKS and result.outcomes.get("transfer_failed") == CHUNKS - stored
    for i, key in enumerate(keys):  # the stored objects are the right bytes
        assert r.client.objects[key] == r.src["A"].object_bytes(IDS[i])


@pytest.mark.parametrize("mode", MODES)
def test_a_store_whose_existence_check_outlasted_the_deadline_puts_nothing(
    monkeypatch: pytest.MonkeyPatch, mode: str, model: str
) -> None:
    with rig(monkeypatch, mode, model, request_timeout_s=25.0) as r:
        r.client.exist_seconds = 30.0
        result = _store(r)
        assert r.client.calls == [] and result.stopped == "the request deadline of 25 s passed"
        _check_store(r, result, 0)


# ------------------------------------------------------------------------------------------- staging wait


@pytest.mark.parametrize("direction", ["load", "store"])
def test_the_staging_wait_ends_at_the_deadline(monkeypatch: pytest.MonkeyPatch, model: str, direction: str) -> None:
    with rig(monkeypatch, "staged", model, request_timeout_s=0.3) as r:
        monkeypatch.setattr(store_calls, "_now", time.monotonic)  # a real wait: the pool's own clock
        if direction == "load":
            r.store_both()
        assert r.pool is not None
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.pool.acquire(r.pool.capacity), r.transfer(r.src["A"] if direction == "store" else dst) as xfer:
            # Another request holds the whole pool: this one waits for its deadline, then fails cleanly.
            t0 = time.monotonic()
            result = xfer.load(r.request("A")) if direction == "load" else xfer.store(r.request("A"))
            assert 0.25 < time.monotonic() - t0 < 5
        assert result.stopped == "the request deadline of 0.3 s passed" and r.client.calls == []
        assert result.outcomes == {"transfer_failed": CHUNKS}
        if isinstance(result, LoadResult):
            r.check_load(result, dst, "A", 0)
        else:
            _check_store(r, result, 0)
    assert np.all(dst.regions[0] == SENTINEL)


# ------------------------------------------------------------------------------------------- abandoned staged calls
#
# A staged Mooncake call that is still running at the request's deadline is abandoned: the request returns at
# the deadline, the call's keys fail, nothing is scattered from its slots, and its staging slots stay leased
# until Mooncake really returns (docs/transfer-modes.md, "Deadlines"). Here the stand-in client's call blocks
# on an Event, in real time (the driver's clock is the monotonic clock again).

CALL_THREAD = "KVTransferStagedCall"
SLOT = -(-2 * BLOCK_BYTES // SLOT_ALIGNMENT) * SLOT_ALIGNMENT  # one staged key of two regions
SMALL = 2  # chunks of a request whose call hangs: it leases 2 of the pool's 8 slots


_GATES: list[Gate] = []


class Gate:
    """Makes call number ``which`` (1-based) of ``client.name`` block until :attr:`opened` is set (at the
    latest when the test's rig closes)."""

    def __init__(self, client: FakeMooncake, name: str, which: int = 1) -> None:
        _GATES.append(self)
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.returned = threading.Event()
        original = getattr(client, name)
        seen = [0]

        def gated(*args: Any) -> Any:
            seen[0] += 1
            if seen[0] != which:
                return original(*args)
            self.entered.set()
            assert self.opened.wait(30), "the gate was never opened"
            try:
                return original(*args)
            finally:
                self.returned.set()

        setattr(client, name, gated)

    def open(self) -> None:
        self.opened.set()
        assert self.returned.wait(10)


@contextmanager
def real_time_rig(monkeypatch: pytest.MonkeyPatch, model: str, **config: Any) -> Iterator[Rig]:
    config.setdefault("request_timeout_s", 0.4)
    try:
        with rig(monkeypatch, "staged", model, **config) as r:
            monkeypatch.setattr(store_calls, "_now", time.monotonic)
            r.pool = StagingPool(8 * SLOT)
            yield r
    finally:
        while _GATES:  # a failed test must not leave a call blocked for the gate's 30 s
            _GATES.pop().opened.set()
    _join_call_threads()


def _call_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(CALL_THREAD)]


def _join_call_threads() -> None:
    for thread in _call_threads():
        thread.join(5)
    assert not _call_threads(), "staged call threads outlived their transfer"


def _small(r: Rig, tag: str, chunks: int = SMALL) -> TransferRequest:
    return TransferRequest(tag, chunks * BS, hashes(f"{r.model}-{tag}", chunks), [IDS[:chunks]])


def _staged(xfer: KVTransfer) -> StagedPath:
    path = xfer.path
    assert isinstance(path, StagedPath)
    return path


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    return fn(), time.monotonic() - t0


def _check_abandoned(result: Any, timeout: float, seconds: float, keys: int) -> None:
    assert timeout * 0.9 <= seconds < timeout + 2.0, seconds  # at the deadline, not when the call returns
    assert result.stopped is not None
    assert result.stopped.startswith(f"the request deadline of {timeout:g} s passed during a staged Mooncake call")
    assert "abandoned" in result.stopped
    assert result.outcomes == {"transfer_failed": keys}, result.outcomes


def test_a_staged_load_returns_at_its_deadline_while_its_call_hangs(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    with real_time_rig(monkeypatch, model) as r:
        r.store_both()
        r.pool = _pool(r.regions)  # 4 slots: 4 keys per call, ten calls a load
        gate = Gate(r.client, "batch_get_into", which=2)
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(dst) as reader:
            result, seconds = _timed(lambda: reader.load(r.request("A")))
            assert gate.entered.is_set() and not gate.returned.is_set()
            assert 0.35 <= seconds < 2.5, seconds
            assert result.stopped is not None and "abandoned" in result.stopped
            # The first call's keys loaded; the abandoned call's and every later key failed, never written.
            assert r.client.transfer_calls() == [4]  # the second call has not reached the stand-in's store yet
            r.check_load(result, dst, "A", 4)
            calls = _staged(reader).calls
            assert calls.abandoned == 1 and r.pool.free_bytes == 0  # the call's 4 slots stay leased
            gate.open()  # Mooncake returns: it writes the right bytes into the slots, which nobody scatters
            assert calls.wait_settled(5) and calls.abandoned == 0 and r.client.transfer_calls() == [4, 4]
            assert r.pool.free_bytes == r.pool.capacity
            r.check_load(result, dst, "A", 4)  # still: the late bytes stayed in staging
            again = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(again) as reader:
            later = reader.load(r.request("B"))
            assert later.ok and later.stopped is None
            r.check_load(later, again, "B", CHUNKS)


def test_a_hung_staged_load_keeps_only_its_slots_and_later_loads_are_right(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    with real_time_rig(monkeypatch, model) as r:
        r.store_both()
        assert r.pool is not None
        gate = Gate(r.client, "batch_get_into")
        hung = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(hung) as stuck, r.transfer(dst) as reader:
            result, seconds = _timed(lambda: stuck.load(_small(r, "A")))
            _check_abandoned(result, 0.4, seconds, SMALL)
            assert result.failed_block_ids == set(IDS[:SMALL]) and not result.loaded_block_ids
            assert r.pool.free_bytes == r.pool.capacity - SMALL * SLOT  # only the call's slots stay leased
            # Meanwhile another load runs through the rest of the pool (6 slots: 7 calls), bytes right.
            for tag in ("B", "A"):
                dst.regions[0][...] = SENTINEL
                dst.regions[1][...] = SENTINEL
                later = reader.load(r.request(tag))
                assert later.ok, later.outcomes
                r.check_load(later, dst, tag, CHUNKS)
            assert r.pool.free_bytes == r.pool.capacity - SMALL * SLOT
            gate.open()
            assert _staged(stuck).calls.wait_settled(5)
            assert r.pool.free_bytes == r.pool.capacity
            assert (hung.regions[0] == SENTINEL).all() and (hung.regions[1] == SENTINEL).all()
            later = stuck.load(r.request("B"))  # the transfer that abandoned a call works as before
            r.check_load(later, hung, "B", CHUNKS)


def test_an_interrupted_wait_for_a_staged_call_keeps_only_that_calls_slots(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    """A ``KeyboardInterrupt`` while a load waits for its second staged get (10 keys through an 8-slot lease:
    8, then 2) abandons that call and propagates; as at a deadline, only the 2 slots the call uses stay leased
    until Mooncake returns, the rest of the lease goes back to the pool at once."""
    with real_time_rig(monkeypatch, model) as r:
        r.store_both()
        assert r.pool is not None
        gate = Gate(r.client, "batch_get_into", which=2)
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(dst) as reader:
            calls = _staged(reader).calls
            submit = calls.submit
            made: list[Any] = []

            def interrupted(timeout: float | None = None) -> bool:
                assert gate.entered.wait(10)  # the call is inside Mooncake
                raise KeyboardInterrupt

            def submit_then_interrupt(*args: Any, **kwargs: Any) -> Any:
                pending = submit(*args, **kwargs)
                made.append(pending)
                if len(made) == 2:
                    monkeypatch.setattr(pending._done, "wait", interrupted)
                return pending

            monkeypatch.setattr(calls, "submit", submit_then_interrupt)
            with pytest.raises(KeyboardInterrupt):
                reader.load(_small(r, "A", chunks=10))
            assert len(made) == 2 and made[1].abandoned and not made[0].abandoned
            assert r.pool.free_bytes == r.pool.capacity - 2 * SLOT
            gate.open()
            assert calls.wait_settled(5)
            assert r.pool.free_bytes == r.pool.capacity


def test_a_staged_store_returns_at_its_deadline_and_its_slots_are_not_reused(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    """An abandoned put still reads its slots when it finally runs: if they had been leased to another
    request meanwhile, it would store that request's bytes under its keys."""
    with real_time_rig(monkeypatch, model) as r:
        with r.transfer(r.src["B"]) as writer:
            assert writer.store(r.request("B")).ok
        assert r.pool is not None
        gate = Gate(r.client, "batch_put_from")
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(r.src["A"]) as stuck, r.transfer(dst) as reader:
            result, seconds = _timed(lambda: stuck.store(_small(r, "A")))
            _check_abandoned(result, 0.4, seconds, SMALL)
            assert result.stored == 0 and len(result.failed_keys) == SMALL and result.saved_tokens == 0
            assert r.pool.free_bytes == r.pool.capacity - SMALL * SLOT
            later = reader.load(r.request("B"))  # fills every other slot with B's bytes
            r.check_load(later, dst, "B", CHUNKS)
            gate.open()
            assert _staged(stuck).calls.wait_settled(5) and r.pool.free_bytes == r.pool.capacity
        # The late put stored A's bytes, read from slots nobody else wrote meanwhile.
        keys = [k for k in r.client.objects if k not in set(_keys_of(r, "B"))]
        assert len(keys) == SMALL
        for i, key in enumerate(keys):
            assert r.client.objects[key] == r.src["A"].object_bytes(IDS[i])


def _keys_of(r: Rig, tag: str) -> list[str]:
    before = set(r.client.objects)
    with r.transfer(r.src[tag]) as writer:  # every key exists: nothing is put, the existence check names them
        calls: list[list[str]] = []
        original = r.store.batch_is_exist

        def spy(keys: Any) -> Any:
            calls.append(list(keys))
            return original(keys)

        r.store.batch_is_exist = spy  # type: ignore[method-assign]
        try:
            assert writer.store(r.request(tag)).already_present == CHUNKS
        finally:
            del r.store.__dict__["batch_is_exist"]
    assert set(r.client.objects) == before
    return calls[0]


def test_new_staged_requests_fail_fast_while_the_abandoned_calls_are_at_their_bound(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    with real_time_rig(monkeypatch, model, max_abandoned_calls=1) as r:
        r.store_both()
        gate = Gate(r.client, "batch_get_into")
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(dst) as reader:
            result, seconds = _timed(lambda: reader.load(_small(r, "A")))
            _check_abandoned(result, 0.4, seconds, SMALL)
            threads = len(_call_threads())
            before = list(r.client.calls)
            # The bound is reached: no Mooncake call, no staging wait, no new thread; every key failed.
            refused, seconds = _timed(lambda: reader.load(r.request("B")))
            assert seconds < 0.3 and r.client.calls == before and len(_call_threads()) == threads
            assert refused.stopped is not None and "max_abandoned_calls=1" in refused.stopped
            assert refused.outcomes == {"transfer_failed": CHUNKS}
            r.check_load(refused, dst, "B", 0)
            stored, seconds = _timed(lambda: reader.store(_small(r, "C")))
            assert seconds < 0.3 and r.client.calls == before
            assert stored.stopped == refused.stopped and stored.outcomes == {"transfer_failed": SMALL}
            gate.open()
            assert _staged(reader).calls.wait_settled(5)
            later = reader.load(r.request("B"))  # below the bound again
            r.check_load(later, dst, "B", CHUNKS)


def test_with_max_abandoned_calls_0_a_staged_request_waits_for_its_call(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    with real_time_rig(monkeypatch, model, max_abandoned_calls=0) as r:
        r.store_both()
        r.pool = _pool(r.regions)
        gate = Gate(r.client, "batch_get_into")
        timer = threading.Timer(0.8, gate.opened.set)
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(dst) as reader:
            timer.start()
            result, seconds = _timed(lambda: reader.load(r.request("A")))
            assert seconds >= 0.75  # the call was waited for, past the 0.4 s deadline
            assert not _call_threads()  # made inline in the request's thread
            assert result.stopped == "the request deadline of 0.4 s passed"
            r.check_load(result, dst, "A", 4)  # the late call's keys loaded; no later call made
        timer.join()


def test_close_with_an_abandoned_call_keeps_the_staging_pool_until_it_returns(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    with real_time_rig(monkeypatch, model) as r:
        r.store_both()
        gate = Gate(r.client, "batch_get_into")
        unregistered: list[int] = []
        original = r.client.unregister_buffer
        r.client.unregister_buffer = lambda ptr: unregistered.append(ptr) or original(ptr)  # type: ignore[method-assign]
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        reader = transfer(r.store, r.model, dst, BS, transfer_mode="staged", start_threads=False)  # owns its pool
        calls = _staged(reader).calls
        pool = reader.staging_pool
        assert pool is not None
        ptr, pool_ref = pool.range[0], weakref.ref(pool)
        del pool
        result, seconds = _timed(lambda: reader.load(_small(r, "A")))
        _check_abandoned(result, 0.4, seconds, SMALL)
        # close() waits its timeout for the call, then finishes without failing: the transfer is closed,
        # the pool stays registered and allocated while Mooncake may still write into it.
        _, seconds = _timed(lambda: reader.close(timeout=0.3))
        assert 0.25 <= seconds < 2.0
        with pytest.raises(StoreClosedError):
            reader.load(r.request("A"))
        gc.collect()
        assert pool_ref() is not None and ptr not in unregistered and calls.abandoned == 1
        gate.open()
        assert calls.wait_settled(5)
        assert unregistered == [ptr]  # by the call's thread, once Mooncake returned
        _join_call_threads()
        gc.collect()
        assert pool_ref() is None  # and then freed
        assert (dst.regions[0] == SENTINEL).all() and (dst.regions[1] == SENTINEL).all()


def test_close_waits_for_an_abandoned_call_that_returns_within_its_timeout(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    with real_time_rig(monkeypatch, model) as r:
        r.store_both()
        gate = Gate(r.client, "batch_get_into")
        unregistered: list[int] = []
        original = r.client.unregister_buffer
        r.client.unregister_buffer = lambda ptr: unregistered.append(ptr) or original(ptr)  # type: ignore[method-assign]
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        reader = r.transfer(dst)
        calls = _staged(reader).calls
        pool = r.pool
        assert pool is not None
        result, seconds = _timed(lambda: reader.load(_small(r, "A")))
        _check_abandoned(result, 0.4, seconds, SMALL)
        timer = threading.Timer(0.3, gate.opened.set)
        timer.start()
        _, seconds = _timed(lambda: reader.close(timeout=10))
        # close() returned once the call did, with everything released by then.
        assert 0.25 <= seconds < 5 and gate.returned.is_set()
        assert calls.abandoned == 0 and pool.free_bytes == pool.capacity and unregistered == [pool.range[0]]
        timer.join()


def test_healthy_staged_calls_reuse_a_few_threads(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    with real_time_rig(monkeypatch, model) as r:
        r.store_both()
        r.pool = _pool(r.regions)  # ten calls a load
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(dst) as reader:
            for i in range(5):
                tag = "AB"[i % 2]
                result = reader.load(r.request(tag))
                r.check_load(result, dst, tag, CHUNKS)
                assert result.outcomes == {"ok": CHUNKS} and result.stopped is None
                assert len(_call_threads()) == 1  # one call at a time: one thread, reused
            assert _staged(reader).calls.abandoned == 0


def test_without_a_deadline_staged_calls_run_inline(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    with real_time_rig(monkeypatch, model, request_timeout_s=None) as r:
        r.store_both()
        dst = Cache(r.regions, CHUNKS + 1, BLOCK_BYTES, fill=SENTINEL)
        with r.transfer(dst) as reader:
            r.check_load(reader.load(r.request("A")), dst, "A", CHUNKS)
            assert not _call_threads()


# ------------------------------------------------------------------------------------------- the call runner


def test_call_runner_abandons_at_the_timeout_and_hands_over_the_release() -> None:
    runner = CallRunner(2, name=CALL_THREAD)
    go = threading.Event()
    released: list[BaseException | None] = []
    pending = runner.submit(lambda: go.wait(10) and 7, 0.05, released.append)
    with pytest.raises(CallAbandoned):
        pending.wait(0.05)
    assert pending.abandoned and runner.abandoned == 1 and not runner.saturated and released == []
    settled: list[str] = []
    runner.when_settled(lambda: settled.append("x"))
    assert settled == []
    go.set()
    assert runner.wait_settled(5) and released == [None] and settled == ["x"]
    # A call that returns in time: its result, no release callback, the thread reused.
    quick = runner.submit(lambda: 5, 5.0, released.append)
    assert quick.wait(5.0) == 5 and not quick.abandoned and released == [None]
    boom = runner.submit(lambda: 1 // 0, 5.0, released.append)
    with pytest.raises(ZeroDivisionError):
        boom.wait(5.0)
    runner.when_settled(lambda: settled.append("now"))
    assert settled == ["x", "now"]
    runner.close()
    _join_call_threads()


def test_call_runner_settles_only_when_the_last_abandoned_call_returns() -> None:
    runner = CallRunner(3, name=CALL_THREAD)
    first, second = threading.Event(), threading.Event()
    released: list[BaseException | None] = []
    calls = [runner.submit(lambda go=go: go.wait(10) and 1, 0.05, released.append) for go in (first, second)]
    for pending in calls:
        with pytest.raises(CallAbandoned):
            pending.wait(0.05)
    assert runner.abandoned == 2
    settled: list[str] = []
    runner.when_settled(lambda: settled.append("x"))
    first.set()
    deadline = time.monotonic() + 5
    while runner.abandoned != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.abandoned == 1 and released == [None]
    assert settled == [] and not runner.wait_settled(0.05)  # one abandoned call still runs
    second.set()
    assert runner.wait_settled(5) and settled == ["x"] and released == [None, None]
    runner.close()
    _join_call_threads()


def test_call_runner_keeps_at_most_max_idle_threads() -> None:
    runner = CallRunner(4, name="KVTransferIdleTest", max_idle=1)
    gate = threading.Event()
    try:
        calls = [runner.submit(lambda: gate.wait(10.0), 10.0, lambda exc: None) for _ in range(3)]
        assert runner._started == 3  # three calls at once: three threads
        gate.set()
        for call in calls:
            assert call.wait(10.0) is True

        def alive() -> list[threading.Thread]:
            return [t for t in threading.enumerate() if t.name.startswith("KVTransferIdleTest-")]

        # Settled: every thread has either parked idle or ended.
        deadline = time.monotonic() + 10.0
        while len(alive()) != len(runner._idle) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(runner._idle) == 1
        assert len(alive()) == 1
    finally:
        gate.set()
        runner.close()


def test_call_runner_is_saturated_at_its_bound_and_never_abandons_at_0() -> None:
    runner = CallRunner(1, name=CALL_THREAD)
    go = threading.Event()
    pending = runner.submit(go.wait, 0.01, lambda _exc: None)
    with pytest.raises(CallAbandoned):
        pending.wait(0.01)
    assert runner.saturated
    go.set()
    assert runner.wait_settled(5) and not runner.saturated
    runner.close()
    inline = CallRunner(0, name=CALL_THREAD)
    assert inline.submit(threading.current_thread, 0.01, lambda _exc: None).wait(0.01) is threading.current_thread()
    _join_call_threads()


def test_an_exception_while_waiting_abandons_the_call_before_it_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CallRunner(2, name=CALL_THREAD)
    go = threading.Event()
    released: list[BaseException | None] = []
    pending = runner.submit(go.wait, 10.0, released.append)

    def interrupted(timeout: float | None = None) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(pending._done, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pending.wait(10.0)
    assert pending.abandoned and runner.abandoned == 1 and released == []  # the caller must not release
    go.set()
    assert runner.wait_settled(5) and released == [None]
    runner.close()
    _join_call_threads()


def test_lease_shrink_and_release_give_bytes_back_once() -> None:
    pool = StagingPool(8 * SLOT_ALIGNMENT)
    lease = pool.acquire(SLOT_ALIGNMENT, 6 * SLOT_ALIGNMENT)
    lease.shrink(SLOT_ALIGNMENT + 1)  # rounded up to two units
    assert lease.nbytes == 2 * SLOT_ALIGNMENT and pool.free_bytes == 6 * SLOT_ALIGNMENT
    other = pool.acquire(6 * SLOT_ALIGNMENT)
    assert other.offset == 2 * SLOT_ALIGNMENT  # the freed tail, right after the kept slots
    lease.release()
    lease.shrink(0)  # released: nothing more to give back
    other.release()
    assert pool.free_bytes == pool.capacity
    with pytest.raises(ValueError):
        pool.acquire(SLOT_ALIGNMENT).shrink(-1)
