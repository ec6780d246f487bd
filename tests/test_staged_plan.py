"""The staged load's fused plan: one native call per group before the get, one scatter after it.

``StagedPath.plan_get`` must give the same keys, rows and block ids, in the same rotated order, as the shared
walk-then-prepare plan, and a slot layout equal to ``plan_slots`` of its rows (whole and per sub-batch); on a
real store a one-group load makes exactly two calls into the native module (docs/transfer-modes.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr_testing import Cache, Calls, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.core import database as database_module
from mooncake_kvaddr.core import keys as keys_module
from mooncake_kvaddr.driver import staging as staging_module
from mooncake_kvaddr.driver.bounds import RegisteredCaches
from mooncake_kvaddr.driver.paths import PathContext, StagedPath, TransferPath, _sub_plan
from mooncake_kvaddr.driver.rules import estimate_staging_bytes
from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT, StagingPool, plan_slots
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import TransferRequest

mooncake = pytest.mark.mooncake


def _paths(groups: int, block_size: int, block_lens: list[int], num_blocks: int) -> tuple[StagedPath, TransferPath]:
    dbs = [ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0, group_id=g), block_size) for g in range(groups)]
    bases = [(r + 1) << 32 for r in range(len(block_lens))]
    for db in dbs:
        db.set_kv_caches_base_addr(bases)
        db.set_block_len(block_lens)
    caches = RegisteredCaches(num_blocks, tuple(bases), tuple(block_lens), ())
    ctx = PathContext(store=None, databases=dbs, caches=caches, replicate_config=None, metrics=None)  # type: ignore[arg-type]
    return StagedPath(ctx, None, None), TransferPath(ctx)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 3),
    block_lens=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    chunks=st.integers(0, 12),
    tail=st.integers(0, 15),
    skip_chunks=st.integers(0, 14),
    tp_rank=st.integers(0, 40),
    seed=st.integers(0, 1 << 16),
)
def test_fused_plan_equals_the_walk_then_prepare_plan(
    groups: int, block_lens: list[int], chunks: int, tail: int, skip_chunks: int, tp_rank: int, seed: int
) -> None:
    bs = 16
    num_blocks = 64
    staged, shared = _paths(groups, bs, block_lens, num_blocks)
    rng = np.random.default_rng(seed)
    token_len = chunks * bs + tail
    h = [bytes(rng.integers(0, 256, 8, dtype=np.uint8)) for _ in range(chunks + 1)]
    ids = [rng.integers(0, num_blocks, chunks + 1).tolist() for _ in range(groups)]
    screened = [staged.ctx.caches.screen(i) for i in ids]
    skip = skip_chunks * bs
    try:
        reference = shared.plan_get(token_len, h, screened, skip, tp_rank)
    except (ValueError, IndexError) as exc:  # a ragged tail: the fused plan refuses it the same way
        with pytest.raises(type(exc)):
            staged.plan_get(token_len, h, screened, skip, tp_rank)
        return
    fused = staged.plan_get(token_len, h, screened, skip, tp_rank)
    assert fused.keys == reference.keys
    if not reference.keys:
        return
    # The fused plan leaves the rows in walk order: key i's row is (i + row_shift) % n.
    assert fused.row_shift == (tp_rank % len(fused.keys) if len(fused.keys) else 0)
    rows = (np.arange(len(fused.keys)) + fused.row_shift) % len(fused.keys)
    assert np.asarray(fused.addrs)[rows].tolist() == np.asarray(reference.addrs).tolist()
    assert np.asarray(fused.sizes)[rows].tolist() == np.asarray(reference.sizes).tolist()
    assert np.asarray(fused.block_ids).tolist() == np.asarray(reference.block_ids).tolist()
    assert fused.key_bytes() == reference.key_bytes()
    assert fused.slots is not None
    n = len(fused.keys)
    for start, end in ((0, n), (0, n // 2), (n // 3, n), (n // 2, n // 2 + 1)):
        if start >= end:
            continue
        want = plan_slots(np.ascontiguousarray(np.asarray(reference.sizes)[start:end]))
        got = _sub_plan(fused.slots, start, end)
        assert got.offsets.tolist() == want.offsets.tolist()
        assert got.object_sizes.tolist() == want.object_sizes.tolist()
        assert got.total_bytes == want.total_bytes
        assert (got.offsets % SLOT_ALIGNMENT == 0).all()


def test_an_invalid_block_id_takes_the_shared_plan_and_drops_its_chunk() -> None:
    staged, shared = _paths(1, 16, [64, 32], 8)
    h = [bytes([i]) * 8 for i in range(6)]
    screened = [staged.ctx.caches.screen([1, 2, 99, 3, 4, 5])]
    fused = staged.plan_get(6 * 16, h, screened, 0, 1)
    reference = shared.plan_get(6 * 16, h, screened, 0, 1)
    assert fused.invalid == reference.invalid and 99 in fused.invalid and fused.dropped == 1
    assert fused.keys == reference.keys and len(fused.keys) == 5
    assert fused.slots is None  # the get lays its slots out from the rows


def test_an_invalid_block_id_in_one_group_of_two_takes_the_shared_plan() -> None:
    """Group 1 names an invalid id, group 0 does not: the whole request takes the shared plan, which drops the
    one chunk on it (the fused plan would have built rows for it)."""
    staged, shared = _paths(2, 16, [64, 32], 8)
    h = [bytes([i]) * 8 for i in range(4)]
    screened = [staged.ctx.caches.screen([1, 2, 3, 4]), staged.ctx.caches.screen([5, 99, 6, 7])]
    fused = staged.plan_get(4 * 16, h, screened, 0, 0)
    reference = shared.plan_get(4 * 16, h, screened, 0, 0)
    assert fused.invalid == reference.invalid and set(fused.invalid) == {99} and fused.dropped == 1
    assert fused.keys == reference.keys and len(fused.keys) == 7
    np.testing.assert_array_equal(np.asarray(fused.block_ids), [1, 2, 3, 4, 5, 6, 7])
    assert fused.slots is None


class NativeSpy:
    """Counts every call into the native module made through the names the planning and copy code use."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        self._monkeypatch = monkeypatch
        for name in ("chunk_walk", "build_key"):
            monkeypatch.setattr(database_module, name, self._wrap(name, getattr(database_module, name)))
        monkeypatch.setattr(keys_module, "_native", self._proxy(keys_module._native))
        monkeypatch.setattr(staging_module, "_native", self._proxy(staging_module._native))

    def watch(self, db: ChunkedTokenDatabase) -> None:
        """Count the database's engine calls too (walk, keys, rows and plans)."""
        self._monkeypatch.setattr(db._layout, "_engine", self._proxy(db._layout._engine))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return fn(*args, **kwargs)

        return counted

    def _proxy(self, target: Any) -> Any:
        spy = self

        class Proxy:
            def __getattr__(self, name: str) -> Any:
                value = getattr(target, name)
                return spy._wrap(name, value) if callable(value) and not isinstance(value, type) else value

        return Proxy()


@mooncake
@pytest.mark.parametrize(("groups", "tp_rank"), [(1, 0), (1, 3), (2, 0), (2, 5)])
def test_a_staged_load_crosses_once_per_group_then_once_to_scatter(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch, groups: int, tp_rank: int
) -> None:
    bs, chunks, regions = 16, 9, 7
    src = Cache(regions, groups * chunks + 1, 320, seed=21)
    dst = Cache(regions, groups * chunks + 1, 320, fill=5)
    h = hashes(model, chunks)
    ids = [[1 + g * chunks + i for i in range(chunks)] for g in range(groups)]
    with (
        transfer(store, model, src, bs, groups=groups, transfer_mode="staged") as writer,
        transfer(store, model, dst, bs, groups=groups, transfer_mode="staged", tp_rank=tp_rank) as reader,
    ):
        assert writer.store(TransferRequest("r", chunks * bs, h, ids)).stored == groups * chunks
        spy = NativeSpy(monkeypatch)
        for db in reader.databases:
            spy.watch(db)
        loaded = reader.load(TransferRequest("r", chunks * bs, h, ids))
        assert loaded.ok and loaded.mode == "staged" and loaded.bytes == groups * chunks * regions * 320
        all_ids = [b for group in ids for b in group]
        assert_blocks_equal(src, all_ids, dst, all_ids)
        calls = list(spy.calls)  # the load's crossings (close() then releases the region pins: not the load's)
    assert calls == ["plan_load"] * groups + ["_staging_scatter"]


@mooncake
@pytest.mark.parametrize("tp_rank", [0, 4, 11])
def test_a_small_pool_scatters_each_batch_into_the_right_rows(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch, tp_rank: int
) -> None:
    # Rotated keys whose batches wrap around the walk order; one key missing: its blocks stay untouched.
    bs, chunks, regions, groups = 16, 7, 3, 2
    src = Cache(regions, groups * chunks + 1, 1000, seed=22)
    dst = Cache(regions, groups * chunks + 1, 1000, fill=6)
    h = hashes(model, chunks)
    ids = [[1 + g * chunks + i for i in range(chunks)][::-1] for g in range(groups)]
    with (
        transfer(store, model, src, bs, groups=groups, transfer_mode="staged") as writer,
        transfer(
            store, model, dst, bs, groups=groups, tp_rank=tp_rank, staging_pool=StagingPool(3 * regions * 1024)
        ) as reader,
    ):
        assert writer.store(TransferRequest("r", chunks * bs, h, ids)).stored == groups * chunks
        assert store.batch_remove([writer.databases[1].key_for(h[2])], force=True).ok
        spy = NativeSpy(monkeypatch)
        for db in reader.databases:
            spy.watch(db)
        loaded = reader.load(TransferRequest("r", chunks * bs, h, ids))
        calls = list(spy.calls)  # the load's crossings (close() then releases the region pins: not the load's)
    missing = ids[1][2]
    good = [b for group in ids for b in group if b != missing]
    assert loaded.failed_block_ids == {missing} and loaded.loaded_block_ids == set(good)
    assert_blocks_equal(src, good, dst, good)
    assert all((region[[0, missing]] == 6).all() for region in dst.regions)
    batches = calls.count("_staging_scatter")
    assert calls == ["plan_load"] * groups + ["_staging_scatter"] * batches and batches >= 4


@mooncake
@pytest.mark.parametrize("tp_rank", [3, 8])
def test_a_rotated_load_split_by_the_disk_offload_budget_scatters_each_part_into_its_rows(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch, tp_rank: int
) -> None:
    """The disk-offload split (docs/transfer-modes.md) hands the staged get keys [start, end) of a rotated plan
    whose rows stay in walk order: a later part must scatter into its own keys' rows, not the first part's."""
    bs, chunks = 16, 10
    src, dst = Cache(2, chunks + 1, 1024, seed=9), Cache(2, chunks + 1, 1024, fill=3)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    with transfer(store, model, src, bs, transfer_mode="staged") as writer:
        assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).ok
    calls = Calls(store, monkeypatch)
    budget = 4 * estimate_staging_bytes(2048)  # usable 90 %: three 2 KiB keys per part
    with transfer(
        store, model, dst, bs, transfer_mode="staged", tp_rank=tp_rank, disk_offload_buffer_budget_bytes=budget
    ) as reader:
        loaded = reader.load(TransferRequest("r", chunks * bs, h, [ids]))
    assert calls.named("batch_get_into") == [3, 3, 3, 1]  # four parts, the later ones starting past key 0
    assert loaded.ok and loaded.loaded_block_ids == set(ids)
    assert_blocks_equal(src, ids, dst, ids)


def test_a_sub_plan_starts_at_zero_so_a_batch_leases_only_its_own_keys() -> None:
    """Keys [start, end) of a fused slot layout equal plan_slots of their sizes alone: a later sub-batch (a
    split load) must not lease the bytes of the keys before it."""
    sizes = np.array([[100, 28], [64, 64], [1, 0], [4096, 1], [7, 9], [64, 0]], np.int64)
    whole = plan_slots(sizes)
    for start, end in ((1, 3), (2, 6), (5, 6), (0, 6), (3, 4)):
        got = _sub_plan(whole, start, end)
        want = plan_slots(np.ascontiguousarray(sizes[start:end]))
        assert got.offsets.tolist() == want.offsets.tolist(), (start, end)
        assert got.object_sizes.tolist() == want.object_sizes.tolist()
        assert got.total_bytes == want.total_bytes < whole.total_bytes or (start, end) == (0, 6)
