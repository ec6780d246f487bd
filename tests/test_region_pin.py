"""A transfer pins its databases' regions: a list edited after the transfer's own check never reaches Mooncake.

A database keeps references to the caller's region lists and re-reads them on every call, so another thread
can edit one in place between :meth:`RegisteredCaches.check_databases` and the native call that computes
addresses from it. ``KVTransfer.register_kv_caches`` therefore pins each database's native table to the
registered regions, and every call compares the values it just read with the pinned ones inside the call
(csrc/bindings/region_pin.hpp; SECURITY.md). Here the "other thread" runs deterministically right after the
check (the check is wrapped), in every transfer mode; then the pin's life cycle: taken before anything
changes, refused for other values, released by ``close`` and by a failed registration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fake_mooncake import fake_store
from kvaddr_testing import Cache, hashes, make_transfer
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver import bounds
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest
from mooncake_kvaddr.integrations.vllm.data import KeyMetadata as LayoutKeyMetadata
from mooncake_kvaddr.integrations.vllm.data import RankLocalStoreLayout

CHANGED = "changed after register_kv_caches"


def _edit_right_after_the_check(monkeypatch: pytest.MonkeyPatch, edit: Callable[[Any], None]) -> list[int]:
    """Wrap the transfer's region check so that ``edit(database)`` runs right after it passed (what another
    thread could do at that moment); returns the list of how many times it ran."""
    original = bounds.RegisteredCaches.check_databases
    ran = [0]

    def check_then_edit(self: bounds.RegisteredCaches, databases: Any) -> None:
        original(self, databases)
        for db in databases:
            edit(db)
        ran[0] += 1

    monkeypatch.setattr(bounds.RegisteredCaches, "check_databases", check_then_edit)
    return ran


@pytest.mark.parametrize("mode", ["multi_buffer", "auto", "staged"])
@pytest.mark.parametrize("what", ["base", "block_len"])
def test_a_region_list_edited_after_the_check_moves_nothing(
    monkeypatch: pytest.MonkeyPatch, mode: str, what: str
) -> None:
    regions = 1 if mode == "auto" else 2  # auto: one region per key, the direct path
    secret = np.full(1 << 16, 0x41, np.uint8)
    with fake_store(monkeypatch) as (store, fake):
        src = Cache(regions, 9, 64, seed=1)
        with make_transfer(store, "m", src, 16, transfer_mode=mode, start_threads=False) as xfer:
            h = hashes("m", 1)
            assert xfer.store(TransferRequest("r", 16, h, [[1]])).ok  # the healthy path first
            stored = dict(fake.objects)

            def edit(db: Any) -> None:
                if what == "base":
                    db.kv_caches_base_addr[0] = int(secret.ctypes.data)  # in place: the same list object
                else:
                    db.block_len[0] = 1 << 20  # block 1 then lies 1 MiB past the region

            ran = _edit_right_after_the_check(monkeypatch, edit)
            h2 = hashes("m2", 1)
            with pytest.raises(ValueError, match=CHANGED):
                xfer.store(TransferRequest("r2", 16, h2, [[1]]))
            assert ran[0] >= 1 and fake.objects == stored  # nothing new reached the store
            before = src.snapshot()
            loaded = xfer.load(TransferRequest("r", 16, h, [[1]]))
            assert loaded.failed_block_ids == {1} and CHANGED in (loaded.error or ""), loaded
            for region, old in zip(src.regions, before, strict=True):
                assert region.tobytes() == old.tobytes()
            assert not (secret != 0x41).any()


def test_pins_are_released_by_close_and_refuse_other_regions_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch) as (store, _fake):
        db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
        a, b = Cache(2, 9, 64, seed=1), Cache(2, 9, 64, seed=2)
        first = KVTransfer(store, [db], start_threads=False, transfer_mode="multi_buffer")
        first.register_kv_caches(a.regions, 9)
        assert db._layout._engine.region_pins == 1
        # The same database over other caches: refused before anything changed (the first still works).
        second = KVTransfer(store, [db], start_threads=False, transfer_mode="multi_buffer")
        with pytest.raises(ValueError, match="pinned to other values"):
            second.register_kv_caches(b.regions, 9)
        assert db._layout._engine.region_pins == 1 and second.mode == "multi_buffer" and second.path is None
        assert first.store(TransferRequest("r", 16, hashes("m", 1), [[1]])).ok
        # The same caches again: a second pin of the same values.
        third = KVTransfer(store, [db], start_threads=False, transfer_mode="multi_buffer")
        third.register_kv_caches(a.regions, 9)
        assert db._layout._engine.region_pins == 2
        third.close()
        first.close()
        second.close()
        assert db._layout._engine.region_pins == 0
        db.set_kv_caches_base_addr([1 << 20, 2 << 20])  # unpinned: the database is the caller's again
        assert db.prepare_values([(0, 16)], [1])[0] == [[(1 << 20) + 64, (2 << 20) + 64]]


def test_a_failed_registration_releases_its_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch) as (store, _fake):
        db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
        xfer = KVTransfer(store, [db], start_threads=False, transfer_mode="multi_buffer")
        broken = RuntimeError("register_buffer failed")

        def fail(*_args: Any) -> None:
            raise broken

        monkeypatch.setattr(store, "register_buffer", fail)
        with pytest.raises(RuntimeError, match="register_buffer failed"):
            xfer.register_kv_caches(Cache(2, 9, 64, seed=1).regions, 9)
        assert db._layout._engine.region_pins == 0
        xfer.close()


@pytest.mark.parametrize("what", ["base", "block_len"])
def test_the_rank_local_layout_engine_refuses_edited_regions_while_pinned(what: str) -> None:
    layout = RankLocalStoreLayout(LayoutKeyMetadata("m", 0, 0, 0, 0), 16, 16)
    bases, lens = [1 << 30, 2 << 30], [256, 256]
    layout.set_kv_caches_base_addr(bases)
    layout.set_block_len(lens)
    layout._pin_regions(list(bases), list(lens))
    assert layout.prepare_values([(0, 16)], [3], [0])[0] == [[(1 << 30) + 768, (2 << 30) + 768]]
    if what == "base":
        bases[1] = 7 << 30
    else:
        lens[0] = 4096
    with pytest.raises(ValueError, match=CHANGED):
        layout.prepare_values([(0, 16)], [3], [0])
    with pytest.raises(ValueError, match=CHANGED):
        layout.prepare_values_array([(0, 16)], [3], [0])
    layout._unpin_regions()
    assert len(layout.prepare_values([(0, 16)], [3], [0])[0][0]) == 2  # the caller's regions again


class _Mutating:
    """An item whose ``__index__`` empties the list being read (a hostile caller)."""

    def __init__(self, target: list[Any], value: int) -> None:
        self.target, self.value = target, value

    def __index__(self) -> int:
        self.target.clear()
        return self.value


@pytest.mark.parametrize("engine", ["table", "layout"])
def test_pin_regions_refuses_hostile_input_cleanly(engine: str) -> None:
    from mooncake_kvaddr import _native

    def make() -> Any:
        if engine == "table":
            return _native.LayoutEngine(16, 16, False, 0, 1, 0, seed_rules=True)
        return _native.LayoutEngine(16, 16, False, 0, 1, 0)

    for bases, lens, error in [
        ({1: 2}, [64], TypeError), ("ab", [64], TypeError), ([1.5], [64], TypeError), (None, [64], TypeError),
        ([1 << 64], [64], OverflowError), ([-(1 << 64)], [64], OverflowError), ([1 << 20], iter([64]), TypeError),
    ]:
        target = make()
        with pytest.raises(error):
            target.pin_regions(bases, lens)
        assert target.region_pins == 0  # nothing pinned by a refused call
    target = make()
    hostile: list[Any] = [1 << 20, 2 << 20]
    hostile.insert(0, _Mutating(hostile, 3 << 20))
    target.pin_regions(hostile, [64])  # reads what is there while it reads (the list shrank to nothing): no crash
    assert target.region_pins == 1 and hostile == []
    target.unpin_regions()
    target.pin_regions([1 << 20], [64])
    with pytest.raises(ValueError, match="pinned to other values"):
        target.pin_regions([2 << 20], [64])
    target.unpin_regions()
    target.unpin_regions()  # one more than held: a no-op, never negative
    assert target.region_pins == 0


@pytest.mark.parametrize("engine", ["table", "layout"])
def test_a_second_pin_must_match_bases_and_block_lengths(engine: str) -> None:
    """Pinned regions are (bases, block lengths) together: the same bases with other block lengths are other
    regions (their slices reach other memory) and are refused like other bases."""
    from mooncake_kvaddr import _native

    target: Any = _native.LayoutEngine(16, 16, False, 0, 1, 0, seed_rules=engine == "table")
    target.pin_regions([1 << 20, 2 << 20], [64, 64])
    with pytest.raises(ValueError, match="pinned to other values"):
        target.pin_regions([1 << 20, 2 << 20], [64, 128])
    with pytest.raises(ValueError, match="pinned to other values"):
        target.pin_regions([1 << 20, 3 << 20], [64, 64])
    target.pin_regions([1 << 20, 2 << 20], [64, 64])  # the same values: a second pin
    target.unpin_regions()
    target.unpin_regions()
    target.pin_regions([1 << 20, 2 << 20], [64, 128])  # released: other values may be pinned now
