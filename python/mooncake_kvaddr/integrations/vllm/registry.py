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
    "ORIGINALS",
    "WORKER_MODULE",
    "fingerprint",
    "fingerprint_problem",
    "fingerprint_source",
    "original_of",
    "params_after_self",
    "replace_attribute",
    "restore_all",
    "signature_problem",
    "static_attribute",
    "vllm_functions",
]

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
        actual = params_after_self(func)
    except (TypeError, ValueError):
        return f"{cls.__name__}.{method} has no readable signature"
    if actual != params:
        return f"{cls.__name__}.{method} takes {actual}, expected {params}"
    return ""


def params_after_self(func: Any) -> tuple[str, ...]:
    """The parameter names of a method after ``self`` (``inspect.signature``'s errors raised as they come)."""
    return tuple(inspect.signature(func).parameters)[1:]


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


def fingerprint_problem(version: str, functions: Mapping[str, Any], known: Mapping[str, Mapping[str, str]]) -> str:
    """Empty string when every function in ``functions`` ("Class.method" -> vLLM's function) has a fingerprint
    in ``known`` (release -> name -> fingerprint, a release module's table) for a release of ``version``'s series
    (its major.minor); otherwise the first that does not."""
    series = ".".join(version.split(".")[:2]) + "."
    for name, func in functions.items():
        if func is None:
            return f"{name} is missing"
        prints = {table[name] for release, table in known.items() if release.startswith(series) and name in table}
        actual = fingerprint(func)
        if actual is None:
            return f"{name} has no readable source to fingerprint"
        if actual not in prints:
            return (
                f"{name} is not the function this plugin was checked against "
                f"(fingerprint {actual}, known: {', '.join(sorted(prints)) or 'none'})"
            )
    return ""


#: Classes of the worker module (the others are the layout or data module's).
_WORKER_CLASSES = (
    "KVCacheStoreRecvingThread",
    "KVCacheStoreSendingThread",
    "MooncakeStoreWorker",
    "ExternalCachedBlockPool",
    "MooncakeStoreCoordinator",
)


def vllm_functions(names: tuple[str, ...], data: ModuleType, worker: ModuleType | None,
                   layout: ModuleType | None = None) -> dict[str, Any]:
    """vLLM's own functions of ``names`` (a release's fingerprinted part), "Class.method" (or a worker-module
    function's name) -> function (the originals where we replaced them; None for one that is missing). Worker
    classes are looked up in ``worker``, the others in ``layout`` (where a release keeps its layouts) or ``data``."""
    found: dict[str, Any] = {}
    for name in names:
        if "." not in name:
            func = None if worker is None else worker.__dict__.get(name)
            found[name] = func if inspect.isfunction(func) else None
            continue
        cls_name, method = name.split(".")
        if cls_name in _WORKER_CLASSES:
            cls = None if worker is None else worker.__dict__.get(cls_name)
        else:
            cls = (layout.__dict__.get(cls_name) if layout is not None else None) or data.__dict__.get(cls_name)
        try:
            found[name] = original_of(cls, method) if isinstance(cls, type) else None
        except AttributeError:
            found[name] = None
    return found
