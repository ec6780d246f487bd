"""vLLM general plugin: makes the installed vLLM's Mooncake store connector use mooncake_kvaddr's native
kernels, with no change to vLLM or to the user's code (docs/vllm-plugin.md).

vLLM runs every entry point of the ``vllm.general_plugins`` group in each of its processes; this package
declares :func:`register` there. :func:`register`:

1. does nothing when ``MOONCAKE_KVADDR_VLLM_PLUGIN=0`` (or ``false``/``off``/``no``); when vLLM's Mooncake
   store modules are not imported yet, defers steps 2-4 to their first import (an import hook; vLLM runs the
   entry point in every process, most of which never build a Mooncake store worker: docs/vllm-plugin.md,
   "Start-up");
2. checks that the installed vLLM is a release whose Mooncake store module it knows (0.32/0.33) and that
   every method it replaces is there with the expected parameters;
3. runs a self-check: on small generated cases, vLLM's own methods and ours return equal values of equal
   types (and raise the same exception types for bad input); and checks that each function it replaces (or
   relies on line by line) has a fingerprint recorded for that release series (docs/vllm-plugin.md,
   "Fingerprints");
4. only then replaces the methods on vLLM's classes and logs one line naming them and the vLLM version.

If any step fails, vLLM is left untouched and one warning says why. Patching is idempotent (vLLM may call
plugins more than once per process) and reversible (:func:`unpatch`). Nothing here imports torch or vLLM at
module import; vLLM is imported inside :func:`register` (vLLM has imported it already by then), vLLM's
Mooncake store modules only when the patch runs.

What is replaced (all on vLLM's ``...mooncake.store.data`` classes, state kept on vLLM's own objects):

- ``RankLocalStoreLayout.prepare_values``, ``.prepare_value_for_block`` and ``.key_for``;
- ``TPShardedStoreLayout.prepare_values`` (and so ``LBHNCStoreLayout``/``LBNHCStoreLayout``) and ``.key_for``;
- ``MooncakeStoreWorker.__init__``/``.register_kv_caches`` get a thin wrapper that sets up the transports:
  the native-client transport (on by default; off with ``MOONCAKE_KVADDR_VLLM_NATIVE_CLIENT=0`` or
  ``{"mooncake_kvaddr_native_client": false}``; host or device caches): the batch calls go through
  :class:`~mooncake_kvaddr.integrations.vllm.native_store.NativeMooncakeStore`, which calls Mooncake's C++
  client only where it was verified for the installed Mooncake and Mooncake's own method otherwise; and the
  staged transport, off by default (``MOONCAKE_KVADDR_VLLM_STAGED=1`` or ``kv_connector_extra_config``
  ``{"mooncake_kvaddr_staged": true}``): host-memory KV caches then move through
  :class:`~mooncake_kvaddr.integrations.vllm.staged_store.StagedMooncakeStore`;
- ``KVCacheStoreRecvingThread._handle_request`` (worker module): one fused native plan per KV-cache group and
  one store call per request (:mod:`~mooncake_kvaddr.integrations.vllm.receive`), vLLM's own handler for
  everything off that fast path; on by default, off with ``MOONCAKE_KVADDR_VLLM_RECV=0`` (the layouts stay
  patched). It has its own shape check and self-check: if either fails, only the handler is left as vLLM's.

Size: one module on purpose (~600 lines): the version/shape checks, the self-check and the patches must be
read together to see that nothing is patched that was not checked first.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import logging
import os
import random
import sys
import textwrap
import threading
import tokenize
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.core.layouts import DEFAULT_ROW_CACHE_BYTES

__all__ = [
    "DATA_MODULE",
    "ENV_NATIVE_CLIENT",
    "ENV_PLUGIN",
    "ENV_RECV",
    "ENV_STAGED",
    "ENV_STAGING_BYTES",
    "EXTRA_NATIVE_CLIENT",
    "EXTRA_STAGED",
    "EXTRA_STAGING_BYTES",
    "FINGERPRINTED",
    "KNOWN_FINGERPRINTS",
    "SUPPORTED_VLLM_SERIES",
    "TRANSPORT_ATTR",
    "WORKER_MODULE",
    "PatchReport",
    "fingerprint",
    "fingerprint_problem",
    "fingerprint_source",
    "is_patched",
    "is_receive_patched",
    "maybe_stage_store",
    "native_client_setting",
    "patch",
    "register",
    "self_check",
    "unpatch",
    "vllm_functions",
]

#: Set to ``0``/``false``/``off``/``no`` to keep vLLM untouched.
ENV_PLUGIN = "MOONCAKE_KVADDR_VLLM_PLUGIN"
#: Set to ``0``/``false``/``off``/``no`` to keep vLLM's own receive handler (the layouts stay patched).
ENV_RECV = "MOONCAKE_KVADDR_VLLM_RECV"
#: Set to ``1``/``true``/``on``/``yes`` to stage host-memory KV caches through one slot per key.
ENV_STAGED = "MOONCAKE_KVADDR_VLLM_STAGED"
#: Staging buffer bytes per worker (default :data:`DEFAULT_STAGING_BYTES`).
ENV_STAGING_BYTES = "MOONCAKE_KVADDR_VLLM_STAGING_BYTES"
#: ``kv_connector_extra_config`` key with the same meaning as :data:`ENV_STAGED` (the variable wins).
EXTRA_STAGED = "mooncake_kvaddr_staged"
#: ``kv_connector_extra_config`` key with the same meaning as :data:`ENV_STAGING_BYTES`.
EXTRA_STAGING_BYTES = "mooncake_kvaddr_staging_bytes"
DEFAULT_STAGING_BYTES = 256 << 20
#: Set to ``1``/``true``/``on``/``yes`` to send the worker's Mooncake batch calls through the native client.
ENV_NATIVE_CLIENT = "MOONCAKE_KVADDR_VLLM_NATIVE_CLIENT"
#: ``kv_connector_extra_config`` key with the same meaning as :data:`ENV_NATIVE_CLIENT` (the variable wins).
EXTRA_NATIVE_CLIENT = "mooncake_kvaddr_native_client"

#: vLLM release series whose Mooncake store module shape this plugin knows.
SUPPORTED_VLLM_SERIES = ("0.32.", "0.33.")
DATA_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data"
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"

#: Logged under vLLM's logger tree so that vLLM's own logging configuration shows the line.
logger = logging.getLogger("vllm.mooncake_kvaddr")

_ENGINE_ATTR = "_mooncake_kvaddr_engine"
#: The native module, untyped here: the layout engine's stubs belong to the layouts (docs/architecture.md).
_NATIVE: Any = _native
_STATE_LOCK = threading.RLock()
#: (class, attribute name) -> the original attribute, for every replaced attribute.
_ORIGINALS: dict[tuple[type, str], Any] = {}
_REPORT: PatchReport | None = None
#: The report whose line :func:`register` logged (the line is logged once per patch).
_LOGGED: PatchReport | None = None
_WARNED = False

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


@dataclass
class PatchReport:
    """What :func:`patch` did: the vLLM version, the replaced ``Class.method`` names, whether the staged
    transport hook is installed, or why nothing was patched."""

    vllm_version: str
    patched: list[str] = field(default_factory=list)
    staged_hook: bool = False
    reason: str = ""
    #: Why vLLM's own receive handler was kept while the rest is patched ("" when it was replaced, or off).
    receive_reason: str = ""
    #: Why the worker's transport hook was not installed ("" when it was, or when there is no worker module).
    hook_reason: str = ""
    #: Why vLLM's own ``MooncakeStoreWorker.lookup`` was kept ("" when it was replaced, or off).
    lookup_reason: str = ""

    @property
    def active(self) -> bool:
        """True when vLLM runs with the replaced methods."""
        return bool(self.patched)


def _disabled_by_env(environ: Mapping[str, str]) -> bool:
    return not flag(environ.get(ENV_PLUGIN), True)


# --- the replacement methods ---------------------------------------------------------------------------------


def _rank_local_engine(layout: Any) -> Any:
    """The native engine of a vLLM ``RankLocalStoreLayout``, kept on the layout and re-pointed whenever vLLM
    assigns new ``kv_caches_base_addr``/``block_len`` lists (the engine re-reads the lists on every call, so
    in-place edits are seen too)."""
    state = layout.__dict__.get(_ENGINE_ATTR)
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
    ):
        engine = _NATIVE.LayoutEngine(block_size, hash_block_size, False, 0, 1, DEFAULT_ROW_CACHE_BYTES)
        engine.set_region_sources(bases, lens)
        state = (engine, bases, lens, block_size, hash_block_size)
        layout.__dict__[_ENGINE_ATTR] = state
    return state[0]


def _sharded_engine(layout: Any) -> Any:
    """The native engine of a vLLM ``TPShardedStoreLayout``, rebuilt whenever vLLM installs new segment
    templates (``_set_segment_templates`` assigns new arrays; their identity is the version)."""
    arrays = (layout._shard_addr_bases, layout._shard_block_strides, layout._shard_sizes)
    state = layout.__dict__.get(_ENGINE_ATTR)
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
        layout.__dict__[_ENGINE_ATTR] = state
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


def _sharded_plan_engine(layout: Any) -> tuple[Any, list[str]]:
    """The receive handler's view of a TP-shared layout: its engine and the key prefix of each owned shard, in
    ``local_shard_ids`` order (ValueError when the owned shards are not the consecutive run the engine keys)."""
    ids = tuple(layout.store_shard_ids)
    first = ids[0] if ids else 0
    if ids != tuple(range(first, first + len(ids))) or len(ids) != max(int(layout.shards_per_rank), 0):
        raise ValueError("the owned store shards are not one consecutive run")
    return _sharded_engine(layout), [layout._shard_key_prefixes[shard] for shard in ids]


_OURS: dict[str, Any] = {
    "rank_local_prepare_values": _rank_local_prepare_values,
    "rank_local_key_for": _rank_local_key_for,
    "sharded_prepare_values": _sharded_prepare_values,
    "sharded_key_for": _sharded_key_for,
}
_PLAN_ENGINES: dict[str, Callable[[Any], tuple[Any, list[str]]]] = {
    "rank_local": _rank_local_plan_engine,
    "sharded": _sharded_plan_engine,
}


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


def _reference(cls: type, name: str) -> Callable[..., Any]:
    """vLLM's own ``cls.name``: the original when we replaced it on ``cls`` or a base class."""
    for klass in cls.__mro__:
        original = _ORIGINALS.get((klass, name))
        if original is not None and original is not _INHERITED:
            func: Callable[..., Any] = original
            return func
        if original is None and name in klass.__dict__:
            func = klass.__dict__[name]
            return func
    raise AttributeError(f"{cls.__name__}.{name}")


def self_check(data: ModuleType, *, seed: int = 0, cases: int = 12) -> None:
    """Compare our replacement methods with ``data``'s own (vLLM's module) on small generated cases.

    Raises ``AssertionError`` naming the first difference. Needs no tensors: regions and segment templates
    are set through vLLM's own setters.
    """
    rng = random.Random(seed)
    metadata = data.KeyMetadata("self-check/model", 1, 0, 0, 0)
    reference = {
        f"{cls_name}.{method}": _reference(getattr(data, cls_name), method) for cls_name, method in _EXPECTED_PARAMS
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


#: "Class.method" -> vLLM's function, filled by :func:`_check_shape` (the self-check calls these).
_ORIGINAL_FUNCS: dict[str, Callable[..., Any]] = {}


def _static(cls: type, name: str) -> Any:
    """``cls.name`` found along the MRO without running descriptors (None when absent)."""
    try:
        return inspect.getattr_static(cls, name)
    except AttributeError:
        return None


def _params(func: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)[1:]


def _check_shape(data: ModuleType, worker: ModuleType | None) -> str:
    """Empty string when ``data`` (and ``worker``) have every class and method we replace with the expected
    parameters; otherwise the first mismatch."""
    for (cls_name, method), params in _EXPECTED_PARAMS.items():
        cls = getattr(data, cls_name, None)
        if not isinstance(cls, type):
            return f"{DATA_MODULE}.{cls_name} is missing"
        func = _static(cls, method)
        if not callable(func):
            return f"{cls_name}.{method} is missing"
        try:
            actual = _params(func)
        except (TypeError, ValueError):
            return f"{cls_name}.{method} has no readable signature"
        if actual != params:
            return f"{cls_name}.{method} takes {actual}, expected {params}"
        _ORIGINAL_FUNCS[f"{cls_name}.{method}"] = _reference(cls, method)
    for name in ("KeyMetadata", "LBHNCStoreLayout", "LBNHCStoreLayout"):
        if not isinstance(getattr(data, name, None), type):
            return f"{DATA_MODULE}.{name} is missing"
    if worker is not None:
        cls = getattr(worker, "MooncakeStoreWorker", None)
        if not isinstance(cls, type):
            return f"{WORKER_MODULE}.MooncakeStoreWorker is missing"
        for method, params in _EXPECTED_WORKER_PARAMS.items():
            func = _static(cls, method)
            if not callable(func):
                return f"MooncakeStoreWorker.{method} is missing"
            if _params(func)[: len(params)] != params:
                return f"MooncakeStoreWorker.{method} takes {_params(func)}, expected {params}"
    return ""


# --- fingerprints ------------------------------------------------------------------------------------------

#: The vLLM functions each part of the plugin was checked against, by part: the layouts (replaced), the receive
#: handler (replaced; ``process_tokens`` is the chunk walk it reproduces) and the worker's transport hook
#: (``register_kv_caches``/``close`` run with the wrapper as the store, so their bodies are what the hook
#: relies on), the worker's lookup (replaced; the block pool's attributes are what its faster pool reads).
FINGERPRINTED: dict[str, tuple[str, ...]] = {
    "layouts": (
        "RankLocalStoreLayout.prepare_values",
        "RankLocalStoreLayout.prepare_value_for_block",
        "RankLocalStoreLayout.key_for",
        "TPShardedStoreLayout.prepare_values",
        "TPShardedStoreLayout.key_for",
        "TPShardedStoreLayout._set_segment_templates",
    ),
    "receive": ("KVCacheStoreRecvingThread._handle_request", "ChunkedTokenDatabase.process_tokens"),
    "worker": ("MooncakeStoreWorker.register_kv_caches", "MooncakeStoreWorker.close"),
    "lookup": (
        "MooncakeStoreWorker.lookup",
        "ExternalCachedBlockPool.__init__",
        "ExternalCachedBlockPool.get_cached_block",
    ),
}

#: :func:`fingerprint` of each function in :data:`FINGERPRINTED`, per release checked. 0.32.0's Mooncake store
#: ``data.py`` and ``worker.py`` are byte-identical to 0.33.0's (compared from the 0.32.0 wheel, not installed).
KNOWN_FINGERPRINTS: dict[str, dict[str, str]] = {
    release: {
        "RankLocalStoreLayout.prepare_values": "3aa2513fe91a14c4",
        "RankLocalStoreLayout.prepare_value_for_block": "d152372ee913685e",
        "RankLocalStoreLayout.key_for": "2c426949ec2ea759",
        "TPShardedStoreLayout.prepare_values": "c2254d3f4f8756ab",
        "TPShardedStoreLayout.key_for": "998e0f8942fb19c0",
        "TPShardedStoreLayout._set_segment_templates": "410b7150a8211070",
        "KVCacheStoreRecvingThread._handle_request": "67cd42f2dc3c5f11",
        "ChunkedTokenDatabase.process_tokens": "d7d54c491f37709b",
        "MooncakeStoreWorker.register_kv_caches": "d61b0517475bfad8",
        "MooncakeStoreWorker.close": "b9b831fa3647518f",
        "MooncakeStoreWorker.lookup": "23da6e4e0684a1e0",
        "ExternalCachedBlockPool.__init__": "8812d6d330d5298f",
        "ExternalCachedBlockPool.get_cached_block": "58a17cb93531b829",
    }
    for release in ("0.32.0", "0.33.0")
}


def fingerprint_source(source: str) -> str:
    """The fingerprint of a function's source text: the first 16 hex digits of the sha256 of the text with the
    common indentation, comments, trailing whitespace and empty lines removed. Stable across installs and
    Python versions (no bytecode in it); any change to a statement, a name or a constant changes it."""
    text = textwrap.dedent(source)
    cuts: dict[int, int] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                cuts[token.start[0]] = token.start[1]
    except (tokenize.TokenError, SyntaxError, IndentationError):
        cuts.clear()  # not tokenizable: the whole text counts
    kept = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line[: cuts[number]] if number in cuts else line
        if line.strip():
            kept.append(line.rstrip())
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def fingerprint(func: Any) -> str | None:
    """:func:`fingerprint_source` of ``func``'s source (``inspect.getsource``); None when it has none."""
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return None
    return fingerprint_source(source)


def fingerprint_problem(version: str, functions: Mapping[str, Any]) -> str:
    """Empty string when every function in ``functions`` ("Class.method" -> vLLM's function) has a fingerprint
    recorded for a release of ``version``'s series (0.32.x, 0.33.x); otherwise the first that does not."""
    series = next((s for s in SUPPORTED_VLLM_SERIES if version.startswith(s)), None)
    for name, func in functions.items():
        if func is None:
            return f"{name} is missing"
        known = {
            table[name]
            for release, table in KNOWN_FINGERPRINTS.items()
            if series is not None and release.startswith(series) and name in table
        }
        actual = fingerprint(func)
        if actual is None:
            return f"{name} has no readable source to fingerprint"
        if actual not in known:
            return (
                f"{name} is not the function this plugin was checked against "
                f"(fingerprint {actual}, known: {', '.join(sorted(known)) or 'none'})"
            )
    return ""


#: Classes of the worker module among :data:`FINGERPRINTED` (the others are the data module's).
_WORKER_CLASSES = ("KVCacheStoreRecvingThread", "MooncakeStoreWorker", "ExternalCachedBlockPool")


def vllm_functions(part: str, data: ModuleType, worker: ModuleType | None) -> dict[str, Any]:
    """vLLM's own functions of one :data:`FINGERPRINTED` part, "Class.method" -> function (the originals where
    we replaced them; None for one that is missing)."""
    found: dict[str, Any] = {}
    for name in FINGERPRINTED[part]:
        cls_name, method = name.split(".")
        module = worker if cls_name in _WORKER_CLASSES else data
        cls = None if module is None else module.__dict__.get(cls_name)
        try:
            found[name] = _reference(cls, method) if isinstance(cls, type) else None
        except AttributeError:
            found[name] = None
    return found


# --- the staged-transport hook on MooncakeStoreWorker --------------------------------------------------------


def _iter_tensors(kv_caches: Any) -> Iterable[Any]:
    values = kv_caches.values() if isinstance(kv_caches, Mapping) else kv_caches
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _all_host(kv_caches: Any) -> bool:
    """True when every KV-cache tensor lives in host memory (``tensor.device.type == "cpu"``, duck-typed)."""
    tensors = list(_iter_tensors(kv_caches))
    return bool(tensors) and all(getattr(getattr(t, "device", None), "type", None) == "cpu" for t in tensors)


def staged_settings(
    extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> tuple[bool, int]:
    """``(staged transport requested, staging bytes)`` from the environment (wins) and the connector's
    ``kv_connector_extra_config``."""
    env = os.environ if environ is None else environ
    extra = extra_config or {}
    wanted = flag(env.get(ENV_STAGED, extra.get(EXTRA_STAGED)), False)
    raw = env.get(ENV_STAGING_BYTES, extra.get(EXTRA_STAGING_BYTES, DEFAULT_STAGING_BYTES))
    try:
        nbytes = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{ENV_STAGING_BYTES}/{EXTRA_STAGING_BYTES} must be a byte count, got {raw!r}") from None
    if nbytes <= 0:
        raise ValueError(f"{ENV_STAGING_BYTES}/{EXTRA_STAGING_BYTES} must be > 0, got {nbytes}")
    return wanted, nbytes


def native_client_setting(extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the native-client transport is wanted: the environment (wins), else the connector's
    ``kv_connector_extra_config``. On by default, like the driver's ``StoreConfig.native_client``: the
    wrapper only calls Mooncake's C++ client where that client was verified for the installed Mooncake, and
    passes every call to Mooncake's own method otherwise (docs/vllm-plugin.md, "Native-client transport")."""
    env = os.environ if environ is None else environ
    return flag(env.get(ENV_NATIVE_CLIENT, (extra_config or {}).get(EXTRA_NATIVE_CLIENT)), True)


def maybe_stage_store(store: Any, kv_caches: Any, extra_config: Mapping[str, Any] | None) -> Any:
    """``store`` wrapped for the requested transports; ``store`` itself when none is requested.

    Native client (any caches): a :class:`NativeMooncakeStore`. Staged (host-memory caches only; device caches
    are passed through unchanged): a :class:`StagedMooncakeStore`, around the native wrapper when both are on
    (its contiguous slot calls then go through the native client too).

    Both are created armed: their registered-range guard refuses every raw-pointer slice outside the buffers
    registered through them, from the first call on (docs/vllm-plugin.md, "Registered-range guard"). The
    worker hook wraps the store right before vLLM registers its KV caches, so the caches are in the table
    before any transfer.
    """
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
    from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

    wanted, nbytes = staged_settings(extra_config)
    if isinstance(store, StagedMooncakeStore):
        return store
    if native_client_setting(extra_config) and not isinstance(store, NativeMooncakeStore):
        logger.info("mooncake_kvaddr: native-client transport on")
        store = NativeMooncakeStore(store, armed=True)
    if not wanted:
        return store
    if not _all_host(kv_caches):
        logger.info("mooncake_kvaddr: staged transport requested but the KV caches are not in host memory: off")
        return store
    logger.info("mooncake_kvaddr: staged transport on (%d MiB staging buffer)", nbytes >> 20)
    return StagedMooncakeStore(store, staging_bytes=nbytes, armed=True)


#: On a worker whose transfer threads got a transport wrapper: ``(vLLM's store, the wrapper)``.
TRANSPORT_ATTR = "_mooncake_kvaddr_transport"


def _wrap_worker(worker_cls: type) -> None:
    """Thin wrappers on ``MooncakeStoreWorker``: ``__init__`` keeps the connector's extra config, and
    ``register_kv_caches`` runs vLLM's with the transport wrapper (:func:`maybe_stage_store`) as the worker's
    store for the duration of the call, so that vLLM registers its KV caches through the wrapper (the
    registered-range guard's table) and hands the wrapper to the transfer threads it starts there. Afterwards
    ``worker.store`` is vLLM's own object again (vLLM and its tests use it directly). ``close`` (when vLLM
    has it) runs vLLM's with the wrapper as the store again, so the store is closed through the wrapper, which
    first refuses new calls and waits for those in flight (docs/vllm-plugin.md)."""
    original_init = _static(worker_cls, "__init__")
    original_register = _static(worker_cls, "register_kv_caches")
    original_close = _static(worker_cls, "close")

    def __init__(self: Any, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, vllm_config, kv_cache_config, *args, **kwargs)
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        self._mooncake_kvaddr_extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})

    def register_kv_caches(self: Any, kv_caches: Any, *args: Any, **kwargs: Any) -> Any:
        store = self.store
        transport = maybe_stage_store(store, kv_caches, self.__dict__.get("_mooncake_kvaddr_extra"))
        if transport is store:
            return original_register(self, kv_caches, *args, **kwargs)
        self.__dict__[TRANSPORT_ATTR] = (store, transport)
        self.store = transport
        try:
            return original_register(self, kv_caches, *args, **kwargs)
        finally:
            if self.store is transport:
                self.store = store

    def close(self: Any, *args: Any, **kwargs: Any) -> Any:
        pair = self.__dict__.pop(TRANSPORT_ATTR, None)
        if pair is not None and pair[0] is not None and self.store is pair[0]:
            self.store = pair[1]
        return original_close(self, *args, **kwargs)

    wrappers: list[tuple[str, Any, Any]] = [
        ("__init__", __init__, original_init),
        ("register_kv_caches", register_kv_caches, original_register),
    ]
    if callable(original_close):
        wrappers.append(("close", close, original_close))
    for name, func, original in wrappers:
        wrapper: Any = func
        wrapper.__wrapped__ = original
        wrapper.__qualname__ = f"{worker_cls.__qualname__}.{name}"
        _replace(worker_cls, name, wrapper)


# --- patching ---------------------------------------------------------------------------------------------------


_INHERITED = object()  # marks an attribute the class inherited (unpatch deletes ours instead of restoring)


def _replace(cls: type, name: str, value: Any) -> None:
    _ORIGINALS.setdefault((cls, name), cls.__dict__.get(name, _INHERITED))
    setattr(cls, name, value)


def is_patched() -> bool:
    """True while vLLM runs with our methods. After :func:`register` deferred the work (no Mooncake store
    module imported yet, docs/vllm-plugin.md "Start-up"), this does it first: imports vLLM's Mooncake store
    modules, checks and patches, as :func:`register` did before."""
    _run_deferred()
    return bool(_ORIGINALS)


def is_receive_patched() -> bool:
    """True while vLLM's receive threads run our ``_handle_request`` (resolves deferred work as
    :func:`is_patched`)."""
    _run_deferred()
    return any(name == "_handle_request" for _, name in _ORIGINALS)


def _patch_receive(data: ModuleType, worker: ModuleType, report: PatchReport) -> None:
    """Replace ``KVCacheStoreRecvingThread._handle_request`` after its own shape check and self-check (the
    layouts must be patched already: the handler plans only layouts backed by our engine)."""
    from mooncake_kvaddr.integrations.vllm import receive

    problem = receive.check_shape(data, worker)
    if problem:
        report.receive_reason = f"unexpected shape: {problem}"
        return
    problem = fingerprint_problem(report.vllm_version, vllm_functions("receive", data, worker))
    if problem:
        report.receive_reason = problem
        return
    cls = worker.KVCacheStoreRecvingThread
    handler = receive.make_handler(_static(cls, "_handle_request"), data, worker, _OURS, _PLAN_ENGINES)
    try:
        receive.self_check(data, worker, handler)
    except Exception as exc:
        report.receive_reason = f"self-check failed: {exc}"
        return
    _replace(cls, "_handle_request", handler)
    report.patched.append("KVCacheStoreRecvingThread._handle_request")


def _patch_lookup(data: ModuleType, worker: ModuleType, report: PatchReport) -> None:
    """Replace ``MooncakeStoreWorker.lookup`` after its own shape check, fingerprint and self-check."""
    from mooncake_kvaddr.integrations.vllm import lookup

    problem = lookup.check_shape(worker) or fingerprint_problem(
        report.vllm_version, vllm_functions("lookup", data, worker)
    )
    if problem:
        report.lookup_reason = problem
        return
    cls = worker.MooncakeStoreWorker
    replacement = lookup.make_lookup(_static(cls, "lookup"), worker)
    try:
        lookup.self_check(worker, replacement)
    except Exception as exc:
        report.lookup_reason = f"self-check failed: {exc}"
        return
    _replace(cls, "lookup", replacement)
    report.patched.append("MooncakeStoreWorker.lookup")


def patch(
    *,
    data: ModuleType | None = None,
    worker: ModuleType | None = None,
    version: str | None = None,
    receive: bool | None = None,
    lookup: bool | None = None,
) -> PatchReport:
    """Check, self-check and patch (see the module docstring); idempotent. Returns what was done.

    ``data``/``worker``/``version`` default to the installed vLLM's modules and version (tests pass their own).
    ``receive``: replace the receive handler (None: unless :data:`ENV_RECV` turns it off).
    ``lookup``: replace the worker's lookup (None: unless ``MOONCAKE_KVADDR_VLLM_LOOKUP`` turns it off).
    """
    global _REPORT
    if _REPORT is not None and _REPORT.active:
        return _REPORT
    if data is None or version is None:
        # Imported before the lock is taken: the import hook (register) may be running this very import's
        # deferred work in another thread, holding the module's import lock while it waits for ours.
        import importlib

        import vllm

        version = version or str(getattr(vllm, "__version__", "unknown"))
        data = data or importlib.import_module(DATA_MODULE)
        if worker is None:
            try:
                worker = importlib.import_module(WORKER_MODULE)
            except Exception as exc:  # worker needs vLLM's full stack; the layouts do not
                logger.debug("mooncake_kvaddr: no staged-transport hook (%s)", exc)
                worker = None
    with _STATE_LOCK:
        if _REPORT is not None and _REPORT.active:
            return _REPORT
        report = PatchReport(vllm_version=version)
        if not version.startswith(SUPPORTED_VLLM_SERIES):
            report.reason = f"vLLM {version} is not a release this plugin knows ({', '.join(SUPPORTED_VLLM_SERIES)}x)"
            return report
        problem = _check_shape(data, worker)
        if problem:
            report.reason = f"vLLM {version}'s Mooncake store module has an unexpected shape: {problem}"
            return report
        try:
            self_check(data)
        except Exception as exc:
            report.reason = f"self-check against vLLM {version} failed: {exc}"
            return report
        problem = fingerprint_problem(version, vllm_functions("layouts", data, worker))
        if problem:
            report.reason = f"vLLM {version}: {problem}"
            return report
        rank_local = data.RankLocalStoreLayout
        sharded = data.TPShardedStoreLayout
        for cls, name, func in (
            (rank_local, "prepare_values", _rank_local_prepare_values),
            (rank_local, "prepare_value_for_block", _rank_local_prepare_value_for_block),
            (rank_local, "key_for", _rank_local_key_for),
            (sharded, "prepare_values", _sharded_prepare_values),
            (sharded, "key_for", _sharded_key_for),
        ):
            _replace(cls, name, func)
            report.patched.append(f"{cls.__name__}.{name}")
        if worker is not None:
            report.hook_reason = fingerprint_problem(version, vllm_functions("worker", data, worker))
            if not report.hook_reason:
                _wrap_worker(worker.MooncakeStoreWorker)
                report.staged_hook = True
            from mooncake_kvaddr.integrations.vllm.receive import receive_enabled

            if receive if receive is not None else receive_enabled(os.environ):
                try:
                    _patch_receive(data, worker, report)
                except Exception as exc:  # the layouts stay patched; only the handler stays vLLM's
                    report.receive_reason = f"{type(exc).__name__}: {exc}"
            from mooncake_kvaddr.integrations.vllm.lookup import lookup_enabled

            if lookup if lookup is not None else lookup_enabled(os.environ):
                try:
                    _patch_lookup(data, worker, report)
                except Exception as exc:  # the rest stays patched; only the lookup stays vLLM's
                    report.lookup_reason = f"{type(exc).__name__}: {exc}"
        _REPORT = report
        return report


def unpatch() -> None:
    """Restore every replaced attribute (tests and benchmarks compare with and without the plugin)."""
    global _REPORT
    with _STATE_LOCK:
        for (cls, name), original in _ORIGINALS.items():
            if original is _INHERITED:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        _ORIGINALS.clear()
        _REPORT = None
        _cancel_deferred()


# --- start-up: the entry point defers its work to the first import of the Mooncake store modules ---------------

_WATCHED = (DATA_MODULE, WORKER_MODULE)
_HOOK: _StoreImportHook | None = None


class _StoreImportHook:
    """A ``sys.meta_path`` finder that runs the plugin's checks and patches right after vLLM's Mooncake store
    ``data`` or ``worker`` module is first executed (docs/vllm-plugin.md, "Start-up"). It finds nothing
    itself: it asks the finders after it and wraps the loader of the spec they return, and it leaves
    ``sys.meta_path`` when it fires (or when :func:`unpatch` cancels it)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _WATCHED or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = None if finder is self else getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
        finally:
            self._local.busy = False
        if spec is not None and spec.loader is not None and callable(getattr(spec.loader, "exec_module", None)):
            spec.loader = _ThenPatch(spec.loader, fullname)
        return spec


class _ThenPatch:
    """A loader that runs the real one, puts it back on the module (so the module looks untouched), then lets
    the deferred work run (:func:`_store_module_executed`)."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        _store_module_executed(self._name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _store_module_executed(name: str) -> None:
    """A watched module finished executing: patch now, unless it is ``data`` imported by ``worker`` (whose own
    execution is not finished: the hook fires again when it is)."""
    if name == DATA_MODULE and WORKER_MODULE in sys.modules:
        return
    _run_deferred()


def _cancel_deferred() -> bool:
    """Take the hook out of ``sys.meta_path``; True when one was pending."""
    global _HOOK
    with _STATE_LOCK:
        hook, _HOOK = _HOOK, None
        if hook is None:
            return False
        try:
            sys.meta_path.remove(hook)
        except ValueError:
            pass
        return True


def _run_deferred() -> None:
    """The work :func:`register` deferred, if it is still pending (never raises)."""
    if _HOOK is not None and _cancel_deferred():
        _activate()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: patch vLLM unless turned off; never raises.

    vLLM runs it in every process, most of which never build a Mooncake store worker. So when vLLM's Mooncake
    store modules are not imported yet, it only checks the release and installs an import hook; the checks
    and the patch run when one of those modules is first imported (or when :func:`is_patched` is asked),
    with the same log line (docs/vllm-plugin.md, "Start-up")."""
    global _HOOK
    if _disabled_by_env(os.environ):
        logger.debug("mooncake_kvaddr: vLLM plugin turned off by %s", ENV_PLUGIN)
        return
    try:
        with _STATE_LOCK:
            if (_REPORT is not None and _REPORT.active) or _HOOK is not None:
                return
            if not any(name in sys.modules for name in _WATCHED):
                import vllm

                version = str(getattr(vllm, "__version__", "unknown"))
                if version.startswith(SUPPORTED_VLLM_SERIES):
                    _HOOK = _StoreImportHook()
                    sys.meta_path.insert(0, _HOOK)
                    logger.debug("mooncake_kvaddr: patches vLLM %s on first import of its Mooncake store", version)
                    return
    except Exception as exc:  # a plugin must never break vLLM's start-up
        logger.warning("mooncake_kvaddr: vLLM left untouched: %s: %s", type(exc).__name__, exc)
        return
    _activate()


def _activate() -> None:
    """Check, self-check and patch now; log the one line (or the one warning). Never raises."""
    global _WARNED, _LOGGED
    try:
        report = patch()
    except Exception as exc:  # a plugin must never break vLLM's start-up
        logger.warning("mooncake_kvaddr: vLLM left untouched: %s: %s", type(exc).__name__, exc)
        return
    with _STATE_LOCK:
        if report.active and report is _LOGGED:
            return  # patched (and logged) before
        _LOGGED = report
    if report.active:
        logger.info(
            "mooncake_kvaddr: native Mooncake store paths active for vLLM %s: %s%s",
            report.vllm_version,
            ", ".join(report.patched),
            " (+ staged-transport hook)" if report.staged_hook else "",
        )
        if report.hook_reason:
            logger.warning("mooncake_kvaddr: store transports off (vLLM's worker kept as is): %s", report.hook_reason)
        if report.receive_reason:
            logger.warning("mooncake_kvaddr: vLLM's own receive handler kept: %s", report.receive_reason)
        if report.lookup_reason:
            logger.warning("mooncake_kvaddr: vLLM's own lookup kept: %s", report.lookup_reason)
    elif not _WARNED:
        _WARNED = True
        logger.warning("mooncake_kvaddr: vLLM left untouched: %s", report.reason)
