"""The plugin's vLLM 0.34 port against vLLM 0.34.0's own functions (docs/vllm-plugin.md, "vLLM 0.34").

Differential, on generated cases (helpers in tests/vllm034_cases.py): the replaced layout methods beside vLLM's
originals (regions set directly, templates set through vLLM's setter, and layouts registered from real CPU
tensors in all six cache layouts, with kernel blocks, and Mamba2/GDN states), and the receive handler beside
vLLM's ``_handle_request`` against recording stores: equal values of identical types, exceptions of vLLM's type,
the same store calls, records, errors and completion. KVADDR_CONFORMANCE_SCALE scales the case counts.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import random
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_kvaddr.integrations.vllm import plugin
from mooncake_kvaddr.integrations.vllm.layouts import ENGINE_ATTR
from mooncake_kvaddr.integrations.vllm.registry import original_of
from mooncake_kvaddr.integrations.vllm.releases import v0_34
from vllm034_cases import (
    EXACT_BUDGETS,
    LIST_TYPES,
    LayoutPool,
    ListStore,
    WrapperLikeStore,
    as_wrapper_calls,
    attention_layout,
    compare,
    edit_in_place,
    mamba_cache,
    mamba_spec,
    rank_local_case,
    receive_case,
    run_handler,
    sharded_batches,
    sharded_layout,
    templates,
)

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_release("0.34")]

try:
    import numpy as np
    import torch
    import vllm

    if not vllm.__version__.startswith("0.34."):
        raise ImportError(f"vLLM {vllm.__version__} is installed")
    LAYOUT = importlib.import_module(v0_34.LAYOUT_MODULE)
    DATA = importlib.import_module(plugin.DATA_MODULE)
    WORKER = importlib.import_module(plugin.WORKER_MODULE)
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout, is_conv_state_dim_first
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"vLLM 0.34 (with torch) is not importable here: {exc!r}", allow_module_level=True)

SCALE = float(os.environ.get("KVADDR_CONFORMANCE_SCALE", "1"))
SEED = int(os.environ.get("KVADDR_CONFORMANCE_SEED", "34"))
FULL = SCALE >= 1


def scaled(n: int) -> int:
    return max(20, int(n * SCALE))


#: What patching vLLM 0.34 replaces: the four layout methods, the receive and the send handler (lookup and the
#: worker hooks are not ported to 0.34).
EXPECTED_PATCHED = [
    "RankLocalStoreLayout.prepare_values",
    "RankLocalStoreLayout.key_for",
    "TPShardedStoreLayout.prepare_values",
    "TPShardedStoreLayout.key_for",
    "KVCacheStoreRecvingThread._handle_request",
    "MooncakeStoreWorker.lookup",
    "KVCacheStoreSendingThread._handle_request",
]


@pytest.fixture(scope="module")
def patched() -> Iterator[plugin.PatchReport]:
    """vLLM 0.34 patched by the plugin (every part it ports: a refused part fails every test here, so that no
    comparison runs vLLM's function against itself)."""
    plugin.unpatch()
    report = plugin.patch()
    try:
        assert report.patched == EXPECTED_PATCHED, report
        yield report
    finally:
        plugin.unpatch()


OURS = {(cls_name, method): ours for cls_name, method, ours in v0_34.REPLACEMENTS}


def _methods(cls_name: str) -> tuple[Any, Any, Any, Any]:
    """(vLLM's prepare_values, ours, vLLM's key_for, ours) of a layout class, ours as installed by the patch."""
    cls = getattr(LAYOUT, cls_name)
    for method in ("prepare_values", "key_for"):
        assert cls.__dict__[method] is OURS[cls_name, method], (cls_name, method)
    return (
        original_of(cls, "prepare_values"),
        cls.__dict__["prepare_values"],
        original_of(cls, "key_for"),
        cls.__dict__["key_for"],
    )


def _handlers() -> tuple[Any, Any]:
    """(vLLM's ``_handle_request``, ours as installed by the patch)."""
    handler = WORKER.KVCacheStoreRecvingThread.__dict__["_handle_request"]
    assert handler.__module__.startswith("mooncake_kvaddr"), handler
    return original_of(WORKER.KVCacheStoreRecvingThread, "_handle_request"), handler


def test_the_plugin_patches_vllm_034(patched: plugin.PatchReport) -> None:
    assert patched.vllm_version == vllm.__version__
    assert patched.patched == EXPECTED_PATCHED, patched
    assert patched.receive_reason == "" and patched.reason == ""
    for cls_name, method, ours in v0_34.REPLACEMENTS:
        cls = getattr(LAYOUT, cls_name)
        assert cls.__dict__[method] is ours
        assert original_of(cls, method).__module__ == v0_34.LAYOUT_MODULE
    handler = WORKER.KVCacheStoreRecvingThread.__dict__["_handle_request"]
    assert handler.__module__.startswith("mooncake_kvaddr") and handler.__wrapped__.__module__ == WORKER.__name__
    # The layout subclasses vLLM builds from tensors inherit the replacements.
    for name in ("HeadMajorStoreLayout", "TokenMajorStoreLayout", "MambaStoreLayout"):
        assert getattr(LAYOUT, name).prepare_values is v0_34._sharded_prepare_values


# --- layouts -------------------------------------------------------------------------------------------------


def test_rank_local_layout_matches_vllm_with_strides_apart_from_lengths(patched: plugin.PatchReport) -> None:
    """RankLocalStoreLayout.prepare_values/key_for: regions whose stride differs from their stored length,
    cycling lists, multi-block chunks, partial tails, empty batches and every error vLLM raises; and again after
    the lists are edited in place or replaced."""
    theirs, ours, theirs_key, ours_key = _methods("RankLocalStoreLayout")
    rng = random.Random(SEED)
    metadata = LAYOUT.KeyMetadata("m/rank-local", 3, 0, 1, 0, group_id=2, cache_prefix="c", store_namespace="@ns")
    seen: collections.Counter[str] = collections.Counter()
    stride_apart = 0
    for case in range(scaled(3500)):
        layout, batches = rank_local_case(rng, LAYOUT, metadata)
        stride_apart += layout.block_stride != layout.block_len
        for label, args in batches:
            seen[f"{label}:{compare(f'rank-local {case} {label}', theirs, ours, layout, *args)}"] += 1
        if rng.random() < 0.3:
            edit_in_place(rng, layout)
            seen[f"edited:{compare(f'rank-local {case} edited', theirs, ours, layout, *batches[0][1])}"] += 1
        digest = rng.randbytes(32)
        for shard in (0, 1):
            result = compare(f"rank-local {case} key_for", theirs_key, ours_key, layout, shard, digest)
            seen[f"key {shard}:{result}"] += 1
    total = sum(seen.values())
    if FULL:
        assert total >= 9000, seen
        assert stride_apart >= 3000
        for label in ("ok:ok", "unaligned:AssertionError", "shard:AssertionError", "count:AssertionError",
                      "past:IndexError", "negative start:IndexError", "negative start:ok", "negative span:ok",
                      "negative id:ok", "empty:ok", "edited:ok", "ok:ZeroDivisionError", "ok:IndexError",
                      "key 0:ok", "key 1:AssertionError"):  # fmt: skip
            assert seen[label] >= 10, (label, seen)


def _engine_ran(layout: Any) -> bool:
    state = layout.__dict__.get(ENGINE_ATTR)
    return state is not None and state[0] is not None


def test_tp_shared_layout_matches_vllm_with_store_chunks_below_a_block(patched: plugin.PatchReport) -> None:
    """TPShardedStoreLayout.prepare_values/key_for with templates per Store chunk and local shard: batches of
    16 chunks or fewer (vLLM's loop) and more (its vectorised path, our engine), every error alone and two in one
    batch, several shard counts and TP sizes, ragged templates, templates re-installed after a first call."""
    theirs, ours, theirs_key, ours_key = _methods("TPShardedStoreLayout")
    rng = random.Random(SEED + 1)
    metadata = LAYOUT.KeyMetadata("m/shared", 0, 0, 0, 1, group_id=1)
    seen: collections.Counter[str] = collections.Counter()
    engine_calls = sub_block = 0
    for case in range(scaled(3500)):
        layout = sharded_layout(rng, LAYOUT, metadata)
        for label, args in sharded_batches(rng, layout):
            result = compare(f"tp-shared {case} {label}", theirs, ours, layout, *args)
            size = "large" if len(args[0]) > 16 else "small"
            seen[f"{label}:{size}:{result}"] += 1
            if label == "ok" and size == "large" and _engine_ran(layout):
                engine_calls += 1
                sub_block += layout.store_chunk_size < layout.block_size
        if rng.random() < 0.2:  # new templates: the engine must follow them
            layout._set_segment_templates(
                templates(rng, layout.block_size // layout.store_chunk_size, layout.shards_per_rank, 3, False)
            )
            label, args = sharded_batches(rng, layout)[0]
            seen[f"reinstalled:{compare(f'tp-shared {case} re-installed', theirs, ours, layout, *args)}"] += 1
        digest = rng.randbytes(32)
        for shard in (layout.local_shard_ids[0], layout.local_shard_ids[-1] + 1, -1):
            result = compare(f"tp-shared {case} key_for", theirs_key, ours_key, layout, shard, digest)
            seen[f"key:{result}"] += 1
    total = sum(seen.values())
    if FULL:
        assert total >= 10_000, seen
        assert engine_calls >= 500 and sub_block >= 300, (engine_calls, sub_block)
        for label in ("ok:small:ok", "ok:large:ok", "reinstalled:ok", "key:ok", "key:KeyError"):
            assert seen[label] >= 50, (label, seen)
        for error, raised in (("boundary", "ValueError"), ("zero span", "ValueError"), ("long span", "ValueError"),
                              ("negative span", "ValueError"), ("shard", "ValueError"),
                              ("negative shard", "ValueError"), ("block index", "ValueError"),
                              ("count", "ValueError"), ("negative id", "OverflowError"),
                              ("negative start", "ok"), ("far negative start", "IndexError"),
                              ("tuple ids", "ok")):  # fmt: skip
            for size in ("small", "large"):
                assert seen[f"{error}:{size}:{raised}"] >= 5, (error, size, seen)


LAYOUT_CASES = [(cache_layout, kernel) for cache_layout in KVCacheLayout for kernel in (False, True)]


@pytest.mark.parametrize(("cache_layout", "kernel_blocks"), LAYOUT_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_attention_layouts_from_cpu_tensors_match_vllm(
    patched: plugin.PatchReport, cache_layout: Any, kernel_blocks: bool
) -> None:
    """Head- and token-major layouts registered by vLLM's own ``register_kv_caches`` from real CPU tensors in
    each of the six KV-cache layouts, 4-D caches and 5-D ones with kernel blocks, several Store chunk sizes:
    vLLM's ``prepare_values`` and ours on the same batches."""
    theirs, ours, _, _ = _methods("TPShardedStoreLayout")
    rng = random.Random(f"{SEED}-{cache_layout.name}-{kernel_blocks}")
    metadata = LAYOUT.KeyMetadata("m/attention", 0, 0, 0, 0)
    seen: collections.Counter[str] = collections.Counter()
    engine_calls = 0
    chunk_sizes = set()
    for case in range(scaled(60)):
        layout, caches = attention_layout(rng, torch, LAYOUT, FullAttentionSpec, metadata, cache_layout, kernel_blocks)
        assert caches[0].ndim == (5 if kernel_blocks else 4)
        chunk_sizes.add((layout.store_chunk_size, layout.block_size))
        for label, args in sharded_batches(rng, layout):
            seen[label + ":" + compare(f"{cache_layout.name} {case} {label}", theirs, ours, layout, *args)] += 1
            if label == "ok" and len(args[0]) > 16 and _engine_ran(layout):
                engine_calls += 1
        del caches
    if FULL:
        assert sum(seen.values()) >= 100 and seen["ok:ok"] >= 50, seen
        assert engine_calls >= 10, engine_calls
        assert len(chunk_sizes) >= 6, chunk_sizes


@pytest.mark.parametrize("conv_layout", ["DS", "SD"])
def test_mamba_layouts_from_cpu_tensors_match_vllm(
    patched: plugin.PatchReport, monkeypatch: pytest.MonkeyPatch, conv_layout: str
) -> None:
    """MambaStoreLayout for Mamba2 and GDN states (specs as vLLM's own tests build them), both conv-state
    layouts, local TP 1/2/4 against 4 Store shards, packed and padded pages: vLLM's ``register_kv_caches``, then
    vLLM's ``prepare_values`` and ours."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", conv_layout)
    get_conv_state_layout.cache_clear()
    try:
        theirs, ours, _, _ = _methods("TPShardedStoreLayout")
        rng = random.Random(f"{SEED}-mamba-{conv_layout}")
        seen: collections.Counter[str] = collections.Counter()
        engine_calls = 0
        for case in range(scaled(80)):
            kind = ("gdn", "mamba2")[case % 2]
            local_tp = rng.choice([1, 2, 4])
            spec = mamba_spec(torch, MambaAttentionBackendEnum, MambaSpec, kind, local_tp, conv_layout == "DS")
            tp_rank = rng.randrange(local_tp)
            metadata = LAYOUT.KeyMetadata("m/mamba", tp_rank, 0, 0, 0, group_id=1)
            layout = LAYOUT.MambaStoreLayout(metadata, 16, 16, local_tp, 4, tp_rank, (spec,) * rng.randint(1, 2))
            blocks = rng.randint(2, 6)
            caches = [mamba_cache(rng, torch, blocks, spec.state_content_size_bytes) for _ in layout.layer_specs]
            layout.register_kv_caches(caches, blocks)
            for label, args in sharded_batches(rng, layout):
                seen[label + ":" + compare(f"mamba {kind} {case} {label}", theirs, ours, layout, *args)] += 1
                if label == "ok" and len(args[0]) > 16 and _engine_ran(layout):
                    engine_calls += 1
    finally:
        get_conv_state_layout.cache_clear()
    if FULL:
        assert sum(seen.values()) >= 120 and seen["ok:ok"] >= 80, seen
        assert engine_calls >= 20, engine_calls


def test_rank_local_layouts_registered_from_cpu_tensors_match_vllm(patched: plugin.PatchReport) -> None:
    """RankLocalStoreLayout.register_kv_caches (vLLM's) on real views: layer-outermost pages padded past the
    state, one block-outermost buffer shared by every layer, and non-dense caches split per head."""
    theirs, ours, _, _ = _methods("RankLocalStoreLayout")
    rng = random.Random(SEED + 7)
    metadata = LAYOUT.KeyMetadata("m/views", 0, 0, 0, 0)
    shapes: collections.Counter[str] = collections.Counter()
    for case in range(scaled(150)):
        layers, blocks = rng.randint(1, 3), rng.randint(2, 6)
        form = ("padded", "block-outermost", "per-head")[case % 3]
        if form == "padded":
            page, state = rng.choice([(64, 40), (128, 128), (96, 8)])
            raw = torch.zeros(layers * blocks * page, dtype=torch.int8)
            views = [torch.as_strided(raw, (blocks, 1, 1, state), (page, state, state, 1), layer * blocks * page)
                     for layer in range(layers)]  # fmt: skip
        elif form == "block-outermost":  # sometimes a spare layer slot at the end of each block
            raw = torch.zeros((blocks, layers + case % 2, 2, 4, 8), dtype=torch.float16)
            views = list(raw.unbind(1))[:layers]
        else:  # heads outside blocks, sometimes padded states
            raw = torch.zeros((layers, 2, blocks, 4 + case % 2, 8), dtype=torch.float16)
            views = [raw[layer, :, :, :4].transpose(0, 1) for layer in range(layers)]
        layout = LAYOUT.RankLocalStoreLayout(metadata, 16, 16)
        layout.register_kv_caches(views, blocks)
        shapes[f"{form}:{layout.block_stride != layout.block_len}"] += 1
        ids = [rng.randrange(blocks) for _ in range(blocks)]
        span = 16 * rng.choice([1, 2])
        chunks = [(s, min(s + span, blocks * 16)) for s in range(0, blocks * 16, span)]
        assert compare(f"views {form} {case}", theirs, ours, layout, chunks, ids, [0] * len(chunks)) == "ok"
    if FULL:
        assert all(shapes[f"{form}:{apart}"] >= 10 for form in ("padded", "block-outermost", "per-head")
                   for apart in (True, False)), shapes  # fmt: skip


def test_where_vllm_wraps_a_64_bit_address_ours_raises_overflow(patched: plugin.PatchReport) -> None:
    """The one deliberate difference (docs/vllm-plugin.md): vLLM's numpy wraps an address past 64 bits (int64 in
    the rank-local rule, uint64 in the TP-shared one); ours raises OverflowError. Pinned so that a change on
    either side shows."""
    theirs, ours, _, _ = _methods("RankLocalStoreLayout")
    layout = LAYOUT.RankLocalStoreLayout(LAYOUT.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    layout.kv_caches_base_addr, layout.block_stride, layout.block_len = [1 << 62], [1 << 40], [100]
    addrs, _, _ = theirs(layout, [(0, 16)], [1 << 30], [0])
    assert addrs == [[1 << 62]]  # (1 << 62) + (1 << 70), wrapped
    with pytest.raises(OverflowError):
        ours(layout, [(0, 16)], [1 << 30], [0])

    theirs, ours, _, _ = _methods("TPShardedStoreLayout")
    sharded = LAYOUT.TPShardedStoreLayout(LAYOUT.KeyMetadata("m", 0, 0, 0, 0), 16, 16, 1, 1, 0, 16)
    sharded._set_segment_templates([[([1 << 40], [1 << 30], [64])]])
    chunks = [(16 * i, 16 * i + 16) for i in range(17)]  # the vectorised path (our engine)
    ids = [1 << 34] * 17
    addrs, _, _ = theirs(sharded, chunks, ids, [0] * 17)
    assert addrs[0] == [1 << 40]  # (1 << 40) + (1 << 64), wrapped modulo 2**64
    with pytest.raises(OverflowError):
        ours(sharded, chunks, ids, [0] * 17)


def _tp_one_segment(base: int) -> Any:
    layout = LAYOUT.TPShardedStoreLayout(LAYOUT.KeyMetadata("m", 0, 0, 0, 0), 16, 16, 1, 1, 0, 16)
    layout._set_segment_templates([[([base], [4096], [64])]])
    return layout


def _rank_local_one_region() -> Any:
    layout = LAYOUT.RankLocalStoreLayout(LAYOUT.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    layout.kv_caches_base_addr, layout.block_stride, layout.block_len = [1 << 30], [4096], [100]
    return layout


def test_a_subclass_calling_super_gets_vllms_own_where_ours_hands_over(patched: plugin.PatchReport) -> None:
    """Where ours hands a batch to vLLM's own (16 chunks or fewer on a TP-shared layout), it runs the patched
    class's own method, never a subclass's override: one that calls ``super()`` would reach ours again."""

    class Wrapped(LAYOUT.TPShardedStoreLayout):  # type: ignore[misc, name-defined]
        def prepare_values(self, chunks: Any, block_ids: Any, shard_ids: Any) -> Any:
            return super().prepare_values(chunks, block_ids, shard_ids)

    layout = Wrapped(LAYOUT.KeyMetadata("m", 0, 0, 0, 0), 16, 16, 1, 1, 0, 16)
    layout._set_segment_templates([[([1 << 30], [4096], [64])]])
    args = (_CHUNKS[:3], [7, 8, 9], [0, 0, 0])
    own = original_of(LAYOUT.TPShardedStoreLayout, "prepare_values")(layout, *args)
    assert layout.prepare_values(*args) == own and own[2] == [7, 8, 9]


@pytest.mark.parametrize("cls_name", ["RankLocalStoreLayout", "TPShardedStoreLayout"])
def test_the_layout_self_check_catches_a_release_that_behaves_differently(cls_name: str) -> None:
    """0.34's layout self-check compares vLLM's own methods with ours: a layout class whose ``prepare_values``
    gives other block ids fails it, naming the class (a self-check that compared ours with ours passed)."""
    base = getattr(LAYOUT, cls_name)

    def shifted(self: Any, chunks: Any, block_ids: Any, shard_ids: Any) -> Any:
        addrs, sizes, ids = base.prepare_values(self, chunks, block_ids, shard_ids)
        return addrs, sizes, [i + 1 for i in ids]

    module = types.ModuleType(LAYOUT.__name__)
    module.__dict__.update(vars(LAYOUT))
    setattr(module, cls_name, type("Shifted", (base,), {"prepare_values": shifted}))
    v0_34.self_check(LAYOUT)
    with pytest.raises(AssertionError, match=f"^{cls_name}.prepare_values"):
        v0_34.self_check(module)


def test_the_handlers_plan_only_templates_the_engine_holds() -> None:
    """The handlers' view of a layout (``PLAN_ENGINES``): the engine and the owned shards' key prefixes where the
    engine holds the templates; the reason vLLM's own handler plans it where it does not (unequal widths)."""
    sharded = _tp_one_segment(1 << 30)
    engine, prefixes = v0_34.PLAN_ENGINES["sharded"](sharded)
    assert engine is sharded.__dict__[ENGINE_ATTR][0] and prefixes == [sharded._shard_key_prefixes[0]]
    uneven = LAYOUT.TPShardedStoreLayout(LAYOUT.KeyMetadata("m", 0, 0, 0, 0), 32, 16, 1, 1, 0, 16)
    uneven._set_segment_templates([[([1 << 30], [4096], [64])], [([1 << 30, 1 << 31], [4096] * 2, [64] * 2)]])
    assert v0_34.PLAN_ENGINES["sharded"](uneven) == "TP-shared templates the engine cannot hold"
    rank_local = _rank_local_one_region()
    engine, prefixes = v0_34.PLAN_ENGINES["rank_local"](rank_local)
    assert engine is rank_local.__dict__[ENGINE_ATTR][0] and prefixes == [rank_local._key_prefix]
    assert rank_local.__dict__[ENGINE_ATTR][5] is rank_local.block_stride  # 0.34's strides, not 0.33's None


_CHUNKS = [(16 * i, 16 * i + 16) for i in range(20)]  # more than 16: vLLM's vectorised path, our engine
#: Inputs vLLM's callers never build, past its token walk: each once differed (found by probing) and is the same
#: now (ours hands int-likes numpy casts to vLLM's own function; a Store chunk of three items is refused).
_ONCE_DIFFERENT: dict[str, tuple[Any, ...]] = {
    # (layout class, layout, chunks, block ids, shard ids)
    "tp-shared float block ids": (
        "TPShardedStoreLayout", lambda: _tp_one_segment(5), _CHUNKS, [float(i) for i in range(20)], [0] * 20,
    ),
    "tp-shared float chunk bounds": (
        "TPShardedStoreLayout", lambda: _tp_one_segment(5), [(float(a), float(b)) for a, b in _CHUNKS],
        list(range(20)), [0] * 20,
    ),
    "tp-shared three-item chunk": (
        "TPShardedStoreLayout", lambda: _tp_one_segment(5), [(0, 16, 3), *_CHUNKS[1:]], list(range(20)), [0] * 20,
    ),
    "tp-shared three-item chunk, later": (
        "TPShardedStoreLayout", lambda: _tp_one_segment(5), [*_CHUNKS[:-1], [304, 320, 3]], list(range(20)), [0] * 20,
    ),
    "rank-local float block id": ("RankLocalStoreLayout", _rank_local_one_region, [(0, 16)], [1.0], [0]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_ONCE_DIFFERENT))
def test_inputs_vllm_never_builds_are_answered_as_vllm_answers(patched: plugin.PatchReport, name: str) -> None:
    cls_name, build, chunks, block_ids, shard_ids = _ONCE_DIFFERENT[name]
    theirs, ours, _, _ = _methods(cls_name)
    compare(name, theirs, ours, build(), chunks, block_ids, shard_ids)


def test_an_address_past_int64_is_refused_where_vllm_computes_it_in_uint64(patched: plugin.PatchReport) -> None:
    """The one deliberate difference (docs/vllm-plugin.md, "vLLM 0.34"): the engine computes in int64 and raises
    OverflowError for an address or size it cannot hold; vLLM's uint64 arithmetic gives the exact value below
    2**64 (and wraps above). No user-space address is near 2**63."""
    theirs, ours, _, _ = _methods("TPShardedStoreLayout")
    layout = _tp_one_segment((1 << 63) - 10)
    addrs, _, _ = theirs(layout, _CHUNKS, list(range(20)), [0] * 20)
    assert addrs[1] == [(1 << 63) - 10 + 4096]
    with pytest.raises(OverflowError):
        ours(layout, _CHUNKS, list(range(20)), [0] * 20)


# --- the receive handler ---------------------------------------------------------------------------------------


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _receive_pool(rng: random.Random) -> LayoutPool:
    """Tensor-built layouts for requests (hash blocks of 16 tokens, Store chunks of 16 or 32 tokens)."""
    items: list[tuple[Any, int, Any]] = []
    metadata = LAYOUT.KeyMetadata("m/recv-tensors", 1, 0, 0, 0)
    for i, cache_layout in enumerate(KVCacheLayout):
        layout, caches = attention_layout(rng, torch, LAYOUT, FullAttentionSpec, metadata, cache_layout, i % 2 == 1,
                                          block_sizes=(32, 64), hbs=16)  # fmt: skip
        items.append((layout, layout.store_chunk_size, caches))
    get_conv_state_layout.cache_clear()
    for kind in ("gdn", "mamba2"):
        spec = mamba_spec(torch, MambaAttentionBackendEnum, MambaSpec, kind, 2, is_conv_state_dim_first())
        layout = LAYOUT.MambaStoreLayout(metadata, 16, 16, 2, 4, 1, (spec,))
        caches = [mamba_cache(rng, torch, 4, spec.state_content_size_bytes)]
        layout.register_kv_caches(caches, 4)
        items.append((layout, 16, caches))
    get_conv_state_layout.cache_clear()
    return LayoutPool(items)


def test_receive_handler_matches_vllms(patched: plugin.PatchReport) -> None:
    """vLLM 0.34's ``KVCacheStoreRecvingThread._handle_request`` and ours on generated requests: every store call
    (keys, rows, Python types where the store gets lists; as our wrappers pass them on where it takes arrays),
    records, reported error block ids, failed requests, completion and the queue's unfinished tasks."""
    original, handler = _handlers()
    assert handler.__wrapped__ is original
    stats = handler.stats
    rng = random.Random(SEED + 11)
    pool = _receive_pool(rng)
    quiet = _Quiet()
    WORKER.logger.addFilter(quiet)
    seen: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    try:
        for case_no in range(scaled(15_000)):
            case = receive_case(rng, DATA, LAYOUT, pool)
            behaviour = rng.choice(["ok", "ok", "ok", "fail", "raise", "short", "tuple", "iter", "numpy"])
            arrays = rng.random() < 0.6
            expected = run_handler(WORKER, original, ListStore(behaviour), case)
            fast_before = stats.fast_requests
            store = WrapperLikeStore(behaviour) if arrays else ListStore(behaviour)
            actual = run_handler(WORKER, handler, store, case)
            fast = stats.fast_requests > fast_before
            want = list(expected)
            if arrays and fast:  # our handler hands a wrapper matrices; vLLM's (the fallback) hands it lists
                want[1] = as_wrapper_calls(expected[1], behaviour)
            assert actual == tuple(want), (case_no, behaviour, arrays, fast, stats.last_fallback)
            assert all(call[3][:4] == LIST_TYPES[:4] and call[3][4] <= LIST_TYPES[4] for call in actual[1])
            seen["fast" if fast else "vllm"] += 1
            seen["fallback: " + stats.last_fallback if not fast else "fast"] += not fast
            seen[f"outcome:{expected[0] if isinstance(expected[0], str) else expected[0].__name__}"] += 1
            if fast:
                _count_fast(seen, case, expected, behaviour, store)
    finally:
        WORKER.logger.removeFilter(quiet)
    elapsed = time.perf_counter() - started
    if FULL:
        assert seen["fast"] + seen["vllm"] >= 15_000
        assert seen["fast"] >= 6000, seen
        for what in ("sub-block chunks", "tensor layout", "mamba", "rotated", "group left out", "masked block",
                     "tail key", "offload:one", "offload:split", "offload:skipped", "offload:a key at the budget",
                     "failed keys", "other answers", "raised",
                     "short answer", "ragged", "several groups", "blob hashes", "hma"):  # fmt: skip
            assert seen[what] >= 20, (what, seen)
        raised = sum(v for k, v in seen.items() if k.startswith("outcome:") and k != "outcome:ok")
        assert seen["outcome:ok"] >= 5000 and raised >= 200, seen
    print(f"receive: {dict(seen)} in {elapsed:.1f} s")


def _count_fast(seen: collections.Counter[str], case: dict[str, Any], expected: tuple[Any, ...], behaviour: str,
                store: Any) -> None:  # fmt: skip
    """What a request that took our fast path exercised (so that a shrinking generator shows)."""
    dbs = [db for db, takes in zip(case["dbs"], case["participates"]) if takes]
    seen["several groups"] += len(dbs) > 1
    seen["group left out"] += len(dbs) < len(case["dbs"])
    seen["sub-block chunks"] += any(getattr(db.store_layout, "store_chunk_size", 0) < db.store_layout.block_size
                                    for db in dbs)  # fmt: skip
    seen["tensor layout"] += any(isinstance(db.store_layout, LAYOUT.AttentionStoreLayout) for db in dbs)
    seen["mamba"] += any(isinstance(db.store_layout, LAYOUT.MambaStoreLayout) for db in dbs)
    calls = expected[1]
    n_keys = sum(len(call[0]) for call in calls)
    seen["rotated"] += bool(calls) and n_keys > 1 and case["tp_rank"] % n_keys != 0
    seen["masked block"] += any(not all(m) for m in case["masks"])
    seen["tail key"] += bool(case["meta"].load_spec.tail_key_boundaries)
    seen["blob hashes"] += type(case["meta"].block_hashes) is not list
    seen["hma"] += case["hma"]
    if case["budget"] is not None:
        seen["offload:" + ("skipped" if not calls else "one" if len(calls) == 1 else "split")] += 1
        seen["offload:a key at the budget"] += case["budget"] in EXACT_BUDGETS and bool(calls)
    seen["failed keys"] += behaviour == "fail" and bool(expected[3])
    seen["other answers"] += behaviour in ("tuple", "iter", "numpy") and bool(expected[3])
    seen["raised"] += behaviour == "raise" and bool(calls)
    seen["short answer"] += behaviour == "short" and bool(calls)
    seen["ragged"] += getattr(store, "ragged", 0) > 0


def test_receive_handler_reads_the_mask_per_physical_block(patched: plugin.PatchReport) -> None:
    """A fixed TP-shared request with Store chunks of a quarter block and one masked block: the fast path loads
    every chunk of the kept blocks and none of the masked one, exactly as vLLM does."""
    original, handler = _handlers()
    metadata = DATA.KeyMetadata("m/mask", 0, 0, 0, 0)
    layout = LAYOUT.TPShardedStoreLayout(metadata, 64, 16, 2, 4, 1, 16)
    layout._set_segment_templates(templates(random.Random(5), 4, 2, 2, False))
    token_len = 3 * 64
    hashes = [bytes([i]) * 32 for i in range(token_len // 16)]
    spec = DATA.LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=token_len, can_load=True, token_len=token_len)
    meta = DATA.ReqMeta(req_id="mask", token_len_chunk=token_len, block_ids=([7, 8, 9],), block_hashes=hashes,
                        load_spec=spec)  # fmt: skip
    case = {
        "dbs": [DATA.ChunkedTokenDatabase(metadata, 16, 16, layout)], "masks": ([True, False, True],),
        "participates": [True], "block_size": 64, "tp_rank": 0, "hma": False, "meta": meta, "budget": None,
    }  # fmt: skip
    before = handler.stats.fast_requests
    expected = run_handler(WORKER, original, ListStore("ok"), case)
    actual = run_handler(WORKER, handler, ListStore("ok"), case)
    assert actual == expected and handler.stats.fast_requests == before + 1
    keys = expected[1][0][0]
    assert len(keys) == 2 * 4 * 2  # two kept blocks, four Store chunks each, two local shards
    assert {key.rsplit("@", 1)[1] for key in keys} == {hashes[i].hex() for i in (0, 1, 2, 3, 8, 9, 10, 11)}
    assert np.all(np.asarray(expected[1][0][1]) > 0)
