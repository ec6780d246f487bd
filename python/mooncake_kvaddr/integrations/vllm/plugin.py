"""vLLM plugin (first part of docs/vllm.md, "Plugin"): make vLLM 0.32/0.33's own store layouts native.

``register()`` is meant for vLLM's ``vllm.general_plugins`` entry-point group, which vLLM runs in every
process. It patches ``prepare_values`` of ``RankLocalStoreLayout`` and ``TPShardedStoreLayout`` and
``RankLocalStoreLayout.prepare_value_for_block`` in vLLM's ``data`` module with the layout engine — only for a
module whose shape it knows (vLLM 0.32.x/0.33.x, the methods and attributes it reads present), and only after a
self-check against vLLM's own implementation on generated cases passes. It logs one line saying what it
patched; otherwise it leaves vLLM untouched with one warning. ``MOONCAKE_KVADDR_VLLM_PLUGIN=0`` turns it off.

A patched layout keeps vLLM's state as the source of truth: the engine re-reads ``kv_caches_base_addr`` and
``block_len`` (the list objects, reassigned or edited in place) and the TP-shared template arrays on every call.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.layouts import DEFAULT_ROW_CACHE_BYTES

logger = logging.getLogger(__name__)

ENV_SWITCH = "MOONCAKE_KVADDR_VLLM_PLUGIN"
DATA_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data"
KNOWN_VERSIONS = ("0.32.", "0.33.")
_ENGINE_ATTR = "_mooncake_kvaddr_engine"

_originals: dict[tuple[type, str], Any] = {}


def _rank_local_engine(layout: Any) -> Any:
    engine = layout.__dict__.get(_ENGINE_ATTR)
    if engine is None:
        engine = _native.LayoutEngine(layout.block_size, layout.hash_block_size, False, 0, 1,
                                      DEFAULT_ROW_CACHE_BYTES)
        layout.__dict__[_ENGINE_ATTR] = engine
    # vLLM keeps the two lists by reference and may reassign them: point the engine at the current objects
    # (it compares their contents on every call, so in-place edits are seen too).
    engine.set_region_sources(layout.kv_caches_base_addr, layout.block_len)
    return engine


def _tp_engine(layout: Any) -> Any:
    arrays = (layout._shard_addr_bases, layout._shard_block_strides, layout._shard_sizes)
    state = layout.__dict__.get(_ENGINE_ATTR)
    if state is None or any(a is not b for a, b in zip(state[1], arrays)):
        shards = layout.store_shard_ids
        engine = _native.LayoutEngine(layout.block_size, layout.hash_block_size, True,
                                      shards[0] if shards else 0, len(shards), DEFAULT_ROW_CACHE_BYTES)
        if shards and arrays[0].shape[1]:
            # uint64 rows go in as they are: the engine rejects values beyond int64 (OverflowError).
            engine.set_templates([(arrays[0][k], arrays[1][k], arrays[2][k]) for k in range(len(shards))])
        state = (engine, arrays)
        layout.__dict__[_ENGINE_ATTR] = state
    return state[0]


def _rank_local_prepare_values(self: Any, chunks: Any, block_ids: Any, shard_ids: Any) -> Any:
    return _rank_local_engine(self).prepare_values(chunks, block_ids, shard_ids)


def _rank_local_prepare_value_for_block(self: Any, block_id: int) -> Any:
    return _rank_local_engine(self).prepare_value_for_block(block_id)


def _tp_prepare_values(self: Any, chunks: Any, block_ids: Any, shard_ids: Any) -> Any:
    if not chunks:
        return [], [], []
    return _tp_engine(self).prepare_values(chunks, block_ids, shard_ids)


def _known_shape(data: Any) -> bool:
    needed = {
        "RankLocalStoreLayout": ("prepare_values", "prepare_value_for_block", "set_kv_caches_base_addr"),
        "TPShardedStoreLayout": ("prepare_values", "_set_segment_templates"),
        "LBHNCStoreLayout": ("register_kv_caches",),
        "KeyMetadata": (),
    }
    return all(hasattr(data, cls) and all(hasattr(getattr(data, cls), m) for m in methods)
               for cls, methods in needed.items())


def _self_check(data: Any, rng: random.Random) -> None:
    """Our engine against vLLM's own methods on generated cases; AssertionError on any difference."""
    for _ in range(20):
        bs = rng.choice([16, 64, 128])
        layout = data.RankLocalStoreLayout(data.KeyMetadata("selfcheck", 0, 0, 0, 0), bs, bs)
        n_regions = rng.randrange(0, 9)
        layout.set_kv_caches_base_addr([rng.randrange(1 << 47) for _ in range(n_regions)])
        layout.set_block_len([rng.randrange(1, 1 << 16) for _ in range(rng.randrange(1, 4))])
        ids = [rng.randrange(1 << 24) for _ in range(8)]
        chunks = [(b * bs, (b + rng.randrange(1, 3)) * bs) for b in rng.sample(range(6), 4)]
        shards = [0] * len(chunks)
        expected = _originals[(data.RankLocalStoreLayout, "prepare_values")](layout, chunks, ids, shards)
        for _ in range(3):  # cold, cached, warm
            assert _rank_local_prepare_values(layout, chunks, ids, shards) == expected
        expected_block = _originals[(data.RankLocalStoreLayout, "prepare_value_for_block")](layout, ids[0])
        assert _rank_local_prepare_value_for_block(layout, ids[0]) == expected_block
    for _ in range(10):
        bs = rng.choice([1, 2, 4])
        layout = data.LBHNCStoreLayout(data.KeyMetadata("selfcheck", 0, 0, 0, 0), bs, bs, 1, 2, 0, 2)
        width = rng.randrange(1, 5)
        layout._set_segment_templates([([rng.randrange(1 << 46) for _ in range(width)],
                                        [rng.randrange(1, 1 << 16) for _ in range(width)],
                                        [rng.randrange(1, 1 << 12) for _ in range(width)]) for _ in range(2)])
        ids = [rng.randrange(1 << 24) for _ in range(4)]
        chunks = [(b * bs, (b + 1) * bs) for b in range(4) for _ in (0, 1)]
        shards = [0, 1] * 4
        expected = _originals[(data.TPShardedStoreLayout, "prepare_values")](layout, chunks, ids, shards)
        for _ in range(3):
            assert _tp_prepare_values(layout, chunks, ids, shards) == expected


def register() -> bool:
    """The ``vllm.general_plugins`` entry point. Returns whether vLLM's layouts are now native."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if _originals:
        return True  # already patched in this process
    try:
        import importlib

        import vllm

        data = importlib.import_module(DATA_MODULE)
    except Exception as exc:
        logger.warning("mooncake_kvaddr: vLLM's Mooncake store module is not importable (%r); nothing patched", exc)
        return False
    version = getattr(vllm, "__version__", "?")
    if not version.startswith(KNOWN_VERSIONS) or not _known_shape(data):
        logger.warning("mooncake_kvaddr: vLLM %s's Mooncake store module has a shape this release does not know; "
                       "nothing patched", version)
        return False
    targets = {
        (data.RankLocalStoreLayout, "prepare_values"): _rank_local_prepare_values,
        (data.RankLocalStoreLayout, "prepare_value_for_block"): _rank_local_prepare_value_for_block,
        (data.TPShardedStoreLayout, "prepare_values"): _tp_prepare_values,
    }
    for cls, name in targets:
        _originals[(cls, name)] = cls.__dict__[name]
    try:
        _self_check(data, random.Random(0))
    except Exception as exc:
        _originals.clear()
        logger.warning("mooncake_kvaddr: self-check against vLLM %s failed (%r); nothing patched", version, exc)
        return False
    for (cls, name), replacement in targets.items():
        setattr(cls, name, replacement)
    logger.info("mooncake_kvaddr: native store layouts active for vLLM %s (%s)", version,
                ", ".join(f"{cls.__name__}.{name}" for cls, name in targets))
    return True


def unregister() -> None:
    """Restore vLLM's own methods (tests)."""
    for (cls, name), original in _originals.items():
        setattr(cls, name, original)
    _originals.clear()
