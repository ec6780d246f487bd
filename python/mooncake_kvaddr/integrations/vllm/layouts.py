"""The plugin's replacements of vLLM 0.32/0.33's store-layout methods (docs/vllm-plugin.md, "What is replaced"),
the shape check of the modules they go into, and their self-check against vLLM's own methods.

Each replacement keeps its native engine on vLLM's own layout object (``layout.__dict__[ENGINE_ATTR]``) and
rebuilds it whenever vLLM assigns new region lists or segment templates.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.layouts import DEFAULT_ROW_CACHE_BYTES
from mooncake_kvaddr.integrations.vllm.registry import (
    DATA_MODULE,
    WORKER_MODULE,
    original_of,
    signature_problem,
    static_attribute,
)

__all__ = ["ENGINE_ATTR", "OURS", "PLAN_ENGINES", "REPLACEMENTS", "check_shape", "self_check"]

#: Where a vLLM layout object keeps its engine (and what it was built from).
ENGINE_ATTR = "_mooncake_kvaddr_engine"
#: The native module, untyped here: the layout engine's stubs belong to the layouts (docs/architecture.md).
_NATIVE: Any = _native

# Parameters (after self) of each replaced method, as vLLM 0.32/0.33 declare them.
_EXPECTED_PARAMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("RankLocalStoreLayout", "prepare_values"): ("chunks", "block_ids", "shard_ids"),
    ("RankLocalStoreLayout", "prepare_value_for_block"): ("block_id",),
    ("RankLocalStoreLayout", "key_for"): ("shard_id", "chunk_hash"),
    ("TPShardedStoreLayout", "prepare_values"): ("chunks", "block_ids", "shard_ids"),
    ("TPShardedStoreLayout", "key_for"): ("shard_id", "chunk_hash"),
    ("TPShardedStoreLayout", "_set_segment_templates"): ("templates",),
}
_EXPECTED_WORKER_PARAMS: dict[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "kv_cache_config"),
    "register_kv_caches": ("kv_caches",),
}



# --- the replacement methods ---------------------------------------------------------------------------------


def _rank_local_engine(layout: Any, strides: Any = None) -> Any:
    """The native engine of a vLLM ``RankLocalStoreLayout``, kept on the layout and re-pointed whenever vLLM
    assigns new ``kv_caches_base_addr``/``block_len`` (and, from vLLM 0.34, ``block_stride``: pass it as
    ``strides``) lists; the engine re-reads the lists on every call, so in-place edits are seen too."""
    state = layout.__dict__.get(ENGINE_ATTR)
    bases = layout.kv_caches_base_addr
    lens = layout.block_len
    block_size = layout.block_size
    hash_block_size = layout.hash_block_size
    if (
        state is None
        or state[1] is not bases
        or state[2] is not lens
        or state[3] != block_size
        or state[4] != hash_block_size
        or state[5] is not strides
    ):
        engine = _NATIVE.LayoutEngine(block_size, hash_block_size, False, 0, 1, DEFAULT_ROW_CACHE_BYTES)
        if strides is None:
            engine.set_region_sources(bases, lens)
        else:
            engine.set_region_sources(bases, lens, strides)
        state = (engine, bases, lens, block_size, hash_block_size, strides)
        layout.__dict__[ENGINE_ATTR] = state
    return state[0]


def _sharded_engine(layout: Any) -> Any:
    """The native engine of a vLLM ``TPShardedStoreLayout``, rebuilt whenever vLLM installs new segment
    templates (``_set_segment_templates`` assigns new arrays; their identity is the version)."""
    arrays = (layout._shard_addr_bases, layout._shard_block_strides, layout._shard_sizes)
    state = layout.__dict__.get(ENGINE_ATTR)
    if state is None or any(old is not new for old, new in zip(state[1], arrays)):
        shards = int(layout.shards_per_rank)
        first = int(layout.store_shard_ids[0]) if layout.store_shard_ids else 0
        engine = _NATIVE.LayoutEngine(
            layout.block_size, layout.hash_block_size, True, first, max(shards, 0), DEFAULT_ROW_CACHE_BYTES
        )
        engine.set_templates(
            [(arrays[0][k].tolist(), arrays[1][k].tolist(), arrays[2][k].tolist()) for k in range(shards)]
        )
        state = (engine, arrays)
        layout.__dict__[ENGINE_ATTR] = state
    return state[0]


def _rank_local_prepare_values(
    self: Any, chunks: Any, block_ids: Any, shard_ids: Any
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """mooncake_kvaddr's ``RankLocalStoreLayout.prepare_values`` (docs/vllm-plugin.md)."""
    if not chunks:
        return [], [], []
    result: tuple[list[list[int]], list[list[int]], list[int]] = _rank_local_engine(self).prepare_values(
        chunks, block_ids, shard_ids
    )
    return result


def _rank_local_prepare_value_for_block(self: Any, block_id: int) -> tuple[list[int], list[int]]:
    """mooncake_kvaddr's ``RankLocalStoreLayout.prepare_value_for_block``."""
    result: tuple[list[int], list[int]] = _rank_local_engine(self).prepare_value_for_block(block_id)
    return result


def _rank_local_key_for(self: Any, shard_id: int, chunk_hash: Any) -> str:
    """``prefix@hash_hex`` in one f-string (vLLM's goes through ``PoolKey.build_key_string``)."""
    assert shard_id == 0
    return f"{self._key_prefix}@{chunk_hash.hex()}"


def _sharded_prepare_values(
    self: Any, chunks: Any, block_ids: Any, shard_ids: Any
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """mooncake_kvaddr's ``TPShardedStoreLayout.prepare_values`` (docs/vllm-plugin.md)."""
    if not chunks:
        return [], [], []
    result: tuple[list[list[int]], list[list[int]], list[int]] = _sharded_engine(self).prepare_values(
        chunks, block_ids, shard_ids
    )
    return result


def _sharded_key_for(self: Any, shard_id: int, chunk_hash: Any) -> str:
    """An owned shard's key in one f-string (KeyError for a shard this rank does not own, as vLLM)."""
    return f"{self._shard_key_prefixes[shard_id]}@{chunk_hash.hex()}"


def _rank_local_plan_engine(layout: Any) -> tuple[Any, list[str]]:
    """The receive handler's view of a rank-local layout: its engine and its one key prefix."""
    return _rank_local_engine(layout), [layout._key_prefix]


def shard_prefixes(layout: Any) -> list[str]:
    """The key prefix of each shard a TP-shared layout owns, in ``local_shard_ids`` order (ValueError when the
    owned shards are not the consecutive run an engine keys)."""
    ids = tuple(layout.store_shard_ids)
    first = ids[0] if ids else 0
    if ids != tuple(range(first, first + len(ids))) or len(ids) != max(int(layout.shards_per_rank), 0):
        raise ValueError("the owned store shards are not one consecutive run")
    return [layout._shard_key_prefixes[shard] for shard in ids]


def _sharded_plan_engine(layout: Any) -> tuple[Any, list[str]]:
    """The receive handler's view of a TP-shared layout: its engine and the key prefix of each owned shard."""
    prefixes = shard_prefixes(layout)
    return _sharded_engine(layout), prefixes


OURS: dict[str, Any] = {
    "rank_local_prepare_values": _rank_local_prepare_values,
    "rank_local_key_for": _rank_local_key_for,
    "sharded_prepare_values": _sharded_prepare_values,
    "sharded_key_for": _sharded_key_for,
}
PLAN_ENGINES: dict[str, Callable[[Any], tuple[Any, list[str]]]] = {
    "rank_local": _rank_local_plan_engine,
    "sharded": _sharded_plan_engine,
}

#: (vLLM class name, method name, ours): what :func:`~mooncake_kvaddr.integrations.vllm.plugin.patch` installs.
REPLACEMENTS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("RankLocalStoreLayout", "prepare_values", _rank_local_prepare_values),
    ("RankLocalStoreLayout", "prepare_value_for_block", _rank_local_prepare_value_for_block),
    ("RankLocalStoreLayout", "key_for", _rank_local_key_for),
    ("TPShardedStoreLayout", "prepare_values", _sharded_prepare_values),
    ("TPShardedStoreLayout", "key_for", _sharded_key_for),
)


# --- the shape check ------------------------------------------------------------------------------------------


def _params(func: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)[1:]


#: "Class.method" -> vLLM's function, filled by :func:`_check_shape` (the self-check calls these).
_ORIGINAL_FUNCS: dict[str, Callable[..., Any]] = {}


def check_shape(data: ModuleType, worker: ModuleType | None) -> str:
    """Empty string when ``data`` (and ``worker``) have every class and method we replace with the expected
    parameters; otherwise the first mismatch."""
    for (cls_name, method), params in _EXPECTED_PARAMS.items():
        cls = getattr(data, cls_name, None)
        if not isinstance(cls, type):
            return f"{DATA_MODULE}.{cls_name} is missing"
        problem = signature_problem(cls, method, params)
        if problem:
            return problem
        _ORIGINAL_FUNCS[f"{cls_name}.{method}"] = original_of(cls, method)
    for name in ("KeyMetadata", "LBHNCStoreLayout", "LBNHCStoreLayout"):
        if not isinstance(getattr(data, name, None), type):
            return f"{DATA_MODULE}.{name} is missing"
    if worker is not None:
        cls = getattr(worker, "MooncakeStoreWorker", None)
        if not isinstance(cls, type):
            return f"{WORKER_MODULE}.MooncakeStoreWorker is missing"
        for method, params in _EXPECTED_WORKER_PARAMS.items():
            func = static_attribute(cls, method)
            if not callable(func):
                return f"MooncakeStoreWorker.{method} is missing"
            if _params(func)[: len(params)] != params:
                return f"MooncakeStoreWorker.{method} takes {_params(func)}, expected {params}"
    return ""


# --- the self-check ---------------------------------------------------------------------------------------


def _outcome(call: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
    try:
        return "ok", call(*args)
    except Exception as exc:  # the type is what is compared
        return "raise", type(exc)


def _same(expected: Any, actual: Any) -> bool:
    """Equal values of equal types, recursively (lists, tuples, ints, strings)."""
    if type(expected) is not type(actual):
        return False
    if isinstance(expected, (list, tuple)):
        return len(expected) == len(actual) and all(_same(e, a) for e, a in zip(expected, actual))
    return bool(expected == actual)


def _compare(name: str, reference: Callable[..., Any], ours: Callable[..., Any], *args: Any) -> None:
    """``reference(*args)`` and ``ours(*args)`` return equal values of equal types, or raise compatible
    exception types (ours may raise a subclass); AssertionError otherwise."""
    expected = _outcome(reference, args)
    actual = _outcome(ours, args)
    if expected[0] == "raise" and actual[0] == "raise":
        # Ours may raise a subclass (e.g. an error class that is both ValueError and AssertionError).
        if issubclass(actual[1], expected[1]):
            return
    elif _same(expected, actual):
        return
    raise AssertionError(f"{name}: vLLM gives {expected!r}, mooncake_kvaddr gives {actual!r}")


def self_check(data: ModuleType, *, seed: int = 0, cases: int = 12) -> None:
    """Compare our replacement methods with ``data``'s own (vLLM's module) on small generated cases.

    Raises ``AssertionError`` naming the first difference. Needs no tensors: regions and segment templates
    are set through vLLM's own setters.
    """
    rng = random.Random(seed)
    metadata = data.KeyMetadata("self-check/model", 1, 0, 0, 0)
    reference = {
        f"{cls_name}.{method}": original_of(getattr(data, cls_name), method) for cls_name, method in _EXPECTED_PARAMS
    }
    for case in range(cases):
        hash_block_size = rng.choice([16, 32, 64])
        block_size = hash_block_size * rng.choice([1, 2, 4])
        layout = data.RankLocalStoreLayout(metadata, block_size, hash_block_size)
        regions = rng.randint(0, 5)
        layout.set_kv_caches_base_addr([rng.randrange(1 << 20, 1 << 40) for _ in range(regions)])
        layout.set_block_len([rng.choice([256, 2048, 4096]) for _ in range(max(1, regions // 2 + case % 2))])
        num_blocks = rng.randint(1, 9)
        block_ids = [rng.randrange(0, 5000) for _ in range(num_blocks)]
        token_len = num_blocks * block_size - rng.randrange(0, block_size // hash_block_size) * hash_block_size
        chunks = [(start, min(start + block_size, token_len)) for start in range(0, token_len, block_size)]
        shard_ids = [0] * len(chunks)
        for name, args in (
            ("RankLocalStoreLayout.prepare_values", (chunks, block_ids, shard_ids)),
            ("RankLocalStoreLayout.prepare_values[empty]", ([], block_ids, [])),
            ("RankLocalStoreLayout.prepare_values[unaligned]", ([(0, hash_block_size + 1)], block_ids, [0])),
            ("RankLocalStoreLayout.prepare_values[shard]", (chunks[:1], block_ids, [1])),
        ):
            _compare(
                name,
                reference["RankLocalStoreLayout.prepare_values"],
                _rank_local_prepare_values,
                layout,
                *args,
            )
        block_id = rng.randrange(0, 5000)
        _compare(
            "RankLocalStoreLayout.prepare_value_for_block",
            reference["RankLocalStoreLayout.prepare_value_for_block"],
            _rank_local_prepare_value_for_block,
            layout,
            block_id,
        )
        chunk_hash = rng.randbytes(32)
        _compare(
            "RankLocalStoreLayout.key_for",
            reference["RankLocalStoreLayout.key_for"],
            _rank_local_key_for,
            layout,
            0,
            chunk_hash,
        )

        # TP-shared formats: templates installed through vLLM's own setter, two local shards.
        layout_cls = data.LBHNCStoreLayout if case % 2 else data.LBNHCStoreLayout
        store_tp, local_tp = 4, 2
        tp_rank = case % local_tp
        sharded = layout_cls(metadata, block_size, hash_block_size, local_tp, store_tp, tp_rank, 8)
        segments = rng.randint(1, 6)
        sharded._set_segment_templates(
            [
                (
                    [rng.randrange(1 << 20, 1 << 40) for _ in range(segments)],
                    [rng.choice([4096, 65536]) for _ in range(segments)],
                    [rng.choice([128, 512]) for _ in range(segments)],
                )
                for _ in range(sharded.shards_per_rank)
            ]
        )
        owned = list(sharded.local_shard_ids)
        full = [(i * block_size, (i + 1) * block_size) for i in range(num_blocks)]
        picks = [rng.choice(owned) for _ in full]
        for name, args in (
            ("TPShardedStoreLayout.prepare_values", (full, block_ids, picks)),
            ("TPShardedStoreLayout.prepare_values[empty]", ([], block_ids, [])),
            ("TPShardedStoreLayout.prepare_values[partial]", ([(0, block_size - 1)], block_ids, owned[:1])),
            ("TPShardedStoreLayout.prepare_values[not owned]", (full[:1], block_ids, [owned[-1] + 1])),
            ("TPShardedStoreLayout.prepare_values[count]", (full, block_ids, picks[:-1])),
        ):
            _compare(
                name,
                reference["TPShardedStoreLayout.prepare_values"],
                _sharded_prepare_values,
                sharded,
                *args,
            )
        for shard in (owned[0], owned[-1] + 1):
            _compare(
                "TPShardedStoreLayout.key_for",
                reference["TPShardedStoreLayout.key_for"],
                _sharded_key_for,
                sharded,
                shard,
                chunk_hash,
            )
