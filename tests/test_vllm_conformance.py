"""Conformance of mooncake_kvaddr.integrations.vllm.data against the installed vLLM 0.33.0 (docs/vllm.md).

Every public method of the mirror is run beside vLLM's own on generated inputs (hypothesis): the same value,
or an exception of vLLM's type. Inputs stay inside int64 (where vLLM's numpy would wrap, we raise instead; that
is pinned in tests/test_layouts.py). About 1.15 × 10^4 generated cases per run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_kvaddr.integrations.vllm import data as M

# Hypothesis's failure report trips a third-party DeprecationWarning under filterwarnings=error.
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

try:
    import torch
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as V
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as W
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm==0.33.0 (with torch) is not importable here: {exc!r}", allow_module_level=True)

if vllm.__version__ != "0.33.0":  # pragma: no cover
    pytest.skip(f"conformance is pinned to vLLM 0.33.0, found {vllm.__version__}", allow_module_level=True)


# KVADDR_CONFORMANCE_SCALE scales every example count (e.g. 0.1 for a quick local run; CI runs 1).
SCALE = float(os.environ.get("KVADDR_CONFORMANCE_SCALE", "1"))


def fast(n: int) -> Any:
    return settings(max_examples=max(10, int(n * SCALE)), deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:
        return "error", exc


def same(ours: Callable[[], Any], theirs: Callable[[], Any]) -> Any:
    """Run both; equal values (with exact int types in nested lists), or our error an instance of theirs."""
    a, b = outcome(ours), outcome(theirs)
    if b[0] == "error":
        assert a[0] == "error", f"vLLM raised {b[1]!r}, we returned {a[1]!r}"
        assert isinstance(a[1], type(b[1])), f"vLLM raised {b[1]!r}, we raised {a[1]!r}"
        return None
    assert a[0] == "ok", f"we raised {a[1]!r}, vLLM returned {b[1]!r}"
    assert a[1] == b[1]
    assert type(a[1]) is type(b[1])
    _same_types(a[1], b[1])
    return a[1]


def _same_types(x: Any, y: Any) -> None:
    if isinstance(y, (list, tuple)):
        assert type(x) is type(y)
        for p, q in zip(x, y):
            _same_types(p, q)
    else:
        assert type(x) is type(y), (x, y)


names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=6)
small = st.integers(-3, 9)


@st.composite
def metadata(draw: Any) -> tuple[Any, Any]:
    args = (draw(names), draw(small), draw(small), draw(small), draw(small))
    kw = {"group_id": draw(small), "cache_prefix": draw(st.sampled_from(["", "depA", draw(names)])),
          "store_namespace": draw(st.sampled_from(["", V.LBNHCStoreLayout.shared_namespace(4, 2), draw(names)]))}
    return M.KeyMetadata(*args, **kw), V.KeyMetadata(*args, **kw)


# --- keys ---------------------------------------------------------------------------------------------------


@fast(2000)
@given(metadata(), metadata(), st.binary(max_size=40), st.binary(max_size=40),
       st.fixed_dictionaries({}, optional={"tp_rank": small, "pcp_rank": small, "dcp_rank": small,
                                           "pp_rank": small}))
def test_keys_prefixes_hashes_ordering_group_ids(md1: Any, md2: Any, h1: bytes, h2: bytes, ov: dict[str, int]) -> None:
    (m1, v1), (m2, v2) = md1, md2
    assert M.PoolKey.build_prefix(m1, **ov) == V.PoolKey.build_prefix(v1, **ov)
    assert M.PoolKey.build_key_string("p", h1.hex()) == V.PoolKey.build_key_string("p", h1.hex())
    a, b = M.PoolKey(m1, h1.hex()), M.PoolKey(m2, h2.hex())
    va, vb = V.PoolKey(v1, h1.hex()), V.PoolKey(v2, h2.hex())
    assert a.to_string() == va.to_string()
    assert hash(a) == hash(va) and hash(b) == hash(vb)
    assert (a == b) == (va == vb)
    same(lambda: a < b, lambda: va < vb)
    assert M.make_mooncake_group_id(m1, h1.hex()) == W._make_mooncake_group_id(v1, h1.hex())


# --- rank-local layout --------------------------------------------------------------------------------------


@st.composite
def rank_local_case(draw: Any) -> dict[str, Any]:
    hbs = draw(st.sampled_from([1, 4, 16, 64]))
    block_size = hbs * draw(st.sampled_from([1, 2, 4]))
    n_regions = draw(st.integers(0, 12))
    n_lens = draw(st.integers(0, 4)) if draw(st.booleans()) else n_regions
    bases = [draw(st.integers(0, 1 << 47)) for _ in range(n_regions)]
    lens = [draw(st.integers(1, 1 << 20)) for _ in range(n_lens)]
    n_blocks = draw(st.integers(0, 12))
    block_ids = [draw(st.integers(-(1 << 20), 1 << 24)) for _ in range(n_blocks)]
    chunks = []
    for _ in range(draw(st.integers(0, 8))):
        start = draw(st.integers(-2, n_blocks + 1)) * block_size + draw(st.sampled_from([0, 0, 0, hbs, 1]))
        span = draw(st.integers(-1, 3)) * block_size + draw(st.sampled_from([0, 0, hbs, 1, -hbs]))
        chunks.append((start, start + span))
    shard_ids = [0] * len(chunks)
    if draw(st.integers(0, 9)) == 0:
        shard_ids = draw(st.lists(st.integers(0, 1), max_size=8))
    return {"hbs": hbs, "bs": block_size, "bases": bases, "lens": lens, "block_ids": block_ids, "chunks": chunks,
            "shard_ids": shard_ids}


def rank_local_pair(md: tuple[Any, Any], c: dict[str, Any]) -> tuple[Any, Any]:
    ours = M.RankLocalStoreLayout(md[0], c["bs"], c["hbs"])
    theirs = V.RankLocalStoreLayout(md[1], c["bs"], c["hbs"])
    for layout in (ours, theirs):
        layout.set_kv_caches_base_addr(list(c["bases"]))
        layout.set_block_len(list(c["lens"]))
    return ours, theirs


@fast(2500)
@given(metadata(), rank_local_case(), st.binary(min_size=1, max_size=32),
       st.lists(st.tuples(small, small, small, small), max_size=4), st.booleans())
def test_rank_local_layout(md: Any, c: dict[str, Any], h: bytes, namespaces: list[Any], warm: bool) -> None:
    ours, theirs = rank_local_pair(md, c)
    assert ours.local_shard_ids == theirs.local_shard_ids
    same(lambda: ours.key_for(0, h), lambda: theirs.key_for(0, h))
    same(lambda: ours.key_for(1, h), lambda: theirs.key_for(1, h))
    same(lambda: ours.lookup_key_prefixes(namespaces), lambda: theirs.lookup_key_prefixes(namespaces))
    args = (c["chunks"], c["block_ids"], c["shard_ids"])
    for _ in range(2 if warm else 1):  # the second call of a warm case hits cached rows
        same(lambda: ours.prepare_values(*args), lambda: theirs.prepare_values(*args))
    for block_id in c["block_ids"][:2]:
        same(lambda b=block_id: ours.prepare_value_for_block(b), lambda b=block_id: theirs.prepare_value_for_block(b))
    assert ours.kv_caches_base_addr == theirs.kv_caches_base_addr and ours.block_len == theirs.block_len


@fast(800)
@given(rank_local_case(), st.integers(0, 11), st.integers(0, 1 << 30))
def test_rank_local_in_place_edits_are_seen(c: dict[str, Any], index: int, value: int) -> None:
    md = (M.KeyMetadata("m", 0, 0, 0, 0), V.KeyMetadata("m", 0, 0, 0, 0))
    ours, theirs = rank_local_pair(md, c)
    args = (c["chunks"], c["block_ids"], c["shard_ids"])
    for _ in range(2):
        same(lambda: ours.prepare_values(*args), lambda: theirs.prepare_values(*args))
    for layout in (ours, theirs):  # vLLM keeps the lists by reference: an in-place edit must show
        if layout.block_len:
            layout.block_len[index % len(layout.block_len)] = value + 1
        if layout.kv_caches_base_addr:
            layout.kv_caches_base_addr[index % len(layout.kv_caches_base_addr)] = value
    same(lambda: ours.prepare_values(*args), lambda: theirs.prepare_values(*args))


# --- registering torch caches, rank-local -----------------------------------------------------------------

DTYPES = [torch.float16, torch.float32, torch.int8, torch.float64]


@st.composite
def torch_caches(draw: Any) -> tuple[list[Any], int]:
    """Caches with odd strides and shared storages: permuted, sliced, stacked views of a few storages."""
    num_blocks = draw(st.integers(1, 4))
    storages = []
    for _ in range(draw(st.integers(1, 3))):
        dims = [num_blocks] + [draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 3)))]
        lead = draw(st.sampled_from([None, 2]))
        shape = ([lead] if lead else []) + dims
        storages.append((torch.zeros(shape, dtype=draw(st.sampled_from(DTYPES))), lead))
    caches = []
    for _ in range(draw(st.integers(1, 5))):
        tensor, lead = storages[draw(st.integers(0, len(storages) - 1))]
        view = tensor[draw(st.integers(0, 1))] if lead else tensor
        kind = draw(st.integers(0, 3))
        if kind == 1 and view.dim() >= 3:
            order = [0, *draw(st.permutations(list(range(1, view.dim()))))]
            view = view.permute(*order)
        elif kind == 2 and view.dim() >= 2 and view.shape[-1] > 1:
            view = view[..., 1:]
        elif kind == 3 and view.dim() >= 3 and view.shape[1] > 1:
            view = view[:, ::2]
        caches.append(view)
    return caches, num_blocks + draw(st.sampled_from([0, 0, 0, 1]))


@fast(1000)
@given(torch_caches())
def test_rank_local_register_kv_caches(case: tuple[list[Any], int]) -> None:
    caches, num_blocks = case
    md = (M.KeyMetadata("m", 0, 0, 0, 0), V.KeyMetadata("m", 0, 0, 0, 0))
    ours = M.RankLocalStoreLayout(md[0], 16, 16)
    theirs = V.RankLocalStoreLayout(md[1], 16, 16)
    same(lambda: ours.register_kv_caches(caches, num_blocks), lambda: theirs.register_kv_caches(caches, num_blocks))
    assert ours.kv_caches_base_addr == theirs.kv_caches_base_addr
    assert ours.block_len == theirs.block_len
    if theirs.kv_caches_base_addr:
        chunks = [(0, 16), (16, 48)]
        same(lambda: ours.prepare_values(chunks, [1, 2, 3], [0, 0]),
             lambda: theirs.prepare_values(chunks, [1, 2, 3], [0, 0]))


# --- TP-shared layouts ------------------------------------------------------------------------------------


@st.composite
def tp_case(draw: Any) -> dict[str, Any]:
    store_tp = draw(st.sampled_from([1, 2, 4, 8]))
    local_tp = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if draw(st.booleans()) or store_tp % d == 0]))
    heads = store_tp * draw(st.sampled_from([1, 2])) * max(1, local_tp // store_tp)
    shards_per_rank = store_tp // local_tp
    tp_rank = draw(st.integers(0, max(0, local_tp - 1)))
    block_size = draw(st.sampled_from([1, 2, 4]))
    return {"cls": draw(st.sampled_from(["LBHNCStoreLayout", "LBNHCStoreLayout"])), "store_tp": store_tp,
            "local_tp": local_tp, "heads": heads, "tp_rank": tp_rank, "bs": block_size,
            "shards_per_rank": shards_per_rank, "num_blocks": draw(st.integers(1, 3)),
            "content": draw(st.integers(1, 3)), "layers": draw(st.integers(1, 3)),
            "bad": draw(st.integers(0, 7)), "dtype": draw(st.sampled_from(DTYPES[:3]))}


def tp_caches(c: dict[str, Any], draw_rng: random.Random) -> list[Any]:
    local_heads = c["heads"] // c["local_tp"]
    nb, bs, content = c["num_blocks"], c["bs"], c["content"]
    caches = []
    for _ in range(c["layers"]):
        if c["cls"] == "LBHNCStoreLayout":
            t = torch.zeros((nb, local_heads, bs, content), dtype=c["dtype"])
        else:
            t = torch.zeros((nb, bs, local_heads, content), dtype=c["dtype"]).permute(0, 2, 1, 3)
        if c["bad"] == 1:  # the other format's packing
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        elif c["bad"] == 2:  # wrong logical shape
            t = t[:, :, :, :1].unsqueeze(0) if draw_rng.random() < 0.5 else t[:1] if nb > 1 else t[..., None]
        elif c["bad"] == 3 and content > 1:  # content not unit-stride
            t = torch.zeros((nb, local_heads, bs, content * 2), dtype=c["dtype"])[..., ::2]
        caches.append(t)
    return caches


@fast(1500)
@given(metadata(), tp_case(), st.randoms(use_true_random=False), st.binary(min_size=1, max_size=8),
       st.lists(st.tuples(small, small, small, small), max_size=4), st.booleans())
def test_tp_shared_layouts(md: Any, c: dict[str, Any], rng: random.Random, h: bytes, namespaces: list[Any],
                           warm: bool) -> None:
    args = (c["bs"], c["bs"], c["local_tp"], c["store_tp"], c["tp_rank"], c["heads"])
    ours = getattr(M, c["cls"])(md[0], *args)
    theirs = getattr(V, c["cls"])(md[1], *args)
    assert ours.local_shard_ids == theirs.local_shard_ids
    for attr in ("shards_per_rank", "store_shard_ids", "store_tp_size", "heads_per_store_shard",
                 "local_num_kv_heads", "store_format"):
        assert getattr(ours, attr) == getattr(theirs, attr)
    assert type(ours).shared_namespace(c["store_tp"], 2) == type(theirs).shared_namespace(c["store_tp"], 2)
    for shard in (*theirs.local_shard_ids, c["store_tp"] + 1, -1):
        same(lambda s=shard: ours.key_for(s, h), lambda s=shard: theirs.key_for(s, h))
    same(lambda: ours.lookup_key_prefixes(namespaces), lambda: theirs.lookup_key_prefixes(namespaces))
    caches = tp_caches(c, rng)
    num_blocks = c["num_blocks"]
    same(lambda: ours.register_kv_caches(caches, num_blocks), lambda: theirs.register_kv_caches(caches, num_blocks))
    # Every (block, shard) the registration covers, plus generated invalid keys.
    bs = c["bs"]
    chunks, shards = [], []
    for block in range(num_blocks):
        for shard in theirs.local_shard_ids:
            chunks.append((block * bs, (block + 1) * bs))
            shards.append(shard)
    for _ in range(rng.randrange(3)):
        start = rng.randrange(-1, num_blocks + 1) * bs
        chunks.append((start, start + bs + rng.choice([0, 0, 0, 1, -1])))
        shards.append(rng.choice([*theirs.local_shard_ids, -1, c["store_tp"]]))
    if rng.random() < 0.1 and shards:
        shards.pop()
    block_ids = [rng.randrange(-2 if rng.random() < 0.1 else 0, 1 << 30) for _ in range(num_blocks)]
    for _ in range(2 if warm else 1):
        same(lambda: ours.prepare_values(chunks, block_ids, shards),
             lambda: theirs.prepare_values(chunks, block_ids, shards))
    same(lambda: ours.prepare_values([], block_ids, []), lambda: theirs.prepare_values([], block_ids, []))


# --- the token database -------------------------------------------------------------------------------------


class Recorder(list):  # type: ignore[type-arg]
    """A hash list that records which indices were read."""

    def __init__(self, items: list[bytes]) -> None:
        super().__init__(items)
        self.reads: list[int] = []

    def __getitem__(self, index: Any) -> Any:
        self.reads.append(index)
        return super().__getitem__(index)


@fast(2000)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.integers(-16, 96), st.integers(0, 40),
       st.integers(-20, 100), st.one_of(st.none(), st.lists(st.booleans(), max_size=12)), st.integers(0, 3),
       st.integers(0, 3))
def test_process_tokens(hbs: int, factor: int, token_len: int, n_hashes: int, mask_num: int,
                        chunk_mask: list[bool] | None, put_step: int, put_step_rank: int) -> None:
    block_size = hbs * factor
    md = (M.KeyMetadata("m", 0, 0, 0, 0), V.KeyMetadata("m", 0, 0, 0, 0))
    ours = M.ChunkedTokenDatabase(md[0], block_size, hbs)
    theirs = V.ChunkedTokenDatabase(md[1], block_size, hbs)
    hashes = [bytes([i]) for i in range(n_hashes)]
    mine, ref = Recorder(hashes), Recorder(hashes)
    kw = {"chunk_mask": chunk_mask, "put_step": put_step, "put_step_rank": put_step_rank}
    same(lambda: list(ours.process_tokens(token_len, mine, mask_num, **kw)),
         lambda: list(theirs.process_tokens(token_len, ref, mask_num, **kw)))
    assert mine.reads == ref.reads


@fast(500)
@given(st.integers(1, 64), st.integers(0, 64), metadata(), st.binary(min_size=1, max_size=8))
def test_database_surface(block_size: int, hbs: int, md: Any, h: bytes) -> None:
    same(lambda: M.ChunkedTokenDatabase(md[0], block_size, hbs).block_size,
         lambda: V.ChunkedTokenDatabase(md[1], block_size, hbs).block_size)
    if hbs and block_size % hbs:
        return
    ours = M.ChunkedTokenDatabase(md[0], block_size, hbs or None)
    theirs = V.ChunkedTokenDatabase(md[1], block_size, hbs or None)
    assert ours.hash_block_size == theirs.hash_block_size
    same(lambda: ours.key_for(h), lambda: theirs.key_for(h))
    for db in (ours, theirs):
        db.set_kv_caches_base_addr([1 << 40, 1 << 41])
        db.set_block_len([block_size * 8])
    assert ours.kv_caches_base_addr == theirs.kv_caches_base_addr and ours.block_len == theirs.block_len
    same(lambda: ours.prepare_value_for_block(3), lambda: theirs.prepare_value_for_block(3))
    # Any other layout: the rank-local surface raises RuntimeError naming "rank-local".
    tp = (M.LBHNCStoreLayout(md[0], block_size, block_size, 1, 1, 0, 1),
          V.LBHNCStoreLayout(md[1], block_size, block_size, 1, 1, 0, 1))
    dbs = (M.ChunkedTokenDatabase(md[0], block_size, store_layout=tp[0]),
           V.ChunkedTokenDatabase(md[1], block_size, store_layout=tp[1]))
    for call in (lambda d: d.key_for(h), lambda d: d.kv_caches_base_addr, lambda d: d.block_len,
                 lambda d: d.set_block_len([1]), lambda d: d.set_kv_caches_base_addr([1]),
                 lambda d: d.prepare_value_for_block(0)):
        same(lambda c=call: c(dbs[0]), lambda c=call: c(dbs[1]))
    with pytest.raises(RuntimeError, match="rank-local"):
        dbs[0].prepare_value_for_block(0)


# --- the fused load plan vs vLLM's receive loop ----------------------------------------------------------------


def vllm_load_loop(db: Any, token_len: int, hashes: list[bytes], mask_num: int, mask: list[bool],
                   tail: int | None, block_ids: list[int]) -> tuple[Any, ...]:
    """vLLM 0.33's receive thread for one group (worker.py), driven through vLLM's own objects."""
    keys, chunks, shard_ids = [], [], []
    for start, end, block_hash in db.process_tokens(token_len, hashes, mask_num):
        index = start // db.block_size
        if index >= len(mask) or not mask[index]:
            continue
        if tail is not None and end == token_len:
            block_hash = hashes[tail // db.hash_block_size - 1]
        for shard in db.store_layout.local_shard_ids:
            keys.append(db.store_layout.key_for(shard, block_hash))
            chunks.append((start, end))
            shard_ids.append(shard)
    addrs, sizes, ids = db.store_layout.prepare_values(chunks, block_ids, shard_ids)
    return keys, addrs, sizes, ids


@fast(1000)
@given(st.sampled_from([4, 8]), st.sampled_from([1, 2]), st.integers(0, 12), st.integers(-8, 80),
       st.lists(st.booleans(), max_size=14), st.one_of(st.none(), st.integers(0, 96)), st.booleans(),
       st.randoms(use_true_random=False))
def test_fused_plan_load_matches_vllm_loop(hbs: int, factor: int, n_blocks: int, mask_num: int, mask: list[bool],
                                           tail: int | None, tp_shared: bool, rng: random.Random) -> None:
    block_size = hbs * factor
    token_len = rng.randrange(0, n_blocks * block_size + 1) // hbs * hbs if n_blocks else 0
    if tp_shared:
        token_len = token_len // block_size * block_size
    hashes = [bytes([i, i ^ 0x5A]) for i in range(max(token_len // hbs, rng.randrange(0, 3)) + rng.randrange(2))]
    block_ids = [rng.randrange(0, 1 << 20) for _ in range(n_blocks)]
    dbs = []
    for mod in (M, V):
        md = mod.KeyMetadata("model", 1, 0, 0, 0)
        if tp_shared:
            layout = mod.LBHNCStoreLayout(md, block_size, hbs, 1, 2, 0, 2)
            layout._set_segment_templates([([1 << 40, 1 << 41], [4096, 4096], [512, 512]),
                                           ([1 << 42, 1 << 43], [4096, 4096], [512, 512])])
        else:
            layout = mod.RankLocalStoreLayout(md, block_size, hbs)
            layout.set_kv_caches_base_addr([1 << 40, 1 << 41, 1 << 42])
            layout.set_block_len([4096, 8192])
        dbs.append(mod.ChunkedTokenDatabase(md, block_size, hbs, store_layout=layout))
    expected = outcome(lambda: vllm_load_loop(dbs[1], token_len, hashes, mask_num, mask, tail, block_ids))
    got = outcome(lambda: tuple(dbs[0].store_layout.plan_load(token_len, hashes, mask_num, mask, block_ids, tail)))
    if expected[0] == "error":
        assert got[0] == "error" and isinstance(got[1], type(expected[1])), (expected, got)
        return
    assert got == expected
    arrays = dbs[0].store_layout.plan_load(token_len, b"".join(hashes), mask_num, mask, block_ids, tail, hash_len=2,
                                           arrays=True)
    assert arrays[0] == expected[1][0]
    assert arrays[1].tolist() == (expected[1][1] or arrays[1].tolist())
    assert arrays[3].tolist() == expected[1][3]
