"""KVTransfer over vLLM 0.33-style layout databases (driver/groups.py), against a real master."""

from __future__ import annotations

import contextlib
import types
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr_testing import hashes
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver.groups import LayoutGroup
from mooncake_kvaddr.driver.lookup import TailKeyBoundary
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest
from mooncake_kvaddr.integrations.vllm import data as M

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.mooncake

NB = 16  # blocks per cache


def _vllm_data() -> Any:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as V
    except Exception as exc:  # any import failure means: no vLLM to compare with
        pytest.skip(f"vLLM 0.33's data module is not importable here: {exc!r}")
    return V


def _rank_local_caches(seed: int, layers: int = 2, per_block: int = 24) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand((NB, per_block), generator=gen) for _ in range(layers)]


def _request(tag: str, token_len: int, block_ids: list[int], n_hashes: int) -> TransferRequest:
    return TransferRequest(tag, token_len, hashes(tag, n_hashes), [block_ids])


@pytest.mark.parametrize("mode", ["multi_buffer", "staged"])
def test_rank_local_round_trip_bytes_and_vllm_keys(store: MooncakeStore, model: str, mode: str) -> None:
    bs = 8
    md = M.KeyMetadata(model, 1, 0, 0, 0)
    db = M.ChunkedTokenDatabase(md, bs, 4)
    caches = _rank_local_caches(1)
    with KVTransfer(store, [db], transfer_mode=mode, start_threads=False, tp_rank=1) as transfer:
        transfer.register_kv_caches(caches, NB)
        assert transfer.mode == mode
        saved = transfer.store(_request("r", 32, [1, 2, 3, 4], 8))
        assert saved.stored == 4 and not saved.failed_keys
        got = transfer.load(TransferRequest("r", 32, hashes("r", 8), [[5, 6, 7, 8]]))
        assert got.failed_block_ids == set() and got.loaded_block_ids == {5, 6, 7, 8}
    for cache in caches:
        assert torch.equal(cache[5:9], cache[1:5])
        assert not torch.equal(cache[9], cache[1])  # untouched blocks stay as they were
    # The objects sit under the keys vLLM 0.33's own rank-local layout builds.
    V = _vllm_data()
    layout = V.RankLocalStoreLayout(V.KeyMetadata(model, 1, 0, 0, 0), bs, 4)
    chained = hashes("r", 8)
    expected = [layout.key_for(0, chained[i]) for i in (1, 3, 5, 7)]
    assert store.batch_is_exist(expected).present == [True] * 4


def _packed(fmt: str, local_heads: int, seed: int, bs: int, content: int = 6) -> Any:
    """A packed cache of logical shape (NB, local heads, block, content) in the format's memory order."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == "lbhnc":
        return torch.rand((NB, local_heads, bs, content), generator=gen)
    return torch.rand((NB, bs, local_heads, content), generator=gen).permute(0, 2, 1, 3)


LAYOUTS = {"lbhnc": M.LBHNCStoreLayout, "lbnhc": M.LBNHCStoreLayout}


def _sharded_db(fmt: str, model: str, local_tp: int, store_tp: int, rank: int, heads: int, bs: int) -> Any:
    cls = LAYOUTS[fmt]
    md = M.KeyMetadata(model, rank, 0, 0, 0, store_namespace=cls.shared_namespace(store_tp, 1))
    layout = cls(md, bs, bs, local_tp, store_tp, rank, heads)
    return M.ChunkedTokenDatabase(md, bs, bs, layout)


@pytest.mark.parametrize("fmt", ["lbhnc", "lbnhc"])
def test_tp_shared_written_at_tp4_read_at_tp2(store: MooncakeStore, model: str, fmt: str) -> None:
    bs, heads, store_tp = 4, 8, 4
    chained = hashes("s", 3)
    writers = []
    for rank in range(4):  # local TP 4: one store shard per rank
        caches = [_packed(fmt, heads // 4, 10 * rank + layer, bs) for layer in range(2)]
        db = _sharded_db(fmt, model, 4, store_tp, rank, heads, bs)
        with KVTransfer(store, [db], start_threads=False, tp_rank=rank) as transfer:
            transfer.register_kv_caches(caches, NB)
            if rank == 0:
                # Before every shard is written a TP-shared chunk is not reusable.
                assert transfer.lookup_with_boundaries(13, chained).hit_length == 0
            saved = transfer.store(TransferRequest("s", 12, chained, [[3, 4, 5]]))
            assert saved.stored == 3 and not saved.failed_keys
        writers.append(caches)
    for rank in range(2):  # local TP 2: two store shards per rank
        caches = [torch.zeros_like(_packed(fmt, heads // 2, 0, bs)) for _ in range(2)]
        db = _sharded_db(fmt, model, 2, store_tp, rank, heads, bs)
        with KVTransfer(store, [db], start_threads=False, tp_rank=rank) as transfer:
            transfer.register_kv_caches(caches, NB)
            assert transfer.mode == "multi_buffer"
            found = transfer.lookup_with_boundaries(13, chained)
            assert found.hit_length == 12
            assert [(b.group_id, b.num_tokens) for b in found.tail_key_boundaries] == [(0, 12)]
            got = transfer.load(
                TransferRequest("s", 12, chained, [[7, 8, 9]], tail_key_boundaries=found.tail_key_boundaries)
            )
            assert got.failed_block_ids == set() and got.loaded_block_ids == {7, 8, 9}
        for layer in range(2):
            expected = torch.cat([writers[2 * rank][layer][3:6], writers[2 * rank + 1][layer][3:6]], dim=1)
            assert torch.equal(caches[layer][7:10], expected)
            assert not caches[layer][10:].any()


def test_tp_shared_keys_equal_vllm_key_for(model: str) -> None:
    V = _vllm_data()
    bs, heads = 4, 8
    chained = hashes("k", 5)
    for fmt, vcls in (("lbhnc", V.LBHNCStoreLayout), ("lbnhc", V.LBNHCStoreLayout)):
        for rank in range(2):
            group = LayoutGroup(_sharded_db(fmt, model, 2, 4, rank, heads, bs))
            vmd = V.KeyMetadata(model, rank, 0, 0, 0, store_namespace=vcls.shared_namespace(4, 1))
            vlayout = vcls(vmd, bs, bs, 2, 4, rank, heads)
            expected = [vlayout.key_for(shard, chained[c]) for c in range(1, 5) for shard in vlayout.local_shard_ids]
            plan = group.plan_store(20, chained, [9, 1, 2, 3, 4], 2)  # chunk 0: masked (vLLM's ceil rule)
            assert plan.keys == expected
            assert group.walk_load(20, chained, 4).keys == expected
            # Chunks on the NULL block 0 or past the block ids are never stored.
            kept = [vlayout.key_for(shard, chained[c]) for c in (0, 1, 3) for shard in vlayout.local_shard_ids]
            assert group.plan_store(20, chained, [9, 1, 0, 3]).keys == kept
            prefixes = group.layout.lookup_key_prefixes([(rank, 0, 0, 0)])
            assert list(prefixes) == list(vlayout.lookup_key_prefixes([(rank, 0, 0, 0)]))


@pytest.mark.parametrize("mode", ["multi_buffer", "staged", "multi_buffer_lists"])
def test_tail_key_boundary_load(store: MooncakeStore, store_config: Any, model: str, mode: str) -> None:
    """A load keyed by a tail-key boundary reads the boundary's object, on each path: the walk (native client
    on, or staged) and, without the native client, the fused list plan (``plan_load`` per group)."""
    bs = 4
    db = M.ChunkedTokenDatabase(M.KeyMetadata(model, 0, 0, 0, 0), bs, bs)
    caches = _rank_local_caches(2)
    chained = hashes("t", 4)
    with contextlib.ExitStack() as stack:
        if mode == "multi_buffer_lists":
            store = stack.enter_context(MooncakeStore(store_config, native_client=False))
            mode = "multi_buffer"
            assert not store.native_client_active
        with KVTransfer(store, [db], transfer_mode=mode, start_threads=False) as transfer:
            transfer.register_kv_caches(caches, NB)
            assert transfer.store(TransferRequest("t", 16, chained, [[1, 2, 3, 4]])).stored == 4
            found = transfer.lookup_with_boundaries(17, chained)
            assert found.hit_length == 16 and found.tail_key_boundaries == (TailKeyBoundary(0, 16),)
            # A 12-token load whose tail is stored under the 16-token key: its last chunk reads block 4's object.
            boundary = M.TailKeyBoundary(0, 16)
            got = transfer.load(TransferRequest("t", 12, chained, [[5, 6, 7]], tail_key_boundaries=[boundary]))
            assert got.failed_block_ids == set()
            # Without the boundary the same load keys its last chunk by its own hash.
            assert transfer.load(TransferRequest("t", 12, chained, [[8, 9, 10]])).failed_block_ids == set()
            group = transfer.databases[0]
            assert isinstance(group, LayoutGroup)
            tail_keys = group.walk_load(12, chained, 0, group.tail_tokens(16)).keys
            assert group.plan_load(12, chained, [5, 6, 7], 0, 16).keys == tail_keys
            assert tail_keys[-1] == db.key_for(chained[3]) and group.walk_load(12, chained).keys[-1] == db.key_for(
                chained[2])
            with pytest.raises(ValueError, match="group_id"):
                transfer.load(TransferRequest("t", 12, chained, [[5, 6, 7]],
                                              tail_key_boundaries=[M.TailKeyBoundary(1, 16)]))
    for cache in caches:
        assert torch.equal(cache[5:7], cache[1:3]) and torch.equal(cache[7], cache[4])
        assert torch.equal(cache[8:11], cache[1:4])


@pytest.mark.parametrize("mode", ["multi_buffer", "staged"])
def test_submit_load_carries_tail_key_boundaries(store: MooncakeStore, model: str, mode: str) -> None:
    bs = 4
    groups = [M.ChunkedTokenDatabase(M.KeyMetadata(f"{model}-g{g}", 0, 0, 0, 0), bs, bs) for g in range(2)]
    caches = _rank_local_caches(5)
    chained = hashes("q", 4)
    with KVTransfer(store, groups, transfer_mode=mode, num_recv_threads=2) as transfer:
        transfer.register_kv_caches(caches, NB)
        assert transfer.store(TransferRequest("q", 16, chained, [[1, 2, 3, 4]] * 2)).stored == 8
        # Group 1's tail is keyed by the 16-token boundary (block 4's object), group 0's by its own hash:
        # as pairs through a receive thread, or TailKeyBoundary objects through load.
        request = TransferRequest("q", 12, chained, [[5, 6, 7], [8, 9, 10]], tail_key_boundaries=((1, 16),))
        got = transfer.submit_load(request).result(timeout=60)
        assert got.failed_block_ids == set() and got.loaded_block_ids == {5, 6, 7, 8, 9, 10}
        same = transfer.load(TransferRequest("q", 12, chained, [[11, 12, 13], [11, 12, 13]],
                                             tail_key_boundaries=[M.TailKeyBoundary(1, 16)]))
        assert same.failed_block_ids == set()
        # The boundary is the request's own: a later request without one keys its tail by its own hash.
        plain = transfer.submit_load(TransferRequest("q", 12, chained, [[14, 14, 14], [14, 14, 14]]))
        assert plain.result(timeout=60).failed_block_ids == set()
        group = transfer.databases[1]
        assert isinstance(group, LayoutGroup)
        assert group.walk_load(12, chained).keys[-1] == groups[1].key_for(chained[2])  # no boundary left behind
        for bad, error, match in (
            (((2, 16),), ValueError, "group_id 2"),
            (((0, 16), (0, 12)), ValueError, "twice"),
            ((("0", 16),), ValueError, "group_id"),
            ((object(),), TypeError, "TailKeyBoundary"),
            ((types.SimpleNamespace(group_id=0),), TypeError, "TailKeyBoundary"),  # a group without tokens
            (((0, 0),), ValueError, "below one hash block"),
        ):
            with pytest.raises(error, match=match):
                transfer.submit_load(TransferRequest("q", 12, chained, [[5, 6, 7]] * 2,
                                                     tail_key_boundaries=bad)).result(timeout=60)
    for cache in caches:
        assert torch.equal(cache[5:7], cache[1:3]) and torch.equal(cache[7], cache[3])
        assert torch.equal(cache[8:10], cache[1:3]) and torch.equal(cache[10], cache[4])


def test_tail_key_boundaries_need_layout_databases(store: MooncakeStore, model: str) -> None:
    from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, KVTransfer

    db = ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0), 4)
    with KVTransfer(store, [db], start_threads=False) as transfer:
        transfer.register_kv_caches([np.zeros((NB, 64), np.uint8)], NB)
        with pytest.raises(ValueError, match="only a transfer over layout databases"):
            transfer.load(TransferRequest("x", 8, hashes("x", 2), [[1, 2]], tail_key_boundaries=((0, 8),)))


def test_lookup_with_boundaries_partial_hit(store: MooncakeStore, model: str) -> None:
    db = M.ChunkedTokenDatabase(M.KeyMetadata(model, 0, 0, 0, 0), 4, 4)
    caches = _rank_local_caches(3)
    chained = hashes("l", 6)
    with KVTransfer(store, [db], start_threads=False) as transfer:
        transfer.register_kv_caches(caches, NB)
        assert transfer.lookup_with_boundaries(24, chained).hit_length == 0
        transfer.store(TransferRequest("l", 8, chained, [[1, 2]]))
        found = transfer.lookup_with_boundaries(24, chained)
        assert (found.hit_length, found.tail_key_boundaries) == (8, (TailKeyBoundary(0, 8),))
        assert transfer.lookup(24, chained) == 8


def test_layout_group_refusals(store: MooncakeStore, model: str) -> None:
    db = _sharded_db("lbhnc", model, 2, 4, 0, 8, 4)
    with pytest.raises(ValueError, match="multi_buffer"):
        KVTransfer(store, [db], transfer_mode="staged", start_threads=False)
    with pytest.raises(TypeError, match="layout ChunkedTokenDatabase"):
        LayoutGroup(object())  # type: ignore[arg-type]
    group = LayoutGroup(db)
    with pytest.raises(ValueError, match="shard_id"):
        group.prepare_values([(0, 4)], [1])
    with pytest.raises(ValueError, match="below one hash block"):
        group.tail_tokens(0)
    # A TP-shared layout whose caches were never registered has no segments: nothing may move.
    with pytest.raises(RuntimeError, match="register its KV caches"):
        group.prepare_values_array(np.asarray([[0, 4, 0], [0, 4, 1]]), [1])
    with pytest.raises(RuntimeError, match="register its KV caches"):
        group.plan_load(4, hashes("x", 1), [1])
    caches = [torch.zeros((NB, 4, 4, 6)) for _ in range(2)]
    with KVTransfer(store, [db], start_threads=False) as transfer:
        # Its segments follow the tensors' shape and strides: numpy arrays are refused before anything registers.
        with pytest.raises(TypeError, match="needs CPU tensors"):
            transfer.register_kv_caches([c.numpy() for c in caches], NB)
        with pytest.raises(ValueError, match="num_blocks: must be >= 1"):  # checked before any segment is derived
            transfer.register_kv_caches(caches, 0)
        assert transfer.path is None and db.store_layout.segment_templates[1] == ()
        transfer.register_kv_caches(caches, NB)
        db.store_layout._set_segment_templates([([], [], [])] * 2)  # a layout left without segments
        with pytest.raises(RuntimeError, match="register its KV caches"):
            transfer.store(TransferRequest("x", 4, hashes("x", 1), [[1]]))
        loaded = transfer.load(TransferRequest("x", 4, hashes("x", 1), [[1]]))
        assert loaded.failed_block_ids == {1} and "register its KV caches" in (loaded.error or "")
        assert store.batch_is_exist([group.layout.key_for(0, hashes("x", 1)[0])]).present == [False]
    group.layout.register_kv_caches(caches, NB)
    rows = group.prepare_values_array(np.asarray([[0, 4, 0], [0, 4, 1]]), [1])
    assert rows[0].shape == (2, 2)


def test_layout_transfer_refusals_of_caches_boundaries_and_transfers(store: MooncakeStore, model: str) -> None:
    """What the layout face refuses before anything moves: a tail boundary that is not an int (a bool, a
    float), a tail boundary past the request's hashes (the load fails with the reason, nothing read), caches
    that are neither arrays nor tensors or not one dense range, tensors on a seed-era transfer, and a layout
    database beside a seed-era one."""
    bs = 4
    db = M.ChunkedTokenDatabase(M.KeyMetadata(model, 0, 0, 0, 0), bs, bs)
    with KVTransfer(store, [db], start_threads=False) as transfer:
        group = transfer.databases[0]
        assert isinstance(group, LayoutGroup)
        for bad in (True, 16.0, "16"):
            with pytest.raises(TypeError, match="tail boundary: num_tokens must be an int"):
                group.tail_tokens(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="tail boundary: num_tokens must be an int"):
                transfer.load(TransferRequest("b", 12, hashes("b", 3), [[4, 5, 6]], tail_key_boundaries=[(0, bad)]))
        with pytest.raises(TypeError, match="expected numpy arrays or CPU tensors, got list"):
            transfer.register_kv_caches([[0.0] * 24 for _ in range(2)], NB)
        strided = torch.zeros((NB, 48))[:, ::2]
        with pytest.raises(ValueError, match="one dense range of memory"):
            transfer.register_kv_caches([strided, strided], NB)
        caches = _rank_local_caches(4)
        transfer.register_kv_caches(caches, NB)
        chained = hashes("b", 3)
        assert transfer.store(TransferRequest("b", 12, chained, [[1, 2, 3]])).stored == 3
        before = [c.clone() for c in caches]
        got = transfer.load(replace(TransferRequest("b", 12, chained, [[4, 5, 6]]),
                                    tail_key_boundaries=(M.TailKeyBoundary(0, 16),)))
        assert got.failed_block_ids == {4, 5, 6} and "needs hash 3, only 3 given" in (got.error or "")
        assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    seed = KVTransfer(store, [ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0), bs)], start_threads=False)
    try:
        with pytest.raises(TypeError, match="C-contiguous numpy array"):
            seed.register_kv_caches(_rank_local_caches(5), NB)
    finally:
        seed.close()
    with pytest.raises(TypeError, match="cannot share a transfer"):
        KVTransfer(store, [db, ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0), bs)], start_threads=False)


_CACHES = {fmt: [_packed(fmt, 4, layer, 4) for layer in range(2)] for fmt in ("lbhnc", "lbnhc")}


@given(
    fmt=st.sampled_from(["rank_local", "lbhnc", "lbnhc"]),
    n_hashes=st.integers(0, 10),
    drop=st.integers(0, 2),
    mask_num=st.integers(0, 24),
    tail=st.one_of(st.none(), st.integers(1, 10)),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_walk_equals_fused_plan(fmt: str, n_hashes: int, drop: int, mask_num: int, tail: int | None,
                                seed: int) -> None:
    """The walk the staged/direct paths take equals the layout's fused plan (keys, rows, block ids), and both
    equal vLLM 0.33's receive-thread construction: process_tokens, the tail hash, one key per shard id."""
    hbs = 4
    bs = 8 if fmt == "rank_local" else hbs  # rank-local: chunks of two hash blocks, a partial last one
    if fmt == "rank_local":
        db = M.ChunkedTokenDatabase(M.KeyMetadata("gen", 1, 0, 0, 0), bs, hbs)
        db.set_kv_caches_base_addr([4096, 1 << 20])
        db.set_block_len([64, 32])
    else:
        db = _sharded_db(fmt, "gen", 2, 4, 0, 8, bs)
        db.store_layout.register_kv_caches(_CACHES[fmt], NB)
    group = LayoutGroup(db)
    chained = hashes(f"g{seed}", n_hashes)
    token_len = max(0, n_hashes - drop) * hbs
    block_ids = [(seed + 3 * i) % NB for i in range(-(-token_len // bs))]
    tail_tokens = None if tail is None or tail > n_hashes else tail * hbs
    walk = list(db.process_tokens(token_len, chained, mask_num))
    expected = []
    for _start, end, chunk_hash in walk:
        if tail_tokens is not None and end == token_len:
            chunk_hash = chained[tail_tokens // hbs - 1]
        expected.extend(group.layout.key_for(shard, chunk_hash) for shard in group.shard_ids)
    walked = group.walk_load(token_len, chained, mask_num, tail_tokens)
    plan = group.plan_load(token_len, chained, block_ids, mask_num, tail_tokens)
    assert walked.keys == plan.keys == expected
    assert walked.chunks.shape == (len(expected), 3)
    if expected:
        addrs, sizes, ids = group.prepare_values_array(walked.chunks, block_ids)
        assert addrs.tolist() == [list(row) for row in plan.addrs]
        assert sizes.tolist() == [list(row) for row in plan.sizes]
        assert ids.tolist() == list(plan.block_ids)
