"""Lookup across rank namespaces and group types (docs/lookup.md).

Most tests drive :meth:`KVTransfer.lookup` against a scripted fake store (no master needed); the last ones
store from several simulated ranks into a real master and look up across their namespaces.
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kvaddr_testing import RecordingHashes
from mooncake_kvaddr import BlobBlockHashes, ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.lookup import (
    GroupSpec,
    GroupSpecLike,
    LookupResult,
    ParallelLayout,
    StoreLookup,
    TailKeyBoundary,
)
from mooncake_kvaddr.driver.store import BatchResult, MooncakeStore, Outcome, StoreError
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

mooncake = pytest.mark.mooncake

Answer = Sequence[int] | BatchResult | Callable[[list[str]], Sequence[int]] | BaseException


class FakeStore:
    """Records every ``batch_is_exist`` call and answers from a script: fixed codes, a function of the keys,
    or an exception to raise."""

    ready = False  # KVTransfer.close() skips unregistering buffers
    config = StoreConfig()  # what KVTransfer reads of a store's configuration

    def __init__(self, answer: Answer = ()) -> None:
        self.answer = answer
        self.calls: list[list[str]] = []

    def batch_is_exist(self, keys: list[str]) -> Sequence[int] | BatchResult:
        self.calls.append(list(keys))
        if isinstance(self.answer, BaseException):
            raise self.answer
        if callable(self.answer):
            return self.answer(keys)
        return self.answer

    @property
    def keys(self) -> list[str]:
        """The keys of the only call."""
        assert len(self.calls) == 1, f"expected one batch_is_exist call, got {len(self.calls)}"
        return self.calls[0]


def hs(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def worker(
    store: Any,
    block_sizes: Sequence[int] = (16,),
    *,
    hbs: int | None = None,
    specs: Sequence[Any] | None = None,
    layout: ParallelLayout | None = None,
    tp_ranks: Sequence[int] | None = None,
    model: str = "test-model",
) -> KVTransfer:
    """A lookup-only transfer (no threads, no regions) over one database per block size."""
    ranks = tp_ranks or [0] * len(block_sizes)
    dbs = [
        ChunkedTokenDatabase(KeyMetadata(model, ranks[g], 0, 0, 0, group_id=g), bs, hbs)
        for g, bs in enumerate(block_sizes)
    ]
    return KVTransfer(store, dbs, start_threads=False, layout=layout, group_specs=specs)


def prefix(tp: int, group: int = 0, pcp: int = 0, dcp: int = 0) -> str:
    return f"test-model@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:0@group:{group}"


# ------------------------------------------------------------------ single full-attention group (bs 16)


def test_partial_prefix_returns_the_first_hit_length() -> None:
    store = FakeStore([1, 1, 0])
    assert worker(store).lookup(48, [b"a0", b"a1", b"a2"]) == 32
    assert store.keys == [f"{prefix(0)}@{h}" for h in ("6130", "6131", "6132")]


def test_partial_last_block_is_not_probed() -> None:
    store = FakeStore([1, 1])
    assert worker(store).lookup(33, [b"a0", b"a1"]) == 32
    assert len(store.calls) == 1 and len(store.keys) == 2


def test_full_hit_is_re_derived_without_a_second_rpc() -> None:
    store = FakeStore([1, 1])
    assert worker(store).lookup(32, [b"h0", b"h1"]) == 16
    assert len(store.calls) == 1


def test_the_vllm_033_shape_re_derives_a_full_hit_too() -> None:
    """lookup_with_boundaries cuts a hit covering the whole prompt below its last token as lookup does (vLLM
    computes that token again), with the boundaries of the shorter hit and without a second RPC."""
    store = FakeStore([1, 1])
    lookup = worker(store).store_lookup
    assert lookup.lookup_with_boundaries(store, 32, [b"h0", b"h1"]) == LookupResult(16, (TailKeyBoundary(0, 16),))
    assert len(store.calls) == 1
    assert lookup.lookup_with_boundaries(FakeStore([1]), 16, [b"h0"]) == LookupResult(0)  # nothing below the last token
    assert lookup.lookup_with_boundaries(FakeStore([1, 1]), 33, [b"h0", b"h1"]).hit_length == 32  # not a full hit


def test_nothing_to_probe_makes_no_rpc() -> None:
    store = FakeStore([1])
    xfer = worker(store)
    assert xfer.lookup(15, [b"a0"]) == 0  # less than one block
    assert xfer.lookup(48, []) == 0
    assert xfer.lookup(16, [b"a0"]) == 0  # a full hit of one block leaves nothing below the last token
    assert len(store.calls) == 1
    assert store.calls == [[f"{prefix(0)}@6130"]]


def test_hashes_shorter_than_the_prompt_bound_the_probe() -> None:
    store = FakeStore([1, 1, 1])
    assert worker(store).lookup(1000, hs("a", 3)) == 48
    assert len(store.keys) == 3


@pytest.mark.parametrize(
    "answer",
    [
        StoreError("master unreachable"),
        RuntimeError("connection reset"),
        [1, 1],  # fewer results than keys
        [1, 1, 1, 1],  # more results than keys
        ["1", "1", "1"],  # not ints
    ],
)
def test_store_errors_are_a_miss(answer: Answer) -> None:
    assert worker(FakeStore(answer)).lookup(64, hs("a", 3)) == 0


def test_batch_result_and_raw_codes_are_both_understood() -> None:
    codes = (1, 1, -704)
    outcomes = (Outcome.OK, Outcome.OK, Outcome.NOT_FOUND)
    raw = worker(FakeStore(codes)).lookup(64, hs("a", 3))
    wrapped = worker(FakeStore(BatchResult(codes, outcomes))).lookup(64, hs("a", 3))
    assert raw == wrapped == 32


@pytest.mark.parametrize("value", [2, -1, 0, 1 << 40])
def test_only_an_exact_one_counts_as_present(value: int) -> None:
    assert worker(FakeStore([1, value, 1])).lookup(64, hs("a", 3)) == 16


def test_blob_hashes_probe_the_same_keys() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    a, b = FakeStore([1] * 5), FakeStore([1] * 5)
    assert worker(a).lookup(81, hashes) == worker(b).lookup(81, BlobBlockHashes(b"".join(hashes), 16)) == 80
    assert a.keys == b.keys


# ------------------------------------------------------------------ rank namespaces (docs/lookup.md, "Rank namespaces")


def test_default_layout_keeps_the_groups_own_namespace() -> None:
    store = FakeStore([1])
    worker(store, tp_ranks=[3]).lookup(17, [b"a0"])
    assert store.keys == [f"{prefix(3)}@6130"]
    store = FakeStore([1])
    worker(store, tp_ranks=[3], layout=ParallelLayout()).lookup(17, [b"a0"])
    assert store.keys == [f"{prefix(0)}@6130"]  # an explicit single-rank layout names shard 0


def test_dcp_probes_every_rank_and_needs_all_of_them() -> None:
    store = FakeStore([1, 1, 0, 1])
    xfer = worker(store, layout=ParallelLayout(tp_size=4, dcp_size=4, num_kv_heads=1))
    assert xfer.store_lookup.prefixes[0] == tuple(prefix(i, dcp=i) for i in range(4))
    assert xfer.lookup(16, [b"a0"]) == 0
    assert store.keys == [f"{prefix(i, dcp=i)}@6130" for i in range(4)]


def test_dcp_hit_when_every_rank_has_the_chunk() -> None:
    store = FakeStore([1] * 8)
    xfer = worker(store, layout=ParallelLayout(tp_size=4, dcp_size=4, num_kv_heads=1))
    assert xfer.lookup(33, [b"a0", b"a1"]) == 32
    # All namespaces of a unit are next to each other, units ascending.
    assert store.keys == [f"{prefix(i, dcp=i)}@{h}" for h in ("6130", "6131") for i in range(4)]


def test_pcp_namespaces() -> None:
    xfer = worker(FakeStore(), layout=ParallelLayout(tp_size=4, pcp_size=2, num_kv_heads=1))
    assert xfer.store_lookup.prefixes[0] == (prefix(0, pcp=0), prefix(0, pcp=1))


def test_pp_namespaces_follow_the_shards() -> None:
    xfer = worker(FakeStore(), layout=ParallelLayout(tp_size=2, pp_size=2, num_kv_heads=2))
    assert xfer.store_lookup.prefixes[0] == tuple(
        f"test-model@tp_rank:{tp}@pcp0@dcp0@pp_rank:{pp}@group:0" for tp in range(2) for pp in range(2)
    )


def test_full_attention_and_mamba_shards() -> None:
    layout = ParallelLayout(tp_size=2, num_kv_heads=1)
    store = FakeStore(lambda keys: [1] * len(keys))
    xfer = worker(store, (16, 16), specs=["attention", "mamba"], layout=layout, tp_ranks=[0, 1])
    assert xfer.store_lookup.prefixes == [(prefix(0, 0),), (prefix(0, 1), prefix(1, 1))]
    assert xfer.lookup(33, [b"h0", b"h1"]) == 32
    assert store.keys == [
        f"{prefix(0, 0)}@6830", f"{prefix(0, 0)}@6831",
        f"{prefix(0, 1)}@6830", f"{prefix(1, 1)}@6830", f"{prefix(0, 1)}@6831", f"{prefix(1, 1)}@6831",
    ]

    store.answer = lambda keys: [0 if "tp_rank:1" in k and "group:1" in k else 1 for k in keys]
    assert xfer.lookup(33, [b"h0", b"h1"]) == 0


def test_replication_factors_of_mla_gqa_and_mamba() -> None:
    xfer = worker(FakeStore(), (16, 16, 16), specs=["mla", "attention", "mamba"],
                  layout=ParallelLayout(tp_size=4, num_kv_heads=2))
    assert xfer.store_lookup.factors == [4, 2, 1]
    assert [len(p) for p in xfer.store_lookup.prefixes] == [1, 2, 4]
    assert xfer.store_lookup.prefixes[2] == tuple(prefix(i, 2) for i in range(4))


@pytest.mark.parametrize("kinds", [["mla", "attention"], ["attention", "mla"]])
def test_uniform_mla_and_gqa_group_uses_the_common_factor(kinds: list[str]) -> None:
    xfer = worker(FakeStore(), specs=[kinds], layout=ParallelLayout(tp_size=4, num_kv_heads=2))
    assert xfer.store_lookup.factors == [2]
    assert xfer.store_lookup.prefixes[0] == (prefix(0), prefix(1))


# ------------------------------------------------------------------ hybrid groups, coarse mode


def test_two_full_attention_groups_need_both() -> None:
    store = FakeStore([1, 1, 1, 1, 0, 1])  # group 1 misses its second chunk
    assert worker(store, (16, 16)).lookup(49, hs("a", 3)) == 16


def test_full_attention_and_mamba_take_the_last_state_inside_the_full_hit() -> None:
    # Group 0: chunks 0..2 present (48 tokens); group 1 (Mamba): states after chunks 0 and 3 only.
    store = FakeStore([1, 1, 1, 0, 1, 0, 0, 1])
    assert worker(store, (16, 16), specs=["attention", "mamba"]).lookup(65, hs("h", 4)) == 16


def test_mamba_probes_only_states_on_scheduler_boundaries() -> None:
    # Full attention bs 32, Mamba bs 16: the scheduler block is 32, so only Mamba's odd chunks can end a hit.
    hashes = RecordingHashes(hs("h", 4))
    store = FakeStore([1, 1, 1, 0])
    xfer = worker(store, (32, 16), hbs=16, specs=["attention", "mamba"])
    assert xfer.lookup(65, hashes) == 32
    assert hashes.accessed == [1, 3, 1, 3]
    assert store.keys == [f"{prefix(0, g)}@{h}" for g in (0, 1) for h in ("6831", "6833")]


def test_sliding_window_single_group() -> None:
    store = FakeStore([0, 0, 1, 1])
    xfer = worker(store, specs=[GroupSpec("attention", sliding_window=32)])
    # 64 tokens: the window before 64 is stored, but a full hit is re-derived at 48, whose window is not.
    assert xfer.lookup(64, hs("h", 4)) == 0
    assert len(store.calls) == 1
    store.calls.clear()
    assert xfer.lookup(65, hs("h", 4)) == 64


def test_full_attention_and_sliding_window_probe_only_window_chunks() -> None:
    hashes = RecordingHashes(hs("h", 12))
    store = FakeStore([1, 0, 0, 1, 0, 0])
    xfer = worker(store, (32, 8), hbs=8, specs=["attention", GroupSpec("attention", sliding_window=8)])
    assert xfer.lookup(96, hashes) == 32
    assert hashes.accessed == [3, 7, 11, 3, 7, 11]
    assert [k.rpartition("@")[2] for k in store.keys[3:]] == ["6833", "6837", "683131"]


def test_sliding_window_run_back_to_the_start_is_a_hit() -> None:
    # Window 48 needs 3 blocks before the hit's end, but blocks back to the start are enough.
    store = FakeStore([1, 1, 0, 0])
    assert worker(store, specs=[GroupSpec("attention", sliding_window=48)]).lookup(65, hs("h", 4)) == 32


def test_lookup_masks_name_the_chunks_that_can_decide_a_hit() -> None:
    """``StoreLookup.lookup_masks``: per group, the chunks a coarse lookup probes (full attention: all, None); a
    window of 8 or 16 tokens over 8-token blocks under a 32-token scheduler block needs the last 1 or 2 blocks
    before each boundary, a window as long as the boundary needs all (None); Mamba needs the block ending on
    one. Handed back to ``lookup`` as the caller's masks, they give the same hit from the same probes."""
    specs = ["attention", *(GroupSpec("attention", sliding_window=w) for w in (8, 16, 32))]
    store = FakeStore(lambda keys: [int(not k.endswith("@6d3130")) for k in keys])  # chunk 10 ("m10") missing
    xfer = worker(store, (32, 8, 8, 8), hbs=8, specs=specs)
    masks = xfer.store_lookup.lookup_masks(90)  # ceil(90 / 8) = 12 chunks of 8 tokens
    assert masks == [None, [i % 4 == 3 for i in range(12)], [i % 4 >= 2 for i in range(12)], None]
    hashes = hs("m", 12)
    assert xfer.lookup(90, hashes) == 64
    assert xfer.lookup(90, hashes, lookup_masks=masks) == 64 and store.calls[0] == store.calls[1]
    mamba = worker(FakeStore(), (32, 16), hbs=16, specs=["attention", "mamba"])
    assert mamba.store_lookup.lookup_masks(65) == [None, [False, True, False, True, False]]
    fine = worker(FakeStore(), (16, 16), hbs=4, specs=["attention", GroupSpec("mamba", mamba_cache_mode="align")])
    assert fine.store_lookup.lookup_masks(65) == [None, None]  # fine-grained: every hash unit is probed


def test_caller_masks_are_read_before_the_hashes() -> None:
    hashes = RecordingHashes(hs("a", 4))
    store = FakeStore([1])
    xfer = worker(store, (16, 16), specs=["attention", "mamba"])
    assert xfer.lookup(65, hashes, lookup_masks=[[False, True], [False, False, False]]) == 0
    assert hashes.accessed == [1]  # group 1's mask is all False and shorter than its chunks
    with pytest.raises(ValueError, match="lookup_masks"):
        xfer.lookup(65, hashes, lookup_masks=[None])


# ------------------------------------------------------------------ fine-grained mode


def fine_worker(store: FakeStore) -> KVTransfer:
    return worker(store, (16, 16), hbs=4, specs=["attention", GroupSpec("mamba", mamba_cache_mode="align")])


def test_fine_grained_partial_tail_hit() -> None:
    store = FakeStore([0, 0, 1, 0, 0, 1])
    xfer = fine_worker(store)
    assert xfer.store_lookup.partial_hash_hits and xfer.store_lookup.alignment == 4
    assert xfer.lookup(13, [b"h0", b"h1", b"h2"]) == 12
    assert [k.rpartition("@")[2] for k in store.keys] == ["6830", "6831", "6832"] * 2


def test_fine_grained_needs_the_full_attention_key_at_the_mamba_boundary() -> None:
    present = {0: {3, 5}, 1: {3, 4}}  # full attention: block 0 and a 24-token tail; Mamba: states at 16, 20

    def answer(keys: list[str]) -> list[int]:
        return [int(int(k[-1]) in present[int(k.split("@group:")[1][0])]) for k in keys]

    store = FakeStore(answer)
    # Mamba's 20 ends inside full attention's block 1, where only the 24-token tail is stored: back to 16.
    assert fine_worker(store).lookup(33, [f"{i}".encode() for i in range(8)]) == 16
    present[1].add(5)
    assert fine_worker(FakeStore(answer)).lookup(33, [f"{i}".encode() for i in range(8)]) == 24


def test_align_mamba_with_block_equal_to_hash_size_stays_coarse() -> None:
    xfer = worker(FakeStore(), (16, 16), hbs=16, specs=["attention", "mamba"])
    assert not xfer.store_lookup.partial_hash_hits and xfer.store_lookup.alignment == 16
    with_dcp = worker(FakeStore(), (16, 16), hbs=16, specs=["attention", "mamba"],
                      layout=ParallelLayout(tp_size=2, dcp_size=2))
    assert with_dcp.store_lookup.partial_hash_hits  # DCP enables it at block == hash size too


def test_non_align_mamba_stays_coarse() -> None:
    xfer = worker(FakeStore(), (16, 16), hbs=4, specs=["attention", GroupSpec("mamba", mamba_cache_mode="all")])
    assert not xfer.store_lookup.partial_hash_hits and xfer.store_lookup.alignment == 16


# ------------------------------------------------------------------ against a brute-force model


def brute_force(fa: list[int], mamba: list[int], bs: int, num_tokens: int) -> int:
    """FA + Mamba of one block size: the highest end <= limit with a Mamba state and full attention up to it."""

    def best(limit: int) -> int:
        ends = [(i + 1) * bs for i in range(len(mamba)) if mamba[i] == 1 and (i + 1) * bs <= limit]
        ok = [e for e in ends if all(x == 1 for x in fa[: e // bs])]
        return max(ok, default=0)

    hit = best(num_tokens // bs * bs)
    return best((num_tokens - 1) // bs * bs) if hit >= num_tokens else hit


def test_random_full_attention_and_mamba_match_the_brute_force_model() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        fa = [rng.choice([1, 1, 1, 0, -704]) for _ in range(n)]
        mamba = [rng.choice([1, 0]) for _ in range(n)]
        num_tokens = rng.randint(1, 16 * n + 20)
        store = FakeStore(lambda keys, fa=fa, mamba=mamba: (fa[: len(keys) // 2] + mamba)[: len(keys)])
        got = worker(store, (16, 16), specs=["attention", "mamba"]).lookup(num_tokens, hs("h", n))
        assert got == brute_force(fa, mamba[: min(n, -(-(num_tokens // 16 * 16) // 16))], 16, num_tokens)


# ------------------------------------------------------------------ configuration checks


def test_configuration_errors() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        ParallelLayout(tp_size=0)
    with pytest.raises(ValueError, match="unknown spec kind"):
        GroupSpec("gqa")
    with pytest.raises(ValueError, match="either Mamba or attention"):
        GroupSpec(["mla", "mamba"])
    with pytest.raises(ValueError, match="sliding_window"):
        GroupSpec("mamba", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window"):
        GroupSpec("attention", sliding_window=0)
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        GroupSpec("mamba", mamba_cache_mode="aligned")
    with pytest.raises(ValueError, match="specs"):
        worker(FakeStore(), (16, 16), specs=["attention"])
    # Groups that disagree on the hash unit still store and load, but cannot be looked up together.
    dbs = [ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0, group_id=g), 16, hbs) for g, hbs in enumerate((16, 8))]
    with pytest.raises(ValueError, match="hash_block_size"):
        StoreLookup(dbs).lookup(FakeStore(), 32, hs("h", 4))


# ------------------------------------------------------------------ real master: several simulated ranks


class Ranks:
    """Simulated ranks writing one model's chunks into a shared store, one KVTransfer each."""

    def __init__(self, store: MooncakeStore, model: str, block_size: int, blocks: int) -> None:
        self.store, self.model, self.bs, self.blocks = store, model, block_size, blocks
        self.regions: list[Any] = []
        self.transfers: list[KVTransfer] = []

    def writer(self, metadata: Sequence[KeyMetadata]) -> KVTransfer:
        dbs = [ChunkedTokenDatabase(md, self.bs) for md in metadata]
        xfer = KVTransfer(self.store, dbs, start_threads=False)
        region = np.random.default_rng(len(self.transfers)).integers(0, 256, (self.blocks + 1, 64), dtype=np.uint8)
        xfer.register_kv_caches([region], self.blocks + 1)
        self.regions.append(region)
        self.transfers.append(xfer)
        return xfer

    def put(self, xfer: KVTransfer, hashes: list[bytes], chunks: int) -> None:
        ids = list(range(1, self.blocks + 1))
        result = xfer.store(TransferRequest("r", chunks * self.bs, hashes, [ids] * len(xfer.databases)))
        assert result.ok and result.saved_tokens == chunks * self.bs

    def close(self) -> None:
        for xfer in self.transfers:
            xfer.close()


@pytest.fixture
def ranks(store: MooncakeStore, key_prefix: str) -> Iterator[Ranks]:
    sim = Ranks(store, key_prefix.replace("@", "_"), 16, 4)
    yield sim
    sim.close()


@mooncake
def test_dcp_ranks_on_a_real_master(store: MooncakeStore, ranks: Ranks) -> None:
    bs, h = ranks.bs, hs(ranks.model, 4)
    rank0 = ranks.writer([KeyMetadata(ranks.model, 0, 0, 0, 0)])
    rank1 = ranks.writer([KeyMetadata(ranks.model, 1, 0, 1, 0)])
    reader = KVTransfer(store, [ChunkedTokenDatabase(KeyMetadata(ranks.model, 0, 0, 0, 0), bs)],
                        start_threads=False, layout=ParallelLayout(tp_size=2, dcp_size=2, num_kv_heads=1))
    own_namespace = KVTransfer(store, [ChunkedTokenDatabase(KeyMetadata(ranks.model, 0, 0, 0, 0), bs)],
                               start_threads=False)

    ranks.put(rank0, h, 4)
    assert own_namespace.lookup(4 * bs + 1, h) == 4 * bs
    assert reader.lookup(4 * bs + 1, h) == 0  # DCP rank 1 holds nothing yet

    ranks.put(rank1, h, 2)
    assert reader.lookup(4 * bs + 1, h) == 2 * bs
    ranks.put(rank1, h, 4)
    assert reader.lookup(4 * bs + 1, h) == 4 * bs
    assert reader.lookup(4 * bs, h) == 3 * bs  # full hit: the last block is recomputed


@mooncake
def test_hybrid_shards_on_a_real_master(store: MooncakeStore, ranks: Ranks) -> None:
    # tp 2, one KV head: full attention is replicated (one shard), Mamba state is per rank.
    bs, h, model = ranks.bs, hs(ranks.model, 4), ranks.model
    rank0 = ranks.writer([KeyMetadata(model, 0, 0, 0, 0, group_id=0), KeyMetadata(model, 0, 0, 0, 0, group_id=1)])
    rank1 = ranks.writer([KeyMetadata(model, 1, 0, 0, 0, group_id=1)])
    dbs = [ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0, group_id=g), bs) for g in range(2)]
    reader = KVTransfer(store, dbs, start_threads=False, layout=ParallelLayout(tp_size=2, num_kv_heads=1),
                        group_specs=["attention", "mamba"])

    ranks.put(rank0, h, 4)
    assert reader.lookup(4 * bs + 1, h) == 0  # rank 1's Mamba shard is missing everywhere

    ranks.put(rank1, h, 2)
    assert reader.lookup(4 * bs + 1, h) == 2 * bs  # the last state both shards hold
    assert rank1.mooncake_store.batch_remove([dbs[0].key_for(h[1])], force=True).ok
    assert reader.lookup(4 * bs + 1, h) == bs  # full attention now stops after chunk 0

    ranks.put(rank0, h, 4)  # restores the removed chunk
    ranks.put(rank1, h, 4)
    assert reader.lookup(4 * bs + 1, h) == 4 * bs


# ------------------------------------------------------------------ every group loads the hit (docs/lookup.md)


def issue_transfer(store: Any) -> KVTransfer:
    """Attention bs 2, attention bs 4, align-mode Mamba bs 4, hash unit 2: fine-grained lookup."""
    return worker(store, (2, 4, 4), hbs=2, specs=["attention", "attention", GroupSpec("mamba")])


def stored_units(stored: dict[int, set[int]]) -> Callable[[list[str]], list[int]]:
    """Answers for keys named ``...@group:G@<hex of b"hN">``: 1 iff hash index N is stored for group G."""

    def answer(keys: list[str]) -> list[int]:
        return [int(int(bytes.fromhex(k.rpartition("@")[2])[1:]) in stored[int(k.split("@group:")[1].split("@")[0])])
                for k in keys]

    return answer


def test_every_full_attention_group_needs_its_own_partial_tail() -> None:
    # Group 0 stores everything, group 1 only its block ends (h1, h3), Mamba only h2 (the state at 6).
    stored = {0: {0, 1, 2, 3}, 1: {1, 3}, 2: {2}}
    store = FakeStore(stored_units(stored))
    xfer = issue_transfer(store)
    assert xfer.store_lookup.partial_hash_hits and xfer.store_lookup.alignment == 2
    assert xfer.lookup(9, hs("h", 4)) == 0  # 6 would need group 1's partial tail at 6 (h2)
    stored[1].add(2)
    assert xfer.lookup(9, hs("h", 4)) == 6
    stored[1].discard(1)  # ... and every whole block before it
    assert xfer.lookup(9, hs("h", 4)) == 0


def test_the_vllm_033_shape_reports_longer_tail_keys() -> None:
    stored = {0: {0, 1, 2, 3}, 1: {1, 3}, 2: {2}}
    lookup = issue_transfer(FakeStore()).store_lookup
    result = lookup.lookup_with_boundaries(FakeStore(stored_units(stored)), 9, hs("h", 4))
    # Group 1 loads its tail block from the full block's key (h3, 8 tokens); a 0.33 loader honours that.
    assert result == LookupResult(6, (TailKeyBoundary(0, 6), TailKeyBoundary(1, 8), TailKeyBoundary(2, 6)))
    assert lookup.lookup_with_boundaries(FakeStore(stored_units({0: set(), 1: set(), 2: set()})), 9,
                                         hs("h", 4)) == LookupResult(0)


def test_a_non_byte_hash_buffer_names_the_same_chunks() -> None:
    raw = b"".join(bytes([i]) * 4 for i in range(8))
    words = memoryview(array("I", raw))  # 8 items of 4 bytes: a view that counts elements, not bytes
    for view in (words, memoryview(bytearray(raw))[::1], raw):
        hashes = BlobBlockHashes(view, 4)
        a, b = FakeStore(lambda keys: [1] * len(keys)), FakeStore(lambda keys: [1] * len(keys))
        worker(a, (16, 16)).lookup(10**6, hashes)
        n = len(hashes)
        worker(b, (16, 16)).lookup(10**6, [raw[4 * i : 4 * i + 4] for i in range(n)])
        assert a.keys == b.keys  # group 1 never reads group 0's hashes or answers
        assert len(a.keys) == 2 * n


def test_a_hash_view_longer_than_its_buffer_is_an_error() -> None:
    blob = bytearray(b"".join(bytes([i]) * 4 for i in range(8)))
    hashes = BlobBlockHashes(blob, 4)
    try:
        del blob[8:]
    except BufferError:  # the view locks a mutable buffer (docs/address-rows.md, "Hash views"): it cannot shrink
        assert len(hashes) == 8
        return
    store = FakeStore(lambda keys: [1] * len(keys))
    try:
        worker(store, (16, 16)).lookup(10**6, hashes)
    except ValueError as exc:  # the view kept its old length: refused, never a shifted read
        assert "hash" in str(exc)
        assert not store.calls
    else:  # the view follows its buffer: only the hashes still there are probed
        assert [k.rpartition("@")[2] for k in store.keys] == ["00000000", "01010101"] * 2


def test_answers_are_consumed_exactly() -> None:
    lookup = worker(FakeStore(), (16, 16)).store_lookup
    plan = lookup.plan(48, hs("h", 3))
    assert plan.key_counts == [3, 3]
    assert [row.tolist() for row in plan.presence([1, 1, 0, 1, 0, 1])] == [[True, True, False], [True, False, True]]
    with pytest.raises(ValueError, match="exist results"):
        plan.presence([1] * 5)
    plan.key_counts = [4, 2]  # a group whose keys do not match its units
    with pytest.raises(ValueError):
        plan.presence([1] * 6)


# ------------------------------------------------------------------ cost (docs/lookup.md, "Cost")


def best_of(runs: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.parametrize("specs, block_sizes, hbs", [
    (["attention", GroupSpec("attention", sliding_window=32)], (64, 16), 16),  # window chunks masked
    (["attention", "mamba"], (64, 16), 16),  # only states on a scheduler block probed
    (["attention", GroupSpec("mamba")], (64, 64), 16),  # fine-grained
])
def test_a_huge_prompt_with_few_hashes_costs_what_the_hashes_cost(
    specs: list[Any], block_sizes: tuple[int, int], hbs: int
) -> None:
    store = FakeStore(lambda keys: [1] * len(keys))
    xfer = worker(store, block_sizes, hbs=hbs, specs=specs)
    hashes = RecordingHashes([bytes([i]) * 16 for i in range(8)])
    assert xfer.lookup(2**32 - 1, hashes) == 128
    assert len(hashes.accessed) <= 16
    assert best_of(5, lambda: xfer.lookup(2**32 - 1, hashes)) < 0.010


def test_hit_length_is_linear_against_an_adversarial_store() -> None:
    # Fine-grained full attention + Mamba over 2**20 hash units: every block end and every Mamba state is
    # stored, no partial tail is: each candidate fails only on the full-attention side.
    units = 1 << 20
    lookup = worker(FakeStore(), (4, 4), hbs=1, specs=["attention", GroupSpec("mamba")]).store_lookup
    attention = np.zeros(units, dtype=bool)
    attention[3::4] = True
    attention[4 * 1000 + 3] = False  # block 1000 is missing
    mamba = np.ones(units, dtype=bool)
    mamba[3::4] = False
    assert lookup.hit_length([attention, mamba], units) == 0  # no block end is a Mamba state
    assert best_of(3, lambda: lookup.hit_length([attention, mamba], units)) < 0.5
    mamba[3::4] = True
    assert lookup.hit_length([attention, mamba], units) == 4000
    assert best_of(3, lambda: lookup.hit_length([attention, mamba], units)) < 0.5


# ------------------------------------------------------------------ validation at construction


@pytest.mark.parametrize("kwargs, match", [
    ({"tp_size": 9, "num_kv_heads": 2}, "divide one another"),
    ({"tp_size": 2, "num_kv_heads": 3}, "divide one another"),
    ({"tp_size": 2, "dcp_size": 4}, "dcp_size 4 must divide tp_size 2"),
    ({"tp_size": 4, "dcp_size": 3}, "must divide tp_size"),
    ({"tp_size": 256, "pp_size": 16, "pcp_size": 32}, "rank namespaces"),
    ({"tp_size": 2.0}, "tp_size"),
    ({"pp_size": True}, "pp_size"),
])
def test_parallel_layouts_are_checked_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"tp_size": 8, "num_kv_heads": 2}, {"tp_size": 2, "num_kv_heads": 8}, {"tp_size": 4, "dcp_size": 4},
    {"tp_size": 4, "dcp_size": 2, "num_kv_heads": 4}, {"tp_size": 1, "num_kv_heads": 7},
])
def test_valid_layouts_construct(kwargs: dict[str, Any]) -> None:
    ParallelLayout(**kwargs)


def test_windows_and_prefixes_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match=">= 2"):
        GroupSpec("attention", sliding_window=1)
    GroupSpec("attention", sliding_window=2)
    dbs = [ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0, group_id=g), 16) for g in range(2)]
    with pytest.raises(ValueError, match="key_prefixes"):
        StoreLookup(dbs, key_prefixes=[("a",)])
    with pytest.raises(ValueError, match="key_prefixes"):
        StoreLookup(dbs, key_prefixes=[("a",), ()])
    with pytest.raises(TypeError, match="key_prefixes"):
        StoreLookup(dbs, key_prefixes=["ab", ("a",)])
    with pytest.raises(TypeError, match="layout"):
        StoreLookup(dbs, layout=(2, 1, 1, 1, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_tokens"):
        StoreLookup(dbs).lookup(FakeStore([1]), 32.0, hs("h", 2))  # type: ignore[arg-type]


class Shards:
    """A stand-in for a vLLM 0.33 store layout: one prefix per namespace, recording what it was asked."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.asked: list[Any] = []

    def lookup_key_prefixes(self, rank_namespaces: Sequence[tuple[int, int, int, int]]) -> tuple[str, ...]:
        self.asked.append(list(rank_namespaces))
        return tuple(f"{self.name}@tp{t}@pcp{c}@dcp{d}@pp{p}" for t, c, d, p in rank_namespaces)


def test_prefixes_from_store_layouts() -> None:
    dbs = [ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0, group_id=g), 16) for g in range(2)]
    sources = [Shards("a"), Shards("b")]
    layout = ParallelLayout(tp_size=2, num_kv_heads=1)
    lookup = StoreLookup.from_prefix_sources(dbs, sources, ["attention", "mamba"], layout)
    assert sources[0].asked == [[(0, 0, 0, 0)]] and sources[1].asked == [[(0, 0, 0, 0), (1, 0, 0, 0)]]
    assert lookup.prefixes == [("a@tp0@pcp0@dcp0@pp0",), ("b@tp0@pcp0@dcp0@pp0", "b@tp1@pcp0@dcp0@pp0")]
    store = FakeStore(lambda keys: [1] * len(keys))
    assert lookup.lookup(store, 33, hs("h", 2)) == 32
    assert store.keys[:2] == ["a@tp0@pcp0@dcp0@pp0@6830", "a@tp0@pcp0@dcp0@pp0@6831"]


@mooncake
def test_the_issue_false_hit_on_a_real_master(store: MooncakeStore, key_prefix: str) -> None:
    model = key_prefix.replace("@", "_")
    dbs = [ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0, group_id=g), bs, 2) for g, bs in enumerate((2, 4, 4))]
    specs: list[GroupSpecLike] = ["attention", "attention", GroupSpec("mamba")]
    reader = KVTransfer(store, dbs, start_threads=False, group_specs=specs)
    hashes = hs(model, 4)
    buf = np.arange(64, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    try:
        def put(group: int, units: Sequence[int]) -> None:
            keys = [dbs[group].key_for(hashes[u]) for u in units]
            assert store.batch_put_from(keys, [buf.ctypes.data] * len(keys), [16] * len(keys)).ok

        put(0, range(4))
        put(1, [1, 3])
        put(2, [2])
        assert reader.lookup(9, hashes) == 0
        assert reader.store_lookup.lookup_with_boundaries(store, 9, hashes).hit_length == 6
        put(1, [2])
        assert reader.lookup(9, hashes) == 6
    finally:
        store.batch_remove([db.key_for(h) for db in dbs for h in hashes], force=True)
        store.unregister_buffer(buf.ctypes.data)
        reader.close()


def test_the_033_walk_is_linear_when_groups_keep_undercutting_each_other() -> None:
    # Sliding-window hits end at 2 mod 4, Mamba states at 0 mod 4: every round of the walk lowers the hit
    # by one step, all the way down to 0 (2**16 rounds).
    units = 1 << 16
    dbs = [ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0, group_id=g), bs, 1) for g, bs in enumerate((4, 2, 4))]
    lookup = StoreLookup(dbs, ["attention", GroupSpec("attention", sliding_window=3), GroupSpec("mamba")])
    attention, window, mamba = np.ones(units, bool), np.zeros(units, bool), np.zeros(units, bool)
    window[1::4] = True
    mamba[3::4] = True
    present = [attention, window, mamba]

    answer = {"hit": -1}
    elapsed = best_of(1, lambda: answer.update(hit=lookup.lookup_with_boundaries(
        FakeStore(lambda keys: np.concatenate(present).astype(int).tolist()), units + 1,
        [i.to_bytes(4, "little") for i in range(units)]).hit_length))
    assert answer["hit"] == 0 and lookup.hit_length(present, units) == 0
    assert elapsed < 5.0


def test_exactly_max_namespaces_is_accepted() -> None:
    """The namespace limit is inclusive: a layout of exactly ``MAX_NAMESPACES`` rank namespaces, and a group
    of exactly that many key prefixes, construct; one more is refused."""
    from mooncake_kvaddr.driver.lookup_types import MAX_NAMESPACES

    assert MAX_NAMESPACES == 1 << 16
    ParallelLayout(tp_size=256, pp_size=16, pcp_size=16)
    with pytest.raises(ValueError, match="rank namespaces"):
        ParallelLayout(tp_size=256, pp_size=16, pcp_size=17)
    db = ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)
    StoreLookup([db], key_prefixes=[tuple(f"p{i}" for i in range(MAX_NAMESPACES))])
    with pytest.raises(ValueError, match="key_prefixes"):
        StoreLookup([db], key_prefixes=[tuple(f"p{i}" for i in range(MAX_NAMESPACES + 1))])
