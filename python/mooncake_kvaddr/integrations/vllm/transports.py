"""The plugin's store transports for vLLM's Mooncake store worker (docs/vllm-plugin.md, "How the transports are
installed"): which transport a worker gets (environment and connector config), and the thin wrappers on
``MooncakeStoreWorker`` that hand it to the transfer threads while ``worker.store`` stays vLLM's object.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.driver.values import parse_size
from mooncake_kvaddr.integrations.vllm.registry import replace_attribute, signature_problem, static_attribute

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "ENV_NATIVE_CLIENT",
    "ENV_STAGED",
    "ENV_STAGING_BYTES",
    "EXTRA_NATIVE_CLIENT",
    "EXTRA_STAGED",
    "EXTRA_STAGING_BYTES",
    "TRANSPORT_ATTR",
    "hook_shape_problem",
    "maybe_stage_store",
    "native_client_setting",
    "staged_settings",
    "wrap_worker",
]

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

#: On a worker whose transfer threads got a transport wrapper: ``(vLLM's store, the wrapper)``.
TRANSPORT_ATTR = "_mooncake_kvaddr_transport"

logger = logging.getLogger("vllm.mooncake_kvaddr")


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
    ``kv_connector_extra_config``. A switch that is neither on nor off, or staging bytes that are not a byte
    count (``StoreConfig``'s parser), raise ``ValueError``/``TypeError`` naming the variable or key."""
    staged, staged_name = _setting(environ, ENV_STAGED, extra_config, EXTRA_STAGED)
    wanted = flag(staged, False, staged_name)
    raw, name = _setting(environ, ENV_STAGING_BYTES, extra_config, EXTRA_STAGING_BYTES)
    # StoreConfig's own size parser: an int, a whole float or "256MiB"; a bool, 1.9, inf or non-ASCII digits
    # are refused (TypeError/ValueError naming the variable or key).
    nbytes = parse_size(DEFAULT_STAGING_BYTES if raw is None else raw, name)
    if nbytes <= 0:
        raise ValueError(f"{name} must be > 0, got {nbytes}")
    return wanted, nbytes


def _setting(
    environ: Mapping[str, str] | None, variable: str, extra_config: Mapping[str, Any] | None, key: str
) -> tuple[object, str]:
    """``(value, where it came from)``: the environment variable (of ``environ``, ``os.environ`` when None) when
    set and not blank (it wins), else the extra-config key."""
    env = os.environ if environ is None else environ
    if env.get(variable, "").strip():
        return env[variable], variable
    return (extra_config or {}).get(key), f"kv_connector_extra_config[{key!r}]"


def native_client_setting(extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the native-client transport is wanted: the environment (wins), else the connector's
    ``kv_connector_extra_config``. On by default, like the driver's ``StoreConfig.native_client``: the
    wrapper only calls Mooncake's C++ client where that client was verified for the installed Mooncake, and
    passes every call to Mooncake's own method otherwise (docs/vllm-plugin.md, "Native-client transport")."""
    value, name = _setting(environ, ENV_NATIVE_CLIENT, extra_config, EXTRA_NATIVE_CLIENT)
    return flag(value, True, name)


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


def hook_shape_problem(worker: ModuleType, methods: Mapping[str, tuple[str, ...]]) -> str:
    """Empty string when the worker module's ``MooncakeStoreWorker`` has every method the hook wraps
    (``Release.worker_methods``: name -> parameters after self); otherwise the first mismatch."""
    cls = worker.__dict__.get("MooncakeStoreWorker")
    if not isinstance(cls, type):
        return "MooncakeStoreWorker is missing"
    for name, params in methods.items():
        problem = signature_problem(cls, name, params)
        if problem:
            return f"unexpected shape: {problem}"
    return ""


#: The worker method that drops the wrapper: run with it as the store, then the pair is forgotten.
_FINAL = "close"


def wrap_worker(worker_cls: type, through: Iterable[str] = (_FINAL,)) -> None:
    """Thin wrappers on ``MooncakeStoreWorker``: ``__init__`` keeps the connector's extra config, and
    ``register_kv_caches`` runs vLLM's with the transport wrapper (:func:`maybe_stage_store`) as the worker's
    store for the duration of the call, so that vLLM registers its KV caches through the wrapper (the
    registered-range guard's table) and hands the wrapper to the transfer threads it starts there. Afterwards
    ``worker.store`` is vLLM's own object again (vLLM and its tests use it directly).

    Each method in ``through`` (the release's, those of them the class has) runs vLLM's with the wrapper as the
    store again, so that its Mooncake calls go through the wrapper too: vLLM 0.34's sleep mode
    (``unregister_kv_caches``/``restore_kv_caches``) keeps the guard's table in step, and ``close`` closes the
    store through the wrapper, which first refuses new calls and waits for those in flight (docs/vllm-plugin.md)."""
    original_init = static_attribute(worker_cls, "__init__")
    original_register = static_attribute(worker_cls, "register_kv_caches")

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
        return _with_transport(self, (store, transport), False, original_register, kv_caches, *args, **kwargs)

    wrappers: list[tuple[str, Any, Any]] = [
        ("__init__", __init__, original_init),
        ("register_kv_caches", register_kv_caches, original_register),
    ]
    for name in dict.fromkeys(through):
        original = static_attribute(worker_cls, name)
        if callable(original):
            wrappers.append((name, _through_transport(original, final=name == _FINAL), original))
    for name, func, original in wrappers:
        wrapper: Any = func
        wrapper.__wrapped__ = original
        wrapper.__qualname__ = f"{worker_cls.__qualname__}.{name}"
        replace_attribute(worker_cls, name, wrapper)


def _through_transport(original: Any, *, final: bool) -> Any:
    """``original`` (a worker method) run with the wrapper that ``register_kv_caches`` made as ``self.store``,
    while the worker still holds vLLM's store that the wrapper wraps (else as it is). ``final`` (``close``): the
    pair is dropped and vLLM's method lets the store go itself; otherwise vLLM's store is put back afterwards."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        pair = self.__dict__.pop(TRANSPORT_ATTR, None) if final else self.__dict__.get(TRANSPORT_ATTR)
        if pair is None or pair[0] is None or self.store is not pair[0]:
            return original(self, *args, **kwargs)
        return _with_transport(self, pair, final, original, *args, **kwargs)

    return method


def _with_transport(worker: Any, pair: Any, final: bool, original: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``original`` (a worker method) run with the wrapper of ``pair`` (vLLM's store, the wrapper) as
    ``worker.store``; unless ``final``, vLLM's store is put back afterwards where the wrapper is still there."""
    store, transport = pair
    worker.store = transport
    if final:
        return original(worker, *args, **kwargs)
    try:
        return original(worker, *args, **kwargs)
    finally:
        if worker.store is transport:
            worker.store = store
