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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import pytest

from fake_mooncake import HUNG_CALL_S, FakeMooncake, fake_store
from kvaddr_testing import Cache, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr.driver import store as store_module
from mooncake_kvaddr.driver.rules import estimate_staging_bytes
from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT, StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, LoadResult, TransferRequest

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
        monkeypatch.setattr(store_module, "_now", time.monotonic)  # a real wait: the pool's own clock
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
