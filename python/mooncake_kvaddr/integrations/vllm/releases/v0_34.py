"""vLLM 0.34: the store layouts moved to ``layout.py``; rank-local regions have a stride apart from their length
and TP-shared layouts keep segment templates per Store chunk of a block (docs/vllm-plugin.md, "vLLM 0.34").

Every TP-shared format (head- and token-major attention, Mamba state) feeds ``_set_segment_templates``, so one
replacement of ``TPShardedStoreLayout.prepare_values`` covers them all. Batches vLLM itself computes in a Python
loop (16 chunks or fewer, or templates of unequal widths) and templates the engine cannot hold stay vLLM's.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.layouts import DEFAULT_ROW_CACHE_BYTES
from mooncake_kvaddr.driver.rules import floor_to
from mooncake_kvaddr.integrations.vllm import send
from mooncake_kvaddr.integrations.vllm.layouts import (
    ENGINE_ATTR,
    LAYOUT_PARAMS,
    Comparison,
    _rank_local_engine,
    _rank_local_key_for,
    _sharded_key_for,
    compare_all,
    each,
    layout_roles,
    plan_engines,
    rank_local_cases,
    sample_request,
    shape_problem,
    shard_templates,
    sharded_key_cases,
)
from mooncake_kvaddr.integrations.vllm.lookup import POOL_FUNCTIONS, DirectHit, LookupRules, LookupUnits
from mooncake_kvaddr.integrations.vllm.receive_check import RECEIVE_FUNCTIONS
from mooncake_kvaddr.integrations.vllm.registry import fingerprint, original_of
from mooncake_kvaddr.integrations.vllm.releases.base import Release
from mooncake_kvaddr.integrations.vllm.send_check import SEND_FUNCTIONS, THREAD_METHODS_033

__all__ = [
    "DIRECT_HIT_FINGERPRINTS",
    "FINGERPRINTED",
    "FINGERPRINTS",
    "LAYOUT_MODULE",
    "LOOKUP_RULES",
    "RELEASE",
    "SEND",
    "WORKER_METHODS",
    "check_shape",
    "plan_lookup",
    "self_check",
]

LAYOUT_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.layout"
#: The native module, untyped here: the layout engine's stubs belong to the layouts (docs/architecture.md).
_NATIVE: Any = _native
#: vLLM 0.34 computes batches of up to this many chunks in a Python loop (its own small-batch path).
_LOOP_CHUNKS = 16

_EXPECTED_PARAMS: dict[tuple[str, str], tuple[str, ...]] = {
    **LAYOUT_PARAMS,
    ("RankLocalStoreLayout", "set_block_len"): ("block_lens",),
    ("RankLocalStoreLayout", "set_kv_caches_base_addr"): ("base_addrs",),
    ("RankLocalStoreLayout", "register_kv_caches"): ("kv_caches", "num_blocks"),
    ("TPShardedStoreLayout", "__init__"): (
        "metadata",
        "block_size",
        "hash_block_size",
        "local_tp_size",
        "store_tp_size",
        "tp_rank",
        "store_chunk_size",
    ),
}

# --- the replacement methods ---------------------------------------------------------------------------------


_Rows = tuple[list[list[int]], list[list[int]], list[int]]


def _rows(
    layout: Any, chunks: Any, block_ids: Any, shard_ids: Any, replaced_on: str, engine: Callable[[], Any]
) -> _Rows:
    """Both replacements' ``prepare_values``: no rows for no chunk; the rows of ``engine()``; else, where that is
    None or raises TypeError (an int-like vLLM's numpy casts, a float id or bound: its own answer, or its own
    error), vLLM's own of the class ``replaced_on`` in ``layout``'s MRO (the class this release patches): never a
    subclass's override, which may call ``super()`` and so reach us again."""
    if not chunks:
        return [], [], []
    try:
        found = engine()
        if found is not None:
            result: _Rows = found.prepare_values(chunks, block_ids, shard_ids)
            return result
    except TypeError:
        pass
    cls = next(klass for klass in type(layout).__mro__ if klass.__name__ == replaced_on)
    own: Any = original_of(cls, "prepare_values")
    result = own(layout, chunks, block_ids, shard_ids)
    return result


def _rank_local_prepare_values(self: Any, chunks: Any, block_ids: Any, shard_ids: Any) -> _Rows:
    """mooncake_kvaddr's ``RankLocalStoreLayout.prepare_values`` for vLLM 0.34 (stride apart from length)."""
    return _rows(self, chunks, block_ids, shard_ids, "RankLocalStoreLayout", lambda: _stride_engine(self))


def _stride_engine(layout: Any) -> Any:
    """A rank-local layout's engine with vLLM 0.34's strides (``block_stride``)."""
    return _rank_local_engine(layout, layout.block_stride)


def _chunked_engine(layout: Any) -> Any:
    """The native engine of a vLLM 0.34 ``TPShardedStoreLayout`` (templates per Store chunk and local shard),
    rebuilt whenever vLLM installs new templates (``_set_segment_templates`` assigns new objects). None when
    the engine cannot hold them (unequal widths, values past int64, no owned shard): vLLM's own then runs."""
    arrays = (layout._chunk_addr_bases, layout._chunk_block_strides, layout._chunk_sizes)
    state = layout.__dict__.get(ENGINE_ATTR)
    if state is not None and all(old is new for old, new in zip(state[1], arrays)):
        return state[0]
    engine = None
    shards = int(layout.shards_per_rank)
    if all(isinstance(a, np.ndarray) and a.ndim == 3 for a in arrays) and shards > 0:
        bases, strides, sizes = (a.tolist() for a in arrays)
        templates = [
            [(bases[c][s], strides[c][s], sizes[c][s]) for s in range(len(bases[c]))] for c in range(len(bases))
        ]
        try:
            candidate = _NATIVE.LayoutEngine(
                layout.block_size,
                layout.hash_block_size,
                True,
                int(layout.store_shard_ids[0]),
                shards,
                DEFAULT_ROW_CACHE_BYTES,
                store_chunk_size=layout.store_chunk_size,
            )
            candidate.set_templates(templates)
            engine = candidate
        except (ValueError, OverflowError, TypeError, IndexError):
            engine = None
    layout.__dict__[ENGINE_ATTR] = (engine, arrays)
    return engine


def _sharded_prepare_values(self: Any, chunks: Any, block_ids: Any, shard_ids: Any) -> _Rows:
    """mooncake_kvaddr's ``TPShardedStoreLayout.prepare_values`` for vLLM 0.34: the engine where vLLM computes
    vectorised (more than 16 chunks, stacked templates), vLLM's own function elsewhere."""
    engine = _chunked_engine(self) if chunks and len(chunks) > _LOOP_CHUNKS else None
    return _rows(self, chunks, block_ids, shard_ids, "TPShardedStoreLayout", lambda: engine)


REPLACEMENTS: tuple[tuple[str, str, Any], ...] = (
    ("RankLocalStoreLayout", "prepare_values", _rank_local_prepare_values),
    ("RankLocalStoreLayout", "key_for", _rank_local_key_for),
    ("TPShardedStoreLayout", "prepare_values", _sharded_prepare_values),
    ("TPShardedStoreLayout", "key_for", _sharded_key_for),
)
OURS: dict[str, Any] = layout_roles(REPLACEMENTS)
PLAN_ENGINES = plan_engines(_stride_engine, _chunked_engine)


def sample_layouts(layout: ModuleType, metadata: Any, rng: random.Random, case: int, block_size: int) -> Any:
    """vLLM 0.34's layouts for the handlers' self-checks: regions whose stride exceeds their length, and a
    TP-shared layout with two local shards and Store chunks of a quarter, half or whole block."""
    rank_local = layout.RankLocalStoreLayout(metadata, block_size, 16)
    rank_local.set_kv_caches_base_addr([rng.randrange(1 << 20, 1 << 40) for _ in range(3)])
    rank_local.set_block_len([8192])
    rank_local.block_len = [8192 - rng.choice([0, 512])]
    store_chunk = block_size // (1, 2, 4)[case % 3]
    sharded = layout.TPShardedStoreLayout(metadata, block_size, store_chunk, 2, 4, case % 2, store_chunk)
    sharded._set_segment_templates(_templates(rng, block_size // store_chunk, sharded.shards_per_rank, 2))
    return rank_local, sharded, store_chunk


# --- the shape check and the self-check ------------------------------------------------------------------------


def check_shape(layout: ModuleType, worker: ModuleType | None) -> str:
    """Empty string when vLLM 0.34's ``layout`` module has every class and method this release replaces or
    relies on, with the expected parameters; otherwise the first mismatch."""
    return shape_problem(layout, LAYOUT_MODULE, ("KeyMetadata", "RankLocalStoreLayout", "TPShardedStoreLayout"),
                         _EXPECTED_PARAMS)  # fmt: skip


def _templates(rng: random.Random, chunks_per_block: int, shards: int, width: int) -> list[Any]:
    """Templates per Store chunk of a block, as vLLM 0.34's ``_set_segment_templates`` takes them."""
    return [
        shard_templates(rng, shards, width, (4096, 65536, 1 << 20), (64, 128, 512)) for _ in range(chunks_per_block)
    ]


def self_check(layout: ModuleType, *, seed: int = 0, cases: int = 8) -> None:
    """Compare our replacements with vLLM 0.34's own methods on small generated cases (raises AssertionError
    naming the first difference). Needs no tensors: regions and templates are set as vLLM's setters do."""
    compare_all(layout, REPLACEMENTS, _cases(layout, random.Random(seed), cases))


def _cases(layout: ModuleType, rng: random.Random, cases: int) -> Iterator[Comparison]:
    metadata = layout.KeyMetadata("self-check/model", 1, 0, 0, 0)
    for case in range(cases):
        hash_block_size = rng.choice([16, 32])
        block_size = hash_block_size * rng.choice([1, 2, 4])
        rank_local = layout.RankLocalStoreLayout(metadata, block_size, hash_block_size)
        regions = rng.randint(0, 5)
        strides = [rng.choice([4096, 8192]) for _ in range(max(1, regions // 2 + case % 2))]
        rank_local.set_kv_caches_base_addr([rng.randrange(1 << 20, 1 << 40) for _ in range(regions)])
        rank_local.set_block_len(strides)
        rank_local.block_len = [stride - rng.choice([0, 64, 1024]) for stride in strides]
        block_ids, token_len = sample_request(rng, block_size, hash_block_size)
        span = block_size * rng.choice([1, 2])
        chunks = [(start, min(start + span, token_len)) for start in range(0, token_len, span)]
        yield from rank_local_cases(rank_local, chunks, block_ids, hash_block_size)
        chunk_hash = rng.randbytes(32)
        yield "RankLocalStoreLayout", "key_for", "", rank_local, (0, chunk_hash)

        store_tp, local_tp = 4, 2
        store_chunk_size = block_size // rng.choice([1, 2, 4]) if block_size >= 64 else block_size
        sharded = layout.TPShardedStoreLayout(
            metadata, block_size, hash_block_size, local_tp, store_tp, case % local_tp, store_chunk_size
        )
        per_block = block_size // store_chunk_size
        sharded._set_segment_templates(_templates(rng, per_block, sharded.shards_per_rank, rng.randint(1, 4)))
        owned = list(sharded.local_shard_ids)
        blocks = rng.randint(5, 12)
        ids = [rng.randrange(0, 5000) for _ in range(blocks)]
        full = [(i * store_chunk_size, (i + 1) * store_chunk_size) for i in range(blocks * per_block)]
        picks = [rng.choice(owned) for _ in full]
        yield from each("TPShardedStoreLayout", "prepare_values", sharded, (
            ("", (full, ids, picks)),
            ("[short]", (full[:3], ids, picks[:3])),
            ("[partial]", ([*full[:-1], (full[-1][0], full[-1][1] - 1)], ids, picks)),
            ("[boundary]", ([*full[:-1], (full[-1][0] + 1, full[-1][1])], ids, picks)),
            ("[not owned]", (full, ids, [*picks[:-1], owned[-1] + 1])),
            ("[no block]", (full, ids[:-1], picks)),
            ("[count]", (full, ids, picks[:-1])),
        ))  # fmt: skip
        yield from sharded_key_cases(sharded, owned, chunk_hash)


# --- the send handler's rules (docs/vllm-plugin.md, "The send handler", vLLM 0.34) ------------------------------


def _send_prepare(thread: Any, req_meta: Any) -> send.Job | str:
    """vLLM 0.34's lengths and masks: the checkpoint (the available length floored to the lcm block size), a live
    job not skipped for pressure, nothing to plan when the checkpoint is not past the saved offset, else the
    store masks from the saved offset with the replay boundary (past the checkpoint for a consumer that replays
    beyond its prefill end)."""
    available = req_meta.token_len_chunk
    lcm_block_size = thread.coord.lcm_block_size
    if type(available) is not int or type(lcm_block_size) is not int or lcm_block_size <= 0:
        return "a token length or lcm block size that is not an int"
    checkpoint = floor_to(available, lcm_block_size)
    if not thread.is_live_store_job(req_meta) or thread._should_skip_request(req_meta.req_id):
        return "a job vLLM skips"
    save_start = thread._saved_offset.get(req_meta.req_id, 0)
    if type(save_start) is not int or save_start < 0:
        return "a saved offset that is not a non-negative int"
    if checkpoint <= save_start:
        return send.Job(checkpoint, save_start, available=available, stale=True)
    replay_boundary = req_meta.prefill_end_tokens
    if thread.kv_role == "kv_consumer" and replay_boundary is not None and checkpoint > replay_boundary:
        replay_boundary = checkpoint + 1
    masks = thread.coord.store_mask(checkpoint, save_start, num_prompt_tokens=replay_boundary)
    return send.Job(checkpoint, save_start, tuple(masks), available=available)


def _send_merge_retry(retry_start: int, retry_ids: list[int], start: int, ids: list[int]) -> tuple[int, Any] | None:
    """vLLM 0.34 merges a failed job's retry ids that reach this job's start: their part before it, then these."""
    if retry_start <= start <= retry_start + len(retry_ids):
        return retry_start, retry_ids[: start - retry_start] + ids
    return None


_SEND_THREAD_METHODS = {name: params for name, params in THREAD_METHODS_033.items() if name != "_record_saved"}
_SEND_THREAD_METHODS["_record_saved_offset"] = ("req_meta", "offset")

SEND = send.SendRules(
    prepare=_send_prepare,
    merge_retry=_send_merge_retry,
    thread_methods=_SEND_THREAD_METHODS,
    req_meta_fields=("prefill_end_tokens", "num_hash_lookahead_tokens"),
    db_chunk="chunk_size",
    lookahead=True,
    checkpoint=True,
)

# --- the lookup's rules (lookup.py runs them) -------------------------------------------------------------------


def plan_lookup(worker: Any, token_len: int, block_hashes: Any, cdiv: Any) -> LookupUnits:
    """The units vLLM 0.34's lookup asks for, read from the worker as vLLM reads them: per prefix-cacheable group,
    every hash block (partial-hash mode) or Store chunk (``db.chunk_size``) whose end lies within ``token_len``
    and the hashes, on a physical block the lookup mask keeps; each unit keyed by the hash at its end. With the
    page-prefix rule's data: each unit's physical block and whether it ends a Store chunk."""
    coord = worker.coord
    fine = coord.enable_partial_hash_hits
    masks = None if fine else coord.lookup_mask(token_len)
    hbs = worker.hash_block_size
    reach = min(token_len, len(block_hashes) * hbs)
    groups: list[tuple[int, list[Any], tuple[str, ...]]] = []
    pages: list[tuple[Any, Any] | None] = []
    for g, db in enumerate(worker.token_dbs):
        spec = worker._kv_cache_groups[g].kv_cache_spec
        if not spec.prefix_cacheable:
            continue
        page_size = spec.block_size
        prefixes = tuple(worker._lookup_key_prefixes[g])
        chunk = db.chunk_size
        unit = hbs if fine else chunk
        ends = np.arange(1, reach // unit + 1, dtype=np.int64) * unit
        blocks = (ends - unit) // page_size
        mask = None if masks is None else masks[g]
        if mask is not None:
            kept = np.zeros(len(ends), dtype=bool)
            inside = blocks < len(mask)
            kept[inside] = np.asarray([bool(mask[b]) for b in blocks[inside].tolist()], dtype=bool)
            ends = ends[kept]
        hashes = [block_hashes[i] for i in (ends // hbs - 1).tolist()]
        groups.append((g, hashes, prefixes))
        # A unit of a whole block is a run of one: the page-prefix rule keeps every flag.
        pages.append(None if unit == page_size else ((ends - 1) // page_size, ends % chunk == 0))
    return LookupUnits(groups, pages)


#: Release -> the fingerprint of ``FullAttentionManager.find_longest_cache_hit``, the rule :func:`direct_hit` reads
#: off the flags (outside the worker module, so not in :data:`FINGERPRINTS`: another one turns the direct hit off).
DIRECT_HIT_FINGERPRINTS: dict[str, str] = {"0.34.0": "106b6cdd1641df4b"}


def direct_hit(worker_module: ModuleType) -> Callable[[Any], DirectHit | None]:
    """The check that a worker's hit can be read off the lookup's flags: vLLM 0.34's own coordinator with one
    spec group, plain full attention through ``FullAttentionManager`` without Eagle's last-block drop, whole
    blocks (not partial hashes), each block one hash block and one Store chunk. Its hit is then the leading
    run of blocks every group has, rounded down to the scheduler block (``find_longest_cache_hit``). Only where
    ``FullAttentionManager.find_longest_cache_hit`` (the rule this reproduces) is the function checked against
    (:data:`DIRECT_HIT_FINGERPRINTS`): else every hit is vLLM's coordinator's, with one warning saying why."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    coordinator_cls = worker_module.MooncakeStoreCoordinator
    actual = fingerprint(FullAttentionManager.find_longest_cache_hit)
    if actual not in DIRECT_HIT_FINGERPRINTS.values():
        logging.getLogger("vllm.mooncake_kvaddr").warning(
            "mooncake_kvaddr: the lookup's hits are all vLLM's coordinator's: "
            "FullAttentionManager.find_longest_cache_hit is not the function this plugin was checked against "
            "(fingerprint %s, known: %s)", actual, ", ".join(sorted(set(DIRECT_HIT_FINGERPRINTS.values()))),
        )  # fmt: skip
        return lambda worker: None

    def check(worker: Any) -> DirectHit | None:
        coord = worker.coord
        if type(coord) is not coordinator_cls or coord.enable_partial_hash_hits or len(coord.attention_groups) != 1:
            return None
        spec, group_ids, manager_cls, eagle = coord.attention_groups[0]
        block = spec.block_size
        if eagle or type(spec) is not FullAttentionSpec or manager_cls is not FullAttentionManager:
            return None
        if block != coord.hash_block_size or any(worker.token_dbs[g].chunk_size != block for g in group_ids):
            return None
        return DirectHit(tuple(group_ids), block, coord.lcm_block_size, len(coord.kv_cache_groups))

    return check


#: The lookup's per-release rules: 0.34's units, ``_longest_hit``'s helpers, the selective lease, and the hit
#: read off the flags where the coordinator's hit is their leading run.
LOOKUP_RULES = LookupRules(
    plan=plan_lookup, helpers=("_tail_key_boundaries", "_longest_hit"), longest_hit=True, direct_hit=direct_hit
)

#: The worker's transport hook: the methods that run with our store wrapper as ``self.store`` (sleep mode's
#: ``unregister_kv_caches``/``restore_kv_caches`` call the store directly), with their parameters after self.
WORKER_METHODS: dict[str, tuple[str, ...]] = {
    "register_kv_caches": ("kv_caches",),
    "unregister_kv_caches": (),
    "restore_kv_caches": (),
    "close": (),
}

FINGERPRINTED: dict[str, tuple[str, ...]] = {
    "worker": tuple(f"MooncakeStoreWorker.{name}" for name in WORKER_METHODS),
    # The replaced lookup, the hit it reproduces (``_longest_hit``; the coordinator's where ``direct_hit`` reads
    # it off the flags) and the pool its faster pool stands in for.
    "lookup": (
        "MooncakeStoreWorker.lookup",
        "MooncakeStoreWorker._longest_hit",
        "MooncakeStoreCoordinator.find_longest_cache_hit",
        "MooncakeStoreCoordinator._find_hit_blocks",
        *POOL_FUNCTIONS,
    ),
    "receive": RECEIVE_FUNCTIONS,
    # The replaced methods, and the setters whose assignments the engines' identity checks rely on.
    "layouts": (
        "RankLocalStoreLayout.prepare_values",
        "RankLocalStoreLayout.key_for",
        "RankLocalStoreLayout.set_block_len",
        "RankLocalStoreLayout.set_kv_caches_base_addr",
        "RankLocalStoreLayout.register_kv_caches",
        "TPShardedStoreLayout.prepare_values",
        "TPShardedStoreLayout.key_for",
        "TPShardedStoreLayout._set_segment_templates",
        "TPShardedStoreLayout.__init__",
    ),
    "send": SEND_FUNCTIONS,
}

FINGERPRINTS: dict[str, dict[str, str]] = {
    "0.34.0": {
        "MooncakeStoreWorker.register_kv_caches": "1fc544d33a5bde1e",
        "MooncakeStoreWorker.close": "b9b831fa3647518f",
        "MooncakeStoreWorker.unregister_kv_caches": "42b19e63061d90dc",
        "MooncakeStoreWorker.restore_kv_caches": "6f3e54d820772d8c",
        "MooncakeStoreWorker.lookup": "380e1d1302c2f4af",
        "MooncakeStoreWorker._longest_hit": "f38cf917b935f6ea",
        "MooncakeStoreCoordinator.find_longest_cache_hit": "f669295b2baff614",
        "MooncakeStoreCoordinator._find_hit_blocks": "f79f9bdabc779583",
        "ExternalCachedBlockPool.__init__": "8812d6d330d5298f",
        "ExternalCachedBlockPool.get_cached_block": "58a17cb93531b829",
        "ExternalCachedBlockPool.contains": "84d038552e03ec9e",
        "KVCacheStoreRecvingThread._handle_request": "0b19240f13c5b4ae",
        "ChunkedTokenDatabase.process_tokens": "8749f101117a163c",
        "_estimate_disk_offload_staging_bytes": "1096992edcfb74ba",
        "_split_disk_offload_load_batches": "0f7a2f3f89d959dc",
        "RankLocalStoreLayout.prepare_values": "836221e56e25cd76",
        "RankLocalStoreLayout.key_for": "2c426949ec2ea759",
        "RankLocalStoreLayout.set_block_len": "81020d83b1252565",
        "RankLocalStoreLayout.set_kv_caches_base_addr": "c770ade1ffa426fd",
        "RankLocalStoreLayout.register_kv_caches": "5fc9fcbffacc8e70",
        "TPShardedStoreLayout.prepare_values": "7103b8a5b8ecc219",
        "TPShardedStoreLayout.key_for": "998e0f8942fb19c0",
        "TPShardedStoreLayout._set_segment_templates": "2078348eb1958f4d",
        "TPShardedStoreLayout.__init__": "c867c33cd493f0ba",
        "KVCacheStoreSendingThread._handle_request": "eef9f0a3c019beb5",
        "_sum_batch_bytes": "3e69ccacfd52a5c3",
    },
}

RELEASE = Release(
    series=("0.34.",),
    layout_module=LAYOUT_MODULE,
    replacements=REPLACEMENTS,
    check_shape=check_shape,
    self_check=self_check,
    fingerprinted=FINGERPRINTED,
    fingerprints=FINGERPRINTS,
    ported=frozenset({"receive", "send", "worker", "lookup"}),
    worker_methods=WORKER_METHODS,
    lookup_rules=LOOKUP_RULES,
    ours=OURS,
    plan_engines=PLAN_ENGINES,
    db_chunk="chunk_size",
    sharded_chunk="store_chunk_size",
    process_tokens=(
        "token_len", "block_hashes", "mask_num", "chunk_mask", "tail_key_boundary", "put_step", "put_step_rank",
    ),
    sample_layouts=sample_layouts,
    send_rules=SEND,
)  # fmt: skip
