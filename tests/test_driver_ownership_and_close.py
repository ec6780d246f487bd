"""A second adversarial audit of the transfer driver and the plugin's transports (issue 9; SECURITY.md).

Each test reproduced a defect on the code before its fix:

* registration read the caller's region container twice (validated one pass, kept the arrays of another):
  an iterator, or a sequence whose iteration changes, left the registered memory unowned (freed while
  Mooncake could still write it);
* a failed registration kept what it had registered so far (KV buffers, the staging pool): leaked, and a
  retry failed on the overlap;
* two threads closing one transfer both released its registrations (a shared staging pool unregistered while
  another transfer still used it);
* a staging lease is an ordinary object: one built or edited by the caller passed the project-owned staging
  check by its own word, and a staged call handed Mooncake slot pointers derived from a lease it never
  checked;
* the plugin's store wrappers sent every call after ``close()`` to the closed Mooncake store (SIGSEGV inside
  Mooncake) and let ``close()`` run under a call in flight;
* a submit racing ``close()`` could queue its request behind the threads' stop marker: its future never
  completed.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from fake_mooncake import fake_store
from kvaddr_testing import Cache, hashes, make_transfer
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver.staging import StagingBuffer, StagingLease, StagingPool, gather, scatter
from mooncake_kvaddr.driver.store import MooncakeStore, StoreClosedError, StoreError
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest
from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore


def _transfer(store: MooncakeStore, model: str, mode: str, **kwargs: Any) -> KVTransfer:
    db = ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0), 16)
    return KVTransfer(store, [db], transfer_mode=mode, start_threads=False, **kwargs)


# ------------------------------------------------------------------------------------------- registration


class _ChangingRegions(list):  # type: ignore[type-arg]
    """A list whose iteration yields other (fresh) arrays after the first pass."""

    def __init__(self, arrays: list[Any]) -> None:
        super().__init__(arrays)
        self.passes = 0

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        if self.passes == 1:
            return super().__iter__()
        return iter([np.zeros_like(a) for a in list.__iter__(self)])


@pytest.mark.parametrize("mode", ["multi_buffer", "staged", "auto"])
@pytest.mark.parametrize("container", ["generator", "changing"])
def test_registered_regions_are_the_arrays_kept_alive(
    monkeypatch: pytest.MonkeyPatch, mode: str, container: str
) -> None:
    regions = 1 if mode == "auto" else 2
    with fake_store(monkeypatch) as (store, _fake):
        arrays = [np.zeros((4, 256), np.uint8) for _ in range(regions)]
        refs = [weakref.ref(a) for a in arrays]
        given: Any = (a for a in arrays) if container == "generator" else _ChangingRegions(arrays)
        xfer = _transfer(store, "m", mode)
        xfer.register_kv_caches(given, 4)
        del arrays, given
        gc.collect()
        assert all(r() is not None for r in refs), "registered memory freed while the transfer can move it"
        bases = {int(r().ctypes.data) for r in refs}  # type: ignore[union-attr]
        assert set(xfer._regions and [int(a.ctypes.data) for a in xfer._regions]) == bases
        xfer.close()
        gc.collect()
        assert all(r() is None for r in refs)  # released by close


def _failing_second_registration(monkeypatch: pytest.MonkeyPatch, fake: Any) -> set[int]:
    """Mooncake (fake) refuses the second KV-buffer registration; returns the live registrations."""
    live: set[int] = set()
    calls = [0]

    def register(ptr: int, size: int) -> int:
        calls[0] += 1
        if calls[0] == 2 or ptr in live:
            return -600
        live.add(ptr)
        return 0

    def unregister(ptr: int) -> int:
        if ptr not in live:
            return -600
        live.discard(ptr)
        return 0

    monkeypatch.setattr(fake, "register_buffer", register)
    monkeypatch.setattr(fake, "unregister_buffer", unregister)
    return live


@pytest.mark.parametrize("mode", ["multi_buffer", "auto"])
def test_a_failed_registration_releases_everything_it_registered(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    with fake_store(monkeypatch) as (store, fake):
        live = _failing_second_registration(monkeypatch, fake)
        cache = Cache(2, 4, 256, seed=1)
        pool = StagingPool(1 << 16)
        # "auto" in memory with two small regions: loads staged, stores multi-buffer, so the pool is registered
        # first and the second registration (the first KV buffer) fails.
        xfer = _transfer(store, "m", mode, staging_pool=pool, local_copy=True)
        with pytest.raises(StoreError):
            xfer.register_kv_caches(cache.regions, 4)
        assert live == set(), f"registrations left behind: {sorted(live)}"
        assert pool._registrations == {}
        assert xfer._registered == [] and xfer.path is None and xfer._regions == []
        # The transfer is usable afterwards: the same registration succeeds now.
        monkeypatch.setattr(fake, "register_buffer", lambda ptr, size: live.add(ptr) or 0)
        xfer.register_kv_caches(cache.regions, 4)
        expected = ("multi_buffer", "multi_buffer") if mode == "multi_buffer" else ("staged", "multi_buffer")
        assert (xfer.mode, xfer.store_mode) == expected
        xfer.close()
        assert live == set() and pool._registrations == {}


def test_a_failed_registration_on_a_shared_pool_leaves_the_other_transfers_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two transfers share one staging pool on one store: the second's registration fails after it counted the
    pool (its first KV buffer is refused); undoing it and closing it later leave the pool registered for the
    first transfer, which still stages through it, until the first closes."""
    with fake_store(monkeypatch) as (store, fake):
        pool = StagingPool(1 << 16)
        live: set[int] = set()
        refuse = [False]

        def register(ptr: int, size: int) -> int:
            if refuse[0] and ptr != pool.buffer.ptr:
                return -600
            live.add(ptr)
            return 0

        def unregister(ptr: int) -> int:
            live.discard(ptr)
            return 0

        monkeypatch.setattr(fake, "register_buffer", register)
        monkeypatch.setattr(fake, "unregister_buffer", unregister)
        first = _transfer(store, "m", "auto", staging_pool=pool, local_copy=True)
        first.register_kv_caches(Cache(2, 4, 256, seed=1).regions, 4)
        assert pool.buffer.ptr in live
        refuse[0] = True
        second = _transfer(store, "m2", "auto", staging_pool=pool, local_copy=True)
        with pytest.raises(StoreError):
            second.register_kv_caches(Cache(2, 4, 256, seed=2).regions, 4)
        second.close()
        assert pool.buffer.ptr in live, "the first transfer's staging pool was unregistered"
        first.close()
        assert live == set() and pool._registrations == {}


def test_concurrent_closes_release_registrations_once(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch) as (store, fake):
        pool = StagingPool(1 << 16)
        other = _transfer(store, "other", "staged", staging_pool=pool)
        other.register_kv_caches(Cache(2, 4, 256).regions, 4)
        xfer = _transfer(store, "m", "multi_buffer")
        mb_cache = Cache(2, 4, 256)
        xfer.register_kv_caches(mb_cache.regions, 4)
        staged = _transfer(store, "s", "staged", staging_pool=pool)
        staged.register_kv_caches(Cache(2, 4, 256).regions, 4)
        assert pool._registrations[id(store)][1] == 2
        for victim in (xfer, staged):
            unregistered: list[int] = []
            original = fake.unregister_buffer

            def slow_unregister(ptr: int, original: Any = original, unregistered: list[int] = unregistered) -> int:
                unregistered.append(ptr)
                time.sleep(0.2)  # the other closer catches up meanwhile
                return original(ptr)

            monkeypatch.setattr(fake, "unregister_buffer", slow_unregister)
            barrier = threading.Barrier(2)
            stop = victim._workers.stop

            def stop_together(deadline: float, stop: Any = stop, barrier: threading.Barrier = barrier) -> list[str]:
                barrier.wait(5)  # both closers are past the "already released" check
                return list(stop(deadline))

            monkeypatch.setattr(victim._workers, "stop", stop_together)
            closers = [threading.Thread(target=victim.close) for _ in range(2)]
            for t in closers:
                t.start()
            for t in closers:
                t.join(10)
            assert len(unregistered) == len(set(unregistered)), f"unregistered twice: {unregistered}"
        # The shared pool is still registered for the transfer that did not close.
        assert pool._registrations[id(store)][1] == 1
        other.close()
        assert pool._registrations == {}


# ------------------------------------------------------------------------------------------- staging


def test_a_lease_built_by_the_caller_is_not_project_staging() -> None:
    pool = StagingPool(1 << 16)
    kv = np.arange(4 * 256, dtype=np.uint8).reshape(4, 256)
    addrs = np.array([[kv.ctypes.data]], dtype=np.int64)
    sizes = np.array([[256]], dtype=np.int64)
    slots = np.zeros(1, dtype=np.int64)
    allowed = [(int(kv.ctypes.data), kv.nbytes)]
    victim = np.zeros(1 << 20, np.uint8)  # memory right after nothing in particular
    for offset, nbytes in ((pool.capacity * 64, 256), (-(1 << 20), 1 << 20), (0, pool.capacity * 2), (0, -1)):
        forged = StagingLease(pool, offset, nbytes)
        with pytest.raises(ValueError, match="staging"):
            gather(addrs, sizes, forged, slots, allowed)
        with pytest.raises(ValueError, match="staging"):
            scatter(addrs, sizes, forged, slots, allowed)
    # A real lease whose fields are edited afterwards is refused the same way.
    lease = pool.acquire(256)
    lease.offset = pool.capacity * 16
    with pytest.raises(ValueError, match="staging"):
        gather(addrs, sizes, lease, slots, allowed)
    assert not victim.any()


def test_a_staging_buffer_subclass_cannot_lie_about_its_range() -> None:
    secret = np.full(4096, 0x41, np.uint8)

    class Lying(StagingBuffer):
        @property
        def ptr(self) -> int:
            return int(secret.ctypes.data)

        @property
        def nbytes(self) -> int:
            return secret.nbytes

    liar = Lying(64)
    kv = np.zeros((1, 4096), np.uint8)
    addrs = np.array([[kv.ctypes.data]], dtype=np.int64)
    sizes = np.array([[4096]], dtype=np.int64)
    slots = np.zeros(1, dtype=np.int64)
    allowed = [(int(kv.ctypes.data), kv.nbytes)]
    for staging in (liar, (int(secret.ctypes.data), secret.nbytes)):
        with pytest.raises(ValueError, match="staging"):
            scatter(addrs, sizes, staging, slots, allowed)  # would copy the secret into the KV cache
    assert not kv.any()


class _ForgingPool(StagingPool):
    """A pool whose leases point past its buffer (a buggy or hostile pool handed to KVTransfer)."""

    def acquire(self, min_bytes: int, max_bytes: int | None = None, *, timeout: float | None = None) -> StagingLease:
        return StagingLease(self, self.capacity * 8, max(max_bytes or 0, min_bytes, 1 << 12))


def test_a_staged_transfer_never_hands_mooncake_a_lease_outside_its_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch) as (store, fake):
        src = Cache(2, 5, 256, seed=3)
        h = hashes("m", 2)
        with make_transfer(store, "m", src, 16, transfer_mode="staged", start_threads=False) as writer:
            assert writer.store(TransferRequest("r", 32, h, [[1, 2]])).ok
        fake.calls.clear()
        dst = Cache(2, 5, 256)
        pool = _ForgingPool(1 << 16)
        with make_transfer(store, "m", dst, 16, transfer_mode="staged", start_threads=False,
                           staging_pool=pool) as reader:  # fmt: skip
            loaded = reader.load(TransferRequest("r", 32, h, [[1, 2]]))
            assert loaded.failed_block_ids == {1, 2} and not loaded.loaded_block_ids
            assert loaded.error is not None and "staging" in loaded.error
            with pytest.raises(ValueError, match="not project-owned staging"):
                reader.store(TransferRequest("r2", 32, hashes("m2", 2), [[1, 2]]))
        assert [c for c in fake.calls if c[0] in ("batch_get_into", "batch_put_from")] == []


# ------------------------------------------------------------------------------------------- plugin wrappers


class _RecordingStore:
    """Stands in for a MooncakeDistributedStore: records every call; ``close`` frees nothing here, but a real
    closed store dereferences a null client (SIGSEGV) on the next call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = False
        self.closes = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def _call(self, name: str, result: Any) -> Any:
        assert not self.closed, f"{name} reached a closed Mooncake store"
        self.calls.append(name)
        if self.gate is not None:
            self.entered.set()
            assert self.gate.wait(10)
            assert not self.closed, f"{name}: the store was closed under the call"
        return result

    def batch_is_exist(self, keys: Any) -> Any:
        return self._call("batch_is_exist", [0] * len(keys))

    def batch_get_into(self, keys: Any, ptrs: Any, sizes: Any) -> Any:
        return self._call("batch_get_into", [-704] * len(keys))

    def batch_put_from(self, keys: Any, ptrs: Any, sizes: Any, *config: Any) -> Any:
        return self._call("batch_put_from", [0] * len(keys))

    def batch_get_into_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, *args: Any) -> Any:
        return self._call("batch_get_into_multi_buffers", [-704] * len(keys))

    def batch_put_from_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, *args: Any) -> Any:
        return self._call("batch_put_from_multi_buffers", [0] * len(keys))

    def get(self, key: str) -> Any:
        return self._call("get", b"")

    def register_buffer(self, ptr: int, size: int) -> int:
        return int(self._call("register_buffer", 0))

    def unregister_buffer(self, ptr: int) -> int:
        return int(self._call("unregister_buffer", 0))

    def close(self) -> int:
        self.closed = True
        self.closes += 1
        return 0


def _wrappers(raw: _RecordingStore) -> dict[str, Any]:
    return {
        "native": NativeMooncakeStore(raw),
        "staged": StagedMooncakeStore(raw, staging_bytes=1 << 16),
        "staged+native": StagedMooncakeStore(NativeMooncakeStore(raw), staging_bytes=1 << 16),
    }


@pytest.mark.parametrize("which", ["native", "staged", "staged+native"])
def test_plugin_wrappers_refuse_every_call_after_close(which: str) -> None:
    raw = _RecordingStore()
    store = _wrappers(raw)[which]
    kv = np.zeros((2, 256), np.uint8)
    base = int(kv.ctypes.data)
    assert store.register_buffer(base, kv.nbytes) == 0
    assert store.batch_is_exist(["k"]) == [0]
    store.close()
    raw.calls.clear()
    calls: list[Any] = [
        lambda: store.batch_is_exist(["k"]),
        lambda: store.batch_get_into(["k"], [base], [256]),
        lambda: store.batch_put_from(["k"], [base], [256]),
        lambda: store.batch_get_into_multi_buffers(["k"], [[base, base + 256]], [[256, 256]]),
        lambda: store.batch_put_from_multi_buffers(["k"], [[base, base + 256]], [[256, 256]]),
        lambda: store.batch_get_into_multi_buffers_arrays(
            ["k"], np.array([[base, base + 256]], np.int64), np.array([[256, 256]], np.int64)
        ),
        lambda: store.get("k"),  # any other Mooncake method reached through the wrapper
        lambda: store.register_buffer(base, kv.nbytes),
    ]
    for call in calls:
        with pytest.raises(StoreClosedError, match="closed"):
            call()
    assert raw.calls == [] and raw.closes == 1
    assert store.close() == 0  # idempotent: Mooncake's close is not called again
    assert raw.calls == [] and raw.closes == 1


@pytest.mark.parametrize("which", ["native", "staged", "staged+native"])
def test_plugin_wrapper_close_waits_for_a_call_in_flight(which: str) -> None:
    raw = _RecordingStore()
    store = _wrappers(raw)[which]
    raw.gate = threading.Event()
    results: list[Any] = []
    caller = threading.Thread(target=lambda: results.append(store.batch_is_exist(["k"])))
    caller.start()
    assert raw.entered.wait(10)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and not raw.closed  # close waits for the call
    with pytest.raises(StoreClosedError):
        store.batch_is_exist(["k"])  # but admits nothing new meanwhile
    raw.gate.set()
    caller.join(10)
    closer.join(10)
    assert results == [[0]] and raw.closed


# ------------------------------------------------------------------------------------------- threads


@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_submit_racing_close_is_either_run_or_refused(monkeypatch: pytest.MonkeyPatch, direction: str) -> None:
    with fake_store(monkeypatch) as (store, _fake):
        cache = Cache(2, 4, 256, seed=2)
        xfer = make_transfer(store, "m", cache, 16, transfer_mode="multi_buffer")
        submit = xfer._workers._submit
        closers: list[threading.Thread] = []

        def close_meanwhile(jobs: Any, request: Any) -> Any:
            # close() runs in another thread right after the submit's closed check passed.
            closer = threading.Thread(target=xfer.close)
            closers.append(closer)
            closer.start()
            closer.join(0.5)
            return submit(jobs, request)

        monkeypatch.setattr(xfer._workers, "_submit", close_meanwhile)
        request = TransferRequest("r", 32, hashes("m", 2), [[1, 2]])
        try:
            future = xfer.submit_load(request) if direction == "load" else xfer.submit_store(request)
        except StoreClosedError:
            future = None  # refused: fine
        if future is not None:
            result = future.result(timeout=10)  # accepted: it must run (it never completed before the fix)
            assert result is not None
        for closer in closers:
            closer.join(10)
            assert not closer.is_alive()
        xfer.close()


# ------------------------------------------------------------------------------------------- regions and rows


@pytest.mark.parametrize("kind", ["readonly", "bytes", "object"])
def test_regions_a_load_cannot_write_as_bytes_are_refused(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A load writes raw bytes into every registered region: read-only memory (an immutable ``bytes`` behind
    the array) would be corrupted or fault inside Mooncake, and an object array holds pointers (a store would
    put process addresses into the shared pool, a load would write garbage pointers)."""
    with fake_store(monkeypatch) as (store, _fake):
        if kind == "readonly":
            region = np.zeros((4, 256), np.uint8)
            region.flags.writeable = False
        elif kind == "bytes":
            region = np.frombuffer(bytes(1024), np.uint8).reshape(4, 256)
        else:
            region = np.empty((4, 32), dtype=object)
        xfer = _transfer(store, "m", "multi_buffer")
        with pytest.raises((TypeError, ValueError), match=r"regions\[1\]"):
            xfer.register_kv_caches([np.zeros((4, 256), np.uint8), region], 4)
        assert xfer.path is None
        xfer.close()


class _WildRows(ChunkedTokenDatabase):
    """A database subclass whose rows point at other memory (a buggy custom planner)."""

    target = 0

    def prepare_values(self, chunks: Any, block_ids: Any) -> Any:
        addrs, sizes, ids = super().prepare_values(chunks, block_ids)
        return [[self.target] * len(row) for row in addrs], sizes, ids

    def prepare_values_array(self, chunks: Any, block_ids: Any) -> Any:
        addrs, sizes, ids = super().prepare_values_array(chunks, block_ids)
        return np.full_like(addrs, self.target), sizes, ids

    def plan_load(self, *args: Any, **kwargs: Any) -> Any:
        plan = super().plan_load(*args, **kwargs)
        return plan._replace(addrs=[[self.target] * len(row) for row in plan.addrs])


@pytest.mark.parametrize("arrays", [False, True])
def test_multi_buffer_rows_from_a_database_subclass_stay_inside_the_caches(
    monkeypatch: pytest.MonkeyPatch, arrays: bool
) -> None:
    secret = np.full(1 << 16, 0x53, np.uint8)
    with fake_store(monkeypatch) as (store, fake):
        if arrays:
            monkeypatch.setattr(type(store), "native_client_active", property(lambda self: True))
        db = _WildRows(KeyMetadata("m", 0, 0, 0, 0), 16)
        db.target = int(secret.ctypes.data)
        xfer = KVTransfer(store, [db], transfer_mode="multi_buffer", start_threads=False)
        cache = Cache(2, 4, 256, seed=9)
        xfer.register_kv_caches(cache.regions, 4)
        h = hashes("m", 2)
        with pytest.raises(ValueError, match="outside the registered"):
            xfer.store(TransferRequest("r", 32, h, [[1, 2]]))
        assert not any(b"\x53" * 64 in v for v in fake.objects.values()), "process memory put into the store"
        fake.objects.update({k: bytes(512) for k in db.keys_for(h)})
        loaded = xfer.load(TransferRequest("r", 32, h, [[1, 2]]))
        assert loaded.failed_block_ids == {1, 2} and not loaded.loaded_block_ids
        assert loaded.error is not None and "outside the registered" in loaded.error
        assert (secret == 0x53).all(), "a load wrote outside the registered caches"
        xfer.close()


def test_direct_rows_from_a_database_subclass_stay_inside_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct path (one region per key) checks a planner's rows against the registered caches on a put as
    on a load: Mooncake's contiguous calls would read or write them unchecked."""
    secret = np.full(1 << 16, 0x53, np.uint8)
    with fake_store(monkeypatch) as (store, fake):
        db = _WildRows(KeyMetadata("m", 0, 0, 0, 0), 16)
        db.target = int(secret.ctypes.data)
        xfer = KVTransfer(store, [db], transfer_mode="auto", start_threads=False)  # one region: direct
        cache = Cache(1, 4, 256, seed=9)
        xfer.register_kv_caches(cache.regions, 4)
        assert xfer.mode == "direct"
        h = hashes("m", 2)
        with pytest.raises(ValueError, match="outside the registered"):
            xfer.store(TransferRequest("r", 32, h, [[1, 2]]))
        assert not any(b"\x53" * 64 in v for v in fake.objects.values()), "process memory put into the store"
        fake.objects.update({k: bytes(256) for k in db.keys_for(h)})
        loaded = xfer.load(TransferRequest("r", 32, h, [[1, 2]]))
        assert loaded.failed_block_ids == {1, 2} and not loaded.loaded_block_ids
        assert loaded.error is not None and "outside the registered" in loaded.error
        assert (secret == 0x53).all(), "a load wrote outside the registered caches"
        xfer.close()


@pytest.mark.parametrize("method", ["prepare_values", "prepare_values_array", "plan_load", "plan_load_arrays"])
def test_one_row_method_replaced_on_a_database_instance_is_not_trusted(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """The database's own type, one of its four row methods replaced on the instance: its rows are checked
    against the registered caches like a subclass's, whichever method it is; the staged load does not use its
    fused plan (rows and slot layout) at all, but plans by the shared walk and loads."""
    secret = np.full(1 << 16, 0x53, np.uint8)
    target = int(secret.ctypes.data)
    arrays = method.endswith(("_array", "_arrays"))
    with fake_store(monkeypatch) as (store, fake):
        if arrays:
            monkeypatch.setattr(type(store), "native_client_active", property(lambda self: True))
        db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
        original = getattr(db, method)

        def wild(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if method.startswith("plan_load"):
                addrs = np.full_like(out.addrs, target) if arrays else [[target] * len(r) for r in out.addrs]
                return out._replace(addrs=addrs)
            addrs, sizes, ids = out
            return (np.full_like(addrs, target) if arrays else [[target] * len(r) for r in addrs]), sizes, ids

        setattr(db, method, wild)
        mode = "staged" if method == "plan_load_arrays" else "multi_buffer"
        xfer = KVTransfer(store, [db], transfer_mode=mode, start_threads=False)
        cache = Cache(2, 4, 256, seed=9)
        xfer.register_kv_caches(cache.regions, 4)
        h = hashes("m", 2)
        if mode == "staged":
            fake.objects.update({k: bytes(512) for k in db.keys_for(h)})
            loaded = xfer.load(TransferRequest("r", 32, h, [[1, 2]]))
            assert loaded.ok and loaded.loaded_block_ids == {1, 2}, loaded
            assert (secret == 0x53).all(), "a load wrote outside the registered caches"
        elif method.startswith("prepare"):
            with pytest.raises(ValueError, match="outside the registered"):
                xfer.store(TransferRequest("r", 32, h, [[1, 2]]))
            assert not any(b"\x53" * 64 in v for v in fake.objects.values()), "process memory put into the store"
        else:
            fake.objects.update({k: bytes(512) for k in db.keys_for(h)})
            loaded = xfer.load(TransferRequest("r", 32, h, [[1, 2]]))
            assert loaded.failed_block_ids == {1, 2} and not loaded.loaded_block_ids
            assert loaded.error is not None and "outside the registered" in loaded.error
            assert (secret == 0x53).all(), "a load wrote outside the registered caches"
        xfer.close()


class _WildSlots(ChunkedTokenDatabase):
    """A database subclass whose fused staged plan lays slots out far past any lease."""

    def plan_load_arrays(self, *args: Any, **kwargs: Any) -> Any:
        plan = super().plan_load_arrays(*args, **kwargs)
        offsets = plan.offsets.copy()
        offsets[1:] += 1 << 40  # every key after the first: a slot 1 TiB past the lease
        return plan._replace(offsets=offsets)


def test_a_staged_slot_layout_from_a_database_subclass_is_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch) as (store, _fake):
        src = Cache(2, 4, 256, seed=4)
        h = hashes("m", 2)
        with make_transfer(store, "m", src, 16, transfer_mode="staged", start_threads=False) as writer:
            assert writer.store(TransferRequest("r", 32, h, [[1, 2]])).ok
        dst = Cache(2, 4, 256)
        xfer = KVTransfer(store, [_WildSlots(KeyMetadata("m", 0, 0, 0, 0), 16)], transfer_mode="staged",
                          start_threads=False)  # fmt: skip
        xfer.register_kv_caches(dst.regions, 4)
        loaded = xfer.load(TransferRequest("r", 32, h, [[1, 2]]))  # crashed inside the get before the fix
        assert loaded.ok and loaded.loaded_block_ids == {1, 2}
        for a, b in zip(src.regions, dst.regions, strict=True):
            np.testing.assert_array_equal(a[1:3], b[1:3])
        xfer.close()


class _RetainedRows(ChunkedTokenDatabase):
    """A database subclass that keeps the rows it returns (and may edit them later, from another thread)."""

    kept: list[Any]

    def prepare_values(self, chunks: Any, block_ids: Any) -> Any:
        rows = super().prepare_values(chunks, block_ids)
        self.kept = rows[0]
        return rows


def test_rows_edited_after_the_check_never_reach_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = np.full(1 << 12, 0x53, np.uint8)
    with fake_store(monkeypatch) as (store, fake):
        db = _RetainedRows(KeyMetadata("m", 0, 0, 0, 0), 16)
        xfer = KVTransfer(store, [db], transfer_mode="multi_buffer", start_threads=False)
        cache = Cache(2, 4, 256, seed=9)
        xfer.register_kv_caches(cache.regions, 4)
        put = store.batch_put_from_multi_buffers

        def edit_then_put(*args: Any, **kwargs: Any) -> Any:
            for row in db.kept:  # what another thread could do right after the driver's check
                row[:] = [int(secret.ctypes.data)] * len(row)
            return put(*args, **kwargs)

        monkeypatch.setattr(store, "batch_put_from_multi_buffers", edit_then_put)
        assert xfer.store(TransferRequest("r", 32, hashes("m", 2), [[1, 2]])).ok
        assert not any(b"\x53" * 64 in v for v in fake.objects.values()), "process memory put into the store"
        xfer.close()


# ------------------------------------------------------------------------------------------- load results


@pytest.mark.parametrize("kind", ["int64 array", "uint32 array", "index objects"])
def test_a_load_that_fails_to_plan_reports_every_named_block_failed(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A planning error (here: hashes of the wrong type) fails the whole load; every block the request names
    must then be in ``failed_block_ids``, whatever integer type the ids came as (vLLM treats a block not
    reported failed as loaded)."""

    class Index:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    ids: Any = {
        "int64 array": np.array([1, 2, 3], dtype=np.int64),
        "uint32 array": np.array([1, 2, 3], dtype=np.uint32),
        "index objects": [Index(1), Index(2), Index(3)],
    }[kind]
    with fake_store(monkeypatch) as (store, _fake):
        cache = Cache(2, 5, 256)
        with make_transfer(store, "m", cache, 16, transfer_mode="multi_buffer", start_threads=False) as xfer:
            loaded = xfer.load(TransferRequest("r", 48, [1, 2, 3], [ids]))  # type: ignore[list-item]
    assert loaded.error is not None and "bytes" in loaded.error
    assert loaded.failed_block_ids == {1, 2, 3} and not loaded.loaded_block_ids
    assert all(type(b) is int for b in loaded.failed_block_ids)


@pytest.mark.parametrize("block_ids", [None, [5], [None], 7])
def test_a_load_with_malformed_block_ids_reports_instead_of_raising(
    monkeypatch: pytest.MonkeyPatch, block_ids: Any
) -> None:
    with fake_store(monkeypatch) as (store, _fake):
        cache = Cache(2, 5, 256)
        with make_transfer(store, "m", cache, 16, transfer_mode="multi_buffer", start_threads=False) as xfer:
            loaded = xfer.load(TransferRequest("r", 48, hashes("m", 3), block_ids))
    assert loaded.error is not None and "TypeError" in loaded.error
    assert not loaded.loaded_block_ids


def test_a_user_index_error_propagates_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = TypeError("my __index__ refuses")

    class Refusing:
        def __index__(self) -> int:
            raise mine

    with fake_store(monkeypatch) as (store, _fake):
        cache = Cache(2, 5, 256)
        with make_transfer(store, "m", cache, 16, transfer_mode="multi_buffer", start_threads=False) as xfer:
            with pytest.raises(TypeError) as raised:
                xfer.store(TransferRequest("r", 32, hashes("m", 2), [[1, Refusing()]]))
            assert raised.value is mine
            loaded = xfer.load(TransferRequest("r", 32, hashes("m", 2), [[1, Refusing()]]))
            assert loaded.error == "TypeError: my __index__ refuses" and loaded.failed_block_ids == {1}


class _ShortAnswers(_RecordingStore):
    """A store whose contiguous calls answer one result too few (or short reads) - never trusted blindly."""

    short_reads = True  # batch_get_into: success with fewer bytes (a failure); else one result too few

    def batch_get_into(self, keys: Any, ptrs: Any, sizes: Any) -> Any:
        return self._call("batch_get_into", [1] * (len(keys) if self.short_reads else len(keys) - 1))

    def batch_get_into_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, *args: Any) -> Any:
        return self._call("batch_get_into_multi_buffers", [512] * (len(keys) - 1))

    def batch_put_from(self, keys: Any, ptrs: Any, sizes: Any, *config: Any) -> Any:
        return self._call("batch_put_from", [0] * (len(keys) - 1))


def test_the_staged_wrapper_never_reports_results_it_did_not_get() -> None:
    raw = _ShortAnswers()
    store = StagedMooncakeStore(raw, staging_bytes=1 << 16)
    kv = np.zeros((4, 256), np.uint8)
    base = int(kv.ctypes.data)
    assert store.register_buffer(base, kv.nbytes) == 0
    addrs = [[base, base + 256], [base + 512, base + 768]]
    sizes = [[256, 256], [256, 256]]
    with pytest.raises(RuntimeError, match="results for 2 keys"):
        store.batch_put_from_multi_buffers(["a", "b"], addrs, sizes)
    kv[:] = 7
    # Short reads are failures (Mooncake's multi-buffer answer, -800), nothing scattered, no second call.
    assert store.batch_get_into_multi_buffers(["a", "b"], addrs, sizes) == [-800, -800]
    assert (kv == 7).all() and raw.calls.count("batch_get_into_multi_buffers") == 0
    raw.short_reads = False
    with pytest.raises(RuntimeError, match="results for 2 keys"):
        store.batch_get_into_multi_buffers(["a", "b"], addrs, sizes)
    assert (kv == 7).all()
    assert store.stats.staged_puts == 1 and store.stats.staged_gets == 2 and store.stats.short_reads == 2
    store.close()


def test_a_lease_inside_another_pools_buffer_is_refused() -> None:
    """A lease must lie inside its own pool's buffer, not merely inside some live staging buffer: another
    pool's slots belong to other requests (before, which buffer a forged lease landed in decided the verdict,
    so a test's outcome depended on where the allocator put the next pool)."""
    from mooncake_kvaddr.driver.staging import check_staging

    a, b = StagingPool(1 << 16), StagingPool(1 << 16)
    forged = StagingLease(a, b.buffer.ptr - a.buffer.ptr, 4096)  # pool a's lease, pointing into b's buffer
    with pytest.raises(ValueError, match="not inside its own pool's staging buffer"):
        check_staging(forged)
    lease = a.acquire(4096)
    assert check_staging(lease) is a.buffer
    lease.release()
