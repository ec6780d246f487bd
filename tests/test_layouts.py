"""The layout engine on its own (no vLLM needed): hardening rules, overflow, caching, arrays, duck typing.

docs/vllm.md lists the rules these pin: strict argument types, OverflowError instead of wrapping, no returned
row aliasing another or the row cache, in-place edits of the region lists seen, a snapshot per call.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_kvaddr.integrations.vllm import data as M

BS = 16


def rank_local(bases: list[int], lens: list[int], bs: int = BS, hbs: int | None = None) -> M.RankLocalStoreLayout:
    layout = M.RankLocalStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), bs, hbs or bs)
    layout.set_kv_caches_base_addr(bases)
    layout.set_block_len(lens)
    return layout


def reference(bases: list[int], lens: list[int], chunks: list[tuple[int, int]], ids: list[int], bs: int = BS) -> Any:
    """The scalar rule (docs/vllm.md): addr = base + id * len, size = len * ceil(span / block_size)."""
    addrs, sizes, out = [], [], []
    for start, end in chunks:
        bid = ids[start // bs]
        addrs.append([b + bid * lens[r % len(lens)] for r, b in enumerate(bases)])
        sizes.append([lens[r % len(lens)] * -(-(end - start) // bs) for r in range(len(bases))])
        out.append(bid)
    return addrs, sizes, out


class FakeStorage:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self._ptr, self._nbytes = ptr, nbytes

    def data_ptr(self) -> int:
        return self._ptr

    def nbytes(self) -> int:
        return self._nbytes


class FakeTensor:
    """Just the tensor methods register_kv_caches reads: the package must not need torch."""

    def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, ptr: int,
                 storage: FakeStorage) -> None:
        self.shape, self._strides, self._itemsize, self._ptr, self._storage = shape, strides, itemsize, ptr, storage

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def stride(self) -> tuple[int, ...]:
        return self._strides

    def element_size(self) -> int:
        return self._itemsize

    def data_ptr(self) -> int:
        return self._ptr

    def untyped_storage(self) -> FakeStorage:
        return self._storage


# --- values ------------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1 << 46), max_size=8), st.lists(st.integers(1, 1 << 16), min_size=1, max_size=4),
       st.lists(st.integers(0, 1 << 30), min_size=1, max_size=6), st.data())
def test_lists_arrays_and_tuples_agree_with_the_rule(bases: list[int], lens: list[int], ids: list[int],
                                                     data: Any) -> None:
    chunks = [(b * BS, (b + data.draw(st.integers(1, 3))) * BS)
              for b in data.draw(st.lists(st.integers(0, len(ids) - 1), max_size=6))]
    expected = reference(bases, lens, chunks, ids)
    layout = rank_local(bases, lens)
    shards = [0] * len(chunks)
    for _ in range(3):  # cold, second sighting (cached), warm
        assert layout.prepare_values(chunks, ids, shards) == expected
    addrs, sizes, out = layout.prepare_values_array(chunks, np.asarray(ids, dtype=np.int64), shards)
    assert addrs.reshape(len(chunks), len(bases)).tolist() == expected[0]
    assert sizes.reshape(len(chunks), len(bases)).tolist() == expected[1] and out.tolist() == expected[2]
    layout.immutable_rows = True
    rows = layout.prepare_values(chunks, tuple(ids), shards)
    assert [list(r) for r in rows[0]] == expected[0] and [list(r) for r in rows[1]] == expected[1]
    assert all(type(r) is tuple for r in rows[0])


def test_returned_rows_never_change_and_never_alias() -> None:
    layout = rank_local([1 << 40, 1 << 41], [4096])
    chunks, ids = [(0, BS), (BS, 2 * BS), (0, BS)], [7, 9]
    first = layout.prepare_values(chunks, ids, [0, 0, 0])
    layout.prepare_values(chunks, ids, [0, 0, 0])  # now cached
    warm = layout.prepare_values(chunks, ids, [0, 0, 0])
    assert layout.row_cache_info()["hits"] >= 3
    assert warm[0][0] is not warm[0][2] and warm[1][0] is not warm[1][1]
    snapshot = [list(r) for r in warm[0]]
    warm[0][0].append(-1)
    warm[0][0][0] = 0
    warm[1][0][:] = []
    again = layout.prepare_values(chunks, ids, [0, 0, 0])
    assert again[0] == first[0] == snapshot and again[1] == first[1]


def test_in_place_edits_and_reassignment_invalidate_cached_rows() -> None:
    bases, lens = [1 << 40, 1 << 41], [4096, 8192]
    layout = rank_local(bases, lens)
    chunks, ids = [(0, BS)], [3]
    for _ in range(3):
        layout.prepare_values(chunks, ids, [0])
    lens[1] = 100  # same length, one item changed: block_len only
    assert layout.prepare_values(chunks, ids, [0])[0] == [[(1 << 40) + 3 * 4096, (1 << 41) + 300]]
    layout.kv_caches_base_addr = [5]
    assert layout.prepare_values(chunks, ids, [0])[0] == [[5 + 3 * 4096]]
    layout.block_len = []
    with pytest.raises(ZeroDivisionError):
        layout.prepare_values(chunks, ids, [0])


def test_a_call_computes_on_the_regions_it_started_with() -> None:
    layout = rank_local([1000], [10])

    class Sneaky:
        def __index__(self) -> int:
            layout.set_kv_caches_base_addr([2000])
            layout.clear_row_cache()
            return 4

    assert layout.prepare_values([(0, BS)], [Sneaky()], [0])[0] == [[1040]]
    assert layout.prepare_values([(0, BS)], [4], [0])[0] == [[2040]]


# --- strict types and overflow ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{0: 1}, {1, 2}, "ab", b"ab", 3, None, np.zeros((1, 2), dtype=np.int64),
                                 np.zeros(2, dtype=np.float64)])
def test_block_ids_must_be_a_list_tuple_or_int_array(bad: Any) -> None:
    layout = rank_local([1 << 40], [64])
    with pytest.raises(TypeError):
        layout.prepare_values([(0, BS)], bad, [0])


@pytest.mark.parametrize("bad", [[1.5], ["1"], [None]])
def test_block_id_items_must_be_ints(bad: Any) -> None:
    with pytest.raises(TypeError):
        rank_local([1 << 40], [64]).prepare_values([(0, BS)], bad, [0])


@pytest.mark.parametrize("chunks", [["ab"], [{0: 0, 1: 16}], "ab", [(0.0, 16.0)], [(0,)]])
def test_chunks_must_be_pairs_of_ints(chunks: Any) -> None:
    with pytest.raises(TypeError):
        rank_local([1 << 40], [64]).prepare_values(chunks, [1], [0] * len(chunks))


@pytest.mark.parametrize(
    ("bases", "lens", "chunks", "ids"),
    [
        ([1 << 62], [1 << 20], [(0, BS)], [1 << 42]),  # address overflow
        ([0], [1 << 40], [(0, BS << 24)], [0]),  # size overflow: block_len * 2^24 blocks
        ([0], [64], [(0, BS)], [-(1 << 64)]),  # below -2^63
        ([0], [64], [(0, BS)], [1 << 63]),  # above 2^63 - 1
        ([0], [64], [(-(1 << 63), (1 << 63) - 1)], [0]),  # span overflow
        ([-(1 << 63)], [64], [(0, BS)], [-1]),
    ],
)
def test_overflow_raises_instead_of_wrapping(bases: list[int], lens: list[int], chunks: Any, ids: list[int]) -> None:
    layout = rank_local(bases, lens)
    with pytest.raises(OverflowError):
        layout.prepare_values(chunks, ids, [0] * len(chunks))
    with pytest.raises(OverflowError):
        layout.prepare_values_array(chunks, ids, [0] * len(chunks))


def test_size_overflow_one_block_past_the_unchecked_limit() -> None:
    """Block length 2, block size 1: 2**62 - 1 blocks is the most whose size fits; 2**62 must raise, not wrap
    (the first count past the plain loop's limit takes the checked loop)."""
    layout = rank_local([4096], [2], bs=1, hbs=1)
    assert layout.prepare_values([(0, 2**62 - 1)], [0], [0])[1] == [[2**63 - 2]]
    assert layout.prepare_values_array([(0, 2**62 - 1)], [0], [0])[1].tolist() == [[2**63 - 2]]
    for prepare in (layout.prepare_values, layout.prepare_values_array):
        with pytest.raises(OverflowError):
            prepare([(0, 2**62)], [0], [0])


def test_size_overflow_message_names_block_stride_only_where_one_differs_from_block_len() -> None:
    """vLLM 0.33's rank-local layout and the seed-era database have no block_stride (stride = block_len): their
    size overflow reads 'block_len * N blocks overflows int64' (docs/errors.md), as before 35cbe13, which gave
    every layout the 0.34 wording. Only a stride other than block_len (vLLM 0.34) is named in the message."""
    from mooncake_kvaddr import _native
    from mooncake_kvaddr.core.database import ChunkedTokenDatabase

    plain = r"^key 0: block_len \* 3 blocks overflows int64$"
    strided = r"^key 0: the size of 3 blocks \(block_len \+ \(blocks - 1\) \* block_stride\) overflows int64$"
    layout = rank_local([0], [1 << 62])
    db = ChunkedTokenDatabase(M.KeyMetadata("m", 0, 0, 0, 0), BS)
    db.set_kv_caches_base_addr([0])
    db.set_block_len([1 << 62])
    engine = _native.LayoutEngine(BS, BS, False, 0, 1, 0)
    for strides, want in (([1 << 62], plain), ([1 << 61], strided)):
        engine.set_region_sources([0], [1 << 62], strides)
        for prepare in (engine.prepare_values, engine.prepare_values_array):
            with pytest.raises(OverflowError, match=want):
                prepare([(0, 3 * BS)], [0], [0])
    for prepare in (layout.prepare_values, layout.prepare_values_array):
        with pytest.raises(OverflowError, match=plain):
            prepare([(0, 3 * BS)], [0], [0])
    for seed_prepare in (db.prepare_values, db.prepare_values_array):
        with pytest.raises(OverflowError, match=plain.replace("key", "chunk")):
            seed_prepare([(0, 3 * BS)], [0])


def test_uint64_arrays_beyond_int64_overflow() -> None:
    layout = rank_local([0], [64])
    with pytest.raises(OverflowError):
        layout.prepare_values([(0, BS)], np.array([1 << 63], dtype=np.uint64), [0])
    with pytest.raises(TypeError):
        layout.prepare_values_array(np.array([[2**64 - 16, 2**64 - 1]], dtype=np.uint64), [0], [0])


@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_uint64_ids_shards_and_templates_past_int64_are_refused_not_wrapped(value: int) -> None:
    """A uint64 value >= 2**63 is refused wherever the layouts read integer arrays; a cast would wrap it
    (2**64 - 1 to -1: the block before the region, a valid-looking address row)."""
    too_big = np.array([value], np.uint64)
    local = rank_local([1 << 40], [64])
    second = ([1 << 42], [4096], [512])
    for call in (lambda: local.prepare_values([(0, BS)], too_big, [0]),
                 lambda: local.prepare_values_array([(0, BS)], too_big, [0]),
                 lambda: local.prepare_values([(0, BS)], [1], too_big),
                 lambda: tp_layout().prepare_values([(0, BS)], [1], too_big),
                 lambda: tp_layout().prepare_values([(0, BS)], too_big, [0]),
                 lambda: tp_layout()._set_segment_templates([(too_big, [4096], [512]), second]),
                 lambda: tp_layout()._set_segment_templates([([1 << 40], too_big, [512]), second]),
                 lambda: tp_layout()._set_segment_templates([([1 << 40], [4096], too_big), second])):
        with pytest.raises(OverflowError, match="does not fit in a signed 64-bit integer"):
            call()


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.int16])
def test_chunks_as_an_integer_array_equal_chunks_as_pairs(dtype: Any) -> None:
    """An ``(n, 2)`` integer array of chunks reads column 0 as the starts and column 1 as the ends, exactly as
    the same chunks given as ``(start, end)`` pairs, in both layouts and both row forms (fresh mutant M19-02:
    the ends read from column 0, every span empty)."""
    local = rank_local([1 << 40, 1 << 41], [64, 128])
    pairs = [(0, BS), (BS, 3 * BS), (3 * BS, 4 * BS)]
    want = reference([1 << 40, 1 << 41], [64, 128], pairs, [3, 4, 5, 6])
    assert want[1] == [[64, 128], [128, 256], [64, 128]]
    array = np.array(pairs, dtype)
    assert local.prepare_values(pairs, [3, 4, 5, 6], [0] * 3) == want
    assert local.prepare_values(array, [3, 4, 5, 6], [0] * 3) == want
    assert [r.tolist() for r in local.prepare_values_array(array, [3, 4, 5, 6], [0] * 3)] == [*want[:2], want[2]]
    shared = tp_layout()
    full = [(0, BS), (BS, 2 * BS)]
    assert shared.prepare_values(np.array(full, dtype), [5, 6], [1, 0]) == shared.prepare_values(full, [5, 6], [1, 0])


def tp_layout(cls: type[M.TPShardedStoreLayout] = M.LBHNCStoreLayout, local_tp: int = 1, store_tp: int = 2,
              heads: int = 2) -> M.TPShardedStoreLayout:
    layout = cls(M.KeyMetadata("m", 0, 0, 0, 0), BS, BS, local_tp, store_tp, 0, heads)
    layout._set_segment_templates([([1 << 40, 1 << 41], [4096, 4096], [512, 512]),
                                   ([1 << 42, 1 << 43], [4096, 4096], [512, 512])][: layout.shards_per_rank])
    return layout


def test_cached_rows_belong_to_their_shard() -> None:
    """The row cache is keyed by (shard, block id): the same block id of another shard is another row, cached
    or not, in both row forms (one engine serves every shard; docs/address-rows.md)."""
    layout = tp_layout()
    expected = {(s, b): [base + b * 4096 for base in bases]
                for s, bases in ((0, [1 << 40, 1 << 41]), (1, [1 << 42, 1 << 43])) for b in (3, 7)}
    chunks = [(0, BS), (BS, 2 * BS)]
    for immutable in (False, True, False):
        layout._engine.immutable_rows = immutable
        for _ in range(3):  # first sighting, second (cached), then from the cache
            for shards in ([0, 1], [1, 0], [1, 1], [0, 0]):
                addrs, sizes, ids = layout.prepare_values(chunks, [3, 7], shards)
                assert [list(r) for r in addrs] == [expected[(s, b)] for s, b in zip(shards, (3, 7))]
                assert [list(r) for r in sizes] == [[512, 512]] * 2 and ids == [3, 7]
    assert layout.row_cache_info()["entries"] == 4


@pytest.mark.parametrize(("local_tp", "store_tp", "rank"), [(2, 2, 1), (2, 4, 1), (4, 8, 3)])
def test_tp_shared_plan_load_at_a_rank_past_shard_zero(local_tp: int, store_tp: int, rank: int) -> None:
    """The fused load plan at a rank whose first store shard is not 0 equals its steps: each walked chunk once
    per local shard id (``tp_rank * shards_per_rank`` on), keyed by ``key_for`` and rowed by ``prepare_values``."""
    layout = M.LBHNCStoreLayout(M.KeyMetadata("m", rank, 0, 0, 0), BS, BS, local_tp, store_tp, rank, 2)
    shards = layout.local_shard_ids
    assert shards[0] == rank * (store_tp // local_tp) > 0
    layout._set_segment_templates([([1 << (40 + k)], [4096], [512]) for k in range(len(shards))])
    hashes, ids = [b"h0", b"h1", b"h2"], [5, 6, 7]
    for arrays in (False, True):
        keys, addrs, sizes, got_ids = layout.plan_load(3 * BS, hashes, 0, None, ids, arrays=arrays)
        chunks = [(c * BS, (c + 1) * BS) for c in range(3) for _ in shards]
        shard_ids = [s for _ in range(3) for s in shards]
        assert keys == [layout.key_for(s, hashes[c]) for c in range(3) for s in shards]
        want = layout.prepare_values(chunks, ids, shard_ids)
        assert [list(r) for r in addrs] == want[0] and [list(r) for r in sizes] == want[1]
        assert list(got_ids) == want[2] == [i for i in ids for _ in shards]


def test_tp_shared_values_errors_and_overflow() -> None:
    layout = tp_layout()
    assert layout.prepare_values([(BS, 2 * BS), (0, BS)], [5, 6], [1, 0]) == (
        [[(1 << 42) + 6 * 4096, (1 << 43) + 6 * 4096], [(1 << 40) + 5 * 4096, (1 << 41) + 5 * 4096]],
        [[512, 512], [512, 512]], [6, 5])
    with pytest.raises(ValueError, match="one shard ID"):
        layout.prepare_values([(0, BS)], [1], [0, 1])
    with pytest.raises(ValueError, match="full KV blocks"):
        layout.prepare_values([(0, BS - 1)], [1], [0])
    with pytest.raises(ValueError, match="not owned"):
        layout.prepare_values([(0, BS)], [1], [2])
    with pytest.raises(OverflowError):  # vLLM computes in uint64 and rejects negative ids
        layout.prepare_values([(0, BS)], [-1], [0])
    with pytest.raises(OverflowError):
        layout.prepare_values([(0, BS)], [1 << 62], [0])
    with pytest.raises(ValueError):
        layout._set_segment_templates([([1], [1], [1]), ([1, 2], [1, 1], [1, 1])])


def test_package_does_not_import_torch() -> None:
    code = ("import sys; import mooncake_kvaddr.integrations.vllm.data as d; "
            "import mooncake_kvaddr.core.layouts; print('torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# --- registration through the duck-typed tensor surface --------------------------------------------------------


def test_rank_local_registration_cases_with_fake_tensors() -> None:
    storage = FakeStorage(0x10000, 4 * 2 * 64 * 2)
    # (b) num_blocks blocks fill the storage: one region at the storage start
    whole = FakeTensor((4, 2, 64), (128, 64, 1), 2, 0x10000, storage)
    # (c) a view into a bigger storage: one region at the tensor
    part = FakeTensor((2, 1, 64), (64, 64, 1), 2, 0x10100, storage)
    # (a) a block is not one dense range: one region per head
    split = FakeTensor((4, 2, 32), (128, 64, 1), 2, 0x20000, FakeStorage(0x20000, 4096))
    layout = M.RankLocalStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), BS, BS)
    layout.register_kv_caches([whole, part, split, whole], 4)
    assert layout.kv_caches_base_addr == [0x10000, 0x10100, 0x20000, 0x20000 + 128]
    assert layout.block_len == [256, 128, 256, 256]


def test_a_size_one_dimension_does_not_split_a_dense_block() -> None:
    """A contiguous cache with a size-1 dimension whose stride is not the running product (an MLA cache laid out
    (num_blocks, block_size, 1 head, head_dim), or a trailing size-1 dimension): each block is still one dense
    range, so it is one region (fresh mutant M11-20: size-1 dimensions were not ignored and the block was
    registered as one region per token)."""
    mla = FakeTensor((4, 16, 1, 576), (9216, 576, 576, 1), 2, 0x80000, FakeStorage(0x80000, 4 * 9216 * 2))
    trailing = FakeTensor((4, 32, 1), (32, 1, 1), 2, 0x90040, FakeStorage(0x90000, 8 * 32 * 2))
    layout = M.RankLocalStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), BS, BS)
    layout.register_kv_caches([mla, trailing], 4)
    assert layout.kv_caches_base_addr == [0x80000, 0x90040]
    assert layout.block_len == [9216 * 2, 64]


def test_tp_shared_registration_with_fake_tensors() -> None:
    heads, content = 2, 8  # local heads, content elements (fp16)
    storage = FakeStorage(0x40000, 1 << 20)
    lbhnc = FakeTensor((3, heads, BS, content), (heads * BS * content, BS * content, content, 1), 2, 0x40000, storage)
    layout = M.LBHNCStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), BS, BS, 1, 2, 0, heads)
    layout.register_kv_caches([lbhnc], 3)
    head_stride = BS * content * 2
    assert layout.prepare_values([(BS, 2 * BS)] * 2, [0, 2], [0, 1]) == (
        [[0x40000 + 2 * heads * head_stride], [0x40000 + head_stride + 2 * heads * head_stride]],
        [[head_stride], [head_stride]], [2, 2])
    lbnhc = FakeTensor((3, heads, BS, content), (heads * BS * content, content, heads * content, 1), 2, 0x40000,
                       storage)
    token = M.LBNHCStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), BS, BS, 1, 2, 0, heads)
    token.register_kv_caches([lbnhc, lbnhc], 3)
    assert token._engine.segment_count == 2 * BS
    with pytest.raises(ValueError, match="tp_shared_lbhnc"):
        layout.register_kv_caches([lbnhc], 3)
    with pytest.raises(ValueError, match="logical shape"):
        layout.register_kv_caches([lbhnc], 4)


def test_tp_shared_registration_refuses_a_content_dimension_that_is_not_packed() -> None:
    """Strides of a packed cache in every outer dimension do not make it packed: the content elements must be
    adjacent too (a broadcast, stride-0 content dimension reads one element content times)."""
    heads, content = 2, 8
    storage = FakeStorage(0x40000, 1 << 20)
    for cls, outer in ((M.LBHNCStoreLayout, (heads * BS * content, BS * content, content)),
                       (M.LBNHCStoreLayout, (heads * BS * content, content, heads * content))):
        layout = cls(M.KeyMetadata("m", 0, 0, 0, 0), BS, BS, 1, 2, 0, heads)
        for inner in (0, 2):
            cache = FakeTensor((3, heads, BS, content), (*outer, inner), 2, 0x40000, storage)
            with pytest.raises(ValueError, match=f"packed {cls.store_format}"):
                layout.register_kv_caches([cache], 3)
        layout.register_kv_caches([FakeTensor((3, heads, BS, content), (*outer, 1), 2, 0x40000, storage)], 3)


def test_token_major_shards_start_at_their_own_heads() -> None:
    """A rank owning two store shards (local TP 1, store TP 2): shard s's segment of each token starts at its
    first head, s * heads_per_store_shard."""
    heads, content = 2, 8  # local heads, content elements (fp16)
    storage = FakeStorage(0x40000, 1 << 20)
    head_bytes, token_stride, block_stride = content * 2, heads * content * 2, heads * BS * content * 2
    lbnhc = FakeTensor((3, heads, BS, content), (heads * BS * content, content, heads * content, 1), 2, 0x40000,
                       storage)
    token = M.LBNHCStoreLayout(M.KeyMetadata("m", 0, 0, 0, 0), BS, BS, 1, 2, 0, heads)
    token.register_kv_caches([lbnhc], 3)
    _, templates = token.segment_templates
    assert len(templates) == 2
    for shard, (bases, strides, sizes) in enumerate(templates):
        assert list(bases) == [0x40000 + t * token_stride + shard * head_bytes for t in range(BS)]
        assert list(strides) == [block_stride] * BS
        assert list(sizes) == [head_bytes] * BS
    addrs, _, _ = token.prepare_values([(BS, 2 * BS)], [0, 2], [1])
    assert addrs == [[0x40000 + 2 * block_stride + t * token_stride + head_bytes for t in range(BS)]]


def test_tp_shared_lookup_prefixes_cover_every_store_shard_not_only_the_owned_ones() -> None:
    """A lookup runs on one rank for the deployment: it must probe every store shard (shard-major, PP ranks
    sorted), also on a rank that owns only some of them (local TP 2 of store TP 4: rank 1 owns shards 2, 3)."""
    for cls in (M.LBHNCStoreLayout, M.LBNHCStoreLayout):
        layout = cls(M.KeyMetadata("m", 1, 0, 0, 0), BS, BS, 2, 4, 1, 4)
        assert layout.local_shard_ids == (2, 3)
        prefixes = layout.lookup_key_prefixes([(0, 0, 0, 1), (1, 0, 0, 0), (0, 0, 0, 1)])
        assert list(prefixes) == [f"m@tp_rank:{s}@pcp0@dcp0@pp_rank:{p}@group:0" for s in range(4) for p in (0, 1)]


def test_threads_reregistering_while_others_prepare_see_one_snapshot_per_call() -> None:
    import threading

    layout = rank_local([1 << 40, 1 << 41], [4096, 4096])
    layout.row_cache_bytes = 1 << 16  # small: eviction runs too
    chunks = [(b * BS, (b + 1) * BS) for b in range(64)]
    ids = list(range(100, 164))
    valid = {scale: reference([scale << 40, scale << 41], [4096, 4096], chunks, ids) for scale in (1, 2)}
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                addrs, sizes, out = layout.prepare_values(chunks, ids, [0] * len(chunks))
                rows = [list(r) for r in addrs]
                assert any(rows == v[0] for v in valid.values()) and out == ids
                assert sizes == valid[1][1]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(300):
        scale = 1 + i % 2
        layout.set_kv_caches_base_addr([scale << 40, scale << 41])
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_array_output_with_the_gil_released_matches_and_never_aliases() -> None:
    from mooncake_kvaddr import _native

    layout = tp_layout()
    chunks = [(b * BS, (b + 1) * BS) for b in range(4) for _ in (0, 1)]
    shards, ids = [0, 1] * 4, [9, 8, 7, 6]
    expected = layout.prepare_values(chunks, ids, shards)
    before = _native.gil_release_min_work_ns()
    _native.set_gil_release_min_work_ns(0)
    try:
        first = layout.prepare_values_array(chunks, ids, shards)
        second = layout.prepare_values_array(chunks, ids, shards)
    finally:
        _native.set_gil_release_min_work_ns(before)
    assert [a.tolist() for a in first] == [list(map(list, expected[0])), list(map(list, expected[1])), expected[2]]
    first[0][0, 0] = -1
    assert second[0][0, 0] == expected[0][0][0] and not np.shares_memory(first[0], second[0])


class _IdList(list):  # type: ignore[type-arg]
    """A list subclass: read through its own len() and [i], as vLLM's block_ids[i]."""


@pytest.mark.parametrize("form", [list, tuple, _IdList, lambda v: np.asarray(v, np.int64)])
def test_a_block_index_equal_to_the_id_count_is_an_index_error(form: Any) -> None:
    """Python indexing: ``block_ids[len(block_ids)]`` raises IndexError; never a read past the ids (fresh
    mutant M8-05)."""
    layout = rank_local([1 << 40], [64])
    chunks = [(0, BS), (BS, 2 * BS), (2 * BS, 3 * BS)]
    assert layout.prepare_values(chunks, form([4, 5, 6]), [0, 0, 0])[0] == [[(1 << 40) + 64 * i] for i in (4, 5, 6)]
    with pytest.raises(IndexError, match="out of range for 2 block ids"):
        layout.prepare_values(chunks, form([4, 5]), [0, 0, 0])
    with pytest.raises(IndexError, match="out of range for 0 block ids"):
        layout.prepare_values(chunks[:1], form([]), [0])
