"""The plugin's record of vLLM's own functions (docs/vllm-plugin.md, "Fingerprints").

Every attribute the plugin replaces on a vLLM class is recorded with vLLM's original, so that unpatching
restores it and every check compares with vLLM's function, never ours; and every vLLM function a replacement
was checked against has its fingerprint per release here: a body that differs keeps vLLM's function.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = [
    "DATA_MODULE",
    "FINGERPRINTED",
    "KNOWN_FINGERPRINTS",
    "ORIGINALS",
    "SUPPORTED_VLLM_SERIES",
    "WORKER_MODULE",
    "fingerprint",
    "fingerprint_problem",
    "fingerprint_source",
    "original_of",
    "replace_attribute",
    "restore_all",
    "signature_problem",
    "static_attribute",
    "vllm_functions",
]

#: vLLM release series whose Mooncake store module shape this plugin knows.
SUPPORTED_VLLM_SERIES = ("0.32.", "0.33.")
DATA_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data"
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"

#: (class, attribute name) -> the original attribute, for every replaced attribute.
ORIGINALS: dict[tuple[type, str], Any] = {}
INHERITED = object()  # marks an attribute the class inherited (restore_all deletes ours instead of restoring)


def replace_attribute(cls: type, name: str, value: Any) -> None:
    """Set ``cls.name`` to ``value``, recording vLLM's original the first time (see :func:`restore_all`)."""
    ORIGINALS.setdefault((cls, name), cls.__dict__.get(name, INHERITED))
    setattr(cls, name, value)


def restore_all() -> None:
    """Put every replaced attribute back (an inherited one is deleted again) and forget them."""
    for (cls, name), original in ORIGINALS.items():
        if original is INHERITED:
            delattr(cls, name)
        else:
            setattr(cls, name, original)
    ORIGINALS.clear()


def static_attribute(cls: type, name: str) -> Any:
    """``cls.name`` found along the MRO without running descriptors (None when absent)."""
    try:
        return inspect.getattr_static(cls, name)
    except AttributeError:
        return None


def signature_problem(cls: type, method: str, params: tuple[str, ...]) -> str:
    """Empty string when ``cls.method`` exists with exactly ``params`` after ``self``; otherwise what differs (the
    shape checks of every replaced part say it the same way)."""
    func = static_attribute(cls, method)
    if not callable(func):
        return f"{cls.__name__}.{method} is missing"
    try:
        actual = tuple(inspect.signature(func).parameters)[1:]
    except (TypeError, ValueError):
        return f"{cls.__name__}.{method} has no readable signature"
    if actual != params:
        return f"{cls.__name__}.{method} takes {actual}, expected {params}"
    return ""


def original_of(cls: type, name: str) -> Callable[..., Any]:
    """vLLM's own ``cls.name``: the original when we replaced it on ``cls`` or a base class."""
    for klass in cls.__mro__:
        original = ORIGINALS.get((klass, name))
        if original is not None and original is not INHERITED:
            func: Callable[..., Any] = original
            return func
        if original is None and name in klass.__dict__:
            func = klass.__dict__[name]
            return func
    raise AttributeError(f"{cls.__name__}.{name}")


# --- fingerprints ------------------------------------------------------------------------------------------

#: The vLLM functions each part of the plugin was checked against, by part: the layouts (replaced), the receive
#: handler (replaced; ``process_tokens`` is the chunk walk it reproduces) and the worker's transport hook
#: (``register_kv_caches``/``close`` run with the wrapper as the store, so their bodies are what the hook
#: relies on), the worker's lookup (replaced; the block pool's attributes are what its faster pool reads), the
#: send handler (replaced; the walk and the byte sum are what it reproduces).
FINGERPRINTED: dict[str, tuple[str, ...]] = {
    "layouts": (
        "RankLocalStoreLayout.prepare_values",
        "RankLocalStoreLayout.prepare_value_for_block",
        "RankLocalStoreLayout.key_for",
        "TPShardedStoreLayout.prepare_values",
        "TPShardedStoreLayout.key_for",
        "TPShardedStoreLayout._set_segment_templates",
    ),
    "receive": (
        "KVCacheStoreRecvingThread._handle_request",
        "ChunkedTokenDatabase.process_tokens",
        "_estimate_disk_offload_staging_bytes",
        "_split_disk_offload_load_batches",
    ),
    "send": (
        "KVCacheStoreSendingThread._handle_request",
        "ChunkedTokenDatabase.process_tokens",
        "_sum_batch_bytes",
    ),
    "worker": ("MooncakeStoreWorker.register_kv_caches", "MooncakeStoreWorker.close"),
    "lookup": (
        "MooncakeStoreWorker.lookup",
        "ExternalCachedBlockPool.__init__",
        "ExternalCachedBlockPool.get_cached_block",
        "ExternalCachedBlockPool.contains",
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
        "_estimate_disk_offload_staging_bytes": "1096992edcfb74ba",
        "_split_disk_offload_load_batches": "0f7a2f3f89d959dc",
        "MooncakeStoreWorker.register_kv_caches": "d61b0517475bfad8",
        "MooncakeStoreWorker.close": "b9b831fa3647518f",
        "MooncakeStoreWorker.lookup": "23da6e4e0684a1e0",
        "ExternalCachedBlockPool.__init__": "8812d6d330d5298f",
        "ExternalCachedBlockPool.get_cached_block": "58a17cb93531b829",
        "ExternalCachedBlockPool.contains": "84d038552e03ec9e",
        "KVCacheStoreSendingThread._handle_request": "9faeb2e256df39de",
        "_sum_batch_bytes": "3e69ccacfd52a5c3",
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
_WORKER_CLASSES = (
    "KVCacheStoreRecvingThread",
    "KVCacheStoreSendingThread",
    "MooncakeStoreWorker",
    "ExternalCachedBlockPool",
)


def vllm_functions(part: str, data: ModuleType, worker: ModuleType | None) -> dict[str, Any]:
    """vLLM's own functions of one :data:`FINGERPRINTED` part, "Class.method" (or a worker-module function's
    name) -> function (the originals where we replaced them; None for one that is missing)."""
    found: dict[str, Any] = {}
    for name in FINGERPRINTED[part]:
        if "." not in name:
            func = None if worker is None else worker.__dict__.get(name)
            found[name] = func if inspect.isfunction(func) else None
            continue
        cls_name, method = name.split(".")
        module = worker if cls_name in _WORKER_CLASSES else data
        cls = None if module is None else module.__dict__.get(cls_name)
        try:
            found[name] = original_of(cls, method) if isinstance(cls, type) else None
        except AttributeError:
            found[name] = None
    return found
