"""The plugin's replacements of vLLM 0.32/0.33's store-layout methods (docs/vllm-plugin.md, "What is replaced"), the
shape check of the modules they go into, and their self-check against vLLM's own methods. What every release does
alike (the shape check's loop, the self-check's loop and shared cases, the plan engines) is here once; a release
module keeps only its own classes, parameters and cases. Each replacement keeps its native engine on vLLM's own
layout object (``layout.__dict__[ENGINE_ATTR]``) and rebuilds it whenever vLLM assigns new region lists or segment
templates.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.layouts import DEFAULT_ROW_CACHE_BYTES
from mooncake_kvaddr.integrations.vllm.registry import (
    DATA_MODULE,
    WORKER_MODULE,
    original_of,
    params_after_self,
    signature_problem,
    static_attribute,
)

__all__ = [
    "ENGINE_ATTR",
    "LAYOUT_PARAMS",
    "OURS",
    "PLAN_ENGINES",
    "REPLACEMENTS",
    "Comparison",
    "check_shape",
    "compare_all",
    "each",
    "layout_roles",
    "plan_engines",
    "rank_local_cases",
    "sample_request",
    "self_check",
    "shape_problem",
    "shard_templates",
    "sharded_key_cases",
]

#: Where a vLLM layout object keeps its engine (and what it was built from).
ENGINE_ATTR = "_mooncake_kvaddr_engine"
#: The native module, untyped here: the layout engine's stubs belong to the layouts (docs/architecture.md).
_NATIVE: Any = _native

#: Parameters (after self) of the layout methods every release replaces or relies on, alike from 0.32 to 0.34.
LAYOUT_PARAMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("RankLocalStoreLayout", "prepare_values"): ("chunks", "block_ids", "shard_ids"),
    ("RankLocalStoreLayout", "key_for"): ("shard_id", "chunk_hash"),
    ("TPShardedStoreLayout", "prepare_values"): ("chunks", "block_ids", "shard_ids"),
    ("TPShardedStoreLayout", "key_for"): ("shard_id", "chunk_hash"),
    ("TPShardedStoreLayout", "_set_segment_templates"): ("templates",),
}
# Parameters (after self) of each replaced method, as vLLM 0.32/0.33 declare them.
_EXPECTED_PARAMS = {**LAYOUT_PARAMS, ("RankLocalStoreLayout", "prepare_value_for_block"): ("block_id",)}
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


_Rows = tuple[list[list[int]], list[list[int]], list[int]]


def _prepare_values(engine_of: Callable[[Any], Any]) -> Callable[[Any, Any, Any, Any], _Rows]:
    """mooncake_kvaddr's ``prepare_values`` of the layouts whose engine ``engine_of(layout)`` gives:
    ``RankLocalStoreLayout``'s and ``TPShardedStoreLayout``'s alike."""

    def prepare_values(self: Any, chunks: Any, block_ids: Any, shard_ids: Any) -> _Rows:
        """mooncake_kvaddr's ``prepare_values`` on the layout's native engine (docs/vllm-plugin.md)."""
        if not chunks:
            return [], [], []
        result: _Rows = engine_of(self).prepare_values(chunks, block_ids, shard_ids)
        return result

    return prepare_values


_rank_local_prepare_values = _prepare_values(_rank_local_engine)


def _rank_local_prepare_value_for_block(self: Any, block_id: int) -> tuple[list[int], list[int]]:
    """mooncake_kvaddr's ``RankLocalStoreLayout.prepare_value_for_block``."""
    result: tuple[list[int], list[int]] = _rank_local_engine(self).prepare_value_for_block(block_id)
    return result


def _rank_local_key_for(self: Any, shard_id: int, chunk_hash: Any) -> str:
    """``prefix@hash_hex`` in one f-string (vLLM's goes through ``PoolKey.build_key_string``)."""
    assert shard_id == 0
    return f"{self._key_prefix}@{chunk_hash.hex()}"


_sharded_prepare_values = _prepare_values(_sharded_engine)


def _sharded_key_for(self: Any, shard_id: int, chunk_hash: Any) -> str:
    """An owned shard's key in one f-string (KeyError for a shard this rank does not own, as vLLM)."""
    return f"{self._shard_key_prefixes[shard_id]}@{chunk_hash.hex()}"


def shard_prefixes(layout: Any) -> list[str]:
    """The key prefix of each shard a TP-shared layout owns, in ``local_shard_ids`` order (ValueError when the
    owned shards are not the consecutive run an engine keys)."""
    ids = tuple(layout.store_shard_ids)
    first = ids[0] if ids else 0
    if ids != tuple(range(first, first + len(ids))) or len(ids) != max(int(layout.shards_per_rank), 0):
        raise ValueError("the owned store shards are not one consecutive run")
    return [layout._shard_key_prefixes[shard] for shard in ids]


def plan_engines(
    rank_local: Callable[[Any], Any], sharded: Callable[[Any], Any]
) -> dict[str, Callable[[Any], tuple[Any, list[str]] | str]]:
    """A release's ``Release.plan_engines`` from its layouts' engine getters, alike in every release: the
    handlers' view of a rank-local layout (its engine, its one key prefix) and of a TP-shared one (its engine,
    the key prefix of each owned shard; why vLLM's own handler must plan it where the getter gives None)."""

    def rank_local_plan(layout: Any) -> tuple[Any, list[str]]:
        return rank_local(layout), [layout._key_prefix]

    def sharded_plan(layout: Any) -> tuple[Any, list[str]] | str:
        prefixes = shard_prefixes(layout)
        engine = sharded(layout)
        return "TP-shared templates the engine cannot hold" if engine is None else (engine, prefixes)

    return {"rank_local": rank_local_plan, "sharded": sharded_plan}


PLAN_ENGINES = plan_engines(_rank_local_engine, _sharded_engine)

#: (vLLM class name, method name, ours): what :func:`~mooncake_kvaddr.integrations.vllm.plugin.patch` installs.
REPLACEMENTS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("RankLocalStoreLayout", "prepare_values", _rank_local_prepare_values),
    ("RankLocalStoreLayout", "prepare_value_for_block", _rank_local_prepare_value_for_block),
    ("RankLocalStoreLayout", "key_for", _rank_local_key_for),
    ("TPShardedStoreLayout", "prepare_values", _sharded_prepare_values),
    ("TPShardedStoreLayout", "key_for", _sharded_key_for),
)

#: Each replaced layout class's role prefix in a release's ``ours`` (``Release.ours``, ``plans.Kinds``).
_ROLES = {"RankLocalStoreLayout": "rank_local", "TPShardedStoreLayout": "sharded"}


def layout_roles(replacements: Iterable[tuple[str, str, Callable[..., Any]]]) -> dict[str, Any]:
    """A release's replacements by role (``rank_local_prepare_values``, ``sharded_key_for``, ...): the methods
    ``plans.Kinds`` compares a layout class's with to know the layout is backed by our engine."""
    return {f"{_ROLES[cls_name]}_{method}": ours for cls_name, method, ours in replacements}


OURS: dict[str, Any] = layout_roles(REPLACEMENTS)


# --- the shape check ------------------------------------------------------------------------------------------


#: "Class.method" -> vLLM's function, filled by :func:`_check_shape` (the self-check calls these).
_ORIGINAL_FUNCS: dict[str, Callable[..., Any]] = {}


def shape_problem(
    module: ModuleType, module_name: str, classes: Iterable[str], expected: Mapping[tuple[str, str], tuple[str, ...]]
) -> str:
    """The layout shape check every release makes: "" when ``module`` (named ``module_name``) has each of
    ``classes``, then each class of ``expected`` with its method taking those parameters after self; otherwise
    the first mismatch."""
    for cls_name in classes:
        if not isinstance(getattr(module, cls_name, None), type):
            return f"{module_name}.{cls_name} is missing"
    for (cls_name, method), params in expected.items():
        cls = getattr(module, cls_name, None)
        if not isinstance(cls, type):
            return f"{module_name}.{cls_name} is missing"
        problem = signature_problem(cls, method, params)
        if problem:
            return problem
    return ""


def check_shape(data: ModuleType, worker: ModuleType | None) -> str:
    """Empty string when ``data`` (and ``worker``) have every class and method we replace with the expected
    parameters; otherwise the first mismatch."""
    problem = shape_problem(data, DATA_MODULE, (), _EXPECTED_PARAMS) or shape_problem(
        data, DATA_MODULE, ("KeyMetadata", "LBHNCStoreLayout", "LBNHCStoreLayout"), {}
    )
    if problem:
        return problem
    for cls_name, method in _EXPECTED_PARAMS:
        _ORIGINAL_FUNCS[f"{cls_name}.{method}"] = original_of(getattr(data, cls_name), method)
    if worker is not None:
        cls = getattr(worker, "MooncakeStoreWorker", None)
        if not isinstance(cls, type):
            return f"{WORKER_MODULE}.MooncakeStoreWorker is missing"
        for method, params in _EXPECTED_WORKER_PARAMS.items():
            func = static_attribute(cls, method)
            if not callable(func):
                return f"MooncakeStoreWorker.{method} is missing"
            if params_after_self(func)[: len(params)] != params:
                return f"MooncakeStoreWorker.{method} takes {params_after_self(func)}, expected {params}"
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


#: One comparison of a layout self-check: class name, method, case label (``[empty]``, ...), the layout object
#: and the arguments after it.
Comparison = tuple[str, str, str, Any, tuple[Any, ...]]


def compare_all(
    module: ModuleType, replacements: Iterable[tuple[str, str, Callable[..., Any]]], cases: Iterable[Comparison]
) -> None:
    """The loop of every release's layout self-check: for each generated case, in order, vLLM's own method of
    the named class in ``module`` and our replacement of it (:func:`_compare`; the first difference raises)."""
    ours = {(cls_name, method): func for cls_name, method, func in replacements}
    reference = {key: original_of(getattr(module, key[0]), key[1]) for key in ours}
    for cls_name, method, label, layout, args in cases:
        key = (cls_name, method)
        _compare(f"{cls_name}.{method}{label}", reference[key], ours[key], layout, *args)


def each(cls_name: str, method: str, layout: Any, cases: Iterable[tuple[str, tuple[Any, ...]]]) -> Iterator[Comparison]:
    """``(label, args)`` cases of one method on one layout, as :data:`Comparison` s."""
    return ((cls_name, method, label, layout, args) for label, args in cases)


def sample_request(rng: random.Random, block_size: int, hash_block_size: int) -> tuple[list[int], int]:
    """A request's block ids and token length (whole blocks, the last one possibly short by hash blocks)."""
    num_blocks = rng.randint(1, 9)
    block_ids = [rng.randrange(0, 5000) for _ in range(num_blocks)]
    token_len = num_blocks * block_size - rng.randrange(0, block_size // hash_block_size) * hash_block_size
    return block_ids, token_len


def shard_templates(
    rng: random.Random, shards: int, width: int, strides: tuple[int, ...], sizes: tuple[int, ...]
) -> list[tuple[list[int], list[int], list[int]]]:
    """Segment templates of ``shards`` shards, ``width`` segments each (bases, strides, sizes drawn in turn per
    shard), as vLLM's ``_set_segment_templates`` takes them (0.34: one such list per Store chunk of a block)."""
    return [
        (
            [rng.randrange(1 << 20, 1 << 40) for _ in range(width)],
            [rng.choice(strides) for _ in range(width)],
            [rng.choice(sizes) for _ in range(width)],
        )
        for _ in range(shards)
    ]


def rank_local_cases(layout: Any, chunks: Any, block_ids: Any, hash_block_size: int) -> Iterator[Comparison]:
    """The rank-local ``prepare_values`` cases every release compares: the request's chunks, none, a chunk not
    a whole number of hash blocks, a shard other than 0."""
    return each("RankLocalStoreLayout", "prepare_values", layout, (
        ("", (chunks, block_ids, [0] * len(chunks))),
        ("[empty]", ([], block_ids, [])),
        ("[unaligned]", ([(0, hash_block_size + 1)], block_ids, [0])),
        ("[shard]", (chunks[:1], block_ids, [1])),
    ))  # fmt: skip


def sharded_key_cases(layout: Any, owned: list[int], chunk_hash: bytes) -> Iterator[Comparison]:
    """A TP-shared layout's ``key_for`` on its first owned shard and on one past its last (vLLM's KeyError)."""
    return each("TPShardedStoreLayout", "key_for", layout, (("", (s, chunk_hash)) for s in (owned[0], owned[-1] + 1)))


def self_check(data: ModuleType, *, seed: int = 0, cases: int = 12) -> None:
    """Compare our replacement methods with ``data``'s own (vLLM's module) on small generated cases.

    Raises ``AssertionError`` naming the first difference. Needs no tensors: regions and segment templates
    are set through vLLM's own setters.
    """
    compare_all(data, REPLACEMENTS, _cases(data, random.Random(seed), cases))


def _cases(data: ModuleType, rng: random.Random, cases: int) -> Iterator[Comparison]:
    metadata = data.KeyMetadata("self-check/model", 1, 0, 0, 0)
    for case in range(cases):
        hash_block_size = rng.choice([16, 32, 64])
        block_size = hash_block_size * rng.choice([1, 2, 4])
        layout = data.RankLocalStoreLayout(metadata, block_size, hash_block_size)
        regions = rng.randint(0, 5)
        layout.set_kv_caches_base_addr([rng.randrange(1 << 20, 1 << 40) for _ in range(regions)])
        layout.set_block_len([rng.choice([256, 2048, 4096]) for _ in range(max(1, regions // 2 + case % 2))])
        block_ids, token_len = sample_request(rng, block_size, hash_block_size)
        chunks = [(start, min(start + block_size, token_len)) for start in range(0, token_len, block_size)]
        yield from rank_local_cases(layout, chunks, block_ids, hash_block_size)
        block_id = rng.randrange(0, 5000)
        yield "RankLocalStoreLayout", "prepare_value_for_block", "", layout, (block_id,)
        chunk_hash = rng.randbytes(32)
        yield "RankLocalStoreLayout", "key_for", "", layout, (0, chunk_hash)

        # TP-shared formats: templates installed through vLLM's own setter, two local shards.
        layout_cls = data.LBHNCStoreLayout if case % 2 else data.LBNHCStoreLayout
        store_tp, local_tp = 4, 2
        tp_rank = case % local_tp
        sharded = layout_cls(metadata, block_size, hash_block_size, local_tp, store_tp, tp_rank, 8)
        segments = rng.randint(1, 6)
        sharded._set_segment_templates(
            shard_templates(rng, sharded.shards_per_rank, segments, (4096, 65536), (128, 512))
        )
        owned = list(sharded.local_shard_ids)
        full = [(i * block_size, (i + 1) * block_size) for i in range(len(block_ids))]
        picks = [rng.choice(owned) for _ in full]
        yield from each("TPShardedStoreLayout", "prepare_values", sharded, (
            ("", (full, block_ids, picks)),
            ("[empty]", ([], block_ids, [])),
            ("[partial]", ([(0, block_size - 1)], block_ids, owned[:1])),
            ("[not owned]", (full[:1], block_ids, [owned[-1] + 1])),
            ("[count]", (full, block_ids, picks[:-1])),
        ))  # fmt: skip
        yield from sharded_key_cases(sharded, owned, chunk_hash)
